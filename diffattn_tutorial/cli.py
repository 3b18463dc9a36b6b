"""The ``diffattn-tutorial`` command.

::

    diffattn-tutorial doctor              versions, devices, and which attention backends work here
    diffattn-tutorial bench [options]     time and peak memory of every backend, side by side
    diffattn-tutorial check NOTEBOOK      run your exercise notebook and print a scorecard
    diffattn-tutorial train [options]     train a TinyLM (python -m diffattn_tutorial.training.loop; torchrun for many processes)

Bad input ends with one line on stderr naming the fix, and exit code 2: no traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import platform
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator, Optional

import torch

from diffattn_tutorial.argtypes import Parser, UsageError, int_at_least, print_usage_error


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return "not installed"


class CommandError(Exception):
    """A command that cannot run with these options here; ``main`` prints the message as one line, exit code 2."""


def cache_report() -> str:
    """One line on the cache folder (``paths.cache_dir``: trained models, compiled kernels): where it is (the home
    folder written ``~``) and whether this process can write there, with the fix when not."""
    from diffattn_tutorial.paths import CACHE_ENV, cache_dir

    folder = cache_dir()
    if folder is None:
        return f"cache: off ({CACHE_ENV}=0): notebooks retrain, kernels compile again in every process"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".doctor-"):
            pass
    except OSError as e:
        return (f"cache: {_home_as_tilde(folder)} is not writable ({e.strerror or e}); set {CACHE_ENV} to a folder "
                f"you can write to, or {CACHE_ENV}=0 to switch the cache off")
    return f"cache: {_home_as_tilde(folder)} (writable; {CACHE_ENV} moves it)"


def _home_as_tilde(folder: Path) -> str:
    """``~/.cache/diffattn_tutorial`` rather than the home folder's full path (a report shared, or kept in a
    notebook's output, should not carry it)."""
    home = Path.home()
    return f"~/{folder.relative_to(home).as_posix()}" if folder.is_relative_to(home) else str(folder)


def doctor(args: argparse.Namespace) -> int:
    """Print what a learner needs to know about this machine before starting the course."""
    import diffattn_tutorial
    from diffattn_tutorial.backends import backend_status  # the backend registry: one entry per backend

    print(f"diffattn_tutorial {diffattn_tutorial.__version__}  python {platform.python_version()}  "
          f"({platform.system()} {platform.machine()})")
    for module in ("torch", "einops", "triton", "matplotlib", "ipywidgets", "jupyterlab", "nbval"):
        print(f"  {module:<11} {_version(module)}")
    devices = ["cpu"]
    print(f"CPU: {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
        devices.append("cuda")
    else:
        print("GPU: none (every notebook runs on the CPU; GPU-only cells skip themselves)")
    print(cache_report())
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        print("MPS: available, but the course uses the CPU on Apple silicon (not every op is exact on MPS)")
    for device in devices:
        print(f"diff_attention backends on {device}:")
        for name, (ok, why) in backend_status(device).items():
            print(f"  {'ok ' if ok else 'no '} {name:<13} {why}")
    return 0


_positive_int = int_at_least(1)


def _backend_list(text: str) -> list[str]:
    """argparse type: comma-separated backend names, each one of ``diff_attention``'s."""
    from diffattn_tutorial.functional import BACKENDS

    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS and name != "auto"]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown backend(s) {unknown or [text]}; choose from "
                                         f"{', '.join(('auto',) + BACKENDS)}, comma-separated")
    return names


def _bench_device(text: str) -> torch.device:
    """argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (what ``bench`` can time and measure)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: bench measures on 'cpu' or 'cuda' (or 'cuda:N')")
    return device


def _bench_device_here(device: Optional[torch.device]) -> torch.device:
    """The device to bench on, refused with the fix when this machine does not have it."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CommandError(f"--device {device}, but no CUDA GPU is visible to torch here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise CommandError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), "
                           f"numbered from 0")
    return device


def bench(args: argparse.Namespace) -> int:
    """Time every backend side by side and print a Markdown table (ratios against naive)."""
    from diffattn_tutorial.functional import backend_status
    from diffattn_tutorial.measure import timing

    device = _bench_device_here(args.device)
    backends = list(args.backends or timing.DEFAULT_BACKENDS)
    if device.type == "cuda" and "triton" not in backends and not args.backends:
        backends.append("triton")
    if args.backends:
        status = backend_status(device)
        unusable = [f"{name} ({status[name][1]})" for name in backends if name in status and not status[name][0]]
        if unusable:
            raise CommandError(f"--backends: {'; '.join(unusable)} cannot run on {device.type} here; leave it out")
    dtype = getattr(torch, args.dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"diff_attention, B={args.batch} H={args.heads} d={args.head_dim} {args.dtype}"
          f"{' causal' if args.causal else ''}, inference; device: {where}; torch {torch.__version__}")
    try:
        rows = timing.run(device, lengths=args.lengths, backends=backends, b=args.batch, h=args.heads, d=args.head_dim,
                     causal=args.causal, dtype=dtype, reps=args.reps, memory=not args.no_memory,
                     progress=(lambda s: print("  " + s, file=sys.stderr, flush=True)) if args.verbose else None)
    except (ValueError, TypeError) as e:  # a backend that refuses these options (e.g. a dtype it does not take)
        raise CommandError(f"{e} (--backends and --dtype choose what runs)") from None
    except (RuntimeError, MemoryError) as e:
        if not _out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CommandError(f"not enough memory for B={args.batch} H={args.heads} N={max(args.lengths)} "
                           f"d={args.head_dim} {args.dtype} on {device.type} ({first}); use smaller --lengths, "
                           f"--heads, --batch or --head-dim") from None
    print(timing.format_table(rows))
    return 0


_OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "not enough memory", "storage size calculation overflowed")


def _out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is torch (or Python) failing to allocate, on the CPU or a GPU."""
    return isinstance(error, (MemoryError, torch.OutOfMemoryError)) or any(
        words in str(error).lower() for words in _OUT_OF_MEMORY)


def check(args: argparse.Namespace) -> int:
    """Run a learner's exercise notebook and print one line per task (see ``diffattn_tutorial.course.scorecard``).
    Ctrl-C stops it (exit code 130), however the notebook runner reports the interrupt it got."""
    from diffattn_tutorial.course.scorecard import check_notebook

    with _noting_ctrl_c() as interrupted:
        try:
            code = check_notebook(args.notebook, timeout=args.timeout)
        finally:
            if interrupted:
                _quiet_runner_teardown()
    if interrupted:
        raise KeyboardInterrupt
    return code


def _quiet_runner_teardown() -> None:
    """After a Ctrl-C the notebook runner has stopped its kernel, but its own teardown can then fail and print
    tracebacks as the process exits (an event-loop task whose ``DeadKernelError`` nobody read, an exit handler that
    finds no kernel manager): noise after the one line that says the command stopped. The process is ending, so the
    asyncio logger and the hook for errors Python can only print (``sys.unraisablehook``) are silenced."""
    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
    sys.unraisablehook = lambda unraisable: None


@contextlib.contextmanager
def _noting_ctrl_c() -> Iterator[list[bool]]:
    """Within: SIGINT raises KeyboardInterrupt and is noted in the list yielded (which then holds True), whatever
    handles it. The notebook runner (nbclient) replaces the SIGINT handler with its own, which stops the kernel and
    makes the run fail with another error (an ``AssertionError`` from its event loop); every SIGINT handler installed
    within is wrapped, so that the interrupt is still raised and the command stops (exit code 130) instead of
    reporting a notebook that could not run. The kernel is stopped either way (the runner's exit handler)."""
    noted: list[bool] = []
    install = signal.signal

    def noting(handler):
        def on_sigint(signum, frame):
            noted.append(True)
            handler(signum, frame)  # the runner's own (it stops the kernel), then the interrupt as Python's default
            raise KeyboardInterrupt
        return on_sigint

    def installing(signum, handler):
        return install(signum, noting(handler) if signum == signal.SIGINT and callable(handler) else handler)

    if threading.current_thread() is not threading.main_thread():  # signals go to the main thread only
        yield noted
        return
    before = install(signal.SIGINT, noting(lambda signum, frame: None))
    signal.signal = installing
    try:
        yield noted
    except Exception:
        if noted:
            raise KeyboardInterrupt from None
        raise
    finally:
        signal.signal = install
        install(signal.SIGINT, before)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="diffattn-tutorial", description="The differential attention course's helper command.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, devices and usable attention backends")
    p.set_defaults(func=doctor)
    p = sub.add_parser("bench", help="time and peak extra memory of every diff_attention backend vs naive")
    p.add_argument("--lengths", type=_positive_int, nargs="+", default=[512, 1024, 2048, 4096], metavar="N")
    p.add_argument("--backends", type=_backend_list, default=None,
                   help="comma-separated (default: every exact backend for the device)")
    p.add_argument("--batch", type=_positive_int, default=1)
    p.add_argument("--heads", type=_positive_int, default=8, help="differential heads H")
    p.add_argument("--head-dim", type=_positive_int, default=64, help="q/k head dim d (V has 2d)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--device", type=_bench_device, default=None, help="cpu, cuda or cuda:N (default: cuda when present)")
    p.add_argument("--reps", type=_positive_int, default=5, help="timed calls per backend (median)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("-v", "--verbose", action="store_true", help="print progress to stderr")
    p.set_defaults(func=bench)
    p = sub.add_parser("check", help="run your exercise notebook and print a scorecard")
    p.add_argument("notebook", help="path to your copy of exercises/NN_*.ipynb")
    p.add_argument("--timeout", type=_positive_int, default=600, help="seconds per cell (at least 1)")
    p.set_defaults(func=check)
    sub.add_parser("train", add_help=False, help="train a TinyLM: see 'diffattn-tutorial train --help' "
                                                 "(torchrun -m diffattn_tutorial.training.loop for several processes)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    """The command: returns the exit code (2 after a one-line error naming the fix, 130 after Ctrl-C)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # the training entry point parses its own options
        from diffattn_tutorial.training.loop import main as train_main

        return train_main(argv[1:], prog="diffattn-tutorial train")
    try:
        args = build_parser().parse_args(argv)
    except UsageError as e:
        return print_usage_error(e, "diffattn-tutorial")
    try:
        return args.func(args)
    except CommandError as e:
        print(f"diffattn-tutorial {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"diffattn-tutorial {args.command}: stopped (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
