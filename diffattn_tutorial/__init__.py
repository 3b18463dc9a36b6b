"""diffattn_tutorial: differential attention (Differential Transformer, arXiv 2410.05258, and DIFF V2), built to be exact.

The folders are the layers, each importing only from those above it in this list:

    constants, paths, argtypes   leaves: LOG2E; the cache folder (DIFFATTN_CACHE); argument types
    backends    the backend registry: every diff_attention backend declared once; "auto" and "sdpa" resolved from it
    functional  the formulas as functions: diff_attention (and its backends naive, chunked, the SDPA forms),
                softmax_attention, diff_attention_v2, lambda_init_fn, reparam_lambda, dual_lambda, rms_norm, masks
    kernels/    fused kernels behind backend=: cpu/ (a C++ kernel, compiled on first use, a torch operator) and
                triton/ (flash-attention forward and backward, split-K decode, ahead-of-time compile checks)
    layers/     attention layers (MultiheadDiffAttn, DiffAttnV2, MultiheadAttention), KV caches, RMSNorm, RoPE
    interop     from_unilm / to_unilm, from_timm / to_timm, from_unilm_v2 / to_unilm_v2, from_diffllama / to_diffllama
    training/   the tiny LM and its data, the toy study, the torchrun loop (DDP, FSDP2, checkpoints), the run log
    measure/    FLOP and byte models, timing and peak memory, CPU threads, GPU benchmark helpers, attention statistics
    course/     notebook set-up, the opening notebooks' toys, plotting, the exercise scorecard
    checks/     the exercise checks;  golden/  the reference implementations' recorded runs;
    recorded/   results files recorded by the project's scripts, with their provenance
    cli         the diffattn-tutorial command (doctor, bench, check, train)
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
from diffattn_tutorial.kernels.cpu import cpu_fused as _cpu_fused  # noqa: F401 (registers the cpu_fused backend)
from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn, RMSNorm
from diffattn_tutorial.layers.rope import apply_rope, rope_cos_sin

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "SDPA_FORMULATIONS", "causal_mask", "diff_attention", "diff_attention_v2", "dual_lambda",
    "lambda_init_fn", "reparam_lambda", "rms_norm", "softmax_attention", "DiffAttnV2", "KVCache",
    "MultiheadAttention", "MultiheadDiffAttn", "RMSNorm", "apply_rope", "rope_cos_sin", "__version__",
]
