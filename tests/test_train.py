"""``python -m diffattn_tutorial.training.loop``: one process and two (DDP, FSDP2, gloo on the CPU) train the same model,
a resumed run continues the uninterrupted loss curve, ``--compile`` changes nothing, bad input is a usage error.

Two-process runs go through ``torchrun`` in a subprocess on a free port, one thread per process, with a timeout
(``distributed.launch``), so a hang fails the test instead of blocking CI. Sizes are tiny: four AdamW steps of a
two-layer ``d_model=32`` DIFF model on a global batch of 8 needle sequences.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from diffattn_tutorial.paths import package_root
from diffattn_tutorial.training import distributed
from diffattn_tutorial.training.checkpoints import (
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    verify_checkpoint,
)
from diffattn_tutorial.training.config import DataSource, RunConfig, graph_breaks
from diffattn_tutorial.training.loop import main
from diffattn_tutorial.training.runlog import loss_curve, read_records, read_steps
from diffattn_tutorial.training.study import lr_factor

STEPS = 4
COMMON = ["--attention", "diff", "--d-model", "32", "--steps", str(STEPS), "--warmup", "1", "--lr", "0.01",
          "--global-batch", "8", "--no-progress"]
TIMEOUT = 240  # seconds for one two-process run; about 8 s of CPU time on an idle 2-core machine
PARAM_TOL = dict(rtol=1e-4, atol=2e-5)  # float32 sums in another order, through 4 AdamW steps
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def run_here(out: Path, *args: str) -> Path:
    """One process, in this interpreter."""
    assert main([*COMMON, "--out", str(out), *args]) == 0
    return out


def run_two(out: Path, *args: str) -> Path:
    """Two processes under torchrun (gloo)."""
    distributed.launch("diffattn_tutorial.training.loop", [*COMMON, "--out", str(out), *args], nproc=2, timeout=TIMEOUT)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("train")
    out = {"one": run_here(tmp / "one", "--batch-size", "8")}
    # DDP: 2 ranks x 2 rows x 2 accumulation micro-steps = the same 8 rows per step
    out["ddp"] = run_two(tmp / "ddp", "--strategy", "ddp", "--batch-size", "2")
    # FSDP2, interrupted after step 2 and resumed by a new pair of processes
    run_two(tmp / "fsdp2", "--strategy", "fsdp2", "--batch-size", "4", "--stop-at", "2")
    out["fsdp2"] = run_two(tmp / "fsdp2", "--strategy", "fsdp2", "--batch-size", "4", "--resume")
    return out


def params(out: Path) -> dict[str, torch.Tensor]:
    return load_model(out).state_dict()


def test_data_rows_do_not_depend_on_how_the_batch_is_split():
    source = DataSource(RunConfig(global_batch=8))
    whole = source.rows(3, range(8))
    parts = [source.rows(3, distributed.micro_batch_rows(m, r, 2, 2)) for m in range(2) for r in range(2)]
    assert torch.equal(whole.tokens, torch.cat([p.tokens for p in parts]))
    assert torch.equal(whole.targets, torch.cat([p.targets for p in parts]))
    assert not torch.equal(source.rows(4, range(8)).tokens[:, :50], whole.tokens[:, :50])  # each step new data


@pytest.mark.parametrize("per_rank, world, accum", [(2, 2, 2), (3, 4, 1), (1, 1, 5), (5, 3, 3)])
def test_micro_batch_rows_read_every_row_once(per_rank, world, accum):
    seen = [i for m in range(accum) for r in range(world) for i in distributed.micro_batch_rows(m, r, per_rank, world)]
    assert sorted(seen) == list(range(per_rank * world * accum))


@pytest.mark.slow  # torchrun launches
def test_ddp_two_processes_reach_the_one_process_parameters(runs):
    ref = params(runs["one"])
    got = params(runs["ddp"])
    assert got.keys() == ref.keys()
    for name in ref:
        assert_close(got[name], ref[name], **PARAM_TOL, msg=name)
    assert_close(loss_curve(runs["ddp"] / "metrics.jsonl")[1], loss_curve(runs["one"] / "metrics.jsonl")[1],
                 **LOSS_TOL)
    start = read_records(runs["ddp"] / "metrics.jsonl")[0]
    assert start["world_size"] == 2 and start["config"]["grad_accum"] == 2 and start["backend"] == "gloo"


@pytest.mark.slow  # torchrun launches
def test_fsdp2_resumed_run_reaches_the_one_process_parameters_and_loss_curve(runs):
    ref = params(runs["one"])
    got = params(runs["fsdp2"])  # loaded into one process from two ranks' shards
    for name in ref:
        assert_close(got[name], ref[name], **PARAM_TOL, msg=name)
    steps, losses = loss_curve(runs["fsdp2"] / "metrics.jsonl")
    assert steps.tolist() == list(range(1, STEPS + 1))  # the resumed log reads as one run
    assert_close(losses, loss_curve(runs["one"] / "metrics.jsonl")[1], **LOSS_TOL)
    starts = [r for r in read_records(runs["fsdp2"] / "metrics.jsonl") if r["event"] == "start"]
    assert [s["step"] for s in starts] == [0, 2]


@pytest.mark.slow  # torchrun launches
def test_fsdp2_keeps_a_torch_chunk_shard_of_each_parameter_per_rank(runs):
    start = read_records(runs["fsdp2"] / "metrics.jsonl")[0]
    full = params(runs["one"]).values()
    expected = [sum(distributed.fsdp_local_shard(p, rank, 2).numel() for p in full) for rank in range(2)]
    assert start["params_per_rank"] == expected
    assert sum(expected) == start["params"] == sum(p.numel() for p in full)
    ddp = read_records(runs["ddp"] / "metrics.jsonl")[0]
    assert ddp["params_per_rank"] == [ddp["params"]] * 2  # DDP: a full copy on every rank


@pytest.mark.slow  # torchrun launches
def test_one_process_resume_continues_exactly(runs, tmp_path):
    run_here(tmp_path, "--batch-size", "8", "--stop-at", "3")
    assert latest_checkpoint(tmp_path).name == "step_000003"
    run_here(tmp_path, "--batch-size", "4", "--resume")  # another micro-batch split of the same global batch
    assert_close(loss_curve(tmp_path / "metrics.jsonl")[1][:3], loss_curve(runs["one"] / "metrics.jsonl")[1][:3],
                 rtol=0, atol=0)
    for name, value in params(runs["one"]).items():
        assert_close(params(tmp_path)[name], value, **PARAM_TOL, msg=name)


@pytest.mark.slow  # torchrun launches
def test_a_resume_that_changes_the_run_is_refused(runs, tmp_path, capsys):
    run_here(tmp_path, "--batch-size", "8", "--stop-at", "1")
    assert main([*COMMON, "--out", str(tmp_path), "--batch-size", "8", "--resume", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "lr: checkpoint 0.01, now 0.5" in err and "another --out" in err


@pytest.mark.slow  # torchrun launches
def test_compiled_blocks_train_the_same_model(runs, tmp_path):
    run_here(tmp_path, "--batch-size", "8", "--compile", "--compile-backend", "eager")
    for name, value in params(runs["one"]).items():
        assert_close(params(tmp_path)[name], value, **PARAM_TOL, msg=name)
    assert json.loads((tmp_path / "config.json").read_text())["compile"] is True


@pytest.mark.slow  # torchrun launches
def test_ctrl_c_under_torchrun_stops_both_ranks_after_the_same_step(tmp_path):
    """torchrun forwards Ctrl-C to every worker: both finish the step (and a checkpoint being written), agree on
    the step to stop after, and rank 0 prints one line; a new pair of processes resumes from that checkpoint."""
    out = tmp_path / "run"
    args = [*COMMON, "--steps", "10000", "--checkpoint-every", "2", "--batch-size", "4", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_root()), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(distributed.torchrun_command("diffattn_tutorial.training.loop", args), env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (checkpoint_dir(out, 2) / "manifest.json").exists() and proc.poll() is None:
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            distributed._kill_tree(proc.pid)
            proc.communicate()
    last = read_records(out / "metrics.jsonl")[-1]
    assert last["event"] == "interrupted", output
    saved = last["step"] - last["step"] % 2
    assert list_checkpoints(out)[-1] == checkpoint_dir(out, saved)
    verify_checkpoint(checkpoint_dir(out, saved))
    ours = [line for line in output.splitlines() if "diffattn_tutorial" in line]  # torchrun adds its own traceback
    assert len(ours) == 1, output  # rank 0's line, no worker traceback
    assert f"stopped at step {last['step']} of 10000; resume with --resume from step {saved}" in ours[0]
    run_two(out, "--steps", "10000", "--checkpoint-every", "2", "--batch-size", "4", "--stop-at", str(saved + 1),
            "--resume")
    assert [r["step"] for r in read_steps(out / "metrics.jsonl")] == list(range(1, saved + 2))


@pytest.mark.parametrize("attention, backend", [("baseline", "auto"), ("diff", "auto"), ("diff_v2", "auto"),
                                                ("diff", "naive"), ("diff", "chunked")])
def test_the_sdpa_path_and_the_pure_pytorch_backends_compile_without_graph_breaks(attention, backend):
    assert graph_breaks(attention, backend) == 0


def test_text_corpus_run(tmp_path):
    assert main(["--task", "text", "--seq-len", "24", "--d-model", "32", "--steps", "3", "--batch-size", "4",
                 "--warmup", "1", "--no-progress", "--out", str(tmp_path)]) == 0
    rows = read_steps(tmp_path / "metrics.jsonl")
    assert [r["tokens"] for r in rows] == [4 * 24 * (i + 1) for i in range(3)]
    assert all(np.isfinite(r["loss"]) and 0 < r["loss"] < 5 for r in rows)  # ln(30 characters) = 3.4 at start


def test_learning_rate_warms_up_then_decays_to_zero():
    factors = [lr_factor(t, 10, 3) for t in range(11)]
    assert factors[0] == pytest.approx(1 / 3 * 1.0) and factors[2] == pytest.approx(0.5 * (1 + np.cos(0.2 * np.pi)))
    assert factors[10] == 0.0 and all(a >= b for a, b in zip(factors[2:], factors[3:]))


@pytest.mark.parametrize("argv, message", [
    (["--global-batch", "10", "--batch-size", "4"], "--global-batch 10 is not a multiple of --batch-size 4"),
    (["--global-batch", "8", "--batch-size", "4", "--grad-accum", "3"], "give only one of the two"),
    (["--steps", "0"], "--steps: 0 must be at least 1"),
    (["--strategy", "zero3"], "--strategy: invalid choice"),
    (["--steps", "4", "--stop-at", "9"], "stop_at must lie in 1..steps=4"),
    (["--attention", "baseline", "--attn-backend", "sdpa_split"], "attn_backend (attention='baseline'): backend 'sdpa_split' is not one this takes; "
                                                          "choose one of ('auto', 'naive', 'sdpa')"),
    (["--attn-backend", "flash"], "argument --attn-backend: unknown backend 'flash'; choose one of ('auto', 'naive'"),
    (["--lr", "-1"], "lr must lie in (0, 1.0], got -1.0"),
    (["--lr", "1e30"], "lr must lie in (0, 1.0], got 1e+30"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),
    (["--clip", "inf"], "argument --clip: 'inf' is not a finite number"),
    (["--clip", "0"], "clip (the gradient-norm limit) must be > 0"),
    (["--weight-decay", "-0.1"], "weight_decay must be >= 0"),
    (["--weight-decay", "1e9"], "below 1/lr"),
    (["--compile", "--compile-backend", "foo"], "compile_backend 'foo' is not a torch.compile backend"),
    (["--resume", "--overwrite"], "give one of the two"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("python -m diffattn_tutorial.training.loop: error: ")
    assert err.count("\n") == 1 and err.rstrip().endswith("(see python -m diffattn_tutorial.training.loop --help)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of bf16")
def test_bf16_on_a_cpu_and_resume_without_checkpoint_are_refused(tmp_path, capsys):
    assert main(["--precision", "bf16", "--steps", "1", "--out", str(tmp_path / "a"), "--no-progress"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert main(["--resume", "--steps", "1", "--out", str(tmp_path / "b"), "--no-progress"]) == 2
    assert "run without --resume first" in capsys.readouterr().err


@pytest.mark.slow  # torchrun launches
def test_a_hung_launch_times_out_and_leaves_no_process(tmp_path, monkeypatch):
    """A run that never finishes raises TimeoutExpired, and torchrun and both workers are gone afterwards."""
    (tmp_path / "hang.py").write_text("import os, time\n"
                                      "open(os.path.join(os.environ['MARKERS'], os.environ['RANK']), 'w').write("
                                      "str(os.getpid()))\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("MARKERS", str(tmp_path))
    with pytest.raises(subprocess.TimeoutExpired):
        distributed.launch("hang", [], nproc=2, timeout=8)  # workers are up in about 1 s idle, 3 s on a busy machine
    pids = [int((tmp_path / str(rank)).read_text()) for rank in range(2)]  # both workers had started
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_metrics_log_cut_short_by_a_killed_process_still_reads(tmp_path):
    from diffattn_tutorial.training.runlog import MetricsLog

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"event": "start", "step": 0}\n{"event": "step", "step": 1}\n{"event": "step", "st')
    assert [r["event"] for r in read_records(path)] == ["start", "step"]  # the unfinished write is left out
    MetricsLog(path).truncate_after(1)
    assert path.read_text().endswith('"step": 1}\n')
    path.write_text('{"event": "start", "step": 0}\ngarbage\n{"event": "step", "step": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl, line 2, is not a JSON record"):
        read_records(path)
