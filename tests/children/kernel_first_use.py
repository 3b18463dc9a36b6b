"""The fused CPU kernel's first use in a fresh process, for ``tests/test_faults_kernel.py`` (its build cache under
faults: ``DIFFATTN_CACHE`` and ``CXX`` come in the environment). Prints ``STATUS <ok> ...`` when the answers hold.

``python -m children.kernel_first_use call [--build-timeout S] [--print-threads]``: one float32 inference call with
the default backend equals naive's (the kernel's or the fall-back's answer); prints ``STATUS <ok> <first line of
why>`` (and ``THREADS <where the kernel runs>``). ``python -m children.kernel_first_use threads``: six threads use
the kernel first at once; all get a working kernel and the same answer; prints ``STATUS True 6``.
"""

import argparse
import threading

import torch

from diffattn_tutorial.functional import diff_attention
from diffattn_tutorial.kernels.cpu import build, cpu_fused


def inputs():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 30, 32, generator=g), torch.randn(1, 2, 30, 32, generator=g)
    return q, k, torch.randn(1, 1, 30, 64, generator=g)


def call(build_timeout, print_threads) -> None:
    if build_timeout is not None:
        build.TIMEOUT_S = build_timeout
    q, k, v = inputs()
    with torch.no_grad():
        ref = diff_attention(q, k, v, 0.4, backend="naive")
        out = diff_attention(q, k, v, 0.4)
    assert (out - ref).abs().max() < 1e-5, "wrong answer"
    ok, why = cpu_fused.kernel_status()
    print("STATUS", ok, why.splitlines()[0])
    if print_threads:
        print("THREADS", cpu_fused.kernel_threads())


def threads() -> None:
    q, k, v = inputs()
    start, results, errors = threading.Barrier(6), [], []

    def first_use():
        start.wait()
        try:
            with torch.no_grad():
                results.append((diff_attention(q, k, v, 0.4), cpu_fused.kernel_status()))
        except BaseException as e:
            errors.append(repr(e))

    workers = [threading.Thread(target=first_use) for _ in range(6)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, errors
    assert all(status[0] for _, status in results), [status for _, status in results]
    assert all(torch.equal(out, results[0][0]) for out, _ in results)
    print("STATUS", True, len(results))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=["call", "threads"])
    parser.add_argument("--build-timeout", type=float)
    parser.add_argument("--print-threads", action="store_true")
    args = parser.parse_args()
    if args.case == "call":
        call(args.build_timeout, args.print_threads)
    else:
        threads()
