"""The building blocks: attention layers (V1, V2, the baseline), their KV cache and norm, and RoPE."""
