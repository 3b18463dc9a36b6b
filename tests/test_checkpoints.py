"""Run folders and checkpoints of ``python -m diffattn_tutorial.training.loop`` under faults: a reused ``--out``, damaged,
unfinished, foreign and crafted checkpoints, a broken ``config.json``, Ctrl-C, a diverging loss.

Runs are tiny (a ``d_model=16`` DIFF model, a global batch of 2, a few steps: about a second each) and happen in
this process, except the Ctrl-C runs, which get processes of their own so the signal reaches only them.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffattn_tutorial.training import loop
from diffattn_tutorial.training.checkpoints import (
    MANIFEST,
    CheckpointError,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_model,
    verify_checkpoint,
)
from diffattn_tutorial.training.config import DataSource
from diffattn_tutorial.training.loop import main
from diffattn_tutorial.training.runlog import read_records, read_steps

TINY = ["--d-model", "16", "--steps", "4", "--warmup", "1", "--global-batch", "2", "--batch-size", "2",
        "--no-progress"]


def run(out: Path, *args: str) -> int:
    return main([*TINY, "--out", str(out), *args])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_second_run_in_the_same_folder_is_refused_and_overwrite_clears_it(tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "2") == 0
    before = snapshot(tmp_path)
    assert run(tmp_path, "--seed", "1") == 2  # the reported bug: this deleted metrics.jsonl, kept checkpoints/
    err = one_line_error(capsys)
    assert f"--out {tmp_path} is not empty" in err and "--resume" in err and "--overwrite" in err
    assert snapshot(tmp_path) == before  # nothing touched
    old_id = json.loads((tmp_path / "config.json").read_text())["run_id"]
    assert run(tmp_path, "--seed", "1", "--stop-at", "1", "--overwrite") == 0
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000001"]  # the old run's are gone
    assert json.loads((tmp_path / "config.json").read_text())["run_id"] != old_id
    assert [r["step"] for r in read_steps(tmp_path / "metrics.jsonl")] == [1]
    (tmp_path / "notes.txt").write_text("mine")
    assert run(tmp_path, "--overwrite") == 2  # only a run's own files are ever deleted
    assert "not a training run's (notes.txt)" in one_line_error(capsys) and (tmp_path / "notes.txt").exists()


def test_every_checkpoint_carries_a_manifest_with_hashes_config_and_run_id(tmp_path):
    assert run(tmp_path, "--stop-at", "2", "--checkpoint-every", "1") == 0
    saved = json.loads((tmp_path / "config.json").read_text())
    for step in (1, 2):
        path = checkpoint_dir(tmp_path, step)
        manifest = verify_checkpoint(path)
        assert manifest["step"] == step and manifest["run_id"] == saved["run_id"]
        assert manifest["config"] == {k: v for k, v in saved.items() if k != "run_id"}
        files = sorted(p.name for p in path.iterdir() if p.name != MANIFEST)
        assert sorted(manifest["files"]) == files and ".metadata" in files
        assert not list(path.glob(f"{MANIFEST}.tmp"))  # written under a temporary name, then renamed


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path, capsys):
    assert run(tmp_path / "a", "--stop-at", "1") == 0
    assert run(tmp_path / "b", "--stop-at", "2") == 0  # the same command: only the run id tells them apart
    shutil.copytree(checkpoint_dir(tmp_path / "b", 2), checkpoint_dir(tmp_path / "a", 2))
    assert run(tmp_path / "a", "--resume") == 2
    err = one_line_error(capsys)
    assert "step_000002 belongs to run" in err and "mixes two runs" in err


def test_resume_refuses_a_command_that_differs_from_the_checkpoints_config(tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "1") == 0
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "lr": 0.5}))  # the checkpoint's own config rules
    assert run(tmp_path, "--resume", "--lr", "0.5") == 2
    assert "lr: checkpoint 0.003, now 0.5" in one_line_error(capsys)


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated distcp": (lambda p: os.truncate(p / "__0_0.distcp", 1000), "__0_0.distcp has 1000 bytes"),
    "bit-flipped distcp": (lambda p: _flip_a_byte(p / "__0_0.distcp"), "__0_0.distcp differs from the sha256"),
    "garbage metadata": (lambda p: (p / ".metadata").write_bytes(b"garbage"), ".metadata has 7 bytes"),
    "unfinished save": (lambda p: (p / MANIFEST).unlink(), f"has no {MANIFEST}"),
    "garbage manifest": (lambda p: (p / MANIFEST).write_text("{"), f"has a damaged {MANIFEST}"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_checkpoint_is_named_and_resume_falls_back_to_the_newest_intact_one(kind, tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "2", "--checkpoint-every", "1") == 0
    damage, message = DAMAGE[kind]
    newest = checkpoint_dir(tmp_path, 2)
    damage(newest)
    with pytest.raises(CheckpointError, match=f"checkpoint {newest}.*{message}"):
        load_model(tmp_path, step=2)
    capsys.readouterr()
    assert run(tmp_path, "--resume", "--checkpoint-every", "1") == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"checkpoint {newest}" in err and message in err
    assert f"resuming from {checkpoint_dir(tmp_path, 1)}" in err
    start = [r for r in read_records(tmp_path / "metrics.jsonl") if r["event"] == "start"][-1]
    assert start["step"] == 1 and start["resumed_from"] == "step_000001" and message in start["skipped_checkpoints"][0]
    assert [r["step"] for r in read_steps(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]
    verify_checkpoint(checkpoint_dir(tmp_path, 2))  # saved again, whole, by the resumed run


def test_without_an_intact_checkpoint_resume_says_how_to_go_on(tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "2", "--checkpoint-every", "1") == 0
    os.truncate(checkpoint_dir(tmp_path, 2) / "__0_0.distcp", 10)
    (checkpoint_dir(tmp_path, 1) / MANIFEST).unlink()
    assert run(tmp_path, "--resume") == 2
    err = one_line_error(capsys)
    assert "no intact checkpoint" in err and "step_000002 is damaged" in err and "step_000001 has no" in err
    assert "--overwrite" in err and "--allow-unverified-checkpoint" in err
    assert run(tmp_path, "--resume", "--allow-unverified-checkpoint") == 0  # the user's word for step 1's files
    assert [r["step"] for r in read_steps(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4]


class _Marker:
    """Unpickling this object creates a file: what a crafted ``.metadata`` could do instead."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_crafted_metadata_pickle_is_never_unpickled(tmp_path, capsys):
    out, marker = tmp_path / "run", tmp_path / "code-ran"
    assert run(out, "--stop-at", "1") == 0
    (checkpoint_dir(out, 1) / ".metadata").write_bytes(pickle.dumps(_Marker(str(marker))))
    with pytest.raises(CheckpointError, match=r"step_000001 is damaged: .metadata"):
        load_model(out)
    assert run(out, "--resume") == 2
    assert "no intact checkpoint" in one_line_error(capsys)
    assert not marker.exists()  # torch never read the file: the manifest check came first


def test_load_model_refuses_a_checkpoint_without_manifest_unless_told(tmp_path):
    assert run(tmp_path, "--stop-at", "2") == 0
    reference = load_model(tmp_path).state_dict()
    (checkpoint_dir(tmp_path, 2) / MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"no verified checkpoint in {tmp_path}/checkpoints: step_000002 "
                                              f"has no {MANIFEST} .*load_model\\(..., allow_unverified=True\\)"):
        load_model(tmp_path)  # the step folders and the option are named (it said "no checkpoint")
    with pytest.raises(FileNotFoundError, match=r"no checkpoint for step 3 in .* \(it holds step_000002\)"):
        load_model(tmp_path, step=3)
    with pytest.raises(CheckpointError, match=f"step_000002 has no {MANIFEST}"):
        load_model(tmp_path, step=2)
    loaded = load_model(tmp_path, allow_unverified=True).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in reference.items())


@pytest.mark.parametrize("content, message", [("{", "config.json is broken"), ("[]", "config.json is broken"),
                                              ('{"lr": 0.1, "colour": 1}', "keys RunConfig does not know (colour)")])
def test_a_broken_config_json_is_named(content, message, tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "1") == 0
    (tmp_path / "config.json").write_text(content)
    assert run(tmp_path, "--resume") == 2
    err = one_line_error(capsys)
    assert f"{tmp_path / 'config.json'}" in err and message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal of bf16")
def test_a_run_refused_for_this_device_leaves_its_folder_untouched(tmp_path, capsys):
    assert run(tmp_path / "run", "--precision", "bf16") == 2
    assert "needs a CUDA GPU" in one_line_error(capsys)
    assert not (tmp_path / "run").exists()  # so the corrected command needs no --overwrite


@pytest.mark.parametrize("bad, message, existing", [
    (["--n-heads", "3"], "d_model=16 must be divisible by n_heads=3", False),  # the reported command
    (["--n-heads", "1"], "n_heads=1 and n_kv_heads=1 must both be even", True),  # into an empty folder
])
def test_a_refused_model_shape_leaves_the_folder_untouched_and_the_corrected_command_runs(bad, message, existing,
                                                                                        tmp_path, capsys):
    out = tmp_path / "run"
    if existing:
        out.mkdir()
    assert run(out, *bad, "--steps", "2") == 2
    assert message in one_line_error(capsys)
    assert (sorted(out.iterdir()) == [] if existing else not out.exists())
    assert run(out, "--steps", "2") == 0  # no --overwrite, no --resume needed
    assert [r["step"] for r in read_steps(out / "metrics.jsonl")] == [1, 2]


def test_stop_at_before_the_checkpoint_is_refused(tmp_path, capsys):
    assert run(tmp_path, "--stop-at", "3") == 0
    assert run(tmp_path, "--resume", "--stop-at", "2") == 2
    assert "--stop-at 2 lies before step 3" in one_line_error(capsys)


def test_a_diverging_loss_is_one_line_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(DataSource, "loss", lambda self, model, batch: model(batch.tokens).sum() * float("nan"))
    assert run(tmp_path) == 1
    assert "step 1: the loss is nan; lower --lr or raise --warmup; then start again with --overwrite" in \
        one_line_error(capsys)


CHILD = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
         "from diffattn_tutorial.cli import main; sys.exit(main(sys.argv[1:]))")


def interrupted_run(out: Path, *args: str, when) -> tuple[int, str]:
    """``train`` in a process of its own, sent SIGINT (Ctrl-C) once ``when()`` holds; its exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "train", *TINY, "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not when() and proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not get there within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


@pytest.fixture
def ctrl_c_after_step_1(monkeypatch):
    """A real SIGINT to this process when step 1 is first logged, Python's default handler in place (as in a
    shell)."""
    write, sent = loop.MetricsLog.write, []

    def write_then_signal(self, record):
        write(self, record)
        if record.get("event") == "step" and record["step"] == 1 and not sent:
            sent.append(True)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(loop.MetricsLog, "write", write_then_signal)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_before_the_first_checkpoint_resumes_from_step_0(tmp_path, capsys, ctrl_c_after_step_1):
    """The reported circle: --resume said "run without --resume first", which refused the folder as not empty."""
    out = tmp_path / "run"
    assert run(out, "--steps", "10000") == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert "stopped at step 1 of 10000, before any checkpoint was saved; --resume starts it again from step 0" in err
    assert not (out / "checkpoints").exists() and (out / "config.json").exists()
    assert run(out, "--steps", "10000", "--stop-at", "2") == 2
    assert "continue its run with --resume" in one_line_error(capsys)
    assert run(out, "--steps", "10000", "--stop-at", "2", "--resume", "--lr", "0.5") == 2  # still the same run
    assert "trains a different run than the run in" in one_line_error(capsys)
    assert run(out, "--steps", "10000", "--stop-at", "2", "--resume") == 0
    records = read_records(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "step"] == [1, 2]  # the log reads as one run
    assert [r["step"] for r in records if r["event"] == "start"] == [0, 0]
    assert json.loads((out / "config.json").read_text())["run_id"] == verify_checkpoint(
        checkpoint_dir(out, 2))["run_id"]


def test_ctrl_c_stops_with_the_step_and_how_to_resume(tmp_path):
    """SIGINT at a moment the test does not choose (once step 2's checkpoint exists; often during a later save):
    the step and a checkpoint being written finish, one line, exit code 130, and ``--resume`` continues."""
    out = tmp_path / "run"
    code, err = interrupted_run(out, "--steps", "10000", "--checkpoint-every", "2",
                                when=lambda: (checkpoint_dir(out, 2) / MANIFEST).exists())
    assert code == 130 and "Traceback" not in err and err.count("\n") == 1, err
    last = read_records(out / "metrics.jsonl")[-1]
    assert last["event"] == "interrupted"
    saved = last["step"] - last["step"] % 2  # the checkpoint of the last step due one was written whole
    assert list_checkpoints(out)[-1] == latest_checkpoint(out) == checkpoint_dir(out, saved)
    verify_checkpoint(checkpoint_dir(out, saved))
    assert f"stopped at step {last['step']} of 10000; resume with --resume from step {saved}" in err
    assert main([*TINY, "--steps", "10000", "--stop-at", str(saved + 1), "--checkpoint-every", "2", "--out",
                 str(out), "--resume"]) == 0
    assert [r["step"] for r in read_steps(out / "metrics.jsonl")] == list(range(1, saved + 2))


WRITES = [*TINY, "--n-layers", "1", "--checkpoint-every", "2"]  # steps 1-4, the first checkpoint after step 2


@pytest.mark.parametrize("how", ["sample", pytest.param("all", marks=pytest.mark.slow)])
def test_ctrl_c_at_every_write_of_a_checkpoint_lets_it_finish_then_stops(how, tmp_path):
    """A real SIGINT inside the k-th write of the first checkpoint, each run in a process of its own
    (``tests/sigint_in_checkpoint.py``; ``sample``: seven writes, ``all``: every write of the first tensor's
    ``torch.save``, the first write of every item and every write of ``.metadata`` and the manifest). The save
    finishes, manifest included, then the run stops; before, the signal cut the save short (exit 1, "cannot save
    checkpoint ... unexpected pos" inside ``torch.save``, or no checkpoint to resume from)."""
    driver = Path(__file__).with_name("sigint_in_checkpoint.py")
    proc = subprocess.run([sys.executable, str(driver), str(tmp_path), how, *WRITES], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    children = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(children) >= (7 if how == "sample" else 100)
    assert {c["where"].split(",")[0] for c in children} == {"__0_0.distcp", ".metadata.tmp", f"{MANIFEST}.tmp"}
    for child in children:
        out = tmp_path / str(child["k"])
        assert child["code"] == 130 and child["stderr"].count("\n") == 1, child
        assert "stopped at step 2 of 4; resume with --resume from step 2\n" in child["stderr"], child
        assert list_checkpoints(out) == [checkpoint_dir(out, 2)]
        verify_checkpoint(checkpoint_dir(out, 2))
        assert read_records(out / "metrics.jsonl")[-1]["event"] == "interrupted"
    out = tmp_path / str(children[len(children) // 2]["k"])
    assert main([*WRITES, "--out", str(out), "--resume"]) == 0  # and the run goes on to the uninterrupted end
    reference = load_model(tmp_path / "ref").state_dict()
    for name, value in load_model(out).state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=1e-4, atol=2e-5, msg=name)
