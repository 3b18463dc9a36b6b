"""The diffattn-tutorial command: doctor reports the backends, bench measures real time and memory side by side."""

import json
import os
from pathlib import Path

import pytest
import torch

from diffattn_tutorial.cli import main
from diffattn_tutorial.measure import timing


def test_doctor_lists_every_backend(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "CPU:" in out
    for name in ("naive", "chunked", "sdpa_split", "sdpa_wide", "sdpa_stacked", "triton", "auto"):
        assert f" {name} " in out, name


def test_bench_prints_every_backend_with_the_same_result(capsys):
    assert main(["bench", "--lengths", "64", "96", "--reps", "1", "--no-memory"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 64 ") or line.startswith("| 96 ")]
    assert len(rows) == 2 * len(timing.DEFAULT_BACKENDS)
    for line in rows:
        err = float(line.rstrip(" |").split("|")[-1])
        assert err < 1e-5, line


@pytest.mark.skipif(not timing.cpu_memory_supported(), reason="CPU peak memory is measured on Linux only")
def test_cpu_peak_memory_is_measured_not_guessed():
    b, h, n, d = 1, 2, 512, 16
    mem = timing.cpu_peak_extra(["naive", "sdpa_split"], b=b, h=h, n=n, d=d, causal=False)
    maps = b * h * 2 * n * n * 4  # the naive backend materialises both float32 maps
    assert mem["naive"] >= maps
    assert mem["sdpa_split"] < maps / 4  # the fused kernel keeps no N x N map


@pytest.mark.skipif(not timing.cpu_memory_supported(), reason="CPU peak memory is measured on Linux only")
def test_a_refusal_in_the_memory_child_comes_back_as_its_own_one_line_error():
    """A function the memory-measuring child runs raises what it raised (type and message), not a
    RuntimeError carrying the child's traceback."""
    import functools

    from diffattn_tutorial.functional import diff_attention

    fn = functools.partial(diff_attention, backend="cpu_fused")
    with pytest.raises(TypeError, match="^backend 'cpu_fused' takes float32.*got float64") as info:
        timing.peak_extra_memory({"fused": fn}, b=1, h=1, n=8, d=4, dtype=torch.float64)
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)


def test_bench_out_of_memory_names_the_options(capsys):
    assert main(["bench", "--batch", "65536", "--heads", "65536", "--lengths", "4096", "--reps", "1",
                 "--device", "cpu", "--no-memory"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not enough memory for B=65536 H=65536 N=4096 d=64" in err
    assert "use smaller --lengths, --heads, --batch or --head-dim" in err


def test_run_rows_and_table():
    rows = timing.run("cpu", lengths=[32], backends=["sdpa_split"], h=2, d=8, reps=1, memory=False)
    assert [r.backend for r in rows] == ["naive", "sdpa_split"]
    assert all(r.ms > 0 and r.extra_mib is None and r.max_abs_err < 1e-5 for r in rows)
    table = timing.format_table(rows)
    assert "| 32 | sdpa_split |" in table and "n/a" in table


def test_make_inputs_layout():
    q, k, v, lam = timing.make_inputs(2, 3, 5, 4, dtype=torch.float64)
    assert q.shape == k.shape == (2, 6, 5, 4) and v.shape == (2, 3, 5, 8) and lam.ndim == 0
    assert q.dtype == torch.float64


def test_unknown_subcommand_exits_with_usage(capsys):
    assert main(["frobnicate"]) == 2  # one line, as every usage error of both commands: no SystemExit, no traceback
    err = capsys.readouterr().err
    assert err.startswith("diffattn-tutorial: error: argument command: invalid choice: 'frobnicate'") \
        and err.endswith("(see diffattn-tutorial --help)\n") and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["bench", "--backends", "nope"], "unknown backend(s) ['nope']; choose from auto, naive"),
    (["bench", "--backends", "naive,sdpa_wrong"], "unknown backend(s) ['sdpa_wrong']"),
    (["bench", "--lengths", "0"], "0 must be at least 1"),
    (["bench", "--reps", "x"], "'x' is not a whole number"),
])
def test_bench_rejects_bad_options_with_a_usage_message(argv, message, capsys):
    assert main(argv) == 2  # argparse's usage error, before any child process starts
    err = capsys.readouterr().err
    assert message in err and err.startswith("diffattn-tutorial bench: error: ")
    assert err.endswith("(see diffattn-tutorial bench --help)\n")


def test_train_subcommand_is_the_training_entry_point(capsys):
    """`diffattn-tutorial train ARGS` is `python -m diffattn_tutorial.training.loop ARGS`: same options, same errors."""
    from diffattn_tutorial.cli import main as cli_main

    assert cli_main(["train", "--steps", "0"]) == 2
    assert "--steps: 0 must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--help"])
    assert exit_info.value.code == 0 and "--strategy" in capsys.readouterr().out



def test_every_subcommand_answers_bad_values_with_one_line_and_no_traceback(tmp_path):
    """Each subcommand of ``diffattn-tutorial --help`` with bad values: a non-zero exit and one line on stderr.

    The cases run through the CLI's ``main`` in one child process (``children/cli_sweep.py`` by
    ``forked.run_module``, without ``TRITON_INTERPRET``, as a learner's shell has it), each as the console script
    runs it: an exception escaping ``main`` is the traceback the user would see."""
    from forked import run_module

    from diffattn_tutorial.cli import build_parser

    a_file, text = tmp_path / "a_file", tmp_path / "notes.txt"
    a_file.write_text("")
    text.write_text("not a notebook")
    (tmp_path / "corrupt.ipynb").write_text('{"cells": [')
    (tmp_path / "list.ipynb").write_text("[]")
    (tmp_path / "int_source.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": "# TASK 1: a\nx = 1", "metadata": {}, "outputs": [], "execution_count": None},
        {"cell_type": "code", "source": 3, "metadata": {}, "outputs": [], "execution_count": None}],
        "metadata": {}, "nbformat": 4, "nbformat_minor": 4}))
    (tmp_path / "no_tasks.ipynb").write_text(json.dumps({"cells": [], "metadata": {}, "nbformat": 4,
                                                         "nbformat_minor": 5}))
    broken = tmp_path / "broken_run"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    (broken / "checkpoints" / "step_000001").mkdir(parents=True)
    train = ["train", "--d-model", "16", "--steps", "2", "--global-batch", "2", "--batch-size", "2", "--no-progress"]
    out = ["--out", str(tmp_path / "run")]
    cases = {
        "": [[], ["frobnicate"], ["--bogus"]],
        "doctor": [["doctor", "--bogus"], ["doctor", "extra"]],
        "bench": [["bench", "--device", "tpu"], ["bench", "--device", "meta"], ["bench", "--device", "cuda:x"],
                  ["bench", "--backends", "nope"], ["bench", "--backends", ","], ["bench", "--lengths", "0"],
                  ["bench", "--lengths", "x"], ["bench", "--reps", "-1"], ["bench", "--dtype", "int8"],
                  ["bench", "--batch", "0"], ["bench", "--heads", "1.5"], ["bench", "--head-dim", "nan"],
                  ["bench", "--backends", "cpu_fused", "--dtype", "float64", "--lengths", "8", "--reps", "1",
                   "--no-memory", "--device", "cpu"],
                  ["bench", "--backends", "cpu_fused", "--dtype", "float64", "--lengths", "8", "--reps", "1",
                   "--device", "cpu"],  # the memory-measuring child is not where the refusal surfaces
                  ["bench", "--batch", "65536", "--heads", "65536", "--lengths", "4096", "--reps", "1",
                   "--device", "cpu"],  # inputs of 8 PiB: no machine can allocate them
                  ["bench", "--heads", "65536", "--lengths", "4096", "--head-dim", "65536", "--batch", "65536",
                   "--reps", "1", "--device", "cpu"]],  # past what torch can even size
        "check": [["check"], ["check", str(tmp_path / "missing.ipynb")], ["check", str(text)],
                  ["check", str(tmp_path / "corrupt.ipynb")], ["check", str(tmp_path / "list.ipynb")],
                  ["check", str(tmp_path / "int_source.ipynb")],
                  ["check", str(tmp_path / "no_tasks.ipynb")], ["check", str(tmp_path)],
                  ["check", str(text), "--timeout", "0"]],
        "train": [[*train, "--out", str(a_file / "x")], [*train, "--out", str(a_file)],
                  [*train, *out, "--attn-backend", "triton"],
                  [*train, *out, "--compile", "--compile-backend", "foo"], [*train, *out, "--lr", "1e30"],
                  [*train, *out, "--lr", "nan"], [*train, *out, "--lr", "inf"], [*train, *out, "--lr", "-1"],
                  [*train, *out, "--weight-decay", "nan"], [*train, *out, "--weight-decay", "-1"],
                  [*train, *out, "--clip", "inf"], [*train, *out, "--clip", "-1"], [*train, *out, "--steps", "0"],
                  [*train, *out, "--strategy", "zero3"], [*train, *out, "--device", "tpu"],
                  [*train, *out, "--seed", "-1"], [*train, *out, "--threads", "0"], [*train, *out, "--resume"],
                  [*train, "--out", str(broken), "--resume"], [*train, *out, "--global-batch", "3"],
                  [*train, *out, "--stop-at", "9"], [*train, *out, "--resume", "--overwrite"],
                  [*train, *out, "--bogus"]],
    }
    if torch.cuda.is_available():
        cases["train"].remove([*train, *out, "--attn-backend", "triton"])
    else:
        cases["bench"] += [["bench", "--device", "cuda"], ["bench", "--backends", "triton", "--device", "cpu"]]
    if Path("/proc").is_dir():
        cases["train"].append([*train, "--out", "/proc/diffattn-cannot-be-here"])
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert commands <= set(cases) and "train" in commands, "a new subcommand needs bad values here"

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argvs = [argv for group in cases.values() for argv in group]
    proc = run_module("children.cli_sweep", [json.dumps(argvs)], env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    problems = []
    for argv, code, err in json.loads(proc.stdout.strip().splitlines()[-1]):
        lines = err.strip().splitlines()
        if code == "escaped" or "Traceback" in err:
            problems.append(f"{argv}: traceback\n{err[-1500:]}")
        elif not isinstance(code, int) or code == 0:
            problems.append(f"{argv}: exit code {code!r}")
        elif len(lines) != 1:
            problems.append(f"{argv}: {len(lines)} lines on stderr:\n{err}")
    assert not problems, "\n".join(problems)
    assert not (tmp_path / "run").exists()  # every refusal came before anything was written


def test_doctor_reports_an_unwritable_cache_folder_and_still_runs(tmp_path, capsys, monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "a_file" / "cache"))  # under a file: cannot be created
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("cache:"))
    assert "is not writable" in line and "set DIFFATTN_CACHE to a folder you can write to" in line
    monkeypatch.setenv("DIFFATTN_CACHE", str(tmp_path / "cache"))
    assert main(["doctor"]) == 0
    assert f"cache: {tmp_path / 'cache'} (writable" in capsys.readouterr().out


def test_a_ctrl_c_leaves_one_line_not_the_runners_teardown_tracebacks():
    """``check`` interrupted: the notebook runner's teardown could print an unread task exception and a failing exit
    handler after "stopped (Ctrl-C)" (seen once in a whole-suite run); the command silences both once interrupted."""
    from forked import run_module

    loud = run_module("children.cli_quiet_teardown", timeout=120)
    assert loud.returncode == 0 and loud.stdout.strip() == "done", loud.stderr
    assert "Task exception was never retrieved" in loud.stderr and "Exception ignored in atexit callback" in loud.stderr
    quiet = run_module("children.cli_quiet_teardown", ["quiet"], timeout=120)
    assert quiet.returncode == 0 and quiet.stdout.strip() == "done" and quiet.stderr == "", quiet.stderr
