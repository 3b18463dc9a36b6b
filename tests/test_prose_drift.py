"""The course's prose agrees with its own code: a drift test that reads, never executes.

For every notebook in ``notebooks/`` and every solution in ``solutions/`` (the exercises are generated from the
solutions, so their text is checked there):

1. **Numbers.** Every *measured-looking* number in a markdown cell (or a code comment, which is prose too)
   appears in that notebook's code or outputs, or the sentence that states it names its source. What counts, outside code spans, fenced code and display
   equations (``$$ ... $$``):

   * a decimal, ``0.1095`` or ``3.2`` (not a version such as ``torch 2.13.0`` or ``Python 3.10``, not an arXiv
     id such as ``2410.05258``);
   * a multiple, ``3x``, ``3.2x``, ``2×``, or a number followed by ``times``;
   * a percentage, ``96.9%`` or ``40 %`` (not ``0 %`` or ``100 %``);
   * a number with thousands separators, ``85,000``, or a whole number of 1000 or more that is not a year
     (1900-2099).

   Small whole numbers (section, notebook, equation and table numbers, counts such as "8 questions") and
   years and issue numbers (``#1633``) do not count. A number *appears* in the code or outputs when some number
   there (its digits, so ``3.35e12`` gives ``3.35``; comments do not count) rounds to it at the precision the
   prose writes it (``0.110`` is backed by a printed ``0.10953``); a percentage is also backed by the fraction
   (``40 %`` by ``0.403``) or by one minus it (a "20 % drop" by a factor ``0.8``), and a round number after "about", "~" or "roughly" by a number that rounds to it.
   A sentence that names an outside source (the paper or a named release or datasheet: "Table 3", "the paper",
   "the authors report", "arXiv ...", or an equation) is taken at its word. A sentence that names a recorded
   results file ("recorded", ``diffattn_tutorial/recorded/...``, ``benchmarks/results_...``) may also be backed
   by a number of those files. A table row counts with the paragraph before the table (its caption).
2. **Asserted.** A markdown cell that says a claim is asserted ("asserted", "asserts", "the ``assert``s check")
   is backed by an ``assert`` (or ``assert_close``) in the code cells it describes: the code cells between it
   and the next markdown cell (when there are none, those before it); or, when its sentence points back
   ("above", "the previous cell"), the code cells between the previous markdown cell and it; or, when it says
   "asserted in section N", the code cells of that section. Each heading, paragraph, list item and table row is
   read on its own.
3. **Names.** Every relative link resolves; every repository path named in markdown (``tools/mutation.py``,
   ``diffattn_tutorial/recorded/seed_study.json``) exists; every dotted library name (``functional.diff_attention``,
   ``diffattn_tutorial.interop.from_diffllama``, ``recorded.load``) resolves to an attribute of the package.
4. **Commands.** In a fenced ``bash`` block a continued line ends with one backslash: a doubled one (``\\\\``,
   what a JSON or Python string shows when it was escaped twice) ends the command when pasted into a shell.
5. **Navigation.** Each solution (so each exercise) ends with a link back to its notebook and a "Next" link to
   the following chapter's notebook while there is one.

``EXPECTED`` lists what fails today in notebooks this change does not edit, one entry per item with the fix it
needs; the test fails when a listed item no longer fails (remove it), so the list only ever shrinks.
"""

from __future__ import annotations

import importlib
import io
import json
import math
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
PAGES = NOTEBOOKS + SOLUTIONS

# Known failures in notebooks another change owns (issue 26), one entry per item, "<page> | <rule> | <what>": the
# fix it needs. The test fails when a listed item no longer fails: remove its entry with the fix.
EXPECTED: dict[str, str] = {
}


# ---------------------------------------------------------------------------------------------------------------
# reading notebooks
# ---------------------------------------------------------------------------------------------------------------


def _load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def _outputs(cell: dict) -> str:
    parts = []
    for o in cell.get("outputs", []):
        parts.append("".join(o.get("text", "")))
        parts.append("".join(o.get("data", {}).get("text/plain", "")))
    return "\n".join(parts)


FENCED = re.compile(r"```.*?```", re.DOTALL)
DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(markdown: str) -> str:
    """Markdown without fenced code, display equations and inline code (inline math stays: it states values)."""
    return INLINE_CODE.sub(" ", DISPLAY_MATH.sub(" ", FENCED.sub(" ", markdown)))


def _blocks(markdown: str) -> list[tuple[str, str]]:
    """(block, caption) pairs: paragraphs and list items, and table rows with the paragraph before the table."""
    out, caption, para = [], "", []
    for line in markdown.splitlines() + [""]:
        stripped = line.strip()
        if stripped.startswith("|"):
            if para:
                caption, para = " ".join(para), []
            if not re.fullmatch(r"\|[\s|:-]+\|?", stripped):
                out.append((stripped, caption))
            continue
        if not stripped or re.match(r"^(?:[*+-]|\d+\.)\s", stripped) or stripped.startswith("#"):
            if para:
                out.append((" ".join(para), ""))
                caption = " ".join(para)
            para = [stripped] if stripped else []
            continue
        para.append(stripped)
    return out


SENTENCE_END = re.compile(r"(?<=[.!?:;])\s+(?=[A-Z(*\[$`])")


def _sentences(block: str) -> list[str]:
    return [s for s in SENTENCE_END.split(block) if s.strip()]


# ---------------------------------------------------------------------------------------------------------------
# rule 1: numbers
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Number:
    text: str  # as written
    value: float
    decimals: int  # digits after the point (negative: trailing zeros of an "about" round number)
    percent: bool


VERSION = re.compile(r"(?:python|torch|triton|cuda|numpy|version|jupyterlab|nbval|transformers|>=|==|<=|~=|\bv)"
                     r"\s*\d+(?:\.\d+)+", re.IGNORECASE)
DOTTED = re.compile(r"\d+\.\d+\.\d+")  # 2.13.0: a version
ARXIV = re.compile(r"\b\d{4}\.\d{4,5}\b")
CANDIDATE = re.compile(
    r"(?<![\w.,^_{#])(?P<num>\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?![\w.]*\d)"
    r"(?P<suffix>\s?(?:%|x\b|×|\s?times\b))?")
APPROX = re.compile(r"(?:about|~|roughly|approximately|around|some|nearly|almost|over|under)\s*$", re.IGNORECASE)
SOURCE = re.compile(  # a source outside this repository: the sentence is taken at its word
    r"\bpaper\b|\bTables?\s+\d|\bFigure\s+\d|\bequation|\bEq\.|\barXiv\b|\bauthors\b|\breports?\b|"
    r"\breported\b|\brelease\b|\bdatasheet\b|\bspecification\b|\bet al\b|\btranscribed\b", re.IGNORECASE)
RECORDED_SOURCE = re.compile(r"\brecorded\b|diffattn_tutorial/recorded/|benchmarks/results_", re.IGNORECASE)
RECORDED_FILES = sorted((ROOT / "diffattn_tutorial" / "recorded").glob("*.json")) + \
    sorted((ROOT / "benchmarks").glob("results_*.json"))


def prose_numbers(sentence: str) -> list[Number]:
    """The numbers of a sentence that must be backed (see the module docstring)."""
    masked = ARXIV.sub(" ", DOTTED.sub(" ", VERSION.sub(" ", sentence)))
    found = []
    for m in CANDIDATE.finditer(masked):
        num, suffix = m.group("num"), (m.group("suffix") or "").strip()
        value = float(num.replace(",", ""))
        decimals = len(num.split(".")[1]) if "." in num else 0
        percent = suffix == "%"
        counts = ("." in num or "," in num or bool(suffix)
                  or (value >= 1000 and not 1900 <= value <= 2099))
        if not counts or (percent and value in (0, 100)):
            continue
        if decimals == 0 and APPROX.search(masked[:m.start()]):
            zeros = len(num.replace(",", "")) - len(num.replace(",", "").rstrip("0"))
            decimals = -min(zeros, len(num.replace(",", "")) - 1)
        found.append(Number(m.group(0).strip(), value, decimals, percent))
    return found


CODE_NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?!\d)|\d+(?:\.\d+)?")


def _without_comments(source: str) -> str:
    """Python source without its comments (prose, not code); cells that do not tokenize are kept whole."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type != tokenize.COMMENT]
        return tokenize.untokenize(tokens)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source


def _comments(source: str) -> list[str]:
    """The comments of a code cell: prose too, so their numbers must be backed like a markdown cell's."""
    try:
        return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return []


def code_numbers(cells: list[dict]) -> set[float]:
    """Every number in the code cells' sources (comments left out) and outputs."""
    text = "\n".join(_without_comments(_source(c)) + "\n" + _outputs(c) for c in cells if c["cell_type"] == "code")
    return {float(t.replace(",", "")) for t in CODE_NUMBER.findall(text)}


def _rounds_to(value: float, target: float, decimals: int) -> bool:
    scale = 10.0 ** decimals
    return math.isclose(math.floor(value * scale + 0.5) / scale, target, rel_tol=1e-9, abs_tol=1e-12)


def is_backed(n: Number, numbers: set[float]) -> bool:
    for v in numbers:
        if _rounds_to(v, n.value, n.decimals):
            return True
        if n.percent and (_rounds_to(100 * v, n.value, n.decimals) or _rounds_to(100 * (1 - v), n.value, n.decimals)):
            return True
    return False


_RECORDED_NUMBERS: list[set[float]] = []


def recorded_numbers() -> set[float]:
    """Every number in the recorded results files (``diffattn_tutorial/recorded``, ``benchmarks/results_*``)."""
    if not _RECORDED_NUMBERS:
        _RECORDED_NUMBERS.append({float(t) for p in RECORDED_FILES for t in CODE_NUMBER.findall(p.read_text())})
    return _RECORDED_NUMBERS[0]


def unbacked_numbers(cells: list[dict]) -> list[tuple[int, str, str]]:
    """(cell, number, sentence) for every number that neither the code nor a named source backs. A sentence that
    names an outside source (the paper, an equation, a datasheet) is taken at its word; one that names a recorded
    file must hold a number of the recorded files (or of the notebook)."""
    numbers = code_numbers(cells)
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            pieces = [(sentence, sentence + (" " + caption if block.startswith("|") else ""))
                      for block, caption in _blocks(_prose(_source(cell)))
                      for sentence in (_sentences(block) if not block.startswith("|") else [block])]
        else:
            pieces = [(c, c) for c in _comments(_source(cell))]
        for sentence, context in pieces:
            if SOURCE.search(context):
                continue
            backing = numbers | recorded_numbers() if RECORDED_SOURCE.search(context) else numbers
            out += [(i, n.text, sentence) for n in prose_numbers(sentence) if not is_backed(n, backing)]
    return out


# ---------------------------------------------------------------------------------------------------------------
# rule 2: asserted
# ---------------------------------------------------------------------------------------------------------------

ASSERTED = re.compile(r"\basserted\b|\basserts\b|\bthe\s+`?assert`?s\b", re.IGNORECASE)
BACKWARD = re.compile(r"\babove\b|\b(?:previous|earlier) (?:cell|section)s?\b", re.IGNORECASE)
SECTION_REF = re.compile(r"\bsection\s+(\d+)\b", re.IGNORECASE)
ASSERT_STMT = re.compile(r"^\s*assert\b|assert_close\(|\.assert_\w+\(|assert_allclose\(", re.MULTILINE)
HEADING = re.compile(r"^#{2,3}\s*(\d+)\b", re.MULTILINE)


def _has_assert(cells: list[dict], indices) -> bool:
    return any(cells[j]["cell_type"] == "code" and ASSERT_STMT.search(_source(cells[j])) for j in indices)


def _run_after(cells, i):
    j = i + 1
    while j < len(cells) and cells[j]["cell_type"] == "code":
        j += 1
    return range(i + 1, j)


def _run_before(cells, i):
    j = i - 1
    while j >= 0 and cells[j]["cell_type"] == "code":
        j -= 1
    return range(j + 1, i)


def _section_cells(cells, number: int):
    start = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and any(int(h) == number for h in HEADING.findall(_source(c)))), None)
    if start is None:
        return range(0)
    end = next((i for i in range(start + 1, len(cells)) if cells[i]["cell_type"] == "markdown"
                and HEADING.search(_source(cells[i]))), len(cells))
    return range(start, end)


def unbacked_asserted(cells: list[dict]) -> list[tuple[int, str]]:
    """(cell, sentence) for every "asserted" claim with no assert in the cells it describes."""
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        sentences = [s for block, _ in _blocks(_source(cell)) for s in _sentences(block)]
        for sentence in sentences:
            if not ASSERTED.search(sentence):
                continue
            ref = SECTION_REF.search(sentence[ASSERTED.search(sentence).start():]) or SECTION_REF.search(sentence)
            if ref and "asserted in section" in sentence.lower():
                where = _section_cells(cells, int(ref.group(1)))
            elif BACKWARD.search(sentence):
                where = _run_before(cells, i)
            else:
                where = _run_after(cells, i) or _run_before(cells, i)
            if not _has_assert(cells, where):
                out.append((i, sentence))
    return out


# ---------------------------------------------------------------------------------------------------------------
# rule 3: names
# ---------------------------------------------------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"(?<![\w/.])((?:notebooks|exercises|solutions|tests|tools|benchmarks|diffattn_tutorial|\.ci)"
                       r"/[\w./<>*{}-]*[\w/>*}-])")
LIB_NAME = re.compile(r"`(?:diffattn_tutorial\.)?([a-z_][a-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?:\([^`]*\))?`")


def _library_modules() -> set[str]:
    pkg = ROOT / "diffattn_tutorial"
    return {p.stem for p in pkg.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in pkg.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    try:
        obj = importlib.import_module(f"diffattn_tutorial.{parts[0]}")
    except ImportError:
        return False
    for name in parts[1:]:
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{name}")
        except (ImportError, AttributeError):
            return False
    return True


BASH_BLOCK = re.compile(r"```(?:bash|sh|shell|console)\n(.*?)```", re.DOTALL)


def broken_commands(cells: list[dict]) -> list[tuple[int, str]]:
    """(cell, line) for every line of a fenced shell block in markdown that ends with a doubled backslash."""
    return [(i, line.strip()) for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
            for block in BASH_BLOCK.findall(_source(cell)) for line in block.splitlines()
            if line.rstrip().endswith("\\\\")]


def broken_names(path: Path, cells: list[dict]) -> list[tuple[int, str]]:
    modules = _library_modules()
    out = []
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "markdown":
            continue
        text = _source(cell)
        for target in LINK.findall(FENCED.sub(" ", INLINE_CODE.sub(" ", text))):
            target = target.split("#")[0]
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not (path.parent / target).exists():
                out.append((i, f"link {target}"))
        for p in REPO_PATH.findall(FENCED.sub(" ", text)):
            p = p.rstrip("/.")
            if not re.search(r"NN|NAME|[*{<]", p) and not (ROOT / p).exists():
                out.append((i, f"path {p}"))
        for dotted in LIB_NAME.findall(text):
            if re.search(r"\.(?:jsonl?|py|ipynb|md|pt|txt|csv)$", dotted):
                continue  # a file name such as metrics.jsonl
            if dotted.split(".")[0] in modules and not _resolves(dotted):
                out.append((i, f"name {dotted}"))
    return out


# ---------------------------------------------------------------------------------------------------------------
# the tests
# ---------------------------------------------------------------------------------------------------------------


def _page(path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def _shorten(sentence: str, limit: int = 110) -> str:
    s = " ".join(sentence.split())
    return s if len(s) <= limit else s[:limit] + "..."


def findings(path: Path) -> dict[str, str]:
    """key -> where, for every drift in one notebook (keys as in EXPECTED)."""
    cells = _load(path)
    page = _page(path)
    out = {}
    for i, number, sentence in unbacked_numbers(cells):
        out[f"{page} | number | {number} in: {_shorten(sentence, 60)}"] = f"cell {i}: {_shorten(sentence)}"
    for i, sentence in unbacked_asserted(cells):
        out[f"{page} | asserted | {_shorten(sentence, 60)}"] = f"cell {i}: {_shorten(sentence)}"
    for i, what in broken_names(path, cells):
        out[f"{page} | name | {what}"] = f"cell {i}"
    for i, line in broken_commands(cells):
        out[f"{page} | command | {_shorten(line, 60)}"] = f"cell {i}: {line}"
    return out


@pytest.mark.parametrize("path", PAGES, ids=_page)
def test_prose_agrees_with_the_code(path):
    found = findings(path)
    page = _page(path)
    new = {k: v for k, v in found.items() if k not in EXPECTED}
    fixed = [k for k in EXPECTED if k.startswith(page + " |") and k not in found]
    msg = "".join(f"\n  {k}\n      ({v})" for k, v in new.items())
    assert not new, f"prose that nothing in the notebook backs (fix it, print it, or name its source):{msg}"
    assert not fixed, "listed in EXPECTED but no longer failing, remove them:\n  " + "\n  ".join(fixed)


@pytest.mark.parametrize("index", range(len(SOLUTIONS)), ids=lambda i: SOLUTIONS[i].name)
def test_each_solution_links_back_and_next(index):
    path = SOLUTIONS[index]
    last = _source(next(c for c in reversed(_load(path)) if c["cell_type"] == "markdown"))
    links = set(LINK.findall(last))
    assert f"../notebooks/{path.name}" in links, f"{path.name}: link back to its notebook at the end"
    later = [p for p in NOTEBOOKS if p.name > path.name]
    if later:
        assert f"../notebooks/{later[0].name}" in links, f"{path.name}: end with a Next link to {later[0].name}"
        assert "start again" not in last.lower(), f"{path.name}: 'Start again' although {later[0].name} follows"


# --- the rules themselves, on made-up text: each can fail -------------------------------------------------------


def test_what_counts_as_a_number():
    texts = [n.text for n in prose_numbers(
        "Section 3 of notebook 07: 8 questions, 0.1095, 3.2x, 2× and 4.8 times, 96.9%, 40 %, 100 %, 85,000, 171392, "
        "in 2026, torch 2.13.0, Python 3.10, arXiv 2410.05258, $\\lambda = 0.2$, 12 steps")]
    assert texts == ["0.1095", "3.2x", "2×", "4.8 times", "96.9%", "40 %", "85,000", "171392", "0.2"]


def test_numbers_are_backed_by_rounding_and_named_sources():
    nums = code_numbers([{"cell_type": "code", "source": ["x = 3.35e12\n"], "outputs": [
        {"output_type": "stream", "text": ["ratio 0.10953, share 0.403, 171,392 logits\n"]}]}])
    backed = [is_backed(n, nums) for n in prose_numbers("0.110, 0.1095, 40 %, 3.35 TB/s, about 170,000, 85,000")]
    assert backed == [True, True, True, True, True, False]
    cells = [{"cell_type": "markdown", "source": ["One logit among ~85,000. The paper reports 0.42."]},
             {"cell_type": "code", "source": ["print(1)"], "outputs": []}]
    assert [n for _, n, _ in unbacked_numbers(cells)] == ["85,000"]


def test_code_comments_are_prose_too():
    cells = [{"cell_type": "code", "source": ["x = 1  # one planted logit among ~85,000\n",
                                              "assert y < 0.8 * x  # a 20 % drop\n"], "outputs": []}]
    assert [n for _, n, _ in unbacked_numbers(cells)] == ["85,000"]


def test_asserted_needs_an_assert_where_it_points():
    md = {"cell_type": "markdown", "source": ["It is exactly zero (asserted)."]}
    code_ok = {"cell_type": "code", "source": ["assert x == 0\n"], "outputs": []}
    code_no = {"cell_type": "code", "source": ["print(x)\n"], "outputs": []}
    assert unbacked_asserted([md, code_ok]) == []
    assert len(unbacked_asserted([md, code_no])) == 1
    above = {"cell_type": "markdown", "source": ["The cell above asserts it."]}
    assert unbacked_asserted([code_ok, above, code_no]) == []
    assert len(unbacked_asserted([code_no, above, code_ok])) == 1


def test_a_doubled_backslash_in_a_shell_block_is_found():
    cells = [{"cell_type": "markdown", "source": ["```bash\nrun --a \\\\\n    --b\nrun --c \\\n    --d\n```\n"]}]
    assert broken_commands(cells) == [(0, "run --a \\\\")]


def test_broken_names_are_found(tmp_path):
    cells = [{"cell_type": "markdown", "source": [
        "See [x](missing.ipynb), `tools/" "no_such_tool.py`, `functional.no_such_function` and "
        "`functional.diff_attention`, [ok](../README.md)."]}]
    path = ROOT / "notebooks" / "x.ipynb"
    assert [w for _, w in broken_names(path, cells)] == ["link missing.ipynb", "path tools/" "no_such_tool.py",
                                                         "name functional.no_such_function"]
