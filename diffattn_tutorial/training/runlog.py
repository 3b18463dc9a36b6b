"""The metrics log of a training run (JSON lines) and the helper that plots it.

:mod:`diffattn_tutorial.training.loop` writes ``metrics.jsonl`` in its output folder, one JSON object per line, from
rank 0 only:

* ``{"event": "start", "step": s, "world_size": ..., "strategy": ..., "device": ..., "config": {...}, ...}``
  each time a process group starts (or resumes) the run at step ``s``;
* ``{"event": "step", "step": n, "loss": ..., "lr": ..., "grad_norm": ..., "tokens": ..., "seconds": ...}``
  after optimizer step ``n`` (1-based), ``loss`` the mean over the whole global batch;
* ``{"event": "end", "step": n, "seconds": ...}`` when it stops.

A resumed run first drops the lines after its checkpoint's step (and a last line a killed process left
unfinished), so the log always reads as one run; Ctrl-C adds ``{"event": "interrupted", "step": n, ...}``.
"""

from __future__ import annotations

import json
import numbers
import os
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import numpy as np

PathLike = Union[str, os.PathLike]


class MetricsLog:
    """A training run's log, ``metrics.jsonl``: appends JSON records to ``path`` (one per line, flushed at once);
    disabled when ``enabled`` is False (every rank but 0)."""

    def __init__(self, path: PathLike, enabled: bool = True) -> None:
        self.path, self.enabled = Path(path), enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        """Drop every record with ``step > step`` (what a run did after the checkpoint it resumes from), by writing
        the records kept to a temporary file that replaces the log (``os.replace``): the log is the old one or the
        new one, whenever the process stops."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):  # nan would keep no record at all
            raise TypeError(f"step must be a whole number (the checkpoint's step), got {step!r}")
        if not self.enabled or not self.path.exists():
            return
        keep = [r for r in read_records(self.path) if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:  # a process killed (or a disk full) mid-write leaves the old log whole: never a log without its steps
            with tmp.open("w") as f:
                f.write("".join(json.dumps(r) + "\n" for r in keep))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def write(self, record: Mapping) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(dict(record)) + "\n")


def read_records(path: PathLike) -> list[dict]:
    """Every record of a metrics log, in order.

    A last line without its newline is a write still going on (or cut short by a killed process) and is left
    out; any other line that is not a JSON object is a ``ValueError`` naming the file and the line.
    """
    text = Path(path).read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip() or (number == len(lines) and not text.endswith("\n")):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            record = e
        if not isinstance(record, dict):
            raise ValueError(f"{path}, line {number}, is not a JSON record of a metrics log; delete that line "
                             f"(or start the run again with --overwrite)")
        records.append(record)
    return records


def read_steps(path: PathLike) -> list[dict]:
    """The ``"step"`` records of a metrics log (one per optimizer step), in step order."""
    return [r for r in read_records(path) if r.get("event") == "step"]


def loss_curve(path: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, losses)`` of a metrics log as two arrays."""
    rows = read_steps(path)
    return np.array([r["step"] for r in rows]), np.array([r["loss"] for r in rows], dtype=float)


def moving_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of each run of ``window`` consecutive values (``len(values) - window + 1`` of them; all of
    ``values`` when ``window <= 1``)."""
    values = np.asarray(values, dtype=float)
    if window <= 1 or window > len(values):
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


def plot_loss_curves(logs: Mapping[str, PathLike], *, smooth: int = 1, ax=None, title: Optional[str] = None,
                     log_scale: bool = True):
    """Loss against step for each ``{label: metrics.jsonl}``, smoothed by a moving mean of ``smooth`` steps.

    Returns ``(fig, ax)``; end the notebook cell with ``plt.show()``.
    """
    import matplotlib.pyplot as plt

    from diffattn_tutorial.course.plotting import DPI

    if ax is None:
        fig, ax = plt.subplots(figsize=(6.5, 3.0), dpi=DPI)
    else:
        fig = ax.figure
    for label, path in logs.items():
        steps, losses = loss_curve(path)
        curve = moving_mean(losses, smooth)
        ax.plot(steps[len(steps) - len(curve):], curve, label=label)
    ylabel = "loss" if smooth <= 1 else f"loss (moving mean of {smooth})"
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title or "")
    if log_scale:
        ax.set_yscale("log")
    ax.legend()
    return fig, ax


__all__ = ["MetricsLog", "read_records", "read_steps", "loss_curve", "moving_mean", "plot_loss_curves"]
