"""Where the fused CPU kernel's work runs: on torch's OpenMP thread pool where the process has that one OpenMP
runtime, else on threads it starts per call; the same bits either way, and a forked child still runs it."""

import os

import pytest
import torch
from forked import run_module

from diffattn_tutorial.kernels.cpu import cpu_fused, openmp
from diffattn_tutorial.measure.cpu_threads import threads

pytestmark = pytest.mark.skipif(cpu_fused.compiler() is None, reason="no C++ compiler here (test_cpu_kernel "
                                                                     "checks what runs instead)")
INLINE, OPENMP, OWN = 0, 1, 2  # diff_attention_cpu_last_threads(): how the last call ran its items


@pytest.mark.parametrize("name,runtime", [
    ("libgomp.so.1", True), ("libgomp-a34b3233.so.1", True), ("libiomp5.so", True), ("libomp.dylib", True),
    ("libomp.so.5", True), ("libgompx.so", False), ("libompitt.so", False), ("libtorch_cpu.so", False),
    ("libgomp-plugin-nvptx.so.1", False),  # a GCC offloading plugin, not a runtime
])
def test_openmp_runtimes_are_told_by_their_file_names(name, runtime):
    assert openmp.is_openmp_runtime(name) is runtime


def test_the_runtimes_are_read_from_any_maps_listing():
    maps = (b"7f00-7f01 r-xp 00000000 08:01 11 /opt/my env/torch/lib/libgomp.so.1\n"  # a space in the path
            b"7f02-7f03 r-xp 00000000 08:01 12 /old/libiomp5.so (deleted)\n"  # replaced since it was loaded
            b"7f04-7f05 r--p 00000000 08:01 13 /data/caf\xe9.bin\n"  # not UTF-8
            b"7f06-7f07 rw-p 00000000 00:00 0 \n"  # anonymous
            b"7f08-7f09 r-xp 00000000 08:01 14 /usr/lib/libgomp-plugin-nvptx.so.1\n")
    assert openmp.runtimes_in(maps) == {"/opt/my env/torch/lib/libgomp.so.1", "/old/libiomp5.so"}


def test_the_pool_is_torchs_where_the_process_has_one_openmp_runtime():
    """Where torch's runtime is the ``libgomp.so.1`` a GCC build of the kernel links to, the kernel brings no
    second one and runs on torch's pool; elsewhere on threads of its own."""
    proc = run_module("children.cpu_threads_cases", ["pool"], env=dict(os.environ), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where, built, count, torch_gomp = proc.stdout.split()
    assert where == ("openmp" if built == "True" and count == "1" else "own")
    if built == "True" and torch_gomp == "True":
        assert (count, where) == ("1", "openmp"), "the kernel brought an OpenMP runtime of its own beside torch's"


def _run_both(q, k, v, lam, grad_out):
    out = torch.ops.diffattn.cpu_fused_forward(q, k, v, lam, None, True, 0.125)[0]
    return (out, *torch.ops.diffattn.cpu_fused_backward(grad_out, q, k, v, lam, None, True, 0.125))


def test_the_pool_and_threads_of_its_own_give_the_same_bits_on_any_thread_count():
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 70, 32, generator=g), torch.randn(2, 2, 70, 32, generator=g)
    v, lam, grad_out = torch.randn(2, 1, 70, 64, generator=g), torch.rand(2, 2, 70, 1, generator=g), \
        torch.randn(2, 2, 70, 64, generator=g)
    lib, pool = cpu_fused._kernel(), cpu_fused.kernel_threads() == "openmp"
    runs = []
    for n in (1, 2, 3):
        with threads(n):
            runs.append(_run_both(q, k, v, lam, grad_out))
            assert lib.diff_attention_cpu_last_threads() == (INLINE if n == 1 else OPENMP if pool else OWN)
            with cpu_fused.own_threads():
                assert cpu_fused.kernel_threads() == "own"
                runs.append(_run_both(q, k, v, lam, grad_out))
                assert lib.diff_attention_cpu_last_threads() == (INLINE if n == 1 else OWN)
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], run))


def test_a_child_forked_after_the_kernel_ran_runs_it_too():
    """GNU OpenMP's pool does not survive fork: a parallel region in the child waits forever for threads that
    are not there. The kernel starts threads of its own in a child forked after it was loaded, also after a switch
    back and forth (small inputs: torch's own calls stay on one thread here, so the kernel alone used the pool).
    A child that hangs anyway is ended by its alarm."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a pool of two threads
    proc = run_module("children.cpu_threads_cases", ["fork_after_run"], env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    status, parent = proc.stdout.split()[1:]
    assert status == "0", f"the forked child exited with {status} (-14: it hung; 3: other numbers or threads)"
    assert parent in ("openmp", "own")
