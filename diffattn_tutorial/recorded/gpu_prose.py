"""Sentences about the recorded GPU runs, computed from the files: what the text says about a GPU comes from here.

The README's and ``benchmarks/NOTES.md``'s generated blocks (``tools/make_readme_tables.py``,
``tools/make_notes.py``) and notebooks 08 and 09 print these, so a claim about what PyTorch's default dispatch
picks, which SDPA formulation is fastest, how the fused kernel compares, what a rerun ran or what the probe measured
is never typed by hand. Each function takes the folder of the files (the package's own by default) so a test can
plant a record. Only the standard library is used: this module is a leaf of the package.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Optional

FOLDER = Path(__file__).resolve().parent
V1_SDPA = ("sdpa_wide", "sdpa_split", "sdpa_stacked")
KERNEL_WORDS = {"flash": "Flash attention", "cudnn": "cuDNN", "efficient": "Memory Efficient", "math": "Math"}
"""How PyTorch's refusal messages name each SDPA kernel (``bench_triton``'s ``backend`` names as keys)."""
KERNEL_NAMES = {"flash": "flash", "cudnn": "cuDNN", "efficient": "memory-efficient", "math": "math"}


def _load(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.exists() else None


def devices(folder: Path = FOLDER) -> list[str]:
    """The device slugs with a recorded ``gpu_session_<slug>.json``, ``bench_sdpa`` or ``bench_triton`` file."""
    slugs = {p.stem.split("_", 2)[-1] for pat in ("gpu_session_*.json", "bench_sdpa_*.json", "bench_triton_*.json")
             for p in folder.glob(pat)}
    return sorted(slugs)


def _files(slug: str, folder: Path) -> tuple[Optional[dict], Optional[dict], Optional[dict]]:
    return tuple(_load(folder / f"{kind}_{slug}.json") for kind in ("gpu_session", "bench_sdpa", "bench_triton"))


def _device(slug: str, folder: Path) -> str:
    for data in _files(slug, folder):
        if data:
            return data["recorded"]["device"]
    raise FileNotFoundError(f"no recorded GPU file for {slug!r} in {folder}")


def _pct(x: float) -> str:
    return f"{abs(x) * 100:.1f}%"


def _span(xs: list[float]) -> str:
    """The range of ``xs``' sizes as percentages, smallest first."""
    lo, hi = min(abs(x) for x in xs), max(abs(x) for x in xs)
    return _pct(lo) if _pct(lo) == _pct(hi) else f"{_pct(lo)} to {_pct(hi)}"


def dispatch_cases(slug: str, folder: Path = FOLDER) -> list[dict]:
    """Per V1 SDPA case: the default dispatch's time (``bench_sdpa``, scaled by the work ratio to ``bench_triton``'s
    batch x heads) against each kernel forced (``bench_triton``), as ``{"case", "default_ms", "forced_ms",
    "nearest"}``. The timings cannot say which kernel ran; they say which forced kernel's time the default matches."""
    _, sdpa, tri = _files(slug, folder)
    if not sdpa or not tri:
        return []
    work = {r["d"]: r["batch"] * r["heads"] for r in tri["rows"]}
    per_call = sdpa["config"]["batch"] * sdpa["config"]["heads"]
    out = []
    for r in sdpa["rows"]:
        if r["formulation"] not in V1_SDPA or not r.get("ms") or r["d"] not in work:
            continue
        key = (r["formulation"], r["d"], r["causal"], r["mode"], r["n"])
        forced = {t["backend"]: t["ms"] for t in tri["rows"]
                  if (t["impl"], t["d"], t["causal"], t["mode"], t["n"]) == key and t.get("ms")}
        if not forced:
            continue
        default = r["ms"] * work[r["d"]] / per_call
        nearest = min(forced, key=lambda b: abs(default / forced[b] - 1))
        out.append({"case": key, "default_ms": default, "forced_ms": forced, "nearest": nearest})
    return out


def dispatch_sentence(slug: str, folder: Path = FOLDER) -> str:
    """What the default dispatch's recorded times match on one device, in one sentence."""
    cases = dispatch_cases(slug, folder)
    device = _device(slug, folder)
    if not cases:
        return f"On the {device}: no pair of `bench_sdpa` and `bench_triton` records to compare the default dispatch with."
    near = {b: sum(c["nearest"] == b for c in cases) for b in dict.fromkeys(c["nearest"] for c in cases)}
    parts = []
    for causal in (False, True):
        cs = [c for c in cases if c["case"][2] == causal]
        if not cs:
            continue
        to_cudnn = [c["default_ms"] / c["forced_ms"]["cudnn"] - 1 for c in cs if "cudnn" in c["forced_ms"]]
        to_flash = [c["default_ms"] / c["forced_ms"]["flash"] - 1 for c in cs if "flash" in c["forced_ms"]]
        text = f"{'causal' if causal else 'non-causal'}: within {_span(to_cudnn)} of cuDNN's time"
        if to_flash:
            below = all(x < 0 for x in to_flash)
            text += f", {_span(to_flash)} {'below' if below else 'off'} flash's where flash takes the call"
        parts.append(text)
    nearest = ", ".join(f"{KERNEL_NAMES.get(b, b)} in {n}" for b, n in sorted(near.items(), key=lambda kv: -kv[1]))
    return (f"On the {device}, PyTorch's default dispatch (`bench_sdpa`, scaled by the work ratio to `bench_triton`'s "
            f"batch x heads) is nearest in time to the kernel forced as {nearest} of {len(cases)} cases "
            f"({'; '.join(parts)}): consistent with cuDNN being the default there, which the timings suggest but "
            f"do not prove.")


def fastest_sentence(slug: str, folder: Path = FOLDER) -> str:
    """Which V1 SDPA formulation was fastest on one device, under the default dispatch and over forced kernels."""
    _, sdpa, tri = _files(slug, folder)
    device = _device(slug, folder)
    parts = []
    if sdpa:
        by_case: dict[tuple, dict[str, float]] = {}
        for r in sdpa["rows"]:
            if r["formulation"] in V1_SDPA and r.get("ms"):
                by_case.setdefault((r["d"], r["causal"], r["mode"], r["n"]), {})[r["formulation"]] = r["ms"]
        wins = [min(ms, key=ms.get) for ms in by_case.values()]
        counts = sorted(((wins.count(f), f) for f in set(wins)), reverse=True)
        wide = sum(ms["sdpa_wide"] < ms["sdpa_split"] for ms in by_case.values() if {"sdpa_wide", "sdpa_split"} <= set(ms))
        parts.append("under the default dispatch the fastest V1 formulation was "
                     + ", ".join(f"`{f}` in {n}" for n, f in counts) + f" of {len(wins)} cases, and `sdpa_wide` "
                     f"was faster than `sdpa_split` in {wide} of {len(wins)}")
    if tri:
        best = [f"{r['impl']}[{r['backend']}]" for r in tri["rows"] if r.get("best_sdpa")]
        counts = sorted(((best.count(b), b) for b in set(best)), reverse=True)
        parts.append("over every forced kernel the best was " + ", ".join(f"`{b}` in {n}" for n, b in counts)
                     + f" of {len(best)}")
    return f"On the {device}: " + "; ".join(parts) + "." if parts else f"On the {device}: no SDPA record."


def kernel_sentence(slug: str, folder: Path = FOLDER) -> str:
    """The fused Triton kernel's speed-up against the best SDPA formulation on one device (``bench_triton``)."""
    _, _, tri = _files(slug, folder)
    device = _device(slug, folder)
    ratios = [r["speedup_vs_best_sdpa"] for r in tri["rows"] if r["impl"] == "triton" and r.get("speedup_vs_best_sdpa")] if tri else []
    if not ratios:
        return f"On the {device}: the fused kernel's speed is not recorded."
    return (f"On the {device} the fused Triton kernel ran at {min(ratios):.2f}x to {max(ratios):.2f}x the best SDPA "
            f"formulation's speed over {len(ratios)} cases (median {statistics.median(ratios):.2f}x; above 1: faster).")


def rerun_sentence(rerun: dict) -> str:
    """What a recorded rerun ran: its step, how it selected tests (``-k``) and the count its log reports."""
    cmd = rerun.get("command", "")
    selection = re.search(r"-k\s+(\"[^\"]*\"|'[^']*'|\S+)", cmd)
    counted = re.search(r"(\d+) (passed|failed)[^\n]*", rerun.get("log_tail", ""))
    what = (f"a rerun of part of the `{rerun['step']}` step, the tests selected by `-k {selection.group(1)}`"
            if selection else f"a rerun of the `{rerun['step']}` step")
    result = counted.group(0).strip() if counted else rerun.get("status", "status not recorded")
    return f"{what}, {rerun.get('date', 'date not recorded')}: {result} ({rerun.get('why', 'why not recorded')})."


def _forward_pick(tri: dict, d: int) -> Optional[dict]:
    """The autotuner's forward configuration at head dim ``d``, non-causal, as ``bench_triton`` recorded it."""
    for name, picks in tri.get("chosen_configs", {}).items():
        if name.startswith("_diff_attn_fwd/") and name.endswith(f"/d{d}"):
            for key, cfg in picks.items():
                if ", False," in key:
                    v = dict(re.findall(r"(\w+): (\w+)", cfg))
                    return {"block_m": int(v["BLOCK_M"]), "block_n": int(v["BLOCK_N"]), "warps": int(v["num_warps"]),
                            "stages": int(v["num_stages"]), "tma": v.get("TMA") == "True"}
    return None


def _same(a: dict, cfg: dict) -> bool:
    return all(a.get(k) == cfg.get(k) for k in ("block_m", "block_n", "warps", "stages")) and \
        bool(a.get("tma")) == bool(cfg.get("tma"))


def _loads(r: dict) -> str:
    return ", TMA loads" if r.get("tma") else ""


def probe_sentence(slug: str, folder: Path = FOLDER) -> str:
    """The probe's fastest forward tile shape per head dim, labelled as measured on the probe's call path."""
    session, _, tri = _files(slug, folder)
    device = _device(slug, folder)
    probe = (session or {}).get("probe")
    if not probe:
        return f"On the {device}: no probe recorded."
    rows = [r for r in probe.get("forward", []) if r.get("status") == "ok" and r.get("ms")]
    parts = []
    for d in sorted({r["d"] for r in rows}):
        rs = [r for r in rows if r["d"] == d]
        best, pinned = min(rs, key=lambda r: r["ms"]), rs[0]
        text = (f"d = {d}: fastest {best['plan']} {best['block_m']} x {best['block_n']} ({best['warps']} warps, "
                f"{best['stages']} stages{_loads(best)}) {best['ms']:.2f} ms, {best['tflops']:.0f} TFLOP/s; the table's first "
                f"entry {pinned['block_m']} x {pinned['block_n']} {pinned['ms']:.2f} ms")
        bench = [t for t in (tri or {}).get("rows", []) if t["impl"] == "triton" and t["d"] == d and not t["causal"]
                 and t["mode"] == "fwd" and t["n"] == pinned["n"] and t.get("ms")]
        pick = _forward_pick(tri or {}, d)
        same = [r for r in rs if pick and _same(r, pick)]
        if bench and same:
            text += (f"; the autotuner's pick in `bench_triton` ({pick['block_m']} x {pick['block_n']}, "
                     f"{pick['warps']} warps, {pick['stages']} stages{_loads(pick)}) took {bench[0]['ms']:.2f} ms on the judged "
                     f"path and {same[0]['ms']:.2f} ms in the probe")
        elif bench:
            text += f"; the judged path's forward (`bench_triton`, the autotuner's pick) took {bench[0]['ms']:.2f} ms"
        parts.append(text)
    command = re.sub(r"\s--out\s+\S+", "", probe["recorded"].get("command", "command not recorded"))  # no machine's path
    return (f"On the {device} the probe (`{command}`) timed the "
            f"forward alone through `triton_diff_attention` (B = 2, N = 8192, bf16, non-causal), a faster call path "
            f"than the `diff_attention(backend=\"triton\")` the goals are judged on; its TFLOP/s are that path's, not "
            f"a verdict on the goals: " + "; ".join(parts) + ".")


def session_sentence(slug: str, folder: Path = FOLDER) -> str:
    """Each step's outcome and time, and each rerun as what it ran, for one recorded session."""
    session, _, _ = _files(slug, folder)
    if not session:
        return f"On the {_device(slug, folder)}: no session recorded."
    rec = session["recorded"]
    steps = ", ".join(f"`{k}` {s['status']} ({s['seconds']:.0f} s)" for k, s in session["steps"].items())
    reruns = session.get("reruns") or []
    text = f"{rec['device']}, {rec.get('date', 'date not recorded')}: {steps}."
    text += "".join(" Then " + rerun_sentence(r) for r in reruns)
    if not reruns:
        text += " No rerun is recorded."
    return text


def refusal_for(status: str, kernel: str) -> str:
    """The part of a recorded ``refused: ...`` status that names ``kernel`` (PyTorch joins the reasons of every
    kernel it tried), whole; the full status where no part names it."""
    word = KERNEL_WORDS.get(kernel, kernel)
    parts = [p.strip() for p in status.removeprefix("refused:").split(";")]
    named = [p for p in parts if p.lower().startswith(word.lower())]
    return "; ".join(named) if named else status


__all__ = ["devices", "dispatch_cases", "dispatch_sentence", "fastest_sentence", "kernel_sentence", "rerun_sentence",
           "probe_sentence", "session_sentence", "refusal_for", "KERNEL_WORDS"]
