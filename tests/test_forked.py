"""``forked.run_python``, the child processes of the crash-prone tests, behaves as ``subprocess.run([python, "-c",
...])`` does: exit status (a crash's signal too), output, arguments, stdin, folder, environment, timeout. Each
check runs forked and through the fallback (a real ``python -c``), and both must give the same answer."""

import os
import subprocess
import time

import forked as forked_module
import pytest
from forked import Child, run_python

FALLBACK = {"FORKED_TEST_FALLBACK": "1"}  # not in forked.FORK_SAFE: a changed one means a real interpreter


@pytest.fixture(params=["forked", "fallback"])
def env(request) -> dict:
    return {**os.environ, **(FALLBACK if request.param == "fallback" else {})}


def test_the_fork_path_is_taken_and_the_fallback_is_a_fresh_interpreter():
    code = "import sys; print('torch' in sys.modules)"
    forked = run_python(code)
    base = forked_module._server["env"]
    changed = {k for k in os.environ.keys() | base.keys() if os.environ.get(k) != base.get(k)}
    assert forked.stdout == "True\n", changed  # forked from the server that imported torch
    assert run_python(code, env={**os.environ, **FALLBACK}).stdout == "False\n"


def test_statuses_output_and_tracebacks(env):
    done = run_python("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)", env=env)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    done = run_python("print('before')\nraise ValueError('boom')", env=env)
    assert done.returncode == 1 and done.stdout == "before\n"
    assert done.stderr.startswith("Traceback") and 'File "<string>", line 2' in done.stderr
    assert done.stderr.strip().endswith("ValueError: boom") and "forked.py" not in done.stderr
    assert run_python("raise SystemExit('a message')", env=env).stderr == "a message\n"


def test_a_segfault_is_the_childs_signal_not_a_crash_here(env):
    done = run_python("import ctypes; print('reached', flush=True); ctypes.string_at(0)", env=env)
    assert done.returncode == -11 and done.stdout == "reached\n"


def test_arguments_stdin_folder_and_environment(env, tmp_path):
    code = ("import os, sys, tempfile\nprint(sys.argv, input(), os.getcwd(), os.environ['DIFFATTN_PROBE'],"
            " tempfile.gettempdir(), __name__)")
    env = {**env, "DIFFATTN_PROBE": "seen", "TMPDIR": str(tmp_path)}
    done = run_python(code, ["a", "b c"], env=env, cwd=tmp_path, input="typed\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['-c',", "'a',", "'b", "c']", "typed", str(tmp_path), "seen", str(tmp_path),
                                   "__main__"]


def test_the_thread_count_and_the_path_are_what_a_fresh_interpreter_gets(tmp_path):
    (tmp_path / "probe_module.py").write_text("WHERE = 'found'\n")
    for threads in {"1", str(min(2, os.cpu_count()))}:  # the tests' counts (the server's is one of them)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(tmp_path)}  # forked: set in the child
        done = run_python("import torch, probe_module; print(torch.get_num_threads(), probe_module.WHERE)", env=env)
        assert (done.returncode, done.stdout) == (0, f"{threads} found\n"), done.stderr


def test_exit_joins_threads_and_runs_atexit(env):
    code = ("import atexit, threading, time\natexit.register(print, 'atexit')\n"
            "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()")
    assert run_python(code, env=env).stdout == "thread\natexit\n"


def test_a_timeout_kills_the_child_and_raises(env):
    t0 = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("import time; print('started', flush=True); time.sleep(30)", env=env, timeout=0.5)
    assert time.perf_counter() - t0 < 10


def test_two_children_run_at_once(env, tmp_path):
    """Each waits for a file the other writes: only possible when both run before either is waited for."""
    code = ("import os, sys, time\nme, other = sys.argv[1:]\nopen(me, 'w').close()\n"
            "deadline = time.time() + 20\nwhile not os.path.exists(other) and time.time() < deadline: time.sleep(0.01)\n"
            "print(os.path.exists(other))")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    children = [Child(code, [a, b], env=env), Child(code, [b, a], env=env)]
    assert [c.wait(timeout=60).stdout for c in children] == ["True\n", "True\n"]
