"""The fused C++ CPU kernel of differential attention (forward), its build cache and operator."""
