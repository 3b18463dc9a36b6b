"""Run a Python snippet in a child process that starts in milliseconds: ``run_python(code, env=...)``.

Crash-prone checks (a kernel, ctypes, Triton's interpreter) run in a child process, so that a crash fails one test
instead of the run. A fresh ``python -c`` spends about 1.5 s of CPU importing torch and half a second more leaving
it. Here the child is forked from a server that imported torch once per pytest process (multiprocessing's
``forkserver``), and leaves through ``os._exit`` after the steps an interpreter takes at exit (joining non-daemon
threads, ``atexit`` handlers, flushing). It is still a process of its own: a segfault, an abort or a hang ends only
it, and the test sees the exit status ``subprocess`` would give (``-11`` for a segfault).

The child gets the environment it is given (``os.environ`` by default), the working folder, ``sys.argv``
(``["-c", *args]``), stdin and a ``__main__`` module of its own. Torch was imported with the server's environment,
so an environment that differs from it in a variable other than ``FORK_SAFE`` (variables read when used, not when
torch is imported) runs in a real ``python -c`` instead, as it does where there is no forkserver (Windows).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

FORK_SAFE = ("DIFFATTN_", "TRITON_", "CXX", "CC", "TMPDIR", "OMP_NUM_THREADS", "PYTHONPATH", "CUDA_VISIBLE_DEVICES",
             "PYTEST_CURRENT_TEST")
"""Variables (or prefixes) a forked child may see changed: read when used (TMPDIR: ``tempfile`` is reset in the
child), or applied in the child (``OMP_NUM_THREADS`` through ``torch.set_num_threads``, ``PYTHONPATH`` put first on
``sys.path``). Triton is not imported by the server, so ``TRITON_INTERPRET`` takes effect in the child. pytest
changes ``PYTEST_CURRENT_TEST`` for every test."""

_server: dict = {}


def _context():
    """The forkserver context, its server importing torch, started on first use; None where there is none."""
    if "ctx" not in _server:
        if "forkserver" not in multiprocessing.get_all_start_methods():
            _server["ctx"] = None
        else:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["torch"])
            _server["ctx"], _server["env"] = ctx, dict(os.environ)  # the server starts with this environment
    return _server["ctx"]


def _forkable(env: dict) -> bool:
    base = _server["env"]
    changed = {k for k in env.keys() | base.keys() if env.get(k) != base.get(k)}
    threads = env.get("OMP_NUM_THREADS", "")  # set in the child; beyond the cores torch's own reading differs
    return all(k.startswith(FORK_SAFE) for k in changed) and (
        "OMP_NUM_THREADS" not in changed or threads.isdigit() and 1 <= int(threads) <= (os.cpu_count() or 1))


def _child(code: str, args: Sequence[str], env: dict, cwd: str, files: tuple[str, str, str]) -> None:
    """In the forked child: set up what a fresh ``python -c code *args`` would have, run it, leave with its status."""
    import atexit
    import builtins
    import threading
    import traceback
    import types

    for fd, path, flags in zip((0, 1, 2), files, (os.O_RDONLY, os.O_WRONLY, os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered: what was printed before a crash stays
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    new_paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[1:1] = new_paths  # after the script's folder, as the interpreter puts PYTHONPATH
    tempfile.tempdir = None  # read TMPDIR again
    if "OMP_NUM_THREADS" in env:
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["-c", *args]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    status = 0
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the snippet's frame, as python -c
        status = 1
    threading._shutdown()  # what the interpreter does at exit: join non-daemon threads, then run atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class Child:
    """A running snippet: ``wait(timeout)`` returns a ``subprocess.CompletedProcess``, as ``subprocess.run`` would
    (``subprocess.TimeoutExpired`` after killing it when it runs longer)."""

    def __init__(self, code: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
                 input: Optional[str] = None):
        self.args = [sys.executable, "-c", code, *args]
        env = dict(os.environ if env is None else env)
        cwd = str(cwd or os.getcwd())
        ctx = _context()
        self._folder = tempfile.TemporaryDirectory(prefix="forked-")
        folder = Path(self._folder.name)
        self._files = tuple(str(folder / name) for name in ("stdin", "stdout", "stderr"))
        Path(self._files[0]).write_text(input or "")
        if ctx is not None and _forkable(env):
            for name in self._files[1:]:
                Path(name).touch()
            self._proc = ctx.Process(target=_child, args=(code, list(args), env, cwd, self._files))
            self._proc.start()
            self._popen = None
        else:
            with open(self._files[0]) as stdin, open(self._files[1], "w") as out, open(self._files[2], "w") as err:
                self._popen = subprocess.Popen(self.args, env=env, cwd=cwd, stdin=stdin, stdout=out,
                                               stderr=err)
            self._proc = None

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else self._popen.pid

    def wait(self, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        try:
            if self._proc is not None:
                self._proc.join(timeout)
                if self._proc.exitcode is None:
                    self._proc.kill()
                    self._proc.join()
                    raise subprocess.TimeoutExpired(self.args, timeout, *self._read())
                status = self._proc.exitcode
            else:
                try:
                    status = self._popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    self._popen.kill()
                    self._popen.wait()
                    raise subprocess.TimeoutExpired(self.args, timeout, *self._read()) from None
            return subprocess.CompletedProcess(self.args, status, *self._read())
        finally:
            self._folder.cleanup()

    def _read(self) -> tuple[str, str]:
        return tuple(Path(name).read_text(encoding="utf-8", errors="replace") for name in self._files[1:])


def run_python(code: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
               input: Optional[str] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, input=input, timeout=timeout,
    capture_output=True, text=True)``, forked from the torch-importing server where the environment allows."""
    return Child(code, args, env=env, cwd=cwd, input=input).wait(timeout)
