"""The package's shape is its architecture: the layer order ``diffattn_tutorial/__init__.py``'s docstring states,
every import going only to a layer above (imports inside functions included), no import cycle, no module too long
to read, ruff clean. (The README's layout table is generated from the package by ``tools/make_readme_tables.py``;
``tests/test_readme_tables.py`` checks it.)"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "diffattn_tutorial"
MAX_TOP_LEVEL_MODULES = 12
MAX_MODULE_LINES = 700


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(path: Path, name: str, known: set[str]) -> set[str]:
    """Every package module ``path`` imports, at module level or inside a function, resolved to a module
    (``from a.b import c`` is an import of ``a.b.c`` when that is a module, else of ``a.b``)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, name, set(mods)) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def stated_layers(doc: str, known: set[str]) -> list[set[str]]:
    """The layers ``doc`` states, top first: one per line indented by four spaces, its names before the first run of
    two spaces (``kernels/`` is a subpackage, ``__init__`` the package itself)."""
    layers = []
    for line in doc.splitlines():
        if not line.startswith("    ") or line.startswith("     "):
            continue
        names = {n.strip().rstrip("/") for n in line.strip().split("  ")[0].split(",")}
        layers.append({"diffattn_tutorial" if n == "__init__" else f"diffattn_tutorial.{n}" for n in names})
    unknown = set().union(*layers) - known
    assert not unknown, f"the stated layers name modules that do not exist: {sorted(unknown)}"
    return layers


def layer_index(module: str, layers: list[set[str]]) -> int:
    """The index of the layer holding ``module`` (a module of a subpackage is in the subpackage's layer)."""
    for i, layer in enumerate(layers):
        if module in layer or any(module.startswith(f"{name}.") for name in layer if name != "diffattn_tutorial"):
            return i
    raise AssertionError(f"{module} is in no layer of diffattn_tutorial/__init__.py's docstring: add it there")


def upward_imports(graph: dict[str, set[str]], layers: list[set[str]]) -> set[tuple[str, str]]:
    """The imports ``a -> b`` where ``b``'s layer is below ``a``'s in the stated order."""
    return {(a, b) for a, bs in graph.items() for b in bs if layer_index(b, layers) > layer_index(a, layers)}


def test_every_import_goes_to_a_layer_above():
    layers = stated_layers(ast.get_docstring(ast.parse((PKG / "__init__.py").read_text())), set(modules()))
    graph = import_graph()
    for name in graph:
        layer_index(name, layers)  # every module is in a stated layer
    found = upward_imports(graph, layers)
    assert not found, f"imports against the layer order of __init__.py's docstring: {sorted(found)}"


def test_the_layer_checker_finds_an_import_against_the_order():
    known = {"diffattn_tutorial", "diffattn_tutorial.a", "diffattn_tutorial.b", "diffattn_tutorial.b.x"}
    layers = stated_layers("Layers:\n\n    a  leaf\n    b/, __init__   over it\n        (continued)\n", known)
    assert layers == [{"diffattn_tutorial.a"}, {"diffattn_tutorial.b", "diffattn_tutorial"}]
    graph = {"diffattn_tutorial.a": {"diffattn_tutorial.b.x"}, "diffattn_tutorial.b.x": {"diffattn_tutorial.a"}}
    assert upward_imports(graph, layers) == {("diffattn_tutorial.a", "diffattn_tutorial.b.x")}
    with pytest.raises(AssertionError, match="no layer"):
        layer_index("diffattn_tutorial.c", layers)


def test_importing_the_package_loads_no_kernel():
    """Nothing is imported for its side effect: the backend table loads a kernel module when its backend first runs
    or is asked for its status."""
    code = ("import sys, diffattn_tutorial, diffattn_tutorial.backends; "
            "print(sorted(m for m in sys.modules if m.startswith('diffattn_tutorial.kernels.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert done.stdout.strip() == "[]", done.stdout


def test_no_import_cycles_even_inside_functions():
    graph = import_graph()
    found = cycles(graph)
    detail = "; ".join(" <-> ".join(c) + " (edges: " + ", ".join(f"{a}->{b}" for a in c for b in sorted(graph[a])
                                                                  if b in c) + ")" for c in found)
    assert not found, f"import cycles: {detail}"


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_few_modules_directly_under_the_package():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


@pytest.mark.parametrize("name", sorted(modules()))
def test_no_module_is_too_long_to_read(name):
    lines = len(modules()[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{name} has {lines} lines; split it by job (limit {MAX_MODULE_LINES})"


@pytest.mark.skipif(shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                    capture_output=True).returncode != 0, reason="ruff is not installed (pip install -e '.[dev]')")
def test_ruff_is_clean():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_package_root_holds_the_package():
    """Children (torchrun workers, the memory-measuring process) get this folder on PYTHONPATH: after a module moves
    deeper, a path counted in parents from its own file would point inside the package."""
    from diffattn_tutorial.paths import package_root

    assert (package_root() / "diffattn_tutorial" / "__init__.py").is_file()
