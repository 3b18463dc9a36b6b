"""The fused Triton kernels (training forward/backward, split-K decode) and their ahead-of-time compile checks."""
