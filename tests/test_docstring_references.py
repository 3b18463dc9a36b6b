"""Every module, file and function the package's docstrings and comments name in backticks exists: a dotted name
(``diffattn_tutorial.x.y``, or ``x.y`` from a top-level module of the package, as in ``:func:`~...```) resolves to a
module and a name defined in it, a bare name in ``:func:``, ``:class:`` or ``:data:`` is defined in the package, and
a path (``benchmarks/bench_cpu_auto.py``, ``diff_attention_cpu.cpp``) is a file or folder of the repository. Read from the source (nothing imported), so a rename that leaves a stale
reference behind fails here."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "diffattn_tutorial"
TOKEN = re.compile(r"`+~?([^`\s]+?)`+")
ROLE = re.compile(r":(?:func|class|data):`~?([A-Za-z_]\w*)`")
PATH = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")
SUFFIXES = (".py", ".cpp", ".md", ".ipynb", ".toml", ".cfg", ".sh")
"""The files of the repository itself (a ``.json`` or ``.pt`` named in a docstring is often one a run writes)."""


EXTERNAL = {"multihead_diffattn.py", "multihead_flashdiff_2.py"}
"""Files of the reference implementations (unilm's), which the docstrings name as their sources."""


def module_path(dotted: str) -> Path | None:
    """The source of module ``dotted`` (``diffattn_tutorial.a.b``), or None."""
    rel = Path(*dotted.split("."))
    for candidate in (ROOT / rel.with_suffix(".py"), ROOT / rel / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level or in its classes (``Class.method`` as well)."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                names |= {f"{node.name}.{n.name}" for n in node.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                names |= {f"{node.name}.{t.id}" for n in node.body if isinstance(n, ast.AnnAssign)
                          for t in [n.target] if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return frozenset(names)


def dotted_exists(dotted: str) -> bool:
    """Whether ``diffattn_tutorial.a.b.name`` (or ``.Class.method``) is a module or a name defined in one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_path(".".join(parts[:cut]))
        if path is not None:
            rest = ".".join(parts[cut:])
            return not rest or rest in defined_names(path) or (
                module_path(".".join(parts[:cut + 1])) is not None)
    return False


def top_level() -> set[str]:
    return {p.stem for p in PKG.glob("*.py")} | {p.parent.name for p in PKG.glob("*/__init__.py")}


def repo_folders() -> set[str]:
    """The first segments a path of the repository starts with (its folders, the package's)."""
    return {p.name for p in (*ROOT.iterdir(), *PKG.iterdir()) if p.is_dir() and not p.name.startswith(".")}


def placeholder(token: str) -> bool:
    """``NAME.json``, ``<x>.py``: a pattern, not a file."""
    stem = token.rsplit(".", 1)[0]
    return stem.isupper() or not re.fullmatch(r"[\w-]+", stem)


def path_exists(token: str, near: Path) -> bool:
    token = token.rstrip("/")
    bases = (ROOT, PKG, near.parent)
    if any((base / token).exists() or (base / f"{token}.py").exists() for base in bases):
        return True
    return "/" not in token and any(ROOT.rglob(token))


def references(text: str) -> list[str]:
    """The tokens in backticks of ``text`` that name a module, a function of the package, or a file."""
    found = []
    for token in TOKEN.findall(text):
        token = token.rstrip(".,:;)").removesuffix("()")
        if token.startswith("diffattn_tutorial.") or (
                "." in token and token.split(".")[0] in top_level() and re.fullmatch(r"[\w.]+", token)
                and not token.endswith(SUFFIXES)):
            found.append(token)
        elif PATH.match(token) and ("/" in token and token.split("/")[0] in repo_folders()
                                    or "/" not in token and token.endswith(SUFFIXES) and not placeholder(token)):
            found.append(token)
    return found


def broken(path: Path) -> list[str]:
    """The references of ``path`` (any text of the file: docstrings and comments) that name nothing."""
    out = []
    for token in references(path.read_text()):
        if token in EXTERNAL:
            continue
        if token.endswith(SUFFIXES) or "/" in token:
            ok = path_exists(token, path)
        else:
            ok = dotted_exists(token if token.startswith("diffattn_tutorial.") else f"diffattn_tutorial.{token}")
        if not ok:
            out.append(token)
    if path.suffix == ".py":  # a bare name in a Sphinx role: defined in this module or another of the package
        out += [name for name in ROLE.findall(path.read_text())
                if name not in defined_names(path) and name not in package_names()]
    return out


@cache
def package_names() -> frozenset[str]:
    return frozenset().union(*(defined_names(p) for p in PKG.rglob("*.py")))


@pytest.mark.parametrize("path", sorted([*PKG.rglob("*.py"), *PKG.rglob("*.cpp")]), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_in_backticks_exists(path):
    assert broken(path) == []


def test_a_stale_reference_is_found(tmp_path):
    stale = tmp_path / "stale.py"
    stale.write_text('"""See ``diffattn_tutorial/' + 'cpu_kernel.py``, :func:`~diffattn_tutorial.functional.nothing`,\n'
                     "``functional.diff_attention``, ``backends.describe_auto`` and :func:`gone`.\"\"\"\n"
                     "# the kernel: `kernels/cpu/diff_attention_cpu.cpp`\n")
    assert broken(stale) == ["diffattn_tutorial/" + "cpu_kernel.py", "diffattn_tutorial.functional.nothing", "gone"]
