"""Record Hugging Face ``LlamaForCausalLM``'s own logits as golden data for ``interop.from_llama``.

    pip install transformers            # only to regenerate; the library and its tests never need it
    python tools/make_llama_golden.py

Builds small random Llama models with transformers (float32, CPU, eager attention), runs their forward on random
token ids and writes ``diffattn_tutorial/golden/llama/<case>.pt``, which ships in the package and reads back as
``diffattn_tutorial.golden.load("llama/<case>")``. Each file holds ``config`` (the ``LlamaConfig`` keys that shape
the function, as ``model.config.to_dict()`` gives them), ``state_dict`` (transformers' names), ``input_ids``
``(B, N)``, ``logits`` ``(B, N, vocab)`` and the versions that produced it. The weights are drawn wider than
transformers' initialisation (``initializer_range=0.2``, RMSNorm scales ``1 + 0.1 N(0, 1)``) so that every term
moves the logits and a wrong mapping shows. One case has GQA, untied embeddings and another RoPE base; the other
ties the LM head to the embedding (its state_dict without ``lm_head.weight``, as tied checkpoints are saved).
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffattn_tutorial import golden

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "llama"
OUT_DIR = ROOT / "diffattn_tutorial" / "golden" / FOLDER
KEEP = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
        "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings", "pretraining_tp")

CASES = {
    # name: (LlamaConfig keys, batch, tokens, seed)
    "gqa_untied": (dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-6), 2, 12, 0),
    "mha_tied": (dict(vocab_size=48, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      rms_norm_eps=1e-5, tie_word_embeddings=True), 2, 9, 1),
}


def make_case(keys: dict, b: int, n: int, seed: int) -> dict:
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**keys, initializer_range=0.2)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, cfg.vocab_size, (b, n))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        assert torch.equal(state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"])
        del state_dict["lm_head.weight"]  # as a tied checkpoint is saved
    whole = cfg.to_dict()
    return {
        "source": "transformers", "variant": "llama", "config": {k: whole[k] for k in KEEP if k in whole},
        "state_dict": state_dict, "input_ids": ids, "logits": logits.detach().clone(),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]},
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
