"""Record transformers' own Llama 3, Qwen2 and Mistral models as golden data for ``hf.checkpoints.from_hf``.

    pip install transformers            # only to regenerate; the library and its tests never need it
    python tools/make_hf_golden.py

Builds small random models with transformers (float32, CPU, eager attention), runs their forward on random token
ids and their greedy ``generate``, and writes ``diffattn_tutorial/golden/hf/<case>.pt`` (read back as
``golden.load("hf/<case>")``). Each file holds ``config`` (``model.config.to_dict()``, JSON-clean, as a folder's
``config.json`` says it), ``state_dict`` (transformers' names; a tied head left out, as tied checkpoints are
saved), ``input_ids`` ``(B, N)``, ``logits`` ``(B, N, vocab)``, ``prompt`` ``(1, P)``, ``greedy`` ``(1, P + T)``
and the versions that produced it. The weights are drawn wider than transformers' initialisation
(``initializer_range=0.2``, norm scales ``1 + 0.1 N(0, 1)``, biases ``0.1 N(0, 1)``) so that every term moves the
logits. The Llama 3 cases' ``original_max_position_embeddings`` (64) puts their RoPE frequencies in all three
bands of the scaling (kept, interpolated, divided by ``factor``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from diffattn_tutorial import golden

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "hf"
OUT_DIR = ROOT / "diffattn_tutorial" / "golden" / FOLDER
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=128)

CASES = {
    # name: (family, config keys, seed)
    "llama3_gqa_untied": ("llama", dict(SIZES, num_attention_heads=4, num_key_value_heads=2, rope_parameters=LLAMA3,
                                        rms_norm_eps=1e-6), 0),
    "llama3_mha_tied": ("llama", dict(SIZES, num_attention_heads=4, num_key_value_heads=4, rope_parameters=LLAMA3,
                                      rms_norm_eps=1e-5, tie_word_embeddings=True), 1),
    "qwen2_gqa_tied": ("qwen2", dict(SIZES, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                     rope_parameters={"rope_type": "default", "rope_theta": 1000.0}), 2),
    "qwen2_mha_untied": ("qwen2", dict(SIZES, num_attention_heads=4, num_key_value_heads=4,
                                       tie_word_embeddings=False), 3),
    "mistral_gqa_window": ("mistral", dict(SIZES, num_attention_heads=4, num_key_value_heads=2, sliding_window=128,
                                           tie_word_embeddings=False), 4),
    "mistral_mha": ("mistral", dict(SIZES, num_attention_heads=4, num_key_value_heads=4, sliding_window=None,
                                    tie_word_embeddings=False), 5),
}


def build(family: str, keys: dict, seed: int):
    """A random transformers model of ``family`` with ``keys``, its weights widened (see the module doc)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "mistral": transformers.MistralConfig}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "mistral": transformers.MistralForCausalLM}[family]
    torch.manual_seed(seed)
    cfg = config_cls(**keys, initializer_range=0.2)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def make_case(family: str, keys: dict, seed: int) -> dict:
    import transformers

    model = build(family, keys, seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    prompt = torch.randint(0, model.config.vocab_size, (1, 5))
    model.generation_config.eos_token_id = None  # all 8 tokens decoded (Mistral's default eos is id 2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                                pad_token_id=0)  # every prompt token attended, a 0 among them too
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del state_dict["lm_head.weight"]  # as a tied checkpoint is saved
    return {
        "source": "transformers", "variant": family, "config": json.loads(model.config.to_json_string()),
        "state_dict": state_dict, "input_ids": ids, "logits": logits.detach().clone(), "prompt": prompt,
        "greedy": greedy, "versions": {"transformers": transformers.__version__,
                                       "torch": torch.__version__.split("+")[0]},
    }


def main() -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, spec in CASES.items():
        case = make_case(*spec)
        path = OUT_DIR / f"{name}{golden.SUFFIX}"
        torch.save(case, path)
        print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.1f} KiB, "
              f"transformers {case['versions']['transformers']}")


if __name__ == "__main__":
    main()
