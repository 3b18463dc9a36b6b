"""Write the measured parts of benchmarks/NOTES.md from the files that hold them, and check its evidence.

    python tools/make_notes.py            # rewrite every generated block of benchmarks/NOTES.md
    python tools/make_notes.py --check    # exit 1 if a block differs or an evidence reference does not resolve

Blocks are marked as in the README (``<!-- generated:NAME -->`` ... ``<!-- /generated -->``):

* ``gpu``: each recorded GPU session (``diffattn_tutorial/recorded/``), through ``recorded.gpu_prose``: steps,
  reruns as what they ran, what the default dispatch's times match, the fastest formulation, the kernel's ratio,
  the probe labelled with its call path;
* ``cpu-train``: every ``benchmarks/results_cpu_train_<cpu>.json`` but the rule file: its machine facts (and which
  are missing), the ratios against each peer and the goal, met or not, for that run; the range over the files;
* ``notebook-times``: ``benchmarks/results_notebook_times_<cpu>.json``.

The hand-written rest is a log of design decisions; each names its evidence as a backticked ``path#NAME`` (a
top-level name of a Python file, or a top-level key of a JSON file) or ``path:json.path`` (keys and list indices
joined by dots). ``unresolved`` lists the references that do not resolve; ``tests/test_records_prose.py`` runs
``--check`` and plants a hand-edited number and a broken reference.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
import make_readme_tables as tables  # noqa: E402

NOTES = ROOT / "benchmarks" / "NOTES.md"
EVIDENCE = re.compile(r"`(?P<path>[\w./-]+\.(?:json|py))(?P<sep>[#:])(?P<key>[\w.\[\]-]+)`")
CASES = ("inference", "inference causal", "training step", "training step causal")


def _goal() -> float:
    m = re.search(r"^GOAL = ([\d.]+)", (ROOT / "benchmarks" / "bench_cpu_train.py").read_text(), re.MULTILINE)
    return float(m.group(1))


# --- evidence references ----------------------------------------------------------------------------------------


def resolve(path: str, sep: str, key: str, root: Path = ROOT) -> str | None:
    """None if ``path`` exists and holds ``key``; else why not."""
    file = root / path
    if not file.is_file():
        return f"{path}: no such file"
    if file.suffix == ".py":
        tree = ast.parse(file.read_text())
        names = {t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
        names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        return None if key in names else f"{path}: no top-level name {key!r}"
    node = json.loads(file.read_text())
    for part in key.split(".") if sep == ":" else [key]:
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return f"{path}: no key {key!r} (stopped at {part!r})"
    return None


def unresolved(text: str, root: Path = ROOT) -> list[str]:
    """Every evidence reference in ``text`` that does not resolve, with the reason."""
    return [why for m in EVIDENCE.finditer(text) if (why := resolve(m["path"], m["sep"], m["key"], root))]


# --- blocks -----------------------------------------------------------------------------------------------------


def gpu_block(folder: Path = tables.RECORDED) -> str:
    from diffattn_tutorial.recorded import gpu_prose as g

    slugs = g.devices(folder)
    if not slugs:
        return "No GPU run is recorded in `diffattn_tutorial/recorded/`: every GPU number is not yet measured.\n"
    out = []
    for s in slugs:
        out.append(f"- **Session.** {g.session_sentence(s, folder)}\n- **Dispatch.** {g.dispatch_sentence(s, folder)}"
                   f"\n- **Formulations.** {g.fastest_sentence(s, folder)}\n- **Kernel.** {g.kernel_sentence(s, folder)}"
                   f"\n- **Probe.** {g.probe_sentence(s, folder)}")
    return "\n\n".join(out) + "\n"


def _machine(data: dict) -> str:
    """The kernel's compiler, or which machine facts the file lacks (the processor is in the provenance)."""
    compiler = (data.get("kernel") or {}).get("compiler")
    missing = [w for w, v in (("processor", data.get("cpu")), ("compiler", compiler)) if not v]
    text = f"compiler {compiler}" if compiler else f"compiler {tables.NOT_RECORDED}"
    if missing:
        text += f" (without its {' and '.join(missing)} this file cannot be told apart from another machine's of the " \
                "same device string)"
    return text


def _ratios(data: dict) -> dict[tuple[str, str, str], float]:
    """``(N, case, peer) -> peer median / ours median`` (above 1: ours is faster)."""
    out = {}
    for n, res in data["results"].items():
        for case, times in res["times_s"].items():
            for peer in ("hf", "timm"):
                if peer in times:
                    out[(n, case, peer)] = statistics.median(times[peer]) / statistics.median(times["ours"])
    return out


def _cpu_train(path: Path, goal: float) -> tuple[str, float]:
    data = tables._load(path)
    r = _ratios(data)
    rounds = len(next(iter(data["results"].values()))["times_s"]["inference"]["ours"])
    rows = ["| N | " + " | ".join(f"{c} (hf / timm)" for c in CASES) + " |", "|---|" + "---|" * len(CASES)]
    for n in data["results"]:
        rows.append(f"| {n} | " + " | ".join(f"{r.get((n, c, 'hf'), 0):.2f}x / {r.get((n, c, 'timm'), 0):.2f}x"
                                            for c in CASES) + " |")
    low = min(r, key=r.get)
    met = sum(v >= goal for v in r.values())
    load = data.get("load_average_before")
    head = (f"From `{tables._rel(path)}`: {tables._provenance(data)}; {_machine(data)}; kernel flags "
            f"{' '.join((data.get('kernel') or {}).get('flags', [])) or tables.NOT_RECORDED}; load average "
            f"{load[0]:.2f} when it began; {rounds} rounds. Ratio: the peer's median over ours (above 1: ours is "
            f"faster); hf's calls include its rotary embedding, ours and timm's do not.")
    verdict = (f"The goal (every peer at least {goal}x ours, `bench_cpu_train.GOAL`) holds for this run in {met} of "
               f"{len(r)} comparisons; the lowest is {r[low]:.2f}x ({low[2]}, {low[1]}, N = {low[0]}).")
    return head + "\n\n" + "\n".join(rows) + "\n\n" + verdict + "\n", r[low]


def cpu_train_block() -> str:
    goal = _goal()
    paths = sorted(p for p in tables.BENCH.glob("results_cpu_train_*.json") if "_rule_" not in p.name)
    parts, lows = [], []
    for p in paths:
        text, low = _cpu_train(p, goal)
        parts.append(text)
        lows.append((low, p))
    meets = [f"`{p.name}`" for low, p in lows if low >= goal]
    summary = (f"Over these {len(lows)} recorded runs the lowest ratio ranges from {min(lows)[0]:.2f}x to "
               f"{max(lows)[0]:.2f}x: the goal holds in every comparison of "
               + (", ".join(meets) if meets else "none of them") + " only, and is a claim about that run.\n")
    return "\n".join(parts) + "\n" + summary


def notebook_times_block() -> str:
    out = []
    for p in sorted(tables.BENCH.glob("results_notebook_times_*.json")):
        data = tables._load(p)
        rows = ["| notebook | before | after |", "|---|---:|---:|"]
        rows += [f"| {r['notebook']} | {r['before']:.1f} s | {r['after']:.1f} s |" for r in data["rows"]]
        out.append(f"From `{tables._rel(p)}` ({tables._provenance(data)}), commits "
                   + ", ".join(f"{k} {v[:7]}" for k, v in (data.get("commits") or {}).items()) + ":"
                   "\n\n" + "\n".join(rows) + "\n")
    return "\n".join(out)


BLOCKS = {"gpu": gpu_block, "cpu-train": cpu_train_block, "notebook-times": notebook_times_block}


def render(text: str) -> str:
    found = {m.group("name") for m in tables.BLOCK.finditer(text)}
    if found != set(BLOCKS):
        raise SystemExit(f"NOTES.md's generated blocks are {sorted(found)}; the generator writes {sorted(BLOCKS)}")
    return tables.BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group("name")]() + m.group(4), text)


def problems(text: str, root: Path = ROOT) -> list[str]:
    """The blocks that differ from their sources, and the evidence references that do not resolve."""
    new = {m.group("name"): m.group("body") for m in tables.BLOCK.finditer(render(text))}
    stale = [f"block {m.group('name')!r} differs from its source" for m in tables.BLOCK.finditer(text)
             if m.group("body") != new[m.group("name")]]
    return stale + unresolved(text, root)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--notes", type=Path, default=NOTES)
    args = ap.parse_args(argv)
    text = args.notes.read_text()
    if args.check:
        found = problems(text)
        for p in found:
            print(f"{args.notes.name}: {p}; run python tools/make_notes.py")
        return 1 if found else 0
    new = render(text)
    if new != text:
        args.notes.write_text(new)
        print(f"wrote {args.notes.name}")
    bad = unresolved(new)
    for why in bad:
        print(f"{args.notes.name}: evidence does not resolve: {why}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
