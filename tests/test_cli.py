"""The diffattn-tutorial command: doctor reports the backends, bench measures real time and memory side by side."""

import pytest
import torch

from diffattn_tutorial import bench
from diffattn_tutorial.cli import main


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
    assert len(rows) == 2 * len(bench.DEFAULT_BACKENDS)
    for line in rows:
        err = float(line.rstrip(" |").split("|")[-1])
        assert err < 1e-5, line


@pytest.mark.skipif(not bench.cpu_memory_supported(), reason="CPU peak memory is measured on Linux only")
def test_cpu_peak_memory_is_measured_not_guessed():
    b, h, n, d = 1, 2, 512, 16
    mem = bench.cpu_peak_extra(["naive", "sdpa_split"], b=b, h=h, n=n, d=d, causal=False)
    maps = b * h * 2 * n * n * 4  # the naive backend materialises both float32 maps
    assert mem["naive"] >= maps
    assert mem["sdpa_split"] < maps / 4  # the fused kernel keeps no N x N map


def test_run_rows_and_table():
    rows = bench.run("cpu", lengths=[32], backends=["sdpa_split"], h=2, d=8, reps=1, memory=False)
    assert [r.backend for r in rows] == ["naive", "sdpa_split"]
    assert all(r.ms > 0 and r.extra_mib is None and r.max_abs_err < 1e-5 for r in rows)
    table = bench.format_table(rows)
    assert "| 32 | sdpa_split |" in table and "n/a" in table


def test_make_inputs_layout():
    q, k, v, lam = bench.make_inputs(2, 3, 5, 4, dtype=torch.float64)
    assert q.shape == k.shape == (2, 6, 5, 4) and v.shape == (2, 3, 5, 8) and lam.ndim == 0
    assert q.dtype == torch.float64


def test_unknown_subcommand_exits_with_usage():
    with pytest.raises(SystemExit) as e:
        main(["frobnicate"])
    assert e.value.code == 2


@pytest.mark.parametrize("argv,message", [
    (["bench", "--backends", "nope"], "unknown backend(s) ['nope']; choose from auto, naive"),
    (["bench", "--backends", "naive,sdpa_wrong"], "unknown backend(s) ['sdpa_wrong']"),
    (["bench", "--lengths", "0"], "0 must be at least 1"),
    (["bench", "--reps", "x"], "'x' is not a whole number"),
])
def test_bench_rejects_bad_options_with_a_usage_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2  # argparse's usage error, before any child process starts
    assert message in capsys.readouterr().err


def test_train_subcommand_is_the_training_entry_point(capsys):
    """`diffattn-tutorial train ARGS` is `python -m diffattn_tutorial.train ARGS`: same options, same errors."""
    from diffattn_tutorial.cli import main as cli_main

    assert cli_main(["train", "--steps", "0"]) == 2
    assert "--steps: 0 must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["train", "--help"])
    assert exit_info.value.code == 0 and "--strategy" in capsys.readouterr().out
