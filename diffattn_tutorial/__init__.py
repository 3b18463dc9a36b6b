"""diffattn_tutorial: differential attention (Differential Transformer, arXiv 2410.05258, and DIFF V2), built to be exact.

The modules are layers, each importing only from the lines above its own (imports inside functions included;
``tests/test_architecture.py`` checks it)::

    constants, paths, argtypes, recorded, golden   leaves: LOG2E, the cache folder, argument types, recorded results
    validation      masks, and the checks every public function runs on its inputs
    formulations    the exact formulas the pure-PyTorch backends run: naive, chunked, the SDPA formulations
    kernels/        fused kernels: cpu/ (a C++ kernel, compiled on first use, a torch operator) and triton/
    backend_table   every diff_attention backend declared once (kernels loaded lazily), and "auto"'s order per device
    backends        the rules that read the table: "auto" and "sdpa" resolved, refusals, status, the prose about them
    functional      the formulas as functions: diff_attention, softmax_attention, diff_attention_v2, lambda, rms_norm
    layers/         attention layers (MultiheadDiffAttn, DiffAttnV2, MultiheadAttention), KV caches, RMSNorm, RoPE,
                    and the conversion of a trained baseline layer or model to DIFF V2 or V1 (convert)
    __init__        this file: the public names below and __version__
    measure/        FLOP and byte models, timing and peak memory, CPU threads, GPU benchmark helpers, attention statistics
    course/         notebook set-up, the opening notebooks' toys, plotting, the exercise scorecard
    training/       the tiny LM and its data, the toy study, fine-tuning after conversion, the torchrun loop (DDP,
                    FSDP2, checkpoints), the run log
    interop         from_unilm / to_unilm, from_timm / to_timm, from_unilm_v2 / to_unilm_v2, from_diffllama /
                    to_diffllama, from_llama (a Hugging Face Llama into training's TinyLM)
    hf/             Hugging Face checkpoints in and out: from_hf (Llama 3, Qwen2, Mistral into TinyLM, from a model
                    or a safetensors folder), save_hf (a TinyLM, baseline or DIFF, back in transformers' format)
    checks/         the exercise checks
    cli             the diffattn-tutorial command (doctor, bench, check, train)
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
from diffattn_tutorial.layers.attention import DiffAttnV2, KVCache, MultiheadAttention, MultiheadDiffAttn, RMSNorm
from diffattn_tutorial.layers.rope import apply_rope, rope_cos_sin

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "SDPA_FORMULATIONS", "causal_mask", "diff_attention", "diff_attention_v2", "dual_lambda",
    "lambda_init_fn", "reparam_lambda", "rms_norm", "softmax_attention", "DiffAttnV2", "KVCache",
    "MultiheadAttention", "MultiheadDiffAttn", "RMSNorm", "apply_rope", "rope_cos_sin", "__version__",
]
