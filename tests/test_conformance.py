"""Conformance with the reference implementations (unilm, timm), via their own outputs (``diffattn_tutorial.golden``).

Each module case pins the forward output, the input gradient, and every parameter after one plain SGD
step on ``(out * g).sum()`` (so every parameter's gradient, lambdas included, is checked).
"""

import pytest
import torch
from golden_case import ATOL, RTOL, assert_reproduces_golden_case

from diffattn_tutorial import golden, interop
from diffattn_tutorial.backends import get_backend
from diffattn_tutorial.functional import BACKENDS, diff_attention

LOADERS = {  # (source, variant) -> (from_*, to_*)
    ("unilm", "v1"): (interop.from_unilm, interop.to_unilm),
    ("timm", "v1"): (interop.from_timm, interop.to_timm),
    ("unilm", "v2"): (interop.from_unilm_v2, interop.to_unilm_v2),
}
REFERENCE_CASES = [n for n in golden.names() if "/" not in n]  # unilm and timm; DiffLlama's are in diffllama/
MODULE_CASES = [n for n in REFERENCE_CASES if not n.startswith("functional")]
CPU_BACKENDS = [b for b in BACKENDS if b != "triton"]


def test_every_golden_file_is_covered():
    assert len(REFERENCE_CASES) == 5 and len(MODULE_CASES) == 4
    assert {(golden.load(n)["source"], golden.load(n)["variant"]) for n in MODULE_CASES} == set(LOADERS)


def test_golden_cases_are_read_from_the_package_and_bad_names_name_the_fix():
    assert golden.names("diffllama") == [n for n in golden.names() if n.startswith("diffllama/")] != []
    first, second = golden.load("unilm_v1_mha"), golden.load("unilm_v1_mha")
    first["x"].zero_()  # each load is a fresh copy
    assert second["x"].abs().sum() > 0
    with pytest.raises(ValueError, match=r"name must be one of diffattn_tutorial.golden.names\(\).*'unilm_v1_mha'"):
        golden.load("unilm_v1_mha.pt")
    with pytest.raises(TypeError, match="name must be a str"):
        golden.load(0)
    with pytest.raises(ValueError, match=r"folder must be one of \['diffllama', 'hf', 'llama'\]"):
        golden.names("difflama")


@pytest.mark.parametrize("name", MODULE_CASES)
@pytest.mark.parametrize("backend", ["naive", "sdpa_wide", "sdpa_split", "sdpa_stacked", "auto"])
def test_module_matches_reference(name, backend):
    case = golden.load(name)
    from_ref, to_ref = LOADERS[(case["source"], case["variant"])]
    if case["variant"] == "v2" and backend not in ("naive", "auto"):
        backend = "sdpa"
    layer = from_ref(case["state_dict"], **case["config"], backend=backend)
    # export before training is exact
    assert_reproduces_golden_case(layer, case, to_ref)


@pytest.mark.parametrize("backend", CPU_BACKENDS + ["auto"])
def test_functional_matches_spec(backend):
    case = golden.load("functional_mha_scalar")
    out = diff_attention(case["q"], case["k"], case["v"], case["lam"], causal=case["causal"], backend=backend)
    torch.testing.assert_close(out, case["out"], rtol=RTOL, atol=ATOL)
    if backend not in ("sdpa", "auto") and torch.float64 not in get_backend(backend).dtypes:  # computes in float32
        return
    out64 = diff_attention(case["q"].double(), case["k"].double(), case["v"].double(), case["lam"].double(),
                           causal=case["causal"], backend=backend)
    # the golden fp64 output agrees with ours to ~1e-7 (its generator kept some float32 arithmetic)
    torch.testing.assert_close(out64, case["out_fp64"], rtol=1e-6, atol=1e-6)


def test_unknown_config_keys_are_refused_with_the_valid_names():
    case = golden.load("unilm_v1_mha")
    with pytest.raises(TypeError, match=r"'num_kv_head' \(did you mean 'num_kv_heads'\?\).*embed_dim, num_heads"):
        interop.from_unilm(case["state_dict"], **case["config"], num_kv_head=2)
    timm = golden.load("timm_v1_paper_lambda")
    with pytest.raises(TypeError, match=r"'qkv_bais' \(did you mean 'qkv_bias'\?\).*module options"):
        interop.from_timm(timm["state_dict"], **timm["config"], qkv_bais=True)
    v2 = golden.load("unilm_v2_mha")
    with pytest.raises(TypeError, match="from_unilm_v2.*'dmodel'"):
        interop.from_unilm_v2(v2["state_dict"], **{**v2["config"], "dmodel": 64})


def test_timm_errors_name_the_checkpoints_own_keys_and_rows():
    case = golden.load("timm_v1_paper_lambda")  # dim 64: qkv.weight (192, 64)
    sd, cfg = case["state_dict"], case["config"]
    with pytest.raises(ValueError, match=r"qkv.weight has 192 rows \(rows 0:64 \(q\), 64:128 \(k\), 128:192 \(v\) "
                                         r"for dim=64\); this config \(dim=32, num_heads=4\) needs 96: rows 0:32 \(q\)"):
        interop.from_timm(sd, **{**cfg, "dim": 32})
    narrow = {**sd, "qkv.weight": sd["qkv.weight"][:, :32]}
    with pytest.raises(ValueError, match=r"qkv.weight rows 0:64 \(q\): checkpoint \(64, 32\), this config \(64, 64\)"):
        interop.from_timm(narrow, **cfg)
    with pytest.raises(ValueError, match=r"missing \['qkv.bias'\]") as e:
        interop.from_timm(sd, **{**cfg, "qkv_bias": True})
    assert "third" not in str(e.value)
