"""Hugging Face checkpoints in and out: :func:`~diffattn_tutorial.hf.checkpoints.from_hf` loads a Llama (RoPE
``default`` or ``llama3``), Qwen2 or Mistral checkpoint into TinyLM term by term (its logits equal transformers' to
float tolerance); :func:`~diffattn_tutorial.hf.export.save_hf` writes a TinyLM (baseline, DIFF V1, DIFF V2) back in
transformers' format. Neither needs transformers installed."""

from diffattn_tutorial.hf.checkpoints import from_hf, hf_lm_config, read_folder
from diffattn_tutorial.hf.export import save_hf
from diffattn_tutorial.training.hf_weights import CheckpointError

__all__ = ["CheckpointError", "from_hf", "hf_lm_config", "read_folder", "save_hf"]
