"""Kinds of prose drift the number test (``test_prose_drift.py``) cannot see, each checked at its kind, not its
instances. Reads files, never executes a notebook.

1. **Which notebooks need a GPU or Triton.** A sentence (README outside its generated blocks, any notebook or
   solution) that lists the notebooks with GPU cells, or those that need Triton, lists exactly the ones whose code
   says so (``tools/make_readme_tables.py``'s ``notebook_needs``, which also writes the README's own list).
2. **What ``auto`` runs.** The rule is printed by ``backends.describe_auto`` (and generated into the README); no
   hand-written sentence says which backend ``auto`` runs, uses, picks or trains with.
3. **Library names.** A dotted name in backticks (``x.y``, RST ``x.y`` and ``:func:`x.y```) whose first part
   is the package, one of its modules (by full or short name: ``timing.peak_extra_memory``) or one of its public
   classes resolves to an attribute of the library: in the README, CONTRIBUTING, the benchmark notes, every
   notebook and solution (markdown, code comments and docstrings) and every library docstring and comment.
4. **Exercises do not give the answer.** In a solution (so in its exercise), the stub and the text from the task's
   heading to its ``# CHECK`` cell contain none of the answer's key expressions: its lines and sub-expressions
   of some size, whitespace and comments aside, that the task's given code does not already hold.
5. **Claims about others carry their source.** A sentence that says what the paper or another project reports,
   says, measures, compares or recommends names where: a section, table, figure or equation, an arXiv id, a
   link, an issue or PR number (``#1234``) or a file of that project (``multihead_diffattn.py``).
6. **One speed-up.** No benchmark script or notebook takes the median of per-round ratios: a speed-up is a ratio
   of medians (``tools/make_readme_tables.speedup``).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import io
import json
import pkgutil
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "diffattn_tutorial"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
PAGES = NOTEBOOKS + SOLUTIONS
PROSE_FILES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "benchmarks" / "NOTES.md"]
GENERATED = re.compile(r"<!-- generated:[\w-]+ -->\n.*?<!-- /generated -->", re.DOTALL)


def _tool():
    spec = importlib.util.spec_from_file_location("make_readme_tables", ROOT / "tools" / "make_readme_tables.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _src(cell: dict) -> str:
    return "".join(cell["source"])


def _comments_and_docstrings(source: str) -> str:
    """The prose of Python source: its comments and string literals (docstrings, messages)."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    return "\n".join(t.string for t in toks if t.type in (tokenize.COMMENT, tokenize.STRING))


def _page_texts(path: Path) -> list[tuple[str, str]]:
    """(where, prose) for each cell: markdown whole, code cells' comments and strings."""
    out = []
    for i, c in enumerate(_cells(path)):
        text = _src(c) if c["cell_type"] == "markdown" else _comments_and_docstrings(_src(c))
        out.append((f"{path.parent.name}/{path.name} cell {i}", text))
    return out


def _prose_texts() -> list[tuple[str, str]]:
    """README (without its generated blocks), CONTRIBUTING, the benchmark notes, and every notebook and solution."""
    out = [(p.name, GENERATED.sub(" ", p.read_text())) for p in PROSE_FILES if p.exists()]
    for path in PAGES:
        out += _page_texts(path)
    return out


SENTENCE_END = re.compile(r"(?<=[.!?;])\s+(?=[A-Z(*\[`])|\n\s*\n|\n\s*[*-]\s")


def _sentences(text: str) -> list[str]:
    text = re.sub(r"```.*?```", " ", text, flags=re.DOTALL)
    return [" ".join(s.split()) for s in SENTENCE_END.split(text) if s.strip()]


# ---------------------------------------------------------------------------------------------------------------
# 1. which notebooks need a GPU or Triton
# ---------------------------------------------------------------------------------------------------------------

NEEDS = {
    "gpu": re.compile(r"GPU cells|cells that need a GPU|cells? (?:that )?needs? a GPU", re.IGNORECASE),
    "triton": re.compile(r"\b(?:need(?:s|ed)?|use[sd]?)\b[^.;]*\bTriton\b|\bTriton\b[^.;]*\b(?:need(?:s|ed)?|"
                         r"use[sd]?)\b|\bwhich (?:is all )?notebooks?\b[^.;]*\bneed\b", re.IGNORECASE),
}
NOTEBOOK_NUMBER = re.compile(r"\b(0\d|1\d)\b")
LIST_START = re.compile(r"\bnotebooks?\b|\(in\b", re.IGNORECASE)


def _listed_notebooks(sentence: str) -> set[str]:
    """The two-digit notebook numbers a sentence lists after "notebook(s)" or "(in"."""
    return {n for m in LIST_START.finditer(sentence) for n in NOTEBOOK_NUMBER.findall(sentence[m.end():m.end() + 60])}


def _running_text(text: str) -> str:
    """Markdown without its tables and headings (a table row names notebooks for other reasons)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith(("|", "#")))


def needs_claims(text: str, needs: dict[str, list[str]]) -> list[str]:
    """Sentences of ``text`` that list notebooks with GPU cells or needing Triton and list others than ``needs``."""
    bad = []
    for sentence in _sentences(_running_text(text)):
        listed = _listed_notebooks(sentence)
        if not listed:
            continue
        for kind, pattern in NEEDS.items():
            if pattern.search(sentence) and listed != set(needs[kind]) and \
                    not (kind == "triton" and "GPU" in sentence and listed == set(needs["gpu"])):
                bad.append(f"{kind}: lists {sorted(listed)}, the notebooks' code gives {needs[kind]}: {sentence[:140]}")
    return bad


def test_lists_of_notebooks_that_need_a_gpu_or_triton_match_the_notebooks():
    needs = _tool().notebook_needs()
    assert needs["gpu"] and needs["triton"], needs
    texts = [(p.name, GENERATED.sub(" ", p.read_text())) for p in PROSE_FILES if p.exists()]
    texts += [(f"{p.parent.name}/{p.name} cell {i}", _src(c)) for p in PAGES for i, c in enumerate(_cells(p))
              if c["cell_type"] == "markdown"]
    bad = [f"{where}: {b}" for where, text in texts for b in needs_claims(text, needs)]
    assert not bad, "lists of notebooks that disagree with the notebooks' own code:\n" + "\n".join(bad)


def test_a_wrong_list_of_notebooks_is_found():
    needs = {"gpu": ["08", "09", "12", "13"], "triton": ["09", "13"]}
    assert needs_claims("Everything runs on a CPU; the GPU cells of notebooks 08 and 09 run on a GPU.", needs)
    assert needs_claims("Triton, about 1 GB, which only notebook 09 (with its exercise) and the tests use.", needs)
    assert not needs_claims("Cells that need a GPU (in 08, 09, 12 and 13) say why they skip.", needs)
    assert not needs_claims("Triton (about 1 GB, needed by notebook 09 and one cell of 13).", needs)


# ---------------------------------------------------------------------------------------------------------------
# 2. what auto runs
# ---------------------------------------------------------------------------------------------------------------

BACKEND = r"`(?:naive|chunked|sdpa(?:_\w+)?|cpu_fused|triton)`"
AUTO_CLAIM = re.compile(
    r"(?:`auto`|`?backend=\"auto\"`?|\bauto\b(?= (?:runs|uses|picks|chooses|trains)))[^.;:]{0,60}?"
    r"\b(?:runs?|uses?|picks?|chooses?|trains? with|falls? back to|selects?|dispatch(?:es)? to)\b[^.;]{0,50}?"
    + BACKEND)


def auto_descriptions(text: str) -> list[str]:
    """Hand-written sentences of ``text`` that say which backend ``auto`` runs (the rule's one home is
    ``describe_auto``)."""
    return [s[:140] for s in _sentences(text) if AUTO_CLAIM.search(s)]


def _library_sources() -> list[Path]:
    return sorted(p for p in (ROOT / PKG).rglob("*.py") if "golden" not in p.parts)


# Known failures in library files another change owns, "<file> | <start of the sentence>": the fix they need. The
# test fails when a listed item no longer fails: remove it then.
EXPECTED_AUTO: dict[str, str] = {}


def test_no_hand_written_description_of_auto():
    texts = _prose_texts() + [(str(p.relative_to(ROOT)), _comments_and_docstrings(p.read_text()))
                              for p in _library_sources() if p.name != "backends.py"]
    found = [(where, s) for where, text in texts for s in auto_descriptions(text)]

    def listed(where: str, sentence: str) -> bool:
        return any(k == f"{where} | {sentence[:len(k) - len(where) - 3]}" for k in EXPECTED_AUTO)

    fixed = [k for k in EXPECTED_AUTO if not any(listed(w, s) and k.startswith(w + " | ") for w, s in found)]
    found = [f"{w}: {s}" for w, s in found if not listed(w, s)]
    assert not fixed, "listed in EXPECTED_AUTO but no longer failing, remove them:\n" + "\n".join(fixed)
    assert not found, ("say what `auto` runs by printing `describe_auto` (or pointing to where it is printed), "
                       "not by hand:\n" + "\n".join(found))


def test_a_hand_written_auto_rule_is_found():
    assert auto_descriptions('On a CPU `auto` trains with `sdpa_padded`.')
    assert auto_descriptions('A C++ compiler lets `backend="auto"` run the fused kernel; without one it uses '
                             '`sdpa_padded`.') or auto_descriptions('`backend="auto"` runs `naive` on a CPU.')
    assert auto_descriptions('For float32 inference, `auto` runs `cpu_fused`: naive\'s FLOPs.')
    assert not auto_descriptions("Which backend `auto` runs for which call is the rule `describe_auto` prints.")


# ---------------------------------------------------------------------------------------------------------------
# 3. library names
# ---------------------------------------------------------------------------------------------------------------

NAME = re.compile(r"(?::(?:func|class|meth|data|attr|mod|exc):`~?|``?)"
                  r"(?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\([^`\n]*\))?``?")


NOT_NAMES = {"cpu.max": "the cgroup v2 file of a CPU quota, not the kernels.cpu package"}


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Names a class sets on its instances (``self.x = ...``) or declares in its body (dataclass fields)."""
    out = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
            elif isinstance(t, ast.Name) and node in cls.body:
                out.add(t.id)
    return out


@functools.lru_cache(maxsize=None)
def _index() -> tuple[dict[str, list[str]], dict[str, list[str]], dict[str, set[str]]]:
    """(module short name -> full names, public class name -> defining modules, class name -> instance attributes)
    for the whole library."""
    pkg = importlib.import_module(PKG)
    mods: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    attrs: dict[str, set[str]] = {}
    for info in pkgutil.walk_packages(pkg.__path__, PKG + "."):
        if ".golden" in info.name:
            continue
        mods.setdefault(info.name.rsplit(".", 1)[1], []).append(info.name)
        path = ROOT / (info.name.replace(".", "/") + ("/__init__.py" if info.ispkg else ".py"))
        if path.exists():
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef):
                    attrs.setdefault(node.name, set()).update(_instance_attributes(node))
                    if not node.name.startswith("_"):
                        classes.setdefault(node.name, []).append(info.name)
    return mods, classes, attrs


def _external(dotted: str) -> bool:
    """Whether ``dotted`` names an object of an installed package other than this one (``triton.testing``)."""
    top = dotted.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None or (spec.origin and str(ROOT) in spec.origin):
        return False
    return _attr_path(importlib.import_module(top), dotted.split(".")[1:])


def _attr_path(obj, names: list[str]) -> bool:
    for name in names:
        if hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        try:
            obj = importlib.import_module(f"{obj.__name__}.{name}")
        except (ImportError, AttributeError, TypeError):
            return False
    return True


def resolves(dotted: str) -> bool | None:
    """True if ``dotted`` names an object of the library, False if it names the library but nothing in it, None if
    it does not name the library at all (``torch.compile``)."""
    mods, classes, attrs = _index()
    if dotted in NOT_NAMES:
        return None
    parts = dotted.split(".")
    first = parts[0]
    if parts[0] == PKG:
        parts = parts[1:]
        starts = [PKG]
    elif parts[0] in mods:
        starts = mods[parts[0]]
        parts = parts[1:]
    elif parts[0] in classes:
        starts = [f"{m}:{parts[0]}" for m in classes[parts[0]]]
        parts = parts[1:]
    else:
        return None
    for start in starts:
        module, _, cls = start.partition(":")
        obj = importlib.import_module(module)
        if cls:
            obj = getattr(obj, cls)
        if _attr_path(obj, parts):
            return True
        if cls and len(parts) == 1 and parts[0] in attrs.get(cls, set()):
            return True  # an instance attribute: `TinyLM.blocks`
    if first != PKG and first not in classes:
        if _external(dotted):
            return None  # another package of that name: `triton.testing.do_bench`
        if len(parts) == 1 and any(parts[0] in a for a in attrs.values()):
            return None  # a variable named like a module, and an attribute of a library object: `model.blocks`
    return False


def broken_library_names(text: str) -> list[str]:
    return sorted({m.group("dotted") for m in NAME.finditer(text)
                   if not re.search(r"\.(?:jsonl?|py|ipynb|md|pt|txt|csv|cpp|toml|cfg|yml)$", m.group("dotted"))
                   and resolves(m.group("dotted")) is False})


def test_every_library_name_in_prose_exists():
    texts = _prose_texts() + [(str(p.relative_to(ROOT)), _comments_and_docstrings(p.read_text()))
                              for p in _library_sources()]
    found = [f"{where}: {name}" for where, text in texts for name in broken_library_names(text)]
    assert not found, "names the library does not have (renamed or moved?):\n" + "\n".join(found)


def test_a_wrong_library_name_is_found():
    assert broken_library_names("(`bench.peak_extra_memory`)") == []  # `bench` names nothing of the library
    assert broken_library_names("(`timing.peak_extra_memory`, ``timing.no_such_helper``)") == \
        ["timing.no_such_helper"]
    assert broken_library_names(":func:`diffattn_tutorial.functional.diff_attention` and "
                                "`kernels.triton.aot.Facts.problems`, `aot.Facts.nothing`") == ["aot.Facts.nothing"]
    assert broken_library_names("`TinyLM.generate`, `TinyLM.no_such_method(x)`, `torch.compile`") == \
        ["TinyLM.no_such_method"]


# ---------------------------------------------------------------------------------------------------------------
# 4. exercises do not give the answer
# ---------------------------------------------------------------------------------------------------------------

TASK = re.compile(r"^# TASK (\d+)", re.MULTILINE)
CHECK = re.compile(r"^# CHECK (\d+)", re.MULTILINE)


def _norm(code: str) -> str:
    return re.sub(r"\s+", "", code)


def _task_parts(source: str) -> tuple[str, list[str], str]:
    """(given code, stub lines, answer code) of a solution's task cell (``tools/make_exercises.py``'s markers)."""
    given, stubs, answer, in_answer = [], [], [], False
    for line in source.splitlines():
        stripped = line.strip()
        if stripped.startswith("# STUB:"):
            stubs.append(stripped[len("# STUB:"):].strip())
            in_answer = True
        elif stripped.startswith("# END TASK"):
            in_answer = False
        elif in_answer:
            answer.append(line.split("  #", 1)[0] if not stripped.startswith("#") else "")
        else:
            given.append(line)
    return "\n".join(given), stubs, "\n".join(answer)


def key_expressions(answer: str, given: str) -> set[str]:
    """The answer's lines and sub-expressions of at least 12 characters (whitespace removed) that the given code
    does not hold: what a learner should write, not read."""
    keys = {_norm(line) for line in answer.splitlines() if len(_norm(line)) >= 12}
    try:
        tree = ast.parse(re.sub(r"^\s+", "", answer, flags=re.MULTILINE))
    except SyntaxError:
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, (ast.BinOp, ast.Compare, ast.Call, ast.Subscript, ast.BoolOp)):
                seg = _norm(ast.unparse(node))
                if len(seg) >= 12:
                    keys.add(seg)
    keys = {k for k in keys if not k.startswith(("return", "raise"))} | \
           {k[len("return"):] for k in keys if k.startswith("return") and len(k) >= 18}
    return {k for k in keys if k not in _norm(given)}


def answer_leaks(cells: list[dict]) -> list[str]:
    """For every task of a solution: key expressions found in its stub or in the text from the task's heading (the
    last markdown cell before the task cell) to its check cell."""
    leaks = []
    for i, cell in enumerate(cells):
        m = TASK.search(_src(cell)) if cell["cell_type"] == "code" else None
        if not m:
            continue
        given, stubs, answer = _task_parts(_src(cell))
        start = max((j for j in range(i) if cells[j]["cell_type"] == "markdown"), default=i)
        end = next((j for j in range(i, len(cells)) if CHECK.search(_src(cells[j])) and cells[j]["cell_type"] == "code"
                    and CHECK.search(_src(cells[j])).group(1) == m.group(1)), i)
        shown = [_src(cells[j]) for j in range(start, end) if j != i] + stubs
        shown_code = _norm("\n".join(re.sub(r"```.*?```", " ", s, flags=re.DOTALL) for s in shown))
        fenced = "\n".join(b for s in shown for b in re.findall(r"```.*?```", s, flags=re.DOTALL))
        keys = key_expressions(answer, given + "\n" + fenced)
        hits = [k for k in keys if k in shown_code]
        leaks += [f"task {m.group(1)}: {k}" for k in sorted(hits) if not any(k != h and k in h for h in hits)]
        if fenced and answer.strip():  # a code block that shows the answer itself
            lines = [_norm(x) for x in answer.splitlines() if len(_norm(x)) >= 12]
            shown_lines = [x for x in lines if x in _norm(fenced)]
            if lines and len(shown_lines) == len(lines):
                leaks.append(f"task {m.group(1)}: every answer line is shown in a code block before the check")
    return leaks


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_no_exercise_gives_its_answer_before_its_check(path):
    leaks = answer_leaks(_cells(path))
    assert not leaks, f"{path.name}: the stub or the text before the check holds the answer:\n" + "\n".join(leaks)


def test_an_answer_in_the_stub_or_the_text_is_found():
    md = {"cell_type": "markdown", "source": ["## Task 1\nCompute the gain, `(gain_plus + gain_minus) / 2`.\n"]}
    task = {"cell_type": "code", "source": [
        "# TASK 1: gain\n", "def f(gain_plus, gain_minus):\n", "    # STUB: raise NotImplementedError('x')\n",
        "    return (gain_plus + gain_minus) / 2\n", "    # END TASK\n"]}
    check = {"cell_type": "code", "source": ["# CHECK 1\n", "check(f)\n"]}
    assert answer_leaks([md, task, check]) == ["task 1: (gain_plus+gain_minus)/2"]
    md_ok = {"cell_type": "markdown", "source": ["## Task 1\nCompute the mean gain.\n"]}
    assert answer_leaks([md_ok, task, check]) == []
    task_hint = {**task, "source": [task["source"][0], task["source"][1],
                                    "    # STUB: raise NotImplementedError('(gain_plus + gain_minus) / 2')\n",
                                    *task["source"][3:]]}
    assert answer_leaks([md_ok, task_hint, check]) == ["task 1: (gain_plus+gain_minus)/2"]


# ---------------------------------------------------------------------------------------------------------------
# 5. claims about the paper and other projects carry their source
# ---------------------------------------------------------------------------------------------------------------

OTHERS = r"(?<![\w`])(?:the paper|the authors|Ye et al\.?|PyTorch(?:'s)?(?: own)?(?: notes| documentation| release notes)?|" \
         r"FlashAttention(?:-\d)?|cuDNN|unilm|timm|Hugging Face|DiffLlama|axonml|vasqu|flash-attn|Megatron)"
CLAIM = re.compile(OTHERS + r"[^.;,]{0,30}?\b(?:reports?|reported|says|states|measures?|measured|compares?|"
                   r"recommends?|finds|found|notes)\b(?<!not measured)", re.IGNORECASE)
CITED = re.compile(r"\bSection\s+\d|\bSec\.\s*\d|\bTables?\s+\d|\bFigure\s+\d|\bFig\.\s*\d|\bEq(?:uation|\.)\s*\(?\d|"
                   r"\barXiv\b|\]\(https?://|https?://|#\d{2,}|\bPR\s*#?\d|\bissue\s*#?\d|`[\w/.-]+\.(?:py|md|cpp|cu)`|"
                   r"\bAppendix\s+[A-Z\d]", re.IGNORECASE)


def uncited_claims(text: str) -> list[str]:
    """Sentences of ``text`` that say what the paper or another project reports without saying where."""
    return [s[:140] for s in _sentences(_running_text(text)) if CLAIM.search(s) and not CITED.search(s)]


def _docstrings_and_comments(source: str) -> str:
    """A module's docstrings and comments, each its own paragraph (messages and other strings left out)."""
    tree = ast.parse(source)
    docs = [ast.get_docstring(n) or "" for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    comments = [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    return "\n\n".join(docs + comments)


# Known failures in library files another change owns, "<file> | <start of the sentence>": the fix they need.
EXPECTED_CLAIMS = {
    "diffattn_tutorial/training/study.py | Train a :class:`~diffattn_tutorial.training.model.TinyLM` on the multi-n":
        "name what the paper measures: Tables 2, 3 and 5 of arXiv 2410.05258",
}


def test_claims_about_the_paper_and_other_projects_name_their_source():
    texts = _prose_texts() + [(str(p.relative_to(ROOT)), _docstrings_and_comments(p.read_text()))
                              for p in _library_sources()]
    found = {f"{where.split(' cell ')[0]} | {s[:70]}": f"{where}: {s}" for where, text in texts
             for s in uncited_claims(text)}
    fixed = [k for k in EXPECTED_CLAIMS if not any(f.startswith(k) or k.startswith(f) for f in found)]
    assert not fixed, "listed in EXPECTED_CLAIMS but no longer failing, remove them:\n" + "\n".join(fixed)
    found = [v for k, v in found.items() if not any(k.startswith(e) or e.startswith(k) for e in EXPECTED_CLAIMS)]
    assert not found, ("a claim about the paper or another project without its section, table, link or issue:\n"
                       + "\n".join(found))


def test_an_uncited_claim_is_found():
    assert uncited_claims("On an H100 cuDNN attention is reported 1.7 to 2.3 times faster (PyTorch's own notes).")
    assert uncited_claims("The paper reports the shares of this map as they are.")
    assert not uncited_claims("The paper's Section 3.4 compares normalized attention scores.")
    assert not uncited_claims("PyTorch's release notes report a speed-up ([blog](https://pytorch.org/blog/x/)).")


# ---------------------------------------------------------------------------------------------------------------
# 6. one speed-up: a ratio of medians
# ---------------------------------------------------------------------------------------------------------------

PER_ROUND_MEDIAN = re.compile(r"median\(\s*\[?[^()\]]*?/[^()\]]*?\bfor\b[^()\]]*?\bzip\(", re.DOTALL)
RATIO_LIST_MEDIAN = re.compile(r"\b(?P<name>\w+)\s*=\s*\[[^\]]*?/[^\]]*?\bfor\b[^\]]*?\bzip\(.*?\][\s\S]*?"
                               r"median\(\s*(?P=name)\s*\)")


def per_round_ratio_medians(source: str) -> list[str]:
    return [m.group(0)[:100] for pattern in (PER_ROUND_MEDIAN, RATIO_LIST_MEDIAN) for m in pattern.finditer(source)]


def test_every_speedup_is_a_ratio_of_medians():
    sources = [(p.name, p.read_text()) for p in sorted((ROOT / "benchmarks").glob("*.py"))]
    sources += [(p.name, p.read_text()) for p in sorted((ROOT / "tools").glob("*.py"))]
    sources += [(f"{p.parent.name}/{p.name}", "\n".join(_src(c) for c in _cells(p) if c["cell_type"] == "code"))
                for p in PAGES]
    sources += [(str(p.relative_to(ROOT)), p.read_text()) for p in _library_sources()]
    found = [f"{name}: {hit}" for name, text in sources for hit in per_round_ratio_medians(text)]
    assert not found, "a median of per-round ratios; the project's speed-up is a ratio of medians:\n" + \
        "\n".join(found)


def test_a_median_of_ratios_is_found():
    assert per_round_ratio_medians("r = statistics.median(b / t for b, t in zip(base, ts))")
    assert per_round_ratio_medians("ratios = [b / t for b, t in zip(base, ts)]\nx = statistics.median(ratios)")
    assert not per_round_ratio_medians("ratios = [b / t for b, t in zip(base, ts)]\nlo = min(ratios)\n"
                                       "x = statistics.median(base) / statistics.median(ts)")
