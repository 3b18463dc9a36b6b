"""``forked.run_python``, the child processes of the crash-prone tests, behaves as ``subprocess.run([python, "-c",
...])`` does: exit status (a crash's signal too), output, arguments, stdin, folder, environment, path, exit steps,
timeout. Each check runs forked and through the fallback (a real ``python -c``), and both must give the same answer."""

import contextlib
import os
import subprocess
import time
import warnings

import forked
import pytest
from forked import Child, _context, run_python


@pytest.fixture(autouse=True, scope="module")
def _forkserver():
    """The server starts with the first test here, not at collection; skipped where there is none."""
    if _context() is None:
        pytest.skip("no forkserver here (or python runs with flags): every child is a real python -c")


FALLBACK = {"FORKED_TEST_FALLBACK": "1"}  # not in forked.FORK_SAFE: a changed one means a real interpreter


@pytest.fixture(params=["forked", "fallback"])
def env(request) -> dict:
    return {**os.environ, **(FALLBACK if request.param == "fallback" else {})}


@contextlib.contextmanager
def warnings_as_errors():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def slow(env: dict, variable: str = "FORKED_TEST_FALLBACK"):
    """Expect the slow path to warn, naming ``variable``, when ``env`` asks for the fallback."""
    if "FORKED_TEST_FALLBACK" not in env:
        return contextlib.nullcontext()
    return pytest.warns(forked.SlowChild, match=f"differs from the server's in .*{variable}")


def run(code, env, args=(), **kw) -> subprocess.CompletedProcess:
    """``run_python``, checking that the path taken is the one ``env`` asks for."""
    with slow(env):
        child = Child(code, args, env=env, **kw)
    base = forked._server["env"]
    assert child.forked == ("FORKED_TEST_FALLBACK" not in env), \
        sorted(k for k in env.keys() | base.keys() if env.get(k) != base.get(k))  # what made it fall back
    return child.wait(timeout=120)


def test_the_fork_path_starts_with_torch_imported_and_the_fallback_without(monkeypatch):
    code = "import sys; print('torch' in sys.modules)"
    for name in ("TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"):  # inductor sets them
        monkeypatch.setenv(name, "set by a compile in this process")                   # in the test process
    assert run_python(code).stdout == "True\n"
    with slow(FALLBACK):
        assert run_python(code, env={**os.environ, **FALLBACK}).stdout == "False\n"


def test_the_slow_path_warns_and_is_counted():
    """A silent fall-back once hid a slowdown until a timing run: each slow child warns and is counted."""
    before = len(forked.SLOW_CHILDREN)
    with pytest.warns(forked.SlowChild, match="differs from the server's in FORKED_TEST_FALLBACK, OMP_NUM_THREADS;"):
        done = run_python("pass", env={**os.environ, **FALLBACK, "OMP_NUM_THREADS": "7"})
    assert done.returncode == 0
    assert forked.SLOW_CHILDREN[before:] == [
        "the environment differs from the server's in FORKED_TEST_FALLBACK, OMP_NUM_THREADS"]
    with warnings_as_errors():
        assert run_python("pass").returncode == 0  # the fork path says nothing
    assert len(forked.SLOW_CHILDREN) == before + 1


def test_statuses_output_and_tracebacks(env):
    done = run("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)", env)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    done = run("print('before')\nraise ValueError('boom')", env)
    assert done.returncode == 1 and done.stdout == "before\n"
    assert done.stderr.startswith("Traceback") and 'File "<string>", line 2' in done.stderr
    assert done.stderr.strip().endswith("ValueError: boom") and "forked.py" not in done.stderr
    assert run("raise SystemExit('a message')", env).stderr == "a message\n"
    assert run("raise KeyboardInterrupt", env).returncode == -2


def test_a_segfault_is_the_childs_signal_not_a_crash_here(env):
    done = run("import ctypes; print('reached', flush=True); ctypes.string_at(0)", env)
    assert done.returncode == -11 and done.stdout == "reached\n"


def test_arguments_stdin_folder_environment_and_path(env, tmp_path):
    (tmp_path / "here_module.py").write_text("WHERE = 'here'\n")  # found through '' (the working folder)
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "lib_module.py").write_text("WHERE = 'lib'\n")  # found through PYTHONPATH
    code = ("import os, sys, tempfile, here_module, lib_module\n"
            "print(sys.argv, input(), os.getcwd(), os.environ['DIFFATTN_PROBE'], 'TRITON_INTERPRET' in os.environ,"
            " tempfile.gettempdir(), __name__, here_module.WHERE, lib_module.WHERE)")
    env = {**{k: v for k, v in env.items() if k != "TRITON_INTERPRET"}, "DIFFATTN_PROBE": "seen",
           "TMPDIR": str(tmp_path), "PYTHONPATH": str(tmp_path / "lib")}
    done = run(code, env, ["a", "b c"], cwd=tmp_path, input="typed\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['-c',", "'a',", "'b", "c']", "typed", str(tmp_path), "seen", "False",
                                   str(tmp_path), "__main__", "here", "lib"]
    assert "No module named 'forked'" in run("import forked", env).stderr  # the tests' folder is not on the path


def test_a_changed_thread_count_gets_a_fresh_interpreter():
    """Thread counts are read when torch and numpy's BLAS load: a child asking for another runs python -c."""
    threads = "2" if os.environ.get("OMP_NUM_THREADS") == "1" else "1"
    with pytest.warns(forked.SlowChild, match="OMP_NUM_THREADS"):
        child = Child("import torch; print(torch.get_num_threads())", env={**os.environ, "OMP_NUM_THREADS": threads})
    assert not child.forked and child.wait(timeout=120).stdout == f"{threads}\n"


def test_random_generators_differ_from_child_to_child(env):
    code = "import random, numpy, torch; print(random.random(), numpy.random.rand(), torch.rand(1).item())"
    assert run(code, env).stdout != run(code, env).stdout


def test_exit_joins_threads_runs_atexit_releases_globals_and_flushes(env, tmp_path):
    code = ("import atexit, ctypes, threading, time\natexit.register(print, 'atexit')\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
            "class Last:\n    def __del__(self): print('released')\nlast = Last()\n"
            "f = open('unflushed.txt', 'w'); f.write('data')\n"
            "ctypes.CDLL(None).printf(b'from C\\n')")
    done = run(code, env, cwd=tmp_path)
    lines = done.stdout.splitlines()  # C's buffer is flushed on its own terms: where it lands may vary
    assert [line for line in lines if line != "from C"] == ["thread", "atexit", "released"] and "from C" in lines
    assert (tmp_path / "unflushed.txt").read_text() == "data"


def test_a_timeout_kills_the_child_and_raises(env):
    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired), slow(env):
        run_python("import time; print('started', flush=True); time.sleep(30)", env=env, timeout=0.5)
    assert time.perf_counter() - t0 < 10


def test_a_missing_folder_raises_here():
    with pytest.raises(FileNotFoundError):
        run_python("pass", cwd="/no/such/folder")


def test_two_children_run_at_once(env, tmp_path):
    """Each waits for a file the other writes: only possible when both run before either is waited for."""
    code = ("import os, sys, time\nme, other = sys.argv[1:]\nopen(me, 'w').close()\n"
            "deadline = time.time() + 20\nwhile not os.path.exists(other) and time.time() < deadline: time.sleep(0.01)\n"
            "print(os.path.exists(other))")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with slow(env):
        children = [Child(code, [a, b], env=env), Child(code, [b, a], env=env)]
    try:
        assert [c.wait(timeout=60).stdout for c in children] == ["True\n", "True\n"]
    finally:
        for c in children:
            c.kill()
