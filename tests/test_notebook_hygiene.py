"""Committed notebooks are what CI checks: strict nbval only compares cells that were executed and kept their
outputs, so an unexecuted notebook would pass it silently. These tests make that, and JSON noise, fail."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXECUTED = sorted((ROOT / "notebooks").glob("*.ipynb")) + sorted((ROOT / "solutions").glob("*.ipynb"))
EXERCISES = sorted((ROOT / "exercises").glob("*.ipynb"))
ABS_PATH = re.compile(r"(?<![\w.:/])/(?:home|root|Users|tmp|work|private|var/folders|usr|opt)/[\w.-]+")
NAME = re.compile(r"^\d\d_[a-z0-9_]+\.ipynb$")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def test_the_series_is_complete_and_named():
    names = [p.name for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    assert [n[:2] for n in names] == [f"{i:02d}" for i in range(15)], names
    assert all(NAME.match(n) for n in names + [p.name for p in EXERCISES])
    assert [p.name for p in EXERCISES] == [p.name for p in sorted((ROOT / "solutions").glob("*.ipynb"))]
    assert {p.name for p in EXERCISES} <= set(names)


@pytest.mark.parametrize("path", EXECUTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_executed_top_to_bottom_with_outputs(path):
    cells = code_cells(load(path))
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), "re-execute with tools/run_notebooks.py and commit"
    assert sum(bool(c["outputs"]) for c in cells) >= len(cells) // 2, "most cells should show something"
    assert not any(o.get("output_type") == "error" for c in cells for o in c["outputs"])


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.name)
def test_exercises_are_committed_unexecuted(path):
    cells = code_cells(load(path))
    assert all(c["execution_count"] is None and not c["outputs"] for c in cells)
    assert any(c["source"][0].startswith("# TASK") for c in cells)


@pytest.mark.parametrize("path", EXECUTED + EXERCISES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_clean_json(path):
    nb = load(path)
    assert set(nb["metadata"]) <= {"kernelspec", "language_info"}, "run tools/run_notebooks.py to clean metadata"
    for c in nb["cells"]:
        assert not set(c.get("metadata", {})) & {"execution", "ExecuteTime", "collapsed", "scrolled"}
    text = json.dumps([c.get("outputs", []) for c in nb["cells"]])
    assert not ABS_PATH.search(text), ABS_PATH.search(text).group(0) if ABS_PATH.search(text) else ""
    assert path.stat().st_size < 1_500_000, "keep figures small (dpi ~80-100)"


# --- no placeholders, no links that go nowhere ------------------------------------------------------------

PLACEHOLDER = re.compile(r"\b(?:TODO|TBD|FIXME)\b|\bpending\b", re.IGNORECASE)
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".json"}
SKIP_DIRS = {".git", "build", "dist", "__pycache__", ".ipynb_checkpoints", ".pytest_cache", ".hypothesis", ".venv"}


def _files(suffixes):
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if path.is_file() and path.suffix in suffixes and not set(rel.parts) & SKIP_DIRS \
                and not rel.parts[0].endswith(".egg-info"):
            yield path


def _notebook_text(path: Path, markdown_only: bool = False) -> str:
    """Cell sources and text outputs (not images) of a notebook."""
    parts = []
    for c in load(path)["cells"]:
        if markdown_only and c["cell_type"] != "markdown":
            continue
        parts.append("".join(c["source"]))
        for o in c.get("outputs", []):
            parts.append("".join(o.get("text", "")))
            parts.append("".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


def test_no_placeholder_text_anywhere():
    found = []
    for path in _files(TEXT_SUFFIXES | {".ipynb"}):
        if path == Path(__file__).resolve():
            continue  # this file names the words it looks for
        text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {m.group(0)!r}" for m in PLACEHOLDER.finditer(text)]
    assert not found, "placeholder text: " + "; ".join(found)


CODE = re.compile(r"```.*?```|`[^`\n]*`", re.DOTALL)


def _relative_links(path: Path) -> list[str]:
    text = _notebook_text(path, markdown_only=True) if path.suffix == ".ipynb" else path.read_text()
    text = CODE.sub("", text)  # `kernel[grid](...)` is code, not a link
    targets = [t.split("#")[0] for t in LINK.findall(text)]
    return [t for t in targets if t and not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # skip https:, mailto:, ...


def test_every_relative_link_resolves():
    broken = [f"{p.relative_to(ROOT)} -> {t}" for p in _files({".md", ".ipynb"})
              for t in _relative_links(p) if not (p.parent / t).exists()]
    assert not broken, "links to files that do not exist: " + "; ".join(broken)


def test_every_markdown_file_named_in_the_repo_exists():
    """A name like `NOTES.md` in a notebook, doc or docstring must be a file of this repository."""
    names = {p.name for p in _files({".md"})}
    missing = set()
    for path in _files({".py", ".md", ".ipynb"}):
        if path == Path(__file__).resolve():
            continue
        text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
        missing |= {f"{path.relative_to(ROOT)}: {n}" for n in re.findall(r"\b([A-Za-z_][\w-]*\.md)\b", text)
                    if n not in names}
    assert not missing, "names a .md file the repository does not have: " + "; ".join(sorted(missing))


REPO_PATH = re.compile(r"(?<![\w/.])((?:notebooks|exercises|solutions|tests|tools|benchmarks|diffattn_tutorial|\.ci)/"
                       r"[\w./-]*[\w-]\.(?:py|ipynb|json|md|pt|cfg|toml))\b")


def test_every_repository_path_named_in_the_repo_exists():
    """A path such as `benchmarks/bench_sdpa.py` in code, a docstring or a notebook must exist (templates that
    name a pattern, `NN_*.ipynb` or `NAME.json`, are not paths)."""
    missing = set()
    for path in _files({".py", ".md", ".ipynb", ".toml", ".yml", ".cfg"}):
        text = _notebook_text(path) if path.suffix == ".ipynb" else path.read_text()
        missing |= {f"{path.relative_to(ROOT)}: {p}" for p in REPO_PATH.findall(text)
                    if not re.search(r"NN|NAME|[*{<]", p) and not (ROOT / p).exists()}
    assert not missing, "names a file the repository does not have: " + "; ".join(sorted(missing))


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("index", range(len(NOTEBOOKS)), ids=lambda i: NOTEBOOKS[i].name)
def test_each_notebook_ends_with_links_to_its_exercise_and_the_next_notebook(index):
    path = NOTEBOOKS[index]
    last = "".join(next(c for c in reversed(load(path)["cells"]) if c["cell_type"] == "markdown")["source"])
    links = set(LINK.findall(last))
    exercise = ROOT / "exercises" / path.name
    if exercise.exists():
        assert f"../exercises/{path.name}" in links, f"{path.name}: link its exercise at the end"
    if index + 1 < len(NOTEBOOKS):
        assert NOTEBOOKS[index + 1].name in links, f"{path.name}: link the next notebook at the end"
