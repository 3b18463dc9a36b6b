"""diffattn_tutorial: differential attention (Differential Transformer, arXiv 2410.05258, and DIFF V2), built to be exact.

Modules:
    functional  diff_attention, softmax_attention, diff_attention_v2, lambda_init_fn, reparam_lambda,
                dual_lambda, rms_norm, causal_mask, BACKENDS
    rope        rope_cos_sin, apply_rope (interleaved GPT-J and half-split NeoX layouts)
    modules     MultiheadAttention, MultiheadDiffAttn, DiffAttnV2, KVCache, RMSNorm
    interop     from_unilm / to_unilm, from_timm / to_timm, from_unilm_v2 / to_unilm_v2,
                from_diffllama / to_diffllama (Hugging Face)
    triton_diff the fused differential flash-attention kernel (forward and backward), backend="triton"
    triton_compile  ahead-of-time compile checks of every kernel config for sm_90a / sm_80, no GPU needed
    flops       attention FLOP and byte accounting (baseline, V1, V2, each SDPA formulation)
    metrics     attention shares (answer vs noise) and activation-outlier ratios
    model, data, experiments   a tiny LM with switchable attention, a retrieval task, the paper's measurements
    recorded    results files recorded by the project's scripts (seed and budget studies, compile facts, GPU
                benchmarks), with their provenance
    golden      the reference implementations' recorded runs (names(), load(name)), shipped in the package
    toys, plotting             the opening notebooks' toy problems, and heatmaps/curves
    bench       side-by-side timing and peak memory of the backends (diffattn-tutorial bench), peak_extra_memory
    gpu_bench   the GPU benchmarks' shared helpers (one GPU timer, SDPA backend selection, recorded results)
    cpu         how many threads to use on a CPU that other programs share (recommended_threads)
    train, distributed, corpus, runlog   training under torchrun (DDP, FSDP2, checkpoints), a generated text
                corpus, and the JSON-lines metrics log and its plots (diffattn-tutorial train)
    checks      the exercise checks; scorecard runs an exercise notebook (diffattn-tutorial check)
"""

from diffattn_tutorial.functional import (
    BACKENDS,
    SDPA_FORMULATIONS,
    causal_mask,
    diff_attention,
    diff_attention_v2,
    dual_lambda,
    lambda_init_fn,
    reparam_lambda,
    rms_norm,
    softmax_attention,
)
from diffattn_tutorial.modules import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn, RMSNorm
from diffattn_tutorial.rope import apply_rope, rope_cos_sin

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "SDPA_FORMULATIONS", "causal_mask", "diff_attention", "diff_attention_v2", "dual_lambda",
    "lambda_init_fn", "reparam_lambda", "rms_norm", "softmax_attention", "DiffAttnV2", "KVCache",
    "MultiheadAttention", "MultiheadDiffAttn", "RMSNorm", "apply_rope", "rope_cos_sin", "__version__",
]
