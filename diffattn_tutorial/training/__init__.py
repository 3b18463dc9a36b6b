"""Training: the tiny LM (and transformers' weight names for it), its data (needle task, text corpus), the toy-study trainer, the torchrun loop (DDP, FSDP2, checkpoints) and its run log."""
