"""How many CPU threads should torch use here, now? Count the cores this process may run on and subtract
the ones other programs keep busy.

torch starts one intra-op thread per core. When another program holds a core, every parallel operation waits
at its end for the thread that shares a core with that program, so a model made of many small operations (the
toy models of notebook 07) can run several times slower on two threads than on one:
``benchmarks/bench_busy_cpu.py`` measures it, and its results file names the machine it ran on.

>>> 1 <= recommended_threads() <= usable_cores()
True
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import time
from typing import Iterator, Optional

import torch


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota (containers)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cgroup_quota() -> Optional[float]:
    """CPUs allowed by a cgroup v2 ``cpu.max`` quota, or None when there is none (or no cgroup v2)."""
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _cpu_times(cpus: set[int]) -> Optional[tuple[int, int]]:
    """``(busy, total)`` jiffies summed over ``cpus`` from ``/proc/stat``; None where it cannot be read."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
            total += sum(ticks)
            busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def busy_cores(sample_s: float = 0.2) -> float:
    """Cores kept busy by other programs, among those this process may use.

    Linux: the busy share of those cores over a ``sample_s`` window (this process sleeps meanwhile).
    Elsewhere: the 1-minute load average (slower to follow a change), capped at the machine's cores.
    """
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    before = _cpu_times(cpus) if cpus else None
    if before is not None:
        time.sleep(sample_s)
        after = _cpu_times(cpus)
        if after is not None and after[1] > before[1]:
            return len(cpus) * (after[0] - before[0]) / (after[1] - before[1])
    if hasattr(os, "getloadavg"):
        return min(float(os.cpu_count() or 1), os.getloadavg()[0])
    return 0.0


def recommended_threads(sample_s: float = 0.2, max_threads: Optional[int] = None) -> int:
    """Intra-op threads for torch: the usable cores not kept busy by other programs (at least 1).

    A core counts as free when less than half of it is busy. ``max_threads`` caps the answer (small models
    run fastest on one thread even on an idle machine: their operations are too short to split).
    """
    free = usable_cores() - busy_cores(sample_s)
    threads = max(1, min(usable_cores(), math.floor(free + 0.5)))
    return threads if max_threads is None else max(1, min(threads, max_threads))


@contextlib.contextmanager
def threads(n: Optional[int]) -> Iterator[int]:
    """``torch.set_num_threads(n)`` inside the block (``n=None``: the count is left as it is); the count from
    before is restored after, also when the block raises. Yields the count in force inside the block.

    >>> before = torch.get_num_threads()
    >>> with threads(1) as n:
    ...     n == torch.get_num_threads() == 1
    True
    >>> torch.get_num_threads() == before
    True
    """
    if n is not None and (isinstance(n, bool) or not hasattr(n, "__index__") or n < 1):
        raise ValueError(f"threads(n={n!r}): pass a whole number of threads >= 1, or None to keep the current count")
    before = torch.get_num_threads()
    try:
        if n is not None:
            torch.set_num_threads(n)
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def cpu_load(processes: int = 1) -> Iterator[None]:
    """``processes`` other CPU-bound programs (Python busy loops) running while the block runs, for benchmarks
    that compare an idle and a loaded machine (``benchmarks/bench_busy_cpu.py``, ``bench_cpu_auto.py --load``)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(processes)]
    try:
        time.sleep(0.5)  # let them start spinning
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


__all__ = ["usable_cores", "busy_cores", "recommended_threads", "threads", "cpu_load"]
