"""Child code lives in modules: no test file passes a multi-line Python string to a child process.

Code in a string is invisible to ruff, to renames and to coverage; a child's code goes in a module of
``tests/children/`` run by ``forked.run_module`` (``python -m children.NAME``). This scans every ``tests/*.py`` with
``ast``: a call that starts a child (``run_python``, ``Child``, ``subprocess`` with ``"-c"``, or a function of the file
that passes one of its parameters on to one of these) whose code argument is, statically, a string that parses as
Python of three lines or more fails the test. One-line probes (``"import torch; print(...)"``) stay allowed, and
``test_forked.py``, whose subject is the snippet runner itself.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path
from typing import Optional

import pytest

TESTS = Path(__file__).resolve().parent
RUNNERS = {"run_python": 0, "Child": 0}  # a child runner's name -> the position of its code argument
SUBPROCESS = {"run", "Popen", "check_output", "check_call", "call"}
MIN_LINES = 3
EXEMPT = {"test_forked.py": "it tests run_python itself: that a snippet runs as under python -c (argv, exit steps)"}


def _name(func: ast.expr) -> Optional[str]:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _code_argument(call: ast.Call, runners: dict) -> Optional[ast.expr]:
    """The expression a call passes as a child's code, or None when the call starts no child."""
    name = _name(call.func)
    if name in runners:
        where = runners[name]
        if len(call.args) > where:
            return call.args[where]
        return next((k.value for k in call.keywords if k.arg == "code"), None)
    if name in SUBPROCESS and call.args and isinstance(call.args[0], ast.List):
        items = call.args[0].elts
        for i, item in enumerate(items[:-1]):
            if isinstance(item, ast.Constant) and item.value == "-c":
                return items[i + 1]
    return None


def _strings(scope: ast.AST) -> dict[str, Optional[ast.expr]]:
    """Names a module assigns at its top level, or a function anywhere in its body -> the expression assigned (None
    for a function's parameters: unknown here, they hide the module's names)."""
    found: dict[str, Optional[ast.expr]] = {}
    if isinstance(scope, ast.Module):
        nodes = scope.body
    else:
        found.update((a.arg, None) for a in (*scope.args.posonlyargs, *scope.args.args, *scope.args.kwonlyargs))
        nodes = list(ast.walk(scope))
    for node in nodes:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            found[node.targets[0].id] = node.value
    return found


def _value(node: ast.expr, scopes: list[dict], depth: int = 0) -> Optional[str]:
    """The string ``node`` holds where that is known without running it (holes of an f-string read as ``0``)."""
    if depth > 20:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = [_value(v, scopes, depth + 1) if isinstance(v, ast.Constant) else "0" for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _value(node.left, scopes, depth + 1), _value(node.right, scopes, depth + 1)
        return left + right if left is not None and right is not None else left or right
    if isinstance(node, ast.Call) and _name(node.func) == "dedent" and node.args:
        return _value(node.args[0], scopes, depth + 1)
    if isinstance(node, ast.Call) and _name(node.func) in ("strip", "format") and isinstance(node.func, ast.Attribute):
        return _value(node.func.value, scopes, depth + 1)
    if isinstance(node, ast.Name):
        for scope in scopes:
            if node.id in scope:
                return None if scope[node.id] is None else _value(scope[node.id], scopes, depth + 1)
    return None


def _is_code(text: str) -> bool:
    lines = [line for line in textwrap.dedent(text).splitlines() if line.strip()]
    if len(lines) < MIN_LINES:
        return False
    try:
        ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return False
    return True


def _runners(tree: ast.Module) -> dict:
    """The child runners a file can call: forked's, and its own functions that pass a parameter on as a child's code
    (``def child(code): return run_python(code, ...)``), to a fixed point."""
    runners = dict(RUNNERS)
    functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    grew = True
    while grew:
        grew = False
        for f in functions:
            params = [a.arg for a in f.args.args]
            if f.name in runners:
                continue
            for call in (c for c in ast.walk(f) if isinstance(c, ast.Call)):
                code = _code_argument(call, runners)
                used = {n.id for n in ast.walk(code) if isinstance(n, ast.Name)} if code is not None else set()
                hit = [i for i, p in enumerate(params) if p in used]
                if hit:
                    runners[f.name], grew = hit[0], True
                    break
    return runners


def code_strings(source: str) -> list[tuple[int, str]]:
    """``(line, first line of the code)`` for each call in ``source`` that passes multi-line Python to a child."""
    tree = ast.parse(source)
    module = _strings(tree)
    runners = _runners(tree)
    found = []
    for f in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
        scopes = [_strings(f), module] if f is not tree else [module]
        body = f.body if f is tree else [f]
        for call in (c for stmt in body for c in ast.walk(stmt) if isinstance(c, ast.Call)):
            code = _code_argument(call, runners)
            text = _value(code, scopes) if code is not None else None
            if text is not None and _is_code(text):
                found.append((call.lineno, textwrap.dedent(text).strip().splitlines()[0]))
    return sorted(set(found))


PLANTED = '''
import subprocess, sys, textwrap
from forked import run_python
BODY = """
import torch
x = torch.ones(2)
print(x.sum())
"""
def child(code, timeout=9):
    return run_python(textwrap.dedent(code), timeout=timeout)
def test_a():
    run_python(BODY)
def test_b():
    subprocess.run([sys.executable, "-c", "import a\\nimport b\\nprint(a, b)"])
def test_c():
    child("""
        import torch
        print(torch.ones(1))
        print("OK")
    """)
def test_fine():
    run_python("import torch; print(torch.ones(1))")
    subprocess.run([sys.executable, "-m", "children.x"])
'''


def test_the_scan_finds_code_strings_passed_to_children():
    """The scan itself: a constant, a module-level name, a ``-c`` list and a file's own wrapper are found; one-line
    probes and ``-m`` runs are not."""
    assert [line for line, _ in code_strings(PLANTED)] == [12, 14, 16]


@pytest.mark.parametrize("path", [p for p in sorted(TESTS.glob("*.py")) if p.name not in EXEMPT], ids=lambda p: p.name)
def test_no_test_file_passes_multi_line_code_to_a_child(path):
    found = code_strings(path.read_text(encoding="utf-8"))
    assert not found, (f"{path.name} passes Python code as a string to a child process at lines "
                       f"{', '.join(str(line) for line, _ in found)}: move it into a module of tests/children/ and "
                       "run it with forked.run_module('children.NAME', args)")


def test_a_worker_child_answers_line_by_line_is_forked_and_restarts_after_a_crash():
    """``forked.Worker``, the streaming child the property tests run their examples in: forked from the server (no
    slow ``python -c``), one answer per request, a crash a failed answer naming its exit code, then a fresh child."""
    import warnings

    from forked import SlowChild, Worker

    worker = Worker("children.echo_worker", timeout=60)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", SlowChild)
            assert worker.run({"n": 1}) == {"ok": True, "echo": {"n": 1}}
            assert worker.child.forked
            first = worker.child.pid
            assert worker.run({"n": 2}) == {"ok": True, "echo": {"n": 2}} and worker.child.pid == first
            crashed = worker.run({"abort": True})
            assert not crashed["ok"] and "exit code -6 (a crash: True)" in crashed["msg"], crashed
            assert worker.child is None
            assert worker.run({"n": 3}) == {"ok": True, "echo": {"n": 3}} and worker.child.pid != first
    finally:
        worker.close()
