"""benchmarks/bench_triton.py on a CPU with tiny sizes (kernels in the interpreter): the plumbing runs every
implementation on the same inputs, compares them and writes a well-formed results file; the helpers it shares
with the notebooks (``diffattn_tutorial.measure.gpu``) summarise, merge, check goals and find recorded files. No
timings are asserted."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from diffattn_tutorial.measure import gpu as gpu_bench  # noqa: E402
from diffattn_tutorial.measure.timing import make_inputs  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_triton.py"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("bench_triton", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path_factory.mktemp("bench") / "results.json"
    rc = mod.main(["--device", "cpu", "--lengths", "32", "--head-dims", "16", "--tokens", "32", "--model-width", "64",
                   "--causal", "yes", "--reps", "1", "--out", str(out), "-q"])
    assert rc == 0
    return mod, json.loads(out.read_text())


IMPLS = ("triton", "sdpa_wide", "sdpa_split", "sdpa_stacked", "naive")


def test_header_names_device_versions_and_date(results):
    mod, r = results
    assert r["schema"] == gpu_bench.TRITON_SCHEMA
    assert set(r["recorded"]) >= {"date", "device", "device_type", "torch", "triton", "cuda", "cudnn"}
    assert r["recorded"]["device_type"] == "cpu" and r["recorded"]["date"].endswith("UTC")
    assert r["config"]["backends"] == ["default"]  # on a CPU; on CUDA flash, cudnn and efficient, explicitly
    assert isinstance(r["chosen_configs"], dict)


def test_every_impl_ran_and_agrees(results):
    mod, r = results
    rows = r["rows"]
    assert {x["impl"] for x in rows} == set(IMPLS)
    assert len(rows) == len(IMPLS) * 2  # fwd and fwd_bwd, causal only, one length, one head dim, one backend
    for x in rows:
        assert set(x) == set(mod.ROW_KEYS)
        assert x["status"] == "ok", x
        assert x["ms"] > 0 and x["tflops"] > 0 and x["batch"] == 1 and x["heads"] == 2
        assert x["max_abs_err"] < 1e-4, x
        assert x["peak_extra_mib"] is None  # measured on CUDA only
    for mode in ("fwd", "fwd_bwd"):
        group = [x for x in rows if x["mode"] == mode]
        assert sum(x["best_sdpa"] for x in group) == 1
        assert next(x for x in group if x["impl"] == "triton")["speedup_vs_best_sdpa"] > 0


def test_summary_table_merge_and_goals(results):
    mod, r = results
    table = gpu_bench.triton_summary(r)
    assert table.count("\n") == 3 and "| 16 | True | fwd | 32 |" in table
    other = json.loads(json.dumps(r))
    for x in other["rows"]:
        x["d"] = 32
    other["config"]["head_dims"] = [32]
    merged = gpu_bench.merge_triton([r, other])
    assert len(merged["rows"]) == 2 * len(r["rows"]) and merged["config"]["head_dims"] == [16, 32]
    assert [(g["d"], g["causal"]) for g in gpu_bench.goals(merged)] == [(64, False), (64, True), (128, False),
                                                                        (128, True)]  # none at N = 8192: none met
    assert not any(any(g["met"].values()) for g in gpu_bench.goals(merged))
    elsewhere = json.loads(json.dumps(r))
    elsewhere["recorded"]["device"] = "another GPU"
    with pytest.raises(ValueError, match="different devices"):
        gpu_bench.merge_triton([r, elsewhere])


def test_a_refusing_backend_is_a_result_not_a_crash():
    spec = importlib.util.spec_from_file_location("bench_triton", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    inputs = make_inputs(1, 2, 16, 8, dtype=torch.float32, device=torch.device("cpu"))
    ms, peak, out, status = mod.measure("sdpa_wide", "cudnn", "fwd", False, inputs, device=torch.device("cpu"), reps=1)
    assert ms is None and out is None and status.startswith("refused"), status


def test_the_kernels_variants_by_name_agree_or_are_refused_as_results(results):
    """``TRITON_VARIANTS`` (the GPU session's ``atomic`` step): each runs through ``triton_diff_attention`` and
    agrees with the kernel's default, or is a ``refused`` result naming what it runs (never an error): the fused
    plans above d = 64 or below sm_90, the fused atomic plan training causal, an atomic twin where the plan has none
    (d <= 32)."""
    mod, _ = results
    cpu = torch.device("cpu")
    small = make_inputs(1, 2, 16, 16, dtype=torch.float32, device=cpu)
    for causal, impls in ((True, ("triton_fused", "triton_pointers")), (False, ("triton_fused_atomic",))):
        ref = mod.attention("triton", *small, causal)
        for impl in impls:
            torch.testing.assert_close(mod.attention(impl, *small, causal), ref)
    refused = mod.measure("triton_atomic", "default", "fwd", True, small, device=cpu, reps=1)[3]
    assert refused.startswith("refused") and "d = 33 to 128" in refused, refused
    refused = mod.measure("triton_fused_atomic", "default", "fwd_bwd", True, small, device=cpu, reps=1)[3]
    assert refused.startswith("refused") and "neither causal" in refused, refused  # training; its forward runs
    assert mod.measure("triton_fused_atomic", "default", "fwd", True, small, device=cpu, reps=1)[3] == "ok"
    from diffattn_tutorial.kernels.triton.configs import form
    from diffattn_tutorial.kernels.triton.flash_diff import capture_launches

    d64 = make_inputs(1, 2, 16, 64, dtype=torch.float32, device=cpu)  # where the default plan is split_kv
    grads = {}
    for impl, dk_launches in (("triton", ["dv", "dk"]), ("triton_fused", ["dkdv"]), ("triton_fused_atomic", [])):
        with capture_launches() as launches:
            mod.attention(impl, *(t.clone().requires_grad_() for t in d64), False).sum().backward()
        assert [form(x.name, x.consts) for x in launches if x.name == "_diff_attn_bwd_dkdv"] == dk_launches, impl
        ins = [t.clone().requires_grad_() for t in d64]
        grads[impl] = torch.autograd.grad(mod.attention(impl, *ins, False).square().sum(), ins)
    for impl in ("triton_fused", "triton_fused_atomic"):
        for a, b in zip(grads[impl], grads["triton"]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        with pytest.raises(ValueError, match="d <= 64 on Hopper"):  # no table entries past d = 64 ...
            mod.attention(impl, *make_inputs(1, 2, 4, 128, dtype=torch.float32, device=cpu), False)
        with capture_launches(80), pytest.raises(ValueError, match="compute capability 8.0"):  # ... or below sm_90
            mod.attention(impl, *d64, False)
    wide = make_inputs(1, 2, 4, 128, dtype=torch.float32, device=cpu)
    refused = mod.measure("triton_fused", "default", "fwd", False, wide, device=cpu, reps=1)[3]
    assert refused.startswith("refused") and "d <= 64" in refused, refused


def test_shapes_keep_tokens_and_width():
    assert gpu_bench.shape_for(1024, 64, 16384, 2048) == (16, 16)
    assert gpu_bench.shape_for(16384, 128) == (1, 8)
    with pytest.raises(ValueError, match="model_width"):
        gpu_bench.shape_for(1024, 48, 16384, 1000)
    with pytest.raises(ValueError, match="unknown SDPA backend"):
        gpu_bench.sdpa_backend("flash3")


def test_find_recorded_and_where_results_go(results, tmp_path):
    mod, r = results
    path = gpu_bench.recorded_path("bench_triton", r["recorded"]["device"], tmp_path)
    assert path.parent == tmp_path and path.name.startswith("bench_triton_cpu-")
    gpu_bench.write_json(path, r)
    (tmp_path / "bench_triton_broken.json").write_text("{")
    (tmp_path / "bench_sdpa_cpu.json").write_text(json.dumps(r))  # a different kind: not listed
    found = gpu_bench.find_recorded("bench_triton", device_type=None, folder=tmp_path)
    assert found == [(path.stem, r)]
    assert gpu_bench.find_recorded("bench_triton", folder=tmp_path) == []  # no CUDA results
    assert gpu_bench.recorded_path("gpu_session", "NVIDIA H100 80GB HBM3").parent == gpu_bench.RECORDED_DIR
    with pytest.raises(SystemExit, match="--out"):  # a CPU run is never written into the package
        mod.main(["--device", "cpu"])
