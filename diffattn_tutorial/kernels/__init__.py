"""Fused kernels behind ``diff_attention(backend=...)``: ``cpu`` (C++, compiled on first use) and ``triton`` (GPU, or the interpreter on a CPU)."""
