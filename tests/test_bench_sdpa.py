"""benchmarks/bench_sdpa.py on a CPU with tiny sizes: it runs every formulation and writes a well-formed file."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffattn_tutorial.measure import gpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_sdpa.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_sdpa", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "results.json"
    mod = load_script()
    rc = mod.main(["--device", "cpu", "--dtype", "float32", "--lengths", "16", "24", "--head-dims", "8", "16",
                   "--heads", "2", "--batch", "2", "--warmup", "0", "--reps", "1", "--out", str(out), "-q"])
    assert rc == 0
    return mod, json.loads(out.read_text())


def test_header(results):
    mod, r = results
    assert r["schema"] == gpu.SDPA_SCHEMA
    rec = r["recorded"]
    assert set(rec) >= {"date", "device", "device_type", "torch", "cuda", "python", "diffattn_tutorial", "command"}
    assert rec["device_type"] == "cpu" and rec["torch"] and rec["date"].endswith("UTC")
    cfg = r["config"]
    assert cfg["lengths"] == [16, 24] and cfg["head_dims"] == [8, 16] and cfg["dtype"] == "float32"
    assert cfg["causal"] == [False, True] and cfg["modes"] == ["fwd", "fwd_bwd"]
    assert cfg["formulations"] == list(mod.DEFAULT_FORMULATIONS)


def test_rows(results):
    mod, r = results
    rows = r["rows"]
    combos = {(x["formulation"], x["mode"], x["causal"], x["n"], x["d"]) for x in rows}
    assert len(rows) == len(combos) == len(mod.DEFAULT_FORMULATIONS) * 2 * 2 * 2 * 2
    for x in rows:
        assert set(x) == set(mod.ROW_KEYS)
        assert x["status"] == "ok", x
        assert x["ms"] > 0 and x["tflops"] > 0 and x["flops"] > 0
        assert x["peak_extra_mib"] is None  # measured on CUDA only
        if x["formulation"] in mod.V1_FORMULATIONS[1:]:
            assert x["max_abs_err"] < 1e-4, x  # every V1 formulation agrees with naive
        elif x["formulation"] in ("naive", "diff_v2", "baseline"):
            assert x["max_abs_err"] is None


def test_flops_in_rows(results):
    from diffattn_tutorial.measure import flops

    _, r = results
    get = {(x["formulation"], x["mode"], x["causal"], x["n"], x["d"]): x["flops"] for x in r["rows"]}
    assert get[("sdpa_wide", "fwd", False, 16, 8)] == flops.diff_v1_attention_flops(2, 2, 16, 8)
    assert get[("baseline", "fwd", False, 16, 8)] * 1.5 == get[("sdpa_wide", "fwd", False, 16, 8)]
    assert get[("naive", "fwd", False, 16, 8)] == get[("baseline", "fwd", False, 16, 8)]
    assert get[("sdpa_split", "fwd_bwd", True, 24, 16)] == 3.5 * 0.5 * 16 * 2 * 2 * 24 * 24 * 16


def test_kernel_support(results):
    """On a CPU: math takes every call; the fused CPU flash kernel takes the equal-dim calls, not V of width 2d."""
    _, r = results
    for d in ("8", "16"):
        s = r["kernel_support"][d]
        for f in ("sdpa_wide", "sdpa_split", "sdpa_stacked", "diff_v2", "baseline"):
            assert s[f]["MATH"] == "ok"
        for f in ("sdpa_split", "sdpa_stacked", "diff_v2", "baseline"):
            assert s[f]["FLASH_ATTENTION"] == "ok"
        assert s["sdpa_wide"]["FLASH_ATTENTION"].startswith("refused: ")
        assert "same last dimension" in s["sdpa_wide"]["FLASH_ATTENTION"]
        assert s["naive"]["FLASH_ATTENTION"].startswith("not used")


def test_cli_subprocess_and_errors(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--lengths", "8", "--head-dims", "4",
                           "--heads", "1", "--causal", "no", "--modes", "fwd", "--formulations", "naive,sdpa_split",
                           "--reps", "1", "--warmup", "0", "--out", str(out), "-q"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert [x["formulation"] for x in r["rows"]] == ["naive", "sdpa_split"]
    assert r["config"]["dtype"] == "float32" and r["recorded"]["command"].startswith("python benchmarks/bench_sdpa.py")
    mod = load_script()
    with pytest.raises(SystemExit, match="unknown formulations"):
        mod.main(["--device", "cpu", "--formulations", "flash3", "--out", str(out)])


def test_find_and_summarise(results, tmp_path):
    mod, r = results
    (tmp_path / "bench_sdpa_cpu.json").write_text(json.dumps(r))
    (tmp_path / "bench_sdpa_broken.json").write_text("{not json")
    assert gpu.find_recorded("bench_sdpa", folder=tmp_path) == []  # only CUDA results by default
    [(name, found)] = gpu.find_recorded("bench_sdpa", device_type=None, folder=tmp_path)
    assert name == "bench_sdpa_cpu" and found == r
    table = gpu.sdpa_summary(r, d=8, mode="fwd")
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * 2  # header, rule, (causal x N)
    assert all(line.count("|") == len(mod.DEFAULT_FORMULATIONS) + 6 for line in lines)
    assert lines[2].startswith("| 8 | no | fwd | 16 |") and lines[2].endswith("x |")
