"""Issue 51's speed goals as ``measure.gpu`` judges and words them: a verdict never prints a value that reads
against its own sign, a missing value says so, and only an H100 run in bf16 at N = 8192 is judged."""
import pytest

from diffattn_tutorial.measure import gpu


def _results(*, device="NVIDIA H100 80GB HBM3", n=8192, dtype="bfloat16", fwd=1.25, tflops=500.0, fb=1.1):
    rows = [{"impl": "triton", "mode": mode, "causal": causal, "n": n, "d": d,
             "speedup_vs_best_sdpa": fwd if mode == "fwd" else fb, "tflops": tflops}
            for d in (64, 128) for causal in (False, True) for mode in ("fwd", "fwd_bwd")]
    return {"recorded": {"device": device}, "config": {"lengths": [n], "dtype": dtype}, "rows": rows}


@pytest.mark.parametrize("fwd, tflops, fb", [(1.1996, 449.8, 0.9996), (1.2, 450.0, 1.0), (1.19999, 449.99, 0.99999)])
def test_a_verdict_never_reads_against_its_sign(fwd, tflops, fb):
    """0.9996 rounded to 3 digits is 1: the verdict must not say ``1 < 1 (not met)``."""
    g = gpu.goals(_results(fwd=fwd, tflops=tflops, fb=fb))[2]  # d = 128, non-causal
    for part in gpu.goal_verdict(g).split(": ", 1)[1].split(", "):
        name, value, sign, threshold = part.split()[:4]
        assert (float(value) >= float(threshold)) == (sign == ">=") == g["met"][name], part


def test_a_missing_value_says_it_was_not_measured():
    res = _results()
    res["rows"] = [r for r in res["rows"] if not r["causal"]]
    text = gpu.goal_verdict(gpu.goals(res)[1])  # d = 64, causal: nothing measured
    assert text.startswith("d = 64, causal: fwd_speedup_vs_best_sdpa not measured (goal >= 1.2, not met)"), text
    assert "fwd_tflops not measured (goal >= 400, not met)" in text


def test_only_an_h100_in_bf16_at_n_8192_is_judged():
    assert all(g["judged"] and all(g["met"].values()) for g in gpu.goals(_results()))
    assert not any(g["judged"] for g in gpu.goals(_results(device="NVIDIA H200")))
    assert not any(g["judged"] for g in gpu.goals(_results(n=16384), n=16384))  # a sweep's longest length
    assert not any(g["judged"] for g in gpu.goals(_results(dtype="float16")))


def test_only_the_kernels_rows_at_the_goals_length_count():
    """A row at another length, or an SDPA formulation's row, is not the kernel's measurement at N = 8192."""
    res = _results(n=4096)
    res["rows"] += [dict(r, impl="sdpa_wide", n=8192) for r in res["rows"]]
    assert all(g[k] is None for g in gpu.goals(res) for k in gpu.KERNEL_GOALS)


def test_notebook_09_states_the_goals_the_code_judges():
    """Chapter 09's prose restates the goals beside the cell that prints them: it must say the code's numbers."""
    import json
    import re
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parents[1] / "notebooks" / "09_triton_kernel.ipynb").read_text())
    text = next(" ".join("".join(c["source"]).split()) for c in nb["cells"]
                if c["cell_type"] == "markdown" and "`measure.gpu.GOALS`" in "".join(c["source"]))
    t = gpu.goal_threshold
    assert f"at least {t('fwd_speedup_vs_best_sdpa', 64):g} times faster than the best SDPA formulation" in text
    assert (f"at least {t('fwd_tflops', 64):g} TFLOP/s at $d = 64$ ({t('fwd_tflops', 128):g} at $d = 128$)"
            in text)
    assert t("fwd_bwd_speedup_vs_best_sdpa", 64) == 1.0 and "forward + backward no slower than the best" in text
    assert re.search(rf"on an {gpu.GOALS_DEVICE} in bf16 at \$N = {gpu.GOALS_N}\$.*causal and not", text)


def test_the_goals_are_read_at_their_length_where_it_was_measured():
    """``goals_length``: a sweep that measured the goals' N and a longer one is read at the goals' N (judged there),
    one that never reached it at its longest length (informative)."""
    assert gpu.goals_length({"config": {"lengths": [4096, gpu.GOALS_N, 16384]}}) == gpu.GOALS_N
    assert gpu.goals_length({"config": {"lengths": [1024, 4096]}}) == 4096
