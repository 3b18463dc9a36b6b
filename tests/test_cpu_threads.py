"""Where the fused CPU kernel's work runs: on torch's OpenMP thread pool where the process has that one OpenMP
runtime, else on threads it starts per call; the same bits either way, and a forked child still runs it."""

import os
import sys

import pytest
import torch
from forked import run_python

from diffattn_tutorial.kernels.cpu import cpu_fused
from diffattn_tutorial.measure.cpu_threads import threads

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel "
                                                                     "checks what runs instead)")


@pytest.mark.parametrize("name,runtime", [
    ("libgomp.so.1", True), ("libgomp-a34b3233.so.1", True), ("libiomp5.so", True), ("libomp.dylib", True),
    ("libomp.so.5", True), ("libgompx.so", False), ("libompitt.so", False), ("libtorch_cpu.so", False),
])
def test_openmp_runtimes_are_told_by_their_file_names(name, runtime):
    assert cpu_fused._is_openmp_runtime(name) is runtime


def test_the_pool_is_torchs_where_the_process_has_one_openmp_runtime():
    code = """
import torch
from diffattn_tutorial.kernels.cpu import cpu_fused
where = cpu_fused.kernel_threads()
runtimes = cpu_fused._openmp_runtimes()
print(where, cpu_fused._THREADS["built"], None if runtimes is None else len(runtimes),
      "ATen parallel backend: OpenMP" in torch.__config__.parallel_info())
"""
    proc = run_python(code, env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, built, count, torch_openmp = proc.stdout.split()
    assert where == ("openmp" if built == "True" and count == "1" else "own")
    if sys.platform.startswith("linux") and built == "True" and torch_openmp == "True":
        assert (count, where) == ("1", "openmp"), "the kernel brought an OpenMP runtime of its own beside torch's"


def _run_both(q, k, v, lam, grad_out):
    out = torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, True, 0.125)
    return (out, *torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam, None, True, 0.125))


def test_the_pool_and_threads_of_its_own_give_the_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 70, 32, generator=g), torch.randn(2, 2, 70, 32, generator=g)
    v, lam, grad_out = torch.randn(2, 1, 70, 64, generator=g), torch.rand(2, 2, 70, 1, generator=g), \
        torch.randn(2, 2, 70, 64, generator=g)
    runs = []
    for n in (1, 2, 3):
        with threads(n):
            runs.append(_run_both(q, k, v, lam, grad_out))
            with cpu_fused._own_threads():
                runs.append(_run_both(q, k, v, lam, grad_out))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_a_child_forked_after_the_kernel_ran_runs_it_too():
    """GNU OpenMP's pool does not survive fork: a parallel region in the child waits forever for threads that
    are not there. The kernel starts threads of its own in a forked child (small inputs: torch's own calls stay
    on one thread here, so the kernel is the only user of the pool)."""
    code = """
import os
import torch
from diffattn_tutorial.kernels.cpu import cpu_fused
g = torch.Generator().manual_seed(0)
q, k = torch.randn(1, 4, 64, 32, generator=g), torch.randn(1, 4, 64, 32, generator=g)
v, lam = torch.randn(1, 2, 64, 64, generator=g), torch.tensor(0.3)
run = lambda: torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, True, 0.125)
before = run()
pid = os.fork()
if pid == 0:
    os._exit(0 if torch.equal(run(), before) else 3)
print("CHILD", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), cpu_fused.kernel_threads())
"""
    proc = run_python(code, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=60)  # a pool of two threads
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, where = proc.stdout.split()[1:]
    assert status == "0", "the forked child computed different numbers"
    assert where in ("openmp", "own")
