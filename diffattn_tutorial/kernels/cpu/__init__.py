"""The fused C++ CPU kernel of differential attention (forward and backward), its build machinery and its operators."""
