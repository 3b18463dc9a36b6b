"""Where the fused CPU kernel's work runs, the cases of ``tests/test_cpu_threads.py`` that need a process of their
own (the kernel not yet loaded, or a fork after it ran). ``python -m children.cpu_threads_cases CASE``, CASE one of
``pool``, ``fork_after_run``; each prints the words its test reads."""

import os
import signal
import sys

import torch

from diffattn_tutorial.kernels.cpu import cpu_fused, openmp


def pool() -> None:
    """Prints where the kernel's work runs, whether it was built with OpenMP, how many OpenMP runtimes the process
    has after loading it, and whether torch's runtime (before it) was ``libgomp.so.1`` alone."""
    before = openmp.openmp_runtimes()
    where = cpu_fused.kernel_threads()
    after = openmp.openmp_runtimes()
    torch_gomp = before is not None and [os.path.basename(f) for f in before] == ["libgomp.so.1"]
    print(where, openmp.CHOSEN["built"], None if after is None else len(after), torch_gomp)


def fork_after_run() -> None:
    """Runs the kernel, forks, and runs it in the child (on its own threads, also after a switch back and forth; an
    alarm ends a child that hangs): prints ``CHILD <the child's exit status> <where the parent ran it>``."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 64, 32, generator=g), torch.randn(1, 4, 64, 32, generator=g)
    v, lam = torch.randn(1, 2, 64, 64, generator=g), torch.tensor(0.3)

    def run():
        return torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, True, 0.125)[0]

    before, parent = run(), cpu_fused.kernel_threads()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        same = torch.equal(run(), before)
        with cpu_fused.own_threads():
            same &= torch.equal(run(), before)
        same &= torch.equal(run(), before)
        os._exit(0 if same and cpu_fused.kernel_threads() == "own" else 3)
    print("CHILD", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), parent)


CASES = {f.__name__: f for f in (pool, fork_after_run)}

if __name__ == "__main__":
    CASES[sys.argv[1]]()
