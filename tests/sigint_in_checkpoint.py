"""Ctrl-C at chosen write positions of a training run's first checkpoint, each run in a process of its own.

    python tests/sigint_in_checkpoint.py BASE {sample|all} TRAIN_OPTIONS...

A reference run (no signal, folder ``BASE/ref``) records every write into a file under ``checkpoints/`` while its
first checkpoint is saved: which file, which item of DCP's ``.distcp`` file it belongs to (each tensor is one
``torch.save``, whose zip writer calls back into Python for every record it writes). Then, for each chosen write
``k``, a child process trains the same run into ``BASE/k`` and sends itself SIGINT (``os.kill``) inside its
``k``-th write, so the signal lands at the same place every time. Children are forked from this process after
torch is imported, so each costs a training run, not an interpreter start; a child that crashes fails alone.

``sample`` chooses seven writes (the first write of the file, the first and a middle write of the first tensor's
``torch.save``, the first write of the last item, the last ``.distcp`` write, ``.metadata``, the manifest); ``all``
every write of the first tensor's ``torch.save``, the first write of every item, and every write of the other
files.

Prints one JSON line per child: ``{"k", "where", "code", "stderr"}`` (``code`` negative: killed by that signal).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import sys
from pathlib import Path

import torch.distributed.checkpoint.filesystem as dcp_fs

from diffattn_tutorial.training import loop

_open, _write_item, _save = pathlib.Path.open, dcp_fs._write_item, loop.save_checkpoint
state = {"saves": 0, "item": -1, "writes": [], "signal_at": None}


class _CountedStream:
    """A file opened for writing under ``checkpoints/``: each ``write`` during the first save is recorded, and the
    ``signal_at``-th one sends SIGINT to this process before it writes."""

    def __init__(self, stream, name: str) -> None:
        self._stream, self._name = stream, name

    def write(self, data):
        if state["saves"] == 1:
            state["writes"].append((self._name, state["item"] if self._name.endswith(".distcp") else -1))
            if len(state["writes"]) == state["signal_at"]:
                os.kill(os.getpid(), signal.SIGINT)
        return self._stream.write(data)

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def __enter__(self):
        self._stream.__enter__()
        return self

    def __exit__(self, *exc):
        return self._stream.__exit__(*exc)


def _counted_open(self, mode="r", *args, **kwargs):
    stream = _open(self, mode, *args, **kwargs)
    return _CountedStream(stream, self.name) if "checkpoints" in self.parts and "r" not in mode else stream


def _counted_item(*args, **kwargs):
    state["item"] += 1
    return _write_item(*args, **kwargs)


def _counted_save(*args, **kwargs):
    state["saves"] += 1
    return _save(*args, **kwargs)


def run(out: Path, options: list[str], signal_at: int | None) -> int:
    state.update(saves=0, item=-1, writes=[], signal_at=signal_at)
    return loop.main([*options, "--out", str(out)])


def choose(writes: list[tuple[str, int]], how: str) -> list[int]:
    """1-based write numbers to signal at (see the module doc)."""
    distcp = [k for k, (name, _) in enumerate(writes, 1) if name.endswith(".distcp")]
    others = [k for k, (name, _) in enumerate(writes, 1) if not name.endswith(".distcp")]
    per_item: dict[int, list[int]] = {}
    for k in distcp:
        per_item.setdefault(writes[k - 1][1], []).append(k)
    item_starts = [ks[0] for ks in per_item.values()]
    first_item = next(ks for ks in per_item.values() if len(ks) > 1)  # the first torch.save (a tensor)
    if how == "sample":
        return sorted({distcp[0], first_item[0], first_item[len(first_item) // 2], item_starts[-1], distcp[-1],
                       *others})
    return sorted({*first_item, *item_starts, distcp[-1], *others})


def main(base: Path, how: str, options: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive shell
    pathlib.Path.open, dcp_fs._write_item, loop.save_checkpoint = _counted_open, _counted_item, _counted_save
    if run(base / "ref", options, None) != 0:
        raise SystemExit("the reference run failed")
    writes = list(state["writes"])
    for k in choose(writes, how):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: its stderr to a file, the run, its exit code
            err = os.open(base / f"{k}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(err, 2)
            code = run(base / str(k), options, k)
            sys.stderr.flush()
            os._exit(code)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        name, item = writes[k - 1]
        print(json.dumps({"k": k, "where": f"{name}, item {item}" if item >= 0 else name, "code": code,
                          "stderr": (base / f"{k}.err").read_text()}), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
