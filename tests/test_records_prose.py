"""Prose about measurements is generated from the records: ``benchmarks/NOTES.md`` (``tools/make_notes.py``) and the
GPU sentences (``diffattn_tutorial.recorded.gpu_prose``) that the README, NOTES and notebooks 08 and 09 print.

Each check has a planted case it must catch: a number edited by hand in a generated block of NOTES, a measured
number written by hand outside them, an evidence reference that does not resolve, a rerun that ran a ``-k``
selection, a session with no rerun, a probe on a faster call path, a results file without its machine facts."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffattn_tutorial.recorded import gpu_prose

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_notes.py"
_spec = importlib.util.spec_from_file_location("make_notes", TOOL)
notes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(notes)
NOTES = ROOT / "benchmarks" / "NOTES.md"


def test_the_committed_notes_are_what_the_records_give_and_every_reference_resolves():
    run = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_hand_edited_number_in_a_generated_block_is_caught(tmp_path):
    text = NOTES.read_text()
    body = next(m for m in notes.tables.BLOCK.finditer(text) if m.group("name") == "cpu-train").group("body")
    edited = body.replace("x / ", "1x / ", 1)
    assert edited != body
    planted = tmp_path / "NOTES.md"
    planted.write_text(text.replace(body, edited))
    assert notes.problems(text) == []
    assert any("'cpu-train' differs" in p for p in notes.problems(planted.read_text()))
    assert notes.main(["--check", "--notes", str(planted)]) == 1


def test_evidence_that_does_not_resolve_is_caught(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps({"rows": [{"ms": 1.0}], "device": "CPU"}))
    (tmp_path / "m.py").write_text("GOAL = 1.5\n\ndef layers():\n    pass\n")
    good = "`r.json#rows` `r.json:rows.0.ms` `m.py#GOAL` `m.py#layers`"
    assert notes.unresolved(good, tmp_path) == []
    for bad, why in (("`r.json#row`", "no key"), ("`r.json:rows.1.ms`", "no key"), ("`r.json:rows.0.s`", "no key"),
                     ("`m.py#GOALS`", "no top-level name"), ("`gone.json#rows`", "no such file")):
        [found] = notes.unresolved(bad, tmp_path)
        assert why in found, (bad, found)


def test_the_notes_state_no_measured_number_by_hand():
    """Outside the generated blocks and code, a measured-looking number (the drift test's rule) is allowed only where
    its sentence names an outside source; a planted hand-written timing is caught."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_prose_drift as drift

    def hand_numbers(text: str) -> list[str]:
        text = notes.tables.BLOCK.sub("", text)
        return [n.text for block, _ in drift._blocks(drift._prose(text)) for sentence in drift._sentences(block)
                if not drift.SOURCE.search(sentence) for n in drift.prose_numbers(sentence)]

    text = NOTES.read_text()
    assert hand_numbers(text) == [], "numbers written by hand in benchmarks/NOTES.md (generate them)"
    planted = text + "\nThe suite took 407.2 s on a quiet machine, 1.36x the run before.\n"
    assert hand_numbers(planted)


def test_the_notes_are_a_short_log():
    assert len(NOTES.read_text().splitlines()) < 200


# --- the GPU sentences, on planted records ----------------------------------------------------------------------


def _rec(device: str) -> dict:
    return {"device": device, "date": "2026-01-02 03:04 UTC", "command": "python x.py"}


def _plant(folder: Path, *, rerun: bool = True, probe: bool = True) -> None:
    slug = "gpu-x"
    session = {"recorded": _rec("GPU X"), "steps": {"tests": {"status": "failed", "seconds": 100.4}}}
    if rerun:
        session["reruns"] = [{"step": "tests", "date": "2026-01-02 04:00 UTC", "status": "passed", "why": "fixed",
                              "command": 'python -m pytest tests/test_triton.py -k "a or b"', "log_tail": "2 passed in 3.1s"}]
    if probe:
        session["probe"] = {"recorded": dict(_rec("GPU X"), command="python p.py --no-ncu --out somewhere.json"), "forward": [
            {"d": 64, "plan": "split_kv", "block_m": 128, "block_n": 32, "warps": 8, "stages": 3, "n": 8192,
             "status": "ok", "ms": 4.0, "tflops": 400.0},
            {"d": 64, "plan": "split_kv", "block_m": 64, "block_n": 64, "warps": 4, "stages": 3, "n": 8192,
             "status": "ok", "ms": 3.0, "tflops": 500.0}]}
    # default dispatch at B*H = 8, forced kernels at B*H = 32: the default's 1.0 ms is 4.0 ms of the forced work
    sdpa = {"recorded": _rec("GPU X"), "config": {"batch": 1, "heads": 8},
            "rows": [{"formulation": f, "d": 64, "causal": False, "mode": "fwd", "n": 8192, "ms": ms}
                     for f, ms in (("sdpa_wide", 1.0), ("sdpa_split", 1.5), ("sdpa_stacked", 2.0))]}
    pick = "BLOCK_M: 128, BLOCK_N: 32, num_warps: 8, num_ctas: 1, num_stages: 3, maxnreg: None"
    tri = {"recorded": _rec("GPU X"), "chosen_configs": {"_diff_attn_fwd/fused/d64": {"(8192, 1, 64, False, 0)": pick}},
           "rows": [
        {"impl": "triton", "backend": "triton", "d": 64, "causal": False, "mode": "fwd", "n": 8192, "batch": 2,
         "heads": 16, "ms": 5.0, "speedup_vs_best_sdpa": 0.8},
        {"impl": "sdpa_wide", "backend": "cudnn", "d": 64, "causal": False, "mode": "fwd", "n": 8192, "batch": 2,
         "heads": 16, "ms": 4.04, "best_sdpa": True},
        {"impl": "sdpa_wide", "backend": "flash", "d": 64, "causal": False, "mode": "fwd", "n": 8192, "batch": 2,
         "heads": 16, "ms": None, "status": "refused: Memory Efficient attention has been runtime disabled.; "
                                            "Flash attention requires q,k,v to have the same last dimension"},
        {"impl": "sdpa_wide", "backend": "efficient", "d": 64, "causal": False, "mode": "fwd", "n": 8192,
         "batch": 2, "heads": 16, "ms": 12.0}]}
    for kind, data in (("gpu_session", session), ("bench_sdpa", sdpa), ("bench_triton", tri)):
        (folder / f"{kind}_{slug}.json").write_text(json.dumps(data))


def test_a_rerun_is_described_as_what_it_ran(tmp_path):
    _plant(tmp_path)
    text = gpu_prose.session_sentence("gpu-x", tmp_path)
    assert 'part of the `tests` step, the tests selected by `-k "a or b"`' in text and "2 passed in 3.1s" in text
    assert "`tests` passed" not in text


def test_a_session_without_a_rerun_says_none_is_recorded(tmp_path):
    _plant(tmp_path, rerun=False, probe=False)
    assert "No rerun is recorded." in gpu_prose.session_sentence("gpu-x", tmp_path)
    assert "no probe recorded" in gpu_prose.probe_sentence("gpu-x", tmp_path)


def test_the_default_dispatch_is_compared_with_each_forced_kernel(tmp_path):
    _plant(tmp_path)
    [case] = gpu_prose.dispatch_cases("gpu-x", tmp_path)
    assert case["nearest"] == "cudnn" and case["default_ms"] == pytest.approx(4.0)
    text = gpu_prose.dispatch_sentence("gpu-x", tmp_path)
    assert "cuDNN in 1 of 1 cases" in text and "within 1.0% of cuDNN's time" in text
    assert "`sdpa_wide` in 1 of 1 cases" in gpu_prose.fastest_sentence("gpu-x", tmp_path)


def test_the_probe_is_labelled_with_its_call_path(tmp_path):
    _plant(tmp_path)
    text = gpu_prose.probe_sentence("gpu-x", tmp_path)
    assert "`triton_diff_attention`" in text and "not a verdict on the goals" in text
    assert "(`python p.py --no-ncu`)" in text  # the command without the machine's output path
    assert "64 x 64 (4 warps, 3 stages) 3.00 ms, 500 TFLOP/s" in text
    assert "the autotuner's pick in `bench_triton` (128 x 32, 8 warps, 3 stages) took 5.00 ms on the judged path and " \
           "4.00 ms in the probe" in text


def test_a_refusal_is_shown_whole_for_the_kernel_that_was_forced():
    status = ("refused: Memory Efficient attention has been runtime disabled.; Flash attention requires q,k,v to "
              "have the same last dimension")
    assert gpu_prose.refusal_for(status, "flash") == "Flash attention requires q,k,v to have the same last dimension"
    assert gpu_prose.refusal_for(status, "efficient").startswith("Memory Efficient")
    assert gpu_prose.refusal_for("refused: something else", "cudnn") == "refused: something else"


def test_a_cpu_record_without_machine_facts_says_so_and_the_goal_is_per_run(tmp_path, monkeypatch):
    times = {"ours": [1.0, 1.0], "hf": [2.0, 2.0], "timm": [1.4, 1.4]}
    record = {"device": "CPU (x86_64, 2 threads)", "torch": "t", "python": "p", "date": "d", "command": "c",
              "load_average_before": [0.5, 0.5, 0.5], "kernel": {"flags": ["-march=native"]},
              "results": {"512": {"times_s": {c: times for c in notes.CASES}}}}
    (tmp_path / "results_cpu_train_cpu-a.json").write_text(json.dumps(record))
    record_b = dict(record, cpu={"name": "Some CPU"}, kernel={"flags": [], "compiler": "g++ 12"},
                    results={"512": {"times_s": {c: dict(times, timm=[1.6, 1.6]) for c in notes.CASES}}})
    (tmp_path / "results_cpu_train_cpu-b.json").write_text(json.dumps(record_b))
    monkeypatch.setattr(notes.tables, "BENCH", tmp_path)
    monkeypatch.setattr(notes.tables, "ROOT", tmp_path)
    text = notes.cpu_train_block()
    assert "processor not recorded" in text and "without its processor and compiler" in text
    assert "processor Some CPU" in text and "compiler g++ 12" in text
    assert "holds for this run in 4 of 8 comparisons; the lowest is 1.40x (timm" in text
    assert "holds for this run in 8 of 8" in text
    assert "ranges from 1.40x to 1.60x" in text and "every comparison of `results_cpu_train_cpu-b.json` only" in text
    assert "hf's calls include its rotary embedding" in text


def test_a_commit_date_is_not_shown_as_a_run_date():
    data = {"device": "CPU (x86_64, 2 threads)", "date": "2026-11-24",
            "provenance": "the date is that of the commit (abc; the run date itself was not recorded)"}
    assert "commit date 2026-11-24 (run date not recorded)" in notes.tables._provenance(data)
    assert ", 2026-11-24," in notes.tables._provenance({"date": "2026-11-24", "device": "GPU"})
