"""Write the README's measured tables and figures from the files that hold them: one source per fact.

    python tools/make_readme_tables.py            # rewrite every generated block of README.md
    python tools/make_readme_tables.py --check    # exit 1, naming each block, if README.md differs

A generated block is the text between ``<!-- generated:NAME -->`` and ``<!-- /generated -->`` in ``README.md``;
everything outside the markers is hand-written and left alone. The blocks and their sources:

* ``install``: the CPU build of torch, pinned to the version ``.ci/run`` tests with;
* ``cpu-table``: ``benchmarks/results_cpu_auto_<cpu>.json`` and its ``_loaded`` twin (``bench_cpu_auto.py``):
  median time, speed-up, peak extra memory of every library backend, idle and with one other process running,
  and the multiply-adds of each formulation relative to naive's (``flops.formulation_flops``);
* ``busy-cpu``: ``benchmarks/results_busy_cpu_<cpu>.json`` (``bench_busy_cpu.py``): training steps idle and loaded;
* ``mutation``: ``diffattn_tutorial/recorded/mutation.json`` (``python tools/mutation.py --record``);
* ``compile-facts``: ``diffattn_tutorial/recorded/compile_facts.json`` (``kernels.triton.aot --write``), per target,
  and against it the sm_90a compiles of the Triton the recorded GPU sessions ran
  (``compile_facts_sm90a_triton-<version>.json``, ``kernels.triton.aot --json`` under that Triton);
* ``layout``: the Layout table, listing the library's modules, the benchmark scripts and the tools as they are;
* ``needs``: which notebooks have GPU cells and which run Triton, read from the notebooks' own code cells;
* ``gpu``: ``diffattn_tutorial/recorded/gpu_session_<device>.json`` and ``bench_triton_<device>.json``
  (``benchmarks/gpu_session.py --collect``): each step's outcome, the Triton kernel against the best SDPA
  formulation, the speed goals; "not yet measured" where no GPU session is recorded.

**Speed-up** has one definition, stated once in the README next to the CPU table: the median time of ``naive``
over the median time of the backend, both over the same rounds of the same run (``diffattn-tutorial bench``
computes it the same way). Every ratio of times this tool writes is a ratio of medians. Each block names the
device, the versions, the date and the command of the file it comes from; a value the file does not hold is
written "not recorded". ``tests/test_readme_tables.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
README = ROOT / "README.md"
BENCH = ROOT / "benchmarks"
RECORDED = ROOT / "diffattn_tutorial" / "recorded"
COMPILE_FACTS = RECORDED / "compile_facts.json"
MUTATION = RECORDED / "mutation.json"
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.DOTALL)
NOT_RECORDED = "not recorded"


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _command(data: dict) -> str:
    return f"`{data['command']}`" if data.get("command") else f"command {NOT_RECORDED}"


def _date(data: dict) -> str:
    """The run's date, or "commit date X (run date not recorded)" where the file's provenance says so."""
    date = data.get("date", NOT_RECORDED)
    if "run date itself was not recorded" in data.get("provenance", ""):
        return f"commit date {date} (run date not recorded)"
    return date


def _processor(data: dict) -> str:
    """", processor NAME" for a CPU file that records it, ", processor not recorded" for one that does not."""
    if not str(data.get("device", "")).startswith("CPU"):
        return ""
    cpu = data.get("cpu")
    name = (cpu.get("name") if isinstance(cpu, dict) else cpu) if cpu else None
    return f", processor {name}" if name else f", processor {NOT_RECORDED}"


def _provenance(data: dict) -> str:
    """Device, processor (CPU files), versions, date and command of a results file, "not recorded" where it holds
    none."""
    return (f"{data.get('device', NOT_RECORDED)}{_processor(data)}, torch {data.get('torch', NOT_RECORDED)}, Python "
            f"{data.get('python', NOT_RECORDED)}, {_date(data)}, {_command(data)}")


def _sci(x: float) -> str:
    """1.2e-7, not 1.2e-07."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def speedup(reference: list[float], times: list[float]) -> float:
    """The project's one definition: the reference's median time over the backend's median time."""
    return statistics.median(reference) / statistics.median(times)


# --- install ----------------------------------------------------------------------------------------------------


def torch_pin() -> str:
    """The torch version ``.ci/run`` installs (``torch==X``)."""
    m = re.search(r"\btorch==([\w.+-]+)", (ROOT / ".ci" / "run").read_text())
    if not m:
        raise SystemExit(".ci/run installs no pinned torch (torch==X): nothing to pin the README to")
    return m.group(1)


def install_block() -> str:
    return ("```bash\n"
            "python -m venv .venv && . .venv/bin/activate      # or: conda env create -f environment.yml\n"
            f"pip install torch=={torch_pin()} --index-url https://download.pytorch.org/whl/cpu"
            "   # CPU-only machines; skip with a GPU\n"
            "```\n")


# --- the CPU table ----------------------------------------------------------------------------------------------


def _library_backends() -> tuple[str, ...]:
    from diffattn_tutorial.functional import BACKENDS

    return (*BACKENDS, "auto")


def _relative_flops() -> dict[str, float]:
    from diffattn_tutorial.measure import flops

    out = {}
    for name in _library_backends():
        try:
            out[name] = flops.formulation_flops(name, 1, 1, 1, 1) / flops.formulation_flops("naive", 1, 1, 1, 1)
        except ValueError:
            pass  # a backend with no fixed formulation (auto, sdpa, cpu_fused)
    return out


def _fmt_x(x: float) -> str:
    return f"{x:.2f}x"


def cpu_table_block() -> str:
    idle_files = sorted(p for p in BENCH.glob("results_cpu_auto_*.json") if not p.stem.endswith("_loaded"))
    if not idle_files:
        raise SystemExit("no benchmarks/results_cpu_auto_*.json: run python benchmarks/bench_cpu_auto.py")
    return "\n".join(_cpu_table(p, p.with_name(f"{p.stem}_loaded.json")) for p in idle_files)


def _remeasured(data: dict) -> str:
    """The note of a results file whose memory column was measured again after its timed run."""
    again = data.get("peak_extra_bytes_remeasured")
    return (f" (measured again on {again['date']}, apart from the times: {again['why']})" if again else "")


def _cpu_table(idle_path: Path, loaded_path: Path) -> str:
    idle = _load(idle_path)
    loaded = _load(loaded_path) if loaded_path.exists() else None
    names = [n for n in _library_backends() if n in idle["times_s"]]
    t, mem, err = idle["times_s"], idle["peak_extra_bytes"], idle["max_abs_err"]
    rounds = len(t["naive"])
    files = f"`{_rel(idle_path)}`" + (f" and `{_rel(loaded_path)}`" if loaded else "")
    lines = [
        f"From {files}: {_provenance(idle)}" + (f"; loaded: {_provenance(loaded)}" if loaded else "") + ". "
        f"B=1, H=8, N={idle['n']}, d=64, float32, {'causal' if idle['causal'] else 'non-causal'}, inference; ms is the "
        f"median over {rounds} rounds" + (f" ({len(loaded['times_s']['naive'])} loaded)" if loaded else "") +
        ", peak extra memory that of a fresh process, output included" + _remeasured(idle) + ".",
        "",
        "| backend | ms | speed-up | peak extra MiB | memory vs naive |"
        + (" loaded: ms | loaded: speed-up |" if loaded else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if loaded else ""),
    ]
    for name in names:
        row = (f"| {name} | {statistics.median(t[name]) * 1e3:.1f} | {_fmt_x(speedup(t['naive'], t[name]))} "
               f"| {mem[name] / 2**20:.1f} | {mem[name] / mem['naive']:.3f} |")
        if loaded:
            lt = loaded["times_s"]
            row += f" {statistics.median(lt[name]) * 1e3:.1f} | {_fmt_x(speedup(lt['naive'], lt[name]))} |"
        lines.append(row)
    worst = max(err[n] for n in names)
    spread = f"naive took {min(t['naive']) * 1e3:.0f} to {max(t['naive']) * 1e3:.0f} ms over the idle rounds"
    if loaded:
        lt = loaded["times_s"]
        spread += f" and {min(lt['naive']) * 1e3:.0f} to {max(lt['naive']) * 1e3:.0f} ms over the loaded ones"
    rel = _relative_flops()
    by_factor: dict[float, list[str]] = {}
    for name in names:
        if name in rel:
            by_factor.setdefault(rel[name], []).append(f"`{name}`")
    work = "; ".join(f"{', '.join(ns)}: {f:g}x" for f, ns in sorted(by_factor.items()))
    lines += ["", f"All outputs agree with `naive` to {_sci(worst)} or better; {spread}. Multiply-adds relative to "
                  f"`naive`'s (`flops.formulation_flops`): {work}."]
    if loaded:
        lt = loaded["times_s"]
        sdpa = [n for n in names if n.startswith("sdpa_")]
        best = min(sdpa, key=lambda n: statistics.median(lt[n]))
        if "cpu_fused" in names:
            lines[-1] += (f" Loaded, `cpu_fused` is {_fmt_x(speedup(lt[best], lt['cpu_fused']))} as fast as the "
                          f"fastest SDPA formulation, `{best}`.")
    return "\n".join(lines) + "\n"


# --- the busy CPU -----------------------------------------------------------------------------------------------


def busy_cpu_block() -> str:
    paths = sorted(BENCH.glob("results_busy_cpu_*.json"))
    if not paths:
        raise SystemExit("no benchmarks/results_busy_cpu_*.json: run python benchmarks/bench_busy_cpu.py")
    return "\n".join(_busy(p) for p in paths)


def _busy(path: Path) -> str:
    data = _load(path)
    rounds = data["rounds"]

    def times(phase: str, key: str) -> list[float]:
        return [r[phase]["seconds"][key] for r in rounds]

    def figures(policy: str) -> tuple[float, float]:
        diff_loaded = times("loaded", f"diff | {policy}")
        return (speedup(diff_loaded, times("idle", f"diff | {policy}")),
                speedup(diff_loaded, times("loaded", f"baseline | {policy}")))

    own, default = figures("recommended"), figures("torch default")
    per_round = [lo / hi for lo, hi in zip(times("loaded", "diff | recommended"), times("idle", "diff | recommended"))]
    return (f"With the recommended threads, DIFF's loaded step takes {_fmt_x(own[0])} its idle step and "
            f"{_fmt_x(own[1])} the baseline's loaded step (torch's default threads: {_fmt_x(default[0])} and "
            f"{_fmt_x(default[1])}): medians over {len(rounds)} rounds of {data['steps']} steps, from "
            f"`{_rel(path)}` ({_provenance(data)}); round by round, the first ratio ran from "
            f"{_fmt_x(min(per_round))} to {_fmt_x(max(per_round))} in this one run. The idle rounds are idle of this "
            f"benchmark's load only: the machine's load average was {_load_average(data)} when the run began.\n")


def _load_average(data: dict) -> str:
    load = data.get("load_average_before")
    return " / ".join(f"{x:.2f}" for x in load) + " (1, 5, 15 min)" if load else NOT_RECORDED


# --- the mutation test ------------------------------------------------------------------------------------------


def mutation_block() -> str:
    data = _load(MUTATION)
    t = data["total"]
    path = MUTATION
    return (f"**Mutation score.** The checks fail on {t['caught']} of {t['mutants']} ({t['caught'] / t['mutants']:.1%}; {t['hint']} of "
            f"them with a named hint, {t['generic']} with the generic \"differs from the reference\", {t['crash']} "
            f"by a crash). The {t['survived']} survivors are listed in the test, each argued equivalent. Recorded in "
            f"`{_rel(path)}` ({_provenance(data)}{'; ' + data['note'] if data.get('note') else ''}); the test fails "
            f"when a run's counts differ from it.\n")


# --- compile facts ----------------------------------------------------------------------------------------------


def compile_facts_block() -> str:
    path = COMPILE_FACTS
    data = _load(path)
    rec = data.get("recorded", {})
    facts = data["facts"]
    command = _command(rec if rec.get("command") else data)
    if "diffattn_tutorial.triton_compile" in command:  # recorded before the module moved
        command += " (the module's name then; now `python -m diffattn_tutorial.kernels.triton.aot`)"
    lines = [f"From `{_rel(path)}`: triton {rec.get('triton', NOT_RECORDED)}, torch {rec.get('torch', NOT_RECORDED)}, "
             f"Python {rec.get('python', NOT_RECORDED)}, {rec.get('date', NOT_RECORDED)}, "
             f"{command}; compiled on a CPU for each target, not run on one.",
             "",
             "| target | compiles | failed | with register spills | most registers per thread | tensor-core products "
             "| compiles with a product computed more than once | with TMA loads (`cp.async.bulk.tensor`) |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    archs = list(dict.fromkeys(f["arch"] for f in facts))
    for arch in archs:
        rows = [f for f in facts if f["arch"] == arch]
        spills = sum(bool(f.get("spill_stores") or f.get("spill_loads")) for f in rows)
        with_dots = [f for f in rows if f.get("dots")]
        instr = Counter("wgmma" if f.get("wgmma") else "mma_sync" if f.get("mma_sync") else "none" for f in with_dots)
        instr_text = ", ".join(f"{k} in {v}" for k, v in instr.most_common()) + f" of {len(with_dots)} with products"
        dup = sum((f.get("dup") or 1) > 1 for f in rows)
        tma = sum(bool(f.get("tma_loads")) for f in rows)
        lines.append(f"| {arch} | {len(rows)} | {sum(bool(f.get('error')) for f in rows)} | {spills} "
                     f"| {max(f.get('regs') or 0 for f in rows)} | {instr_text} | {dup} | {tma} |")
    return "\n".join(lines) + "\n" + _duplicated_products(facts) + _other_triton(facts, rec.get("triton"),
                                                                                    record_hash=rec.get("source_hash"))


def _by_launch(facts: list[dict]) -> dict[tuple, dict]:
    """Compiles keyed by kernel, form, case, tile, warps, stages and TMA, then the launch's place among those alike
    and how many they are (a launch per map at d = 128 gives two of each; every run lists the launches in the same
    order, so two files pair a configuration's launches in order only where both hold as many of them)."""
    key = lambda f: (f["kernel"], f.get("form"), f["case"], f["block_m"], f["block_n"],  # noqa: E731
                     f["num_warps"], f["num_stages"], bool(f.get("tma")))
    alike, seen = Counter(key(f) for f in facts), Counter()
    out = {}
    for f in facts:
        k = key(f)
        out[k + (seen[k], alike[k])] = f
        seen[k] += 1
    return out


def _fact_name(f: dict, launch: tuple = (0, 1)) -> str:
    """A compile in words; ``launch`` (its place, how many alike) names which of several alike it is."""
    place, alike = launch
    return (f"`{f['kernel']}` ({f.get('form')}) {f['block_m']}x{f['block_n']} w{f['num_warps']} s{f['num_stages']}"
            f"{' TMA' if f.get('tma') else ''} [{f['case']}]" + (f" (launch {place + 1} of {alike})" * (alike > 1)))


def _other_triton(facts: list[dict], record_triton: str, folder: Path = RECORDED, *,
                  record_hash: str | None = None) -> str:
    """One paragraph per Triton version the recorded GPU sessions ran, when the record is another's: its sm_90a
    compiles (``compile_facts_sm90a_triton-<version>.json``) against the record's, matched by kernel, form, case,
    tile, warps, stages and TMA; or the sentence that no such compile is recorded. With ``record_hash`` (the
    record's kernel source hash, the same under every Triton), a file compiled from another source is called stale."""
    from diffattn_tutorial.measure import gpu

    ran = {d["recorded"].get("triton") for _, d in gpu.find_recorded("gpu_session", None, folder)}
    versions = sorted(ran - {None, record_triton})
    ours = _by_launch([f for f in facts if f["arch"] == "sm_90a"])
    parts = []
    for version in versions:
        path = folder / f"compile_facts_sm90a_triton-{version}.json"
        if not path.exists():
            parts.append(f"The recorded GPU sessions ran Triton {version}; no sm_90a compile with it is recorded.")
            continue
        data = _load(path)
        rec = data["recorded"]
        theirs = _by_launch(data["facts"])
        both = [k for k in ours if k in theirs]
        regs = [theirs[k]["regs"] - ours[k]["regs"] for k in both]
        spill = lambda f: bool(f.get("spill_stores") or f.get("spill_loads"))  # noqa: E731
        newly = [k for k in both if spill(theirs[k]) and not spill(ours[k])]
        gone = [k for k in both if spill(ours[k]) and not spill(theirs[k])]
        changed = sum(spill(theirs[k]) and spill(ours[k]) and theirs[k]["spill_stores"] != ours[k]["spill_stores"]
                      for k in both)
        parts.append(
            f"The recorded GPU sessions ran Triton {version}. `{_rel(path)}` ({rec.get('date', NOT_RECORDED)}, "
            f"{_command(rec)}, kernel source hash {rec.get('source_hash', NOT_RECORDED)}"
            + _same_source(rec.get("source_hash"), record_hash) + f") compiles sm_90a's cases with it: {len(both)} of the {len(ours)} sm_90a compiles above have a "
            f"counterpart there (the same launch: kernel, form, case, tile, warps, stages, TMA, and its place among "
            f"as many launches alike)"
            + (f"; {len(theirs) - len(both)} compiles there have none here" if len(theirs) > len(both) else "")
            + f". Registers per thread differ "
            f"in {sum(r != 0 for r in regs)} of them" + (f" ({min(regs):+d} to {max(regs):+d})" if regs else "") + "; "
            + f"{sum(spill(theirs[k]) for k in both)} spill there against {sum(spill(ours[k]) for k in both)} here. "
            f"Clean here, spilling there ({len(newly)}): "
            + ("; ".join(f"{_fact_name(theirs[k], k[-2:])} {theirs[k]['spill_stores']} B stored" for k in newly)
               or "none")
            + f". Spilling here, clean there ({len(gone)}): "
            + ("; ".join(f"{_fact_name(ours[k], k[-2:])} {ours[k]['spill_stores']} B stored here" for k in gone)
               or "none")
            + f". Spilling in both, by a different amount: {changed}. A GPU session measures the code its own Triton "
            f"compiles.")
    return "".join(f"\n{p}\n" for p in parts)


def _same_source(theirs: str | None, ours: str | None) -> str:
    if ours is None:
        return ""
    if theirs == ours:
        return ", the record's"
    return (f", not the record's {ours}: compiled from another kernel source, so what follows is stale until it is "
            f"compiled again as CONTRIBUTING says")


def _duplicated_products(facts: list[dict]) -> str:
    """One sentence on the compiles that compute a product more than once: which kernel and configuration, and
    where ``kernels.triton.aot.Facts.problems`` counts it as a problem (sm_90a only: warpgroups over one row block)."""
    dup = [f for f in facts if (f.get("dup") or 1) > 1]
    if not dup:
        return "\nNo compile computes a product more than once.\n"
    kinds = Counter((f["kernel"], f.get("form"), f.get("head_dim"), f["block_m"], f["num_warps"]) for f in dup)
    what = "; ".join(f"`{k}`{f' (form {form})' if form else ''}, d {d}, block_m {m}, {w} warps"
                     for (k, form, d, m, w) in sorted(kinds, key=str))
    archs = ", ".join(dict.fromkeys(f["arch"] for f in dup))
    flagged = sum(f["arch"] == "sm_90a" for f in dup)
    return (f"\nThe {len(dup)} compiles with a product computed more than once ({archs}) are all one configuration: {what}. "
            f"`kernels.triton.aot.Facts.problems` counts a product computed twice as a problem on sm_90a only "
            f"(warpgroups over the same rows), where there are {flagged}.\n")


# --- which notebooks need a GPU or Triton -----------------------------------------------------------------------

GPU_CELL = re.compile(r"^\s*(?:el)?if\b[^\n]*(?:\bGPU\b|torch\.cuda\.is_available\(\)|device\.type\s*==\s*[\"']cuda)|"
                      r"^\s*GPU\s*=", re.MULTILINE)
TRITON_CELL = re.compile(r"^\s*(?:import triton|from triton\b|from diffattn_tutorial\.kernels\.triton\b)|"
                         r"backend=[\"']triton[\"']", re.MULTILINE)


def _code_without_comments(source: str) -> str:
    return "\n".join(line.split("#", 1)[0] if not line.lstrip().startswith("#") else "" for line in source.splitlines())


def notebook_needs() -> dict[str, list[str]]:
    """``{"gpu": [...], "triton": [...]}``: the numbers of the notebooks (``notebooks/NN_*.ipynb``) with a code cell
    that branches on a GPU, and with one that runs Triton (imports it, directly or in a string a subprocess runs,
    or calls ``backend="triton"``)."""
    out: dict[str, list[str]] = {"gpu": [], "triton": []}
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        code = [_code_without_comments("".join(c["source"])) for c in json.loads(path.read_text())["cells"]
                if c["cell_type"] == "code"]
        for key, pattern in (("gpu", GPU_CELL), ("triton", TRITON_CELL)):
            if any(pattern.search(c) for c in code):
                out[key].append(path.name[:2])
    return out


def _numbers(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def needs_block() -> str:
    needs = notebook_needs()
    return (f"Every notebook runs on a CPU. Notebooks {_numbers(needs['gpu'])} have GPU cells: they run where a GPU "
            f"is present and say so where not. Notebooks {_numbers(needs['triton'])} run Triton (on a CPU in its "
            f"interpreter); without Triton their Triton cells are skipped, saying why (by `pytest`, or by the "
            f"cell itself).\n")


# --- layout -----------------------------------------------------------------------------------------------------


def _first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    line = " ".join(doc.split("\n\n")[0].split()).rstrip(".")
    return re.sub(r"``([^`]+)``", r"`\1`", line)


def _package_rows(pkg: Path) -> list[tuple[str, str]]:
    """One row per top-level module and per subpackage of the library (its docstring's first sentence and, for a
    subpackage, its modules): the package's layout, as it is."""
    rows = []
    for path in sorted(pkg.glob("*.py")):
        if path.stem != "__init__":
            rows.append((f"`diffattn_tutorial/{path.name}`", _first_line(path)))
    for sub in sorted(p for p in pkg.rglob("__init__.py") if p.parent != pkg):
        folder = sub.parent
        if folder.name in ("golden", "recorded"):
            continue  # data folders: rows of their own below
        mods = sorted(m.stem for m in folder.glob("*.py") if m.stem != "__init__")
        mods += sorted(f"{c.name}/" for c in folder.iterdir() if (c / "__init__.py").exists())
        rel = folder.relative_to(pkg.parent).as_posix()
        rows.append((f"`{rel}/`", _first_line(sub) + ((": " + ", ".join(f"`{m}`" for m in mods)) if mods else "")))
    return rows


def layout_block() -> str:
    pkg = ROOT / "diffattn_tutorial"
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    tools = sorted((ROOT / "tools").glob("*.py"))
    rows = [
        ("`notebooks/`", "the numbered series, committed with outputs"),
        *_package_rows(pkg),
        ("`exercises/`, `solutions/`", "the learner notebooks, generated from their solved sources in `solutions/` "
                                       "by `python tools/make_exercises.py` (`--check` in CI)"),
        ("`tests/`", "unit, property and conformance tests, the drift test of the prose, the architecture test "
                     "(layers, import cycles, module size, ruff), the site's build and the wheel set-up every "
                     "notebook runs under (from an empty folder, against the built wheel)"),
        ("`docs/`", "the course website: `python docs/build.py` renders the notebooks' stored outputs, the exercises "
                    "and the API reference from the docstrings (Sphinx with MyST-NB)"),
        ("`diffattn_tutorial/golden/`", "outputs of the reference implementations, read with "
                                        "`diffattn_tutorial.golden.load(name)`"),
        ("`benchmarks/`", "benchmark scripts (" + ", ".join(f"`{s}`" for s in scripts) + "), their results files "
                          "(`results_*.json`) and [notes](benchmarks/NOTES.md)"),
        ("`tools/`", "; ".join(f"`{p.name}`: {_first_line(p)}" for p in tools)),
        ("`diffattn_tutorial/recorded/`", "recorded results files (device, versions, date, command), read with "
                                          "`diffattn_tutorial.recorded.load`: "
                                          + ", ".join(f"`{p.name}`" for p in sorted(RECORDED.glob("*.json")))),
    ]
    return "| path | what lives there |\n|---|---|\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def backends_block() -> str:
    """The backend table and what ``auto`` runs, from the backend registry (``diffattn_tutorial.backends``)."""
    from diffattn_tutorial.backends import backend_table, describe_auto

    return backend_table() + "\n\n" + describe_auto("cpu") + " " + describe_auto("cuda") + "\n"


def decode_block() -> str:
    """Decoding speed per kind and KV cache (``benchmarks/bench_decode.py``), one table per results file."""
    parts = []
    for path in sorted(BENCH.glob("results_decode_*.json")):
        data = _load(path)
        new = data["config"]["new"]
        med = {name: statistics.median(t) for name, t in data["times_s"].items()}
        rows = ["| kind | recompute (eager) | dynamic (eager) | static (eager) | static (compiled) | static compiled: "
                "speed-up over recompute (ratio of medians) |", "|---|---:|---:|---:|---:|---:|"]
        for kind in ("baseline", "diff", "diff_v2"):
            ref = data["times_s"][f"{kind} cache=None eager"]
            cells = [f"{new / med[f'{kind} cache={c}']:.0f} tok/s" for c in ("None eager", "dynamic eager",
                                                                          "static eager", "static compiled")]
            rows.append(f"| {kind} | " + " | ".join(cells) + f" | {_fmt_x(speedup(ref, data['times_s'][f'{kind} cache=static compiled']))} |")
        met = sum(g["met"] for g in data["goals"])
        parts.append(f"From `{_rel(path)}`: {_provenance(data)}; {data['threads']} thread(s), "
                     f"{data['config']['prompt']}-token prompt, {new} new tokens, median of {data['config']['rounds']} "
                     f"rounds; goals met: {met} of {len(data['goals'])}.\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts)


# --- GPU sessions -----------------------------------------------------------------------------------------------


def gpu_block(folder: Path = RECORDED) -> str:
    """One paragraph and table per recorded GPU session in ``folder``, or the sentence that none is recorded."""
    from diffattn_tutorial.measure import gpu
    from diffattn_tutorial.recorded import gpu_prose

    sessions = gpu.find_recorded("gpu_session", device_type=None, folder=folder)
    if not sessions:
        return ("**GPU speed: not yet measured.** No `gpu_session_<device>.json` is recorded in "
                "`diffattn_tutorial/recorded/`.\n")
    parts = []
    for name, data in sessions:
        rec = data["recorded"]
        steps = ", ".join(f"`{step}` {s['status']} ({s['seconds']:.0f} s)" for step, s in data["steps"].items())
        parts.append(f"**Recorded on {rec.get('device', NOT_RECORDED)}** (compute capability "
                     f"{rec.get('capability', NOT_RECORDED)}, torch {rec.get('torch', NOT_RECORDED)}, CUDA "
                     f"{rec.get('cuda', NOT_RECORDED)}, Triton {rec.get('triton', NOT_RECORDED)}, "
                     f"{rec.get('date', NOT_RECORDED)}; `{_rel(folder / (name + '.json'))}`). Steps: {steps}."
                     + "".join(f" Then {gpu_prose.rerun_sentence(r)}" for r in data.get("reruns", []))
                     + ("" if data.get("reruns") else " No rerun is recorded."))
        triton = folder / (name.replace("gpu_session", "bench_triton", 1) + ".json")
        if triton.exists():
            res = _load(triton)
            goals = gpu.goals(res, n=gpu.goals_length(res))
            verdicts = "; ".join(gpu.goal_verdict(g) for g in goals)
            judged = all(g["judged"] for g in goals)
            parts.append(f"The fused kernel against the best SDPA formulation over every SDPA kernel (bf16, median ms, "
                         f"`{_rel(triton)}`):\n\n{gpu.triton_summary(res)}\n\nThe speed goals (`measure.gpu.GOALS`"
                         f"{'' if judged else f', judged on an {gpu.GOALS_DEVICE} only; informative here'}): "
                         f"{verdicts}.")
        slug = name.split("_", 2)[-1]
        parts.append(" ".join(f(slug, folder) for f in (gpu_prose.dispatch_sentence, gpu_prose.fastest_sentence,
                                                         gpu_prose.probe_sentence)))
    return "\n\n".join(parts) + "\n"


BLOCKS: dict[str, Callable[[], str]] = {
    "decode": decode_block,
    "backends": backends_block,
    "install": install_block,
    "cpu-table": cpu_table_block,
    "busy-cpu": busy_cpu_block,
    "mutation": mutation_block,
    "compile-facts": compile_facts_block,
    "layout": layout_block,
    "needs": needs_block,
    "gpu": gpu_block,
}


def render(text: str) -> str:
    """``text`` (a README) with every generated block rewritten; an unknown block name is an error."""
    found = [m.group("name") for m in BLOCK.finditer(text)]
    unknown = sorted(set(found) - set(BLOCKS))
    if unknown:
        raise SystemExit(f"README.md has generated blocks no generator writes: {unknown}; known: {sorted(BLOCKS)}")
    missing = sorted(set(BLOCKS) - set(found))
    if missing:
        raise SystemExit(f"README.md lacks the generated blocks {missing} (<!-- generated:NAME --> ... "
                         f"<!-- /generated -->)")
    return BLOCK.sub(lambda m: m.group(1) + BLOCKS[m.group("name")]() + m.group(4), text)


def stale_blocks(text: str) -> list[str]:
    """Names of the blocks whose committed text differs from what the sources give."""
    new = {m.group("name"): m.group("body") for m in BLOCK.finditer(render(text))}
    return [m.group("name") for m in BLOCK.finditer(text) if m.group("body") != new[m.group("name")]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if README.md differs from what the sources give")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args(argv)
    text = args.readme.read_text()
    if args.check:
        stale = stale_blocks(text)
        for name in stale:
            print(f"{args.readme.name}: block {name!r} differs from its source; run python tools/make_readme_tables.py")
        return 1 if stale else 0
    new = render(text)
    if new != text:
        args.readme.write_text(new)
        print(f"wrote {args.readme.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
