"""The checks of exercise 11 pass right answers and name each public implementation's bug when it is handed in."""

import pytest
import torch
from einops import rearrange

from diffattn_tutorial.checks import (
    CheckFailed,
    NotAttempted,
    check_axonml_fixed,
    check_block_causal_mask,
    check_diffllama_rows,
    check_four_calls_gqa,
)
from diffattn_tutorial.functional import causal_mask, diff_attention
from diffattn_tutorial.layers.rope import interleaved_to_half_split

# --- TASK 1 -----------------------------------------------------------------------------------------------------

def make_axonml(*, mask="scores", lam_copy=False, scale="half", maps="first"):
    """axonml's attention on its own layout, one knob per bug (the defaults are right)."""

    def fn(q, k, v, lam, attn_mask):
        half = q.shape[-1] // 2
        s = (half if scale == "half" else 2 * half) ** -0.5
        (i1, i2) = (slice(0, half), slice(half, None)) if maps == "first" else (slice(half, None), slice(0, half))
        s1 = q[..., i1] @ k[..., i1].transpose(-1, -2) * s
        s2 = q[..., i2] @ k[..., i2].transpose(-1, -2) * s
        if attn_mask is not None and mask == "scores":
            s1, s2 = s1.masked_fill(~attn_mask, float("-inf")), s2.masked_fill(~attn_mask, float("-inf"))
        a1, a2 = torch.softmax(s1, -1), torch.softmax(s2, -1)
        if attn_mask is not None and mask == "after":
            a1, a2 = a1 * attn_mask, a2 * attn_mask
        lam_used = torch.full_like(a2, lam.item()) if lam_copy else lam
        return (a1 - a2 * lam_used) @ v

    return fn


def test_axonml_right_answers_pass(capsys):
    check_axonml_fixed(make_axonml())

    def via_library(q, k, v, lam, attn_mask):
        split = lambda t: rearrange(t, "b h n (two d) -> b (h two) n d", two=2)  # noqa: E731
        return diff_attention(split(q), split(k), v, lam, attn_mask=attn_mask)

    with pytest.raises(CheckFailed, match="calls the library's diff_attention"):  # right, but not built by hand
        check_axonml_fixed(via_library)
    assert capsys.readouterr().out.count("PASSED") == 1


@pytest.mark.parametrize("kwargs, match", [
    ({"mask": "ignored"}, "mask is ignored"),
    ({"mask": "after"}, "after the softmax"),
    ({"scale": "full"}, "1/sqrt\\(2d\\)"),
    ({"maps": "second"}, "maps are swapped"),
    ({"lam_copy": True}, "constant copy"),
])
def test_axonml_bugs_are_named(kwargs, match):
    with pytest.raises(CheckFailed, match=match):
        check_axonml_fixed(make_axonml(**kwargs))


# --- TASK 2 -----------------------------------------------------------------------------------------------------

def _kron(block, inner):
    return torch.kron(block.int(), inner.int()).bool()


def test_block_causal_mask():
    tri = lambda m, off=0: torch.ones(m, m, dtype=torch.bool).tril(off)  # noqa: E731
    check_block_causal_mask(lambda n, paths: _kron(tri(paths), causal_mask(n, n)))
    check_block_causal_mask(lambda n, paths: torch.cat([torch.cat([causal_mask(n, n) if j <= i else
                                                                   torch.zeros(n, n, dtype=torch.bool)
                                                                   for j in range(paths)], 1) for i in range(paths)]))
    for fn, match in [
        (lambda n, paths: causal_mask(n, n).repeat(1, paths), "one path's queries"),  # the notebook's mask
        (lambda n, paths: causal_mask(n, n).repeat(paths, paths), "every path reads every path's keys"),
        (lambda n, paths: _kron(torch.eye(paths, dtype=torch.bool), causal_mask(n, n)), "only its own keys"),
        (lambda n, paths: _kron(tri(paths, -1), causal_mask(n, n)), "not its own"),
        (lambda n, paths: causal_mask(paths * n, paths * n), "one causal mask over all"),
        (lambda n, paths: _kron(tri(paths), tri(n, -1)), "own position"),
        (lambda n, paths: _kron(tri(paths), torch.ones(n, n, dtype=torch.bool)), "inside a block every position"),
        (lambda n, paths: ~_kron(tri(paths), causal_mask(n, n)), "swapped"),
        (lambda n, paths: _kron(tri(paths), causal_mask(n, n)).float(), "bool"),
        (lambda n, paths: causal_mask(n, n), "shape"),
        (lambda n, paths: torch.ones(paths * n, paths * n, dtype=torch.bool).triu(), "differs at query"),
    ]:
        with pytest.raises(CheckFailed, match=match):
            check_block_causal_mask(fn)


def test_unattempted_stub_is_not_attempted():
    def stub(n, paths):
        raise NotImplementedError

    with pytest.raises(NotAttempted, match="TASK 2 not attempted yet"):
        check_block_causal_mask(stub)


# --- TASK 3 -----------------------------------------------------------------------------------------------------

def make_four_calls(*, rule="groups", causal=True, keys="k1 k2", halves="va vb"):
    def fn(q, k, v, lam):
        rep = q.shape[1] // k.shape[1]
        if rule == "repeat_kv":  # vasqu: repeat the interleaved key heads in place
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            k1, k2 = k[:, 0::2], k[:, 1::2]
        elif rule == "tile":
            k1, k2, v = k[:, 0::2].repeat(1, rep, 1, 1), k[:, 1::2].repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k1, k2 = k[:, 0::2].repeat_interleave(rep, 1), k[:, 1::2].repeat_interleave(rep, 1)
            v = v.repeat_interleave(rep, 1)
        k1, k2 = ({"k1": k1, "k2": k2}[name] for name in keys.split())
        q1, q2 = q[:, 0::2], q[:, 1::2]
        va, vb = v.chunk(2, dim=-1)
        va, vb = ({"va": va, "vb": vb}[name] for name in halves.split())
        sdpa = lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)  # noqa
        return torch.cat([sdpa(q1, k1, va), sdpa(q1, k1, vb)], -1) - lam * torch.cat([sdpa(q2, k2, va),
                                                                                     sdpa(q2, k2, vb)], -1)

    return fn


def test_four_calls_gqa(capsys):
    check_four_calls_gqa(make_four_calls())
    with pytest.raises(CheckFailed, match="calls the library's diff_attention"):  # right, but not built by hand
        check_four_calls_gqa(lambda q, k, v, lam: diff_attention(q, k, v, lam, causal=True, backend="sdpa_split"))
    assert capsys.readouterr().out.count("PASSED") == 1
    for kwargs, match in [({"rule": "repeat_kv"}, "same key map"), ({"rule": "tile"}, "tiled"),
                          ({"causal": False}, "causal mask is missing"), ({"keys": "k2 k1"}, "k1 and k2 are swapped"),
                          ({"keys": "k1 k1"}, "both maps read k1"), ({"keys": "k2 k2"}, "both maps read k2"),
                          ({"halves": "vb va"}, "V halves are swapped")]:
        with pytest.raises(CheckFailed, match=match):
            check_four_calls_gqa(make_four_calls(**kwargs))


# --- TASK 4 -----------------------------------------------------------------------------------------------------

def reorder(w, maps, head_dim):
    """The right answer, written without the library: blocks of head_dim rows in order [0, m/2, 1, m/2 + 1, ...]."""
    blocks = list(w.split(head_dim, dim=0))
    half = maps // 2
    return torch.cat([b for i in range(half) for b in (blocks[i], blocks[i + half])], dim=0)


def test_diffllama_rows():
    check_diffllama_rows(reorder)
    check_diffllama_rows(lambda w, maps, hd: rearrange(w, "(two h d) ... -> (h two d) ...", two=2, d=hd))
    for fn, match in [
        (lambda w, maps, hd: interleaved_to_half_split(w, hd), "inside each map"),
        (lambda w, maps, hd: rearrange(w, "(h two d) ... -> (two h d) ...", two=2, d=hd), "inverse order"),
        (lambda w, maps, hd: w, "unchanged"),
        (lambda w, maps, hd: rearrange(w, "(two r) ... -> (r two) ...", two=2), "single rows"),
        (lambda w, maps, hd: rearrange(w, "(two h d) ... -> (h d two) ...", two=2, d=hd), "channels"),
        (lambda w, maps, hd: w[: maps * hd // 2], "shape"),
    ]:
        with pytest.raises(CheckFailed, match=match):
            check_diffllama_rows(fn)


def test_the_checks_are_registered_for_tasks_1_to_4():
    checks = [check_axonml_fixed, check_block_causal_mask, check_four_calls_gqa, check_diffllama_rows]
    assert [c.task for c in checks] == [1, 2, 3, 4]
    assert [c.function_name for c in checks] == ["axonml_fixed", "block_causal_mask", "four_calls_gqa",
                                                 "diffllama_rows"]
