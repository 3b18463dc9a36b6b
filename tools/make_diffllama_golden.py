"""Record Hugging Face DiffLlama's own outputs as golden data for ``interop.from_diffllama`` / ``to_diffllama``.

    pip install transformers            # only to regenerate; the library and its tests never import it
    python tools/make_diffllama_golden.py

Runs transformers' ``DiffLlamaAttention`` (eager attention, float32, CPU) on small random configs and writes
``diffattn_tutorial/golden/diffllama/<case>.pt``, which ships in the package and reads back as
``diffattn_tutorial.golden.load("diffllama/<case>")``. Each file holds what the other golden cases hold (see
``diffattn_tutorial/golden/__init__.py``): ``config`` (``DiffLlamaConfig`` keys plus ``layer_idx``), ``x``,
``rope`` (this library's ``(cos, sin)`` tables, ``(N, head_dim/2)``, cut from DiffLlama's ``position_embeddings``),
``causal``, ``attn_mask`` (bool ``(B, 1, 1, N)``, True = may attend, or None), ``state_dict`` (DiffLlama's
names), ``out``, ``g``, ``x_grad``, ``lr``, ``state_dict_after_sgd`` (after one plain SGD step on
``(out * g).sum()``), and the versions that produced it. DiffLlama's eager path gets the additive mask
transformers builds: 0 where a key may be attended, ``finfo.min`` elsewhere, causal and padding merged; with no
mask it attends everywhere.
"""

from __future__ import annotations

from pathlib import Path

import torch

from diffattn_tutorial import golden

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "diffllama"
OUT_DIR = ROOT / "diffattn_tutorial" / "golden" / FOLDER

CASES = {
    # name: (DiffLlamaConfig keys, layer_idx, batch, tokens, causal, right-padding lengths or None, seed)
    "mha_causal": (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4), 0, 2, 10, True, None, 0),
    "gqa_bias_padding": (dict(hidden_size=48, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                              attention_bias=True, rms_norm_eps=1e-6), 3, 2, 9, True, [9, 6], 1),
    "gqa_one_pair_bidirectional": (dict(hidden_size=32, num_attention_heads=8, num_key_value_heads=2), 1, 2, 7,
                                   False, None, 2),
}
LR = 0.5


def additive_mask(causal: bool, lengths: list[int] | None, b: int, n: int) -> tuple[torch.Tensor | None, ...]:
    """(DiffLlama's additive float mask (B, 1, N, N), this library's bool key mask (B, 1, 1, N) or None)."""
    allowed = torch.ones(b, 1, n, n, dtype=torch.bool)
    key_mask = None
    if causal:
        allowed &= torch.ones(n, n, dtype=torch.bool).tril()
    if lengths is not None:
        key_mask = (torch.arange(n)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
        allowed &= key_mask
    if not causal and lengths is None:
        return None, None
    hf = torch.zeros(b, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return hf, key_mask


def make_case(keys: dict, layer_idx: int, b: int, n: int, causal: bool, lengths, seed: int) -> dict:
    import transformers
    from transformers import DiffLlamaConfig
    from transformers.models.diffllama.modeling_diffllama import DiffLlamaAttention, DiffLlamaRotaryEmbedding

    torch.manual_seed(seed)
    cfg = DiffLlamaConfig(**keys, lambda_std_dev=0.3)
    cfg._attn_implementation = "eager"
    attn = DiffLlamaAttention(cfg, layer_idx=layer_idx).eval()  # nn.Linear's init (biases too), lambdas N(0, 0.3)
    x = torch.randn(b, n, cfg.hidden_size)
    rotary = DiffLlamaRotaryEmbedding(cfg)
    cos, sin = rotary(x, torch.arange(n)[None].expand(b, n))
    half = cfg.head_dim // 2
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    hf_mask, key_mask = additive_mask(causal, lengths, b, n)
    state_dict = {k: v.detach().clone() for k, v in attn.state_dict().items()}

    xg = x.clone().requires_grad_(True)
    out = attn(xg, position_embeddings=(cos, sin), attention_mask=hf_mask)[0]
    g = torch.randn_like(out)
    (out * g).sum().backward()
    with torch.no_grad():
        for p in attn.parameters():
            assert p.grad is not None, "every parameter must receive a gradient"
            p -= LR * p.grad
    config = {k: getattr(cfg, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                           "rms_norm_eps", "attention_bias")}
    return {
        "source": "diffllama", "variant": "v1", "config": {**config, "layer_idx": layer_idx},
        "x": x, "rope": (cos[0, :, :half].clone(), sin[0, :, :half].clone()), "causal": causal,
        "attn_mask": key_mask, "state_dict": state_dict, "out": out.detach(), "g": g,
        "x_grad": xg.grad.detach(), "lr": LR,
        "state_dict_after_sgd": {k: v.detach().clone() for k, v in attn.state_dict().items()},
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
    if Path(golden.__file__).resolve().parent == OUT_DIR.parent:  # the editable install reads what was written
        assert golden.names(FOLDER) == sorted(f"{FOLDER}/{name}" for name in CASES)
        print(f"diffattn_tutorial.golden.names({FOLDER!r}) lists every case")


if __name__ == "__main__":
    main()
