"""Run a child process that starts in milliseconds: ``run_module("children.NAME", args, env=...)`` for a module of
``tests/children/`` (the tests' child code lives there, as modules), ``Worker("children.NAME")`` for one that answers
requests line by line, ``run_python(code)`` for a one-line probe.

Crash-prone checks (a kernel, ctypes, Triton's interpreter) run in a child process, so that a crash fails one test
instead of the run. A fresh ``python -c`` spends about 1.5 s of CPU importing torch and half a second more leaving
it. Here the child is forked from a server that imported torch once per pytest process (multiprocessing's
``forkserver``). It is still a process of its own: a segfault, an abort or a hang ends only it, and the test sees
the exit status ``subprocess`` would give (``-11`` for a segfault, ``-2`` for an uncaught ``KeyboardInterrupt``).

The child gets the environment it is given (``os.environ`` by default), the working folder, ``sys.argv``
(``["-c", *args]``), ``sys.path`` (a fresh ``python -c``'s, after ``PYTHONPATH``), stdin, freshly seeded random
generators and a ``__main__`` module of its own. It leaves as an interpreter does, in that order: non-daemon threads
joined, ``atexit`` handlers run, ``__main__``'s globals released, Python's and C's output buffers flushed; then
``os._exit`` skips the rest of the teardown (what costs half a second after ``import torch``). Torch was imported
with the server's environment and interpreter flags, so a child whose environment differs in a variable other than
``FORK_SAFE``, or a pytest started with flags (``python -O``, ``-W error``), runs a real ``python -c`` instead, as
everything does where there is no forkserver (Windows). That slow path is loud: each such child warns
(:class:`SlowChild`, naming the variables that forced it) and is counted in :data:`SLOW_CHILDREN`, which
``tests/conftest.py`` sums over the session and reports at its end.

A ``Child`` that is never waited for is killed when pytest exits.
"""

from __future__ import annotations

import atexit
import errno
import json
import multiprocessing
import multiprocessing.process
import os
import select
import subprocess
import sys
import tempfile
import time
import warnings
import weakref
from pathlib import Path
from typing import Optional, Sequence

FORK_SAFE = ("DIFFATTN_", "TRITON_", "TORCHINDUCTOR_", "_TORCHINDUCTOR_", "CXX", "CC", "TMPDIR", "PYTHONPATH",
             "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST")
"""Variables (or prefixes) a forked child may see changed: read when used, not when torch is imported (TMPDIR:
``tempfile`` is reset in the child; PYTHONPATH: ``sys.path`` is built in the child). Triton is not imported by the
server, so ``TRITON_INTERPRET`` takes effect in the child; nor is inductor, which sets ``TORCHINDUCTOR_CACHE_DIR``
and ``_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`` in the process that first compiles. pytest changes ``PYTEST_CURRENT_TEST`` for every test.
Thread counts (``OMP_NUM_THREADS``) are not here: torch and numpy's BLAS read them when they are loaded."""

SLOW_CHILDREN: list[str] = []
"""Why each child of this process ran a real ``python -c``, one entry per child (the reason :class:`SlowChild` gave)."""


class SlowChild(UserWarning):
    """A child ran a real ``python -c`` (about 2 s of CPU) instead of being forked from the server."""


_server: dict = {}
_BASE_ENV = dict(os.environ)  # at import (test collection), before a test changes the environment: the server's


def _context():
    """The forkserver context, its server importing torch, started on first use; None where there is none or
    where this interpreter runs with flags (``-O``, ``-W``) a fresh ``python -c`` would not have."""
    if "ctx" not in _server:
        from multiprocessing import forkserver, util

        _server["ctx"] = None
        if "forkserver" not in multiprocessing.get_all_start_methods():
            return None
        probe = "import json, sys; from multiprocessing import util; print(json.dumps([sys.path, " \
                "util._args_from_interpreter_flags()]))"
        fresh = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True,
                               env={k: v for k, v in _BASE_ENV.items() if k != "PYTHONPATH"})
        path, flags = json.loads(fresh.stdout)
        if util._args_from_interpreter_flags() != flags:  # -O, -W ...: the server would inherit them
            return None
        _server["path"] = path[1:]  # after '' (the working folder), and after PYTHONPATH in the child
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch"])
        now = dict(os.environ)
        os.environ.clear()
        os.environ.update(_BASE_ENV)
        try:
            forkserver.ensure_running()  # the server inherits the environment of the moment it starts
        finally:
            os.environ.clear()
            os.environ.update(now)
        _server["env"], _server["ctx"] = _BASE_ENV, ctx
    return _server["ctx"]


def _unforkable(env: dict) -> list[str]:
    """The variables, outside ``FORK_SAFE``, in which ``env`` differs from the server's: any one forces the slow path."""
    base = _server["env"]
    return sorted(k for k in env.keys() | base.keys() if env.get(k) != base.get(k) and not k.startswith(FORK_SAFE))


def _slow_reason(ctx, env: dict) -> Optional[str]:
    """Why a child with ``env`` cannot be forked (None: it can)."""
    if ctx is None:
        return "no forkserver here, or python runs with flags (-O, -W)"
    changed = _unforkable(env)
    return f"the environment differs from the server's in {', '.join(changed)}" if changed else None


def _count_slow(reason: str) -> None:
    SLOW_CHILDREN.append(reason)
    warnings.warn(SlowChild(f"a child runs a real python -c (slow): {reason}; add the variable to forked.FORK_SAFE "
                            "if torch does not read it at import, or leave the environment as it is"), stacklevel=3)


def _child(code: str, args: Sequence[str], env: dict, cwd: str, files: tuple[str, str, str], path: list) -> None:
    """In the forked child: set up what a fresh ``python -c code *args`` would have, run it, leave as it would."""
    import builtins
    import ctypes
    import gc
    import random
    import signal
    import threading
    import traceback
    import types

    import numpy
    import torch

    sys.modules.pop(__name__, None)  # imported to unpickle this function: a fresh interpreter has not
    for fd, name, flags in ((1, files[1], os.O_WRONLY), (2, files[2], os.O_WRONLY), (0, files[0], os.O_RDONLY)):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = sys.__stdin__ = open(0, closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", buffering=1, closefd=False)  # line-buffered, and written through:
    sys.stderr = sys.__stderr__ = open(2, "w", buffering=1, closefd=False, errors="backslashreplace")
    for stream in (sys.stdout, sys.stderr):  # what was printed before a crash is kept
        stream.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = ["", *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], *path]
    tempfile.tempdir = None  # read TMPDIR again
    random.seed()
    numpy.random.seed()
    torch.seed()
    sys.argv = ["-c", *args]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    status, interrupted = 0, False
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)  # from the snippet's frame, as python -c
        status, interrupted = 1, isinstance(e, KeyboardInterrupt)
    threading._shutdown()  # what the interpreter does at exit: join non-daemon threads, run atexit, tear down
    atexit._run_exitfuncs()
    main.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ctypes.CDLL(None).fflush(None)  # C's stdio buffers (printf from a library)
    if interrupted:  # an uncaught KeyboardInterrupt ends python by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status)


def _kill(proc) -> None:
    """At exit: a child nobody waited for (a test that failed between start and wait) is killed, not waited for."""
    if proc.exitcode is None:
        proc.kill()
        proc.join()


class Child:
    """A running snippet: ``wait(timeout)`` returns a ``subprocess.CompletedProcess``, as ``subprocess.run`` would
    (``subprocess.TimeoutExpired`` after killing it when it runs longer); ``kill()`` stops it.

    With ``stream=True`` its stdin and stdout are pipes (FIFOs for a forked child), ``child.stdin`` and
    ``child.stdout`` text streams, as ``Popen(stdin=PIPE, stdout=PIPE, text=True)`` gives: a worker that answers
    requests line by line (:class:`Worker`); ``wait`` then returns stdout empty (read it from ``child.stdout``)."""

    def __init__(self, code: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
                 input: Optional[str] = None, stream: bool = False):
        if stream and input is not None:
            raise ValueError("a streaming child reads its stdin from child.stdin: pass input=None")
        self.args = [sys.executable, "-c", code, *args]
        env = dict(os.environ if env is None else env)
        cwd = str(cwd or os.getcwd())
        if not os.path.isdir(cwd):  # what subprocess raises, here rather than in the child
            raise FileNotFoundError(2, "No such directory", cwd)
        ctx = _context()
        self._result: Optional[subprocess.CompletedProcess] = None
        self._folder = tempfile.TemporaryDirectory(prefix="forked-")
        folder = Path(self._folder.name)
        self._files = tuple(str(folder / name) for name in ("stdin", "stdout", "stderr"))
        self._stream, self.stdin, self.stdout = stream, None, None
        self._proc = self._popen = None
        reason = _slow_reason(ctx, env)
        if reason is None:
            self._fork(ctx, code, args, env, cwd, input)
        else:
            _count_slow(reason)
            self._spawn(env, cwd, input)

    def _fork(self, ctx, code, args, env, cwd, input) -> None:
        Path(self._files[2]).touch()
        if self._stream:
            os.mkfifo(self._files[0])
            os.mkfifo(self._files[1])
            out = os.open(self._files[1], os.O_RDONLY | os.O_NONBLOCK)  # now: the child's open of it returns
        else:
            Path(self._files[0]).write_text(input or "")
            Path(self._files[1]).touch()
        self._proc = ctx.Process(target=_child, args=(code, list(args), env, cwd, self._files, _server["path"]))
        self._proc.start()
        multiprocessing.process._children.discard(self._proc)  # not joined by multiprocessing at exit ...
        weakref.finalize(self, _kill, self._proc)                # ... but killed then, if still running
        if self._stream:
            self.stdin = open(self._open_stdin(), "w", buffering=1, encoding="utf-8")
            os.set_blocking(out, True)  # the child opened its stdout before its stdin: EOF is its end from here
            self.stdout = open(out, encoding="utf-8", errors="replace")

    def _open_stdin(self) -> int:
        """The writing end of the child's stdin FIFO, once the child has opened its end (it opens its stdin last)."""
        while True:
            try:
                fd = os.open(self._files[0], os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                if e.errno != errno.ENXIO:  # ENXIO: no reader yet
                    raise
                if self._proc.exitcode is not None:
                    raise ChildProcessError(f"the child ended (exit status {self._proc.exitcode}) before it read "
                                            f"its stdin:\n{Path(self._files[2]).read_text(errors='replace')}")
                time.sleep(0.002)
            else:
                os.set_blocking(fd, True)
                return fd

    def _spawn(self, env, cwd, input) -> None:
        err = open(self._files[2], "w")
        if self._stream:
            self._popen = subprocess.Popen(self.args, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                           stderr=err, text=True, bufsize=1)
            self.stdin, self.stdout = self._popen.stdin, self._popen.stdout
        else:
            Path(self._files[0]).write_text(input or "")
            with open(self._files[0]) as stdin, open(self._files[1], "w") as out:
                self._popen = subprocess.Popen(self.args, env=env, cwd=cwd, stdin=stdin, stdout=out, stderr=err)
        err.close()

    @property
    def forked(self) -> bool:
        return self._proc is not None

    @property
    def pid(self) -> int:
        return self._proc.pid if self.forked else self._popen.pid

    def kill(self) -> None:
        if self.forked:
            _kill(self._proc)
        elif self._popen.poll() is None:
            self._popen.kill()
            self._popen.wait()

    def wait(self, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        if self._result is not None:
            return self._result
        if self.forked:
            self._proc.join(timeout)
            status = self._proc.exitcode
        else:
            try:
                status = self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                status = None
        if status is None:
            self.kill()
            out, err = self._read()
            self._close()
            raise subprocess.TimeoutExpired(self.args, timeout, out, err)
        self._result = subprocess.CompletedProcess(self.args, status, *self._read())
        self._close()
        return self._result

    def _read(self) -> tuple[str, str]:
        out = "" if self._stream else Path(self._files[1]).read_text(encoding="utf-8", errors="replace")
        return out, Path(self._files[2]).read_text(encoding="utf-8", errors="replace")

    def _close(self) -> None:
        for stream in (self.stdin, self.stdout):
            if stream is not None:
                try:
                    stream.close()
                except BrokenPipeError:  # what was left to write to a child that has ended
                    pass
        self._folder.cleanup()


def run_python(code: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
               input: Optional[str] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=cwd, input=input, timeout=timeout,
    capture_output=True, text=True)``, forked from the torch-importing server where the environment allows."""
    return Child(code, args, env=env, cwd=cwd, input=input).wait(timeout)


CHILDREN_ROOT = Path(__file__).resolve().parent
"""The folder that holds ``children/``: put on the child's ``PYTHONPATH`` by :func:`run_module`."""


def start_module(module: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
                 input: Optional[str] = None, stream: bool = False) -> Child:
    """Start ``python -m module *args`` (a module of ``tests/children/``: child code as a module, not a string),
    forked from the server where the environment allows, and return its :class:`Child` without waiting for it."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHILDREN_ROOT), env.get("PYTHONPATH", "")) if p)
    code = f"import runpy; runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    return Child(code, args, env=env, cwd=cwd, input=input, stream=stream)


def run_module(module: str, args: Sequence[str] = (), *, env: Optional[dict] = None, cwd=None,
               input: Optional[str] = None, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, "-m", module, *args], ...)`` for a module of ``tests/children/``, as
    :func:`run_python` runs a snippet (see :func:`start_module`)."""
    return start_module(module, args, env=env, cwd=cwd, input=input).wait(timeout)


class Worker:
    """A child (``python -m module``, a module of ``tests/children/`` that runs ``children.worker.serve``) answering
    one JSON line per request: ``run(request) -> answer``. A crash, or no answer within ``timeout`` seconds, is a
    failed answer (``{"ok": False, "msg": ...}`` naming the exit code and the end of its stderr), and the next
    request starts a fresh child: the property tests whose examples may crash the interpreter run through one."""

    def __init__(self, module: str, *, env: Optional[dict] = None, timeout: float = 300, start_timeout: float = 120):
        self.module, self.env, self.timeout, self.start_timeout = module, env, timeout, start_timeout
        self.child: Optional[Child] = None

    def _start(self) -> None:
        self.child = start_module(self.module, env=self.env, stream=True)
        assert json.loads(self._read_line(self.start_timeout) or "{}").get("ready"), self._died()

    def _read_line(self, timeout: float) -> str:
        ready, _, _ = select.select([self.child.stdout], [], [], timeout)
        return self.child.stdout.readline() if ready else ""

    def _died(self) -> str:
        self.child.kill()
        done, self.child = self.child.wait(), None
        code = done.returncode
        return f"worker ended with exit code {code} (a crash: {code < 0 or code == 134}):\n{done.stderr[-1500:]}"

    def run(self, request: dict) -> dict:
        if self.child is None:
            self._start()
        try:
            self.child.stdin.write(json.dumps(request) + "\n")
            self.child.stdin.flush()
        except BrokenPipeError:
            return {"ok": False, "msg": self._died()}
        line = self._read_line(self.timeout)
        return json.loads(line) if line else {"ok": False, "msg": self._died()}

    def close(self) -> None:
        if self.child is not None:
            self.child.stdin.close()
            self.child.wait(timeout=60)
            self.child = None
