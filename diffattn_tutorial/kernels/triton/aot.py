"""Compile the Triton kernels ahead of time for GPUs that are not here, and read what a GPU would meet.

Triton's compiler runs on any machine: given a target (``GPUTarget("cuda", 90, 32)`` is an H100) it lowers a kernel
to PTX, and the ``ptxas`` inside the Triton wheel assembles it and reports registers and spills. This module captures
every launch the library makes (:func:`launches_for`, from the real host code, so arguments, strides and constexprs
are a run's), compiles each configuration its autotuner may pick for each target of :data:`ARCHS` (T4 sm_75, A100
sm_80, RTX 30xx sm_86, L4 and RTX 40xx sm_89, H100 sm_90a) and records per compile (:class:`Facts`): registers,
spills, shared memory, the matrix instructions in the PTX (``wgmma`` or ``mma.sync``; FMA loops on sm_75), and
``dup``, how many times a product is computed redundantly (warpgroups over the same rows, read from the TTGIR);
which cases each run compiles is :mod:`~diffattn_tutorial.kernels.triton.aot_cases`'s.
:meth:`Facts.problems` turns them into failures: a compile error, a spill, a limit exceeded, a 16-bit dot off the
tensor cores, a product computed twice.

``python -m diffattn_tutorial.kernels.triton.aot --all --archs sm_80 --jobs 2 --write`` records one target into
``diffattn_tutorial/recorded/compile_facts.json`` and keeps the other targets' facts (:func:`merge_runs`) while the
kernels' source hash (:func:`source_hash`) and Triton are the same; ``--decode`` does the same for the decode kernels
(``compile_facts_decode.json``). ``tests/test_triton_compile.py`` fails when the record is stale and compiles a
subset live. The compiler cannot run where ``TRITON_INTERPRET=1`` was set before triton was imported, so
:func:`compile_check` then runs itself in a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

from diffattn_tutorial.kernels.triton.aot_cases import (  # noqa: F401 (the cases, named here too)
    DTYPES,
    EXCLUSIONS,
    HEAD_DIMS,
    LESSONS,
    Case,
    all_cases,
    case_on,
    decode_cases,
    plan_work,
    record_cases,
    subset_cases,
)
from diffattn_tutorial.kernels.triton.aot_keys import (  # noqa: F401 (the targets and hashes, named here too)
    ARCHS,
    DECODE_GROUPS,
    DECODE_HEAD_DIMS,
    Arch,
    decode_source_hash,
    fact_key,
    kernel_and_form,
    kernel_source_hash,
    source_hash,
)

SCHEMA = "diffattn-tutorial/compile_facts/1"
FACTS_NAME = "compile_facts"
"""The full run's file in :mod:`diffattn_tutorial.recorded` (``recorded.load(FACTS_NAME)``)."""
FACTS_FILE = Path(__file__).resolve().parents[2] / "recorded" / f"{FACTS_NAME}.json"
DECODE_FACTS_NAME = "compile_facts_decode"
"""The decode kernels' file (``--decode --write``), under its own :func:`decode_source_hash`."""
DECODE_FACTS_FILE = FACTS_FILE.with_name(f"{DECODE_FACTS_NAME}.json")


@dataclasses.dataclass
class Facts:
    """What compiling one launch with one configuration for one target showed."""

    kernel: str
    form: str
    case: str
    arch: str
    dtype: str
    head_dim: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    pinned: bool
    tma: bool = False  # a TMA twin (configs.TMA_TWINS): k and v tiles by tensor descriptor
    regs: Optional[int] = None
    spill_stores: Optional[int] = None
    spill_loads: Optional[int] = None
    stack: Optional[int] = None
    shared: Optional[int] = None
    dots: int = 0
    wgmma: int = 0
    mma_sync: int = 0
    wgmma_shapes: tuple = ()
    dup: float = 1.0
    p_via_smem: bool = False
    tma_loads: int = 0  # cp.async.bulk.tensor instructions in the PTX (the copy engine's loads)
    compile_s: float = 0.0
    error: str = ""
    key: str = ""  # fact_key: the kernel's own source, its constexprs and arguments, the configuration, the target

    @property
    def shape(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"

    @property
    def config(self) -> str:
        return self.shape + (" tma" if self.tma else "")

    @property
    def spills_allowed(self) -> bool:
        """A careful launch (it runs only after a NaN or an infinity) may spill, and so may an sm_90a entry of
        :data:`~diffattn_tutorial.kernels.triton.configs.MEASURED_SPILLS` (timed faster on a GPU, spills and all)."""
        from diffattn_tutorial.kernels.triton.configs import MEASURED_SPILLS

        base = self.form.split("/")[0]
        return self.form.endswith("/careful") or (
            self.arch == "sm_90a" and (self.kernel, base, self.head_dim, self.shape) in MEASURED_SPILLS)

    def problems(self) -> list[str]:
        """Why this compile would fail on the GPU or run slowly there; empty if none."""
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if ((self.spill_stores or 0) or (self.spill_loads or 0)) and not self.spills_allowed:
            out.append(f"register spills: {self.spill_stores} B stored, {self.spill_loads} B loaded")
        arch = ARCHS[self.arch]
        if (self.shared or 0) > arch.shared:
            out.append(f"shared memory {self.shared} B over the {self.arch} limit {arch.shared} B")
        if (self.regs or 0) * 32 * self.num_warps > arch.regs_per_block:
            out.append(f"{self.regs} registers x {32 * self.num_warps} threads over the {self.arch} block limit "
                       f"{arch.regs_per_block}")
        if 80 <= arch.capability < 90 and self.dtype != "float32" and self.dots and not self.mma_sync:
            out.append("16-bit dots not on tensor cores (no mma.sync: FMA loops)")
        if self.tma and not self.tma_loads:
            out.append("a TMA configuration with no cp.async.bulk.tensor in its PTX (pointer loads after all)")
        if self.arch == "sm_90a" and self.dtype != "float32" and self.dots:
            few_rows = self.kernel == "_decode_partial" and self.block_m < 64  # wgmma is m64: mma.sync then
            if few_rows and not self.mma_sync:
                out.append("16-bit dots not on tensor cores (no mma.sync: FMA loops)")
            elif not few_rows and (self.mma_sync or not self.wgmma):
                out.append(f"16-bit dots not on wgmma ({self.mma_sync} mma.sync, {self.wgmma} wgmma)")
            if self.dup > 1:
                out.append(f"a dot is computed {self.dup:g} times (warpgroups over the same rows)")
        return out

    def row(self) -> dict:
        """These facts as a JSON-ready dict (:meth:`from_row` reads it back)."""
        d = dataclasses.asdict(self)
        d["wgmma_shapes"] = list(self.wgmma_shapes)
        return d

    @classmethod
    def from_row(cls, row: dict) -> "Facts":
        """The inverse of :meth:`row` (a lesson's row also carries its ``problems``, which are recomputed)."""
        fields = {k: v for k, v in row.items() if k != "problems"}
        return cls(**{**fields, "wgmma_shapes": tuple(fields["wgmma_shapes"])})


def recorded_facts(name: str = FACTS_NAME) -> tuple[dict, list[Facts], list[Facts]]:
    """The recorded full run: ``(header, facts, lessons)``, the header with the Triton version, date, source hash,
    targets and cases; ``facts`` every compile of every launch the library makes; ``lessons`` the fused plan at
    d = 128 that the library does not use (notebook 09's counter-examples). ``name``: or DECODE_FACTS_NAME."""
    from diffattn_tutorial import recorded

    data = recorded.load(name)
    header = {**data["recorded"], "schema": data["schema"], "cases": data["cases"]}
    return header, [Facts.from_row(r) for r in data["facts"]], [Facts.from_row(r) for r in data["lessons"]]


def excluded_facts() -> list[Facts]:
    """The recorded compiles of :data:`EXCLUSIONS`: each sm_90a entry the table keeps from a variant
    (``configs.UNMASKED_ONLY``, ``configs.NON_CAUSAL_ONLY``), compiled in that variant, with its problems."""
    from diffattn_tutorial import recorded

    return [Facts.from_row(r) for r in recorded.load(FACTS_NAME).get("excluded", [])]


def _interpreted() -> bool:
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


# ----------------------------------------------------------------------------------------------------------
# capture the launches of a case, from the real host code
# ----------------------------------------------------------------------------------------------------------


def launches_for(case: Case, n: int = 1024, arch: str = "sm_90a"):
    """The kernel launches ``diff_attention(..., backend="triton")`` makes for ``case`` (forward + backward),
    recorded on small CPU tensors (contiguous, like a real run; lengths a multiple of 16 as at N = 8192); a decode
    case's: ``decode.capture_step``."""
    import torch

    from diffattn_tutorial.kernels.triton.decode import capture_step
    from diffattn_tutorial.kernels.triton.flash_diff import capture_launches, triton_diff_attention

    if case.decode:
        return _mock_tensors(capture_step(case.head_dim, getattr(torch, case.dtype), case.group,
                                         ARCHS[arch].capability))
    dtype = getattr(torch, case.dtype)
    B, Hkv, d = 1, 2, case.head_dim
    H = Hkv * case.group
    q = torch.zeros(B, 2 * H, n, d, dtype=dtype)
    k = torch.zeros(B, 2 * Hkv, n, d, dtype=dtype)
    v = torch.zeros(B, Hkv, n, 2 * d, dtype=dtype)
    lam = (torch.zeros(B, H, n, 1, dtype=dtype) if case.lam == "token" else torch.zeros((), dtype=dtype))
    for t in (q, k, v, lam):
        t.requires_grad_(case.grad)
    mask = None
    if case.mask == "bool":
        mask = torch.ones(B, 1, n, n, dtype=torch.bool)
    elif case.mask == "additive":
        mask = torch.zeros(B, 1, n, n, dtype=dtype)
    # a plan by name may have no table entry here (LESSONS: the fused plan at d = 128), which a call refuses unless
    # it chooses its tile: the launches are recorded all the same, each compiled with the configurations it is given
    blocks = None if case.plan == "auto" else (16, 16)
    with capture_launches(ARCHS[arch].capability) as launches:
        out = triton_diff_attention(q, k, v, lam, causal=case.causal, attn_mask=mask, plan=case.plan, blocks=blocks)
        if case.grad:
            out.backward(torch.zeros_like(out))
    return _mock_tensors(launches)


def _mock_tensors(launches: list) -> list:
    import torch
    from triton.runtime.jit import MockTensor

    for launch in launches:  # the compiler needs only each tensor's dtype (and 16-byte alignment, which holds)
        assert all(a.data_ptr() % 16 == 0 for a in launch.args.values() if isinstance(a, torch.Tensor))
        launch.args = {k: MockTensor(a.dtype) if isinstance(a, torch.Tensor) else a for k, a in launch.args.items()}
    return launches


# ----------------------------------------------------------------------------------------------------------
# compile one launch
# ----------------------------------------------------------------------------------------------------------

_MMA_LAYOUT = re.compile(r"^#(\w+) = #ttg\.nvidia_mma<\{versionMajor = (\d+).*?warpsPerCTA = \[(\d+), (\d+)\]"
                         r"(?:.*?instrShape = \[(\d+), (\d+)(?:, \d+)?\])?", re.M)
_DOT = re.compile(r"(?:ttng\.warp_group_dot|tt\.dot) .*-> tensor<(\d+)x(\d+)xf32, #(\w+)>")
_CONVERT_P = re.compile(r"ttg\.convert_layout %\S+ : tensor<\S+, #(\w+)> -> tensor<\S+, #ttg\.dot_op<\{opIdx = 0, "
                        r"parent = #(\w+)")
_PTXAS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def analyse_ttgir(ttgir: str) -> tuple[int, float, bool]:
    """``(dots, dup, p_via_smem)`` from Triton's GPU IR: the number of dots, the worst duplication factor
    (rows or columns the warps of a dot's layout cover, over the rows or columns it has), and whether an
    operand goes from one MMA layout to another with different warps (a round trip through shared memory)."""
    layouts = {}
    for name, major, wm, wn, _im, inn in _MMA_LAYOUT.findall(ttgir):
        per_warp_cols = int(inn) if (major == "3" and inn) else 8
        layouts[name] = (int(wm), int(wn), per_warp_cols)
    dots, dup = 0, 1.0
    for rows, cols, layout in _DOT.findall(ttgir):
        dots += 1
        if layout in layouts:
            wm, wn, per_warp_cols = layouts[layout]
            covered_rows, covered_cols = wm * 16, wn * per_warp_cols
            dup = max(dup, max(1.0, covered_rows / int(rows)) * max(1.0, covered_cols / int(cols)))
    p_via_smem = any(src in layouts and dst in layouts and layouts[src][:2] != layouts[dst][:2]
                     for src, dst in _CONVERT_P.findall(ttgir))
    return dots, dup, p_via_smem


def _ptxas_report(ptx: str, capability: int) -> str:
    """``ptxas -v`` on ``ptx`` with the assembler shipped in the Triton wheel (the newer one for sm_90+)."""
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    names = ["ptxas-blackwell", "ptxas"] if capability >= 90 else ["ptxas"]
    exe = next((bin_dir / n for n in names if (bin_dir / n).exists()), None)
    if exe is None:
        return ""
    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(exe), "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, check=False)
    return proc.stdout + proc.stderr


def compile_one(launch, config, arch: str, case: Case, pinned: bool) -> Facts:
    """Compile ``launch`` with ``config`` for ``arch`` (a key of :data:`ARCHS`) and read the facts."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn, form = kernel_and_form(launch.name, launch.consts)
    capability = ARCHS[arch].capability
    kw = dict(launch.consts)
    kw.update(config.kwargs)
    facts = Facts(kernel=launch.name, form=form, case=case.label,
                  arch=arch, dtype=case.dtype, head_dim=launch.consts.get("BLOCK_D", 0),
                  block_m=kw.get("BLOCK_M", 0), block_n=kw.get("BLOCK_N", 0), num_warps=config.num_warps,
                  num_stages=config.num_stages, pinned=pinned, tma=bool(kw.get("TMA")))
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, opts = binder(**launch.args, **kw, num_warps=config.num_warps, num_stages=config.num_stages)
    if len(inspect.signature(fn._pack_args).parameters) >= 5:  # Triton 3.9; older ones take no options
        options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, None)
    else:
        options, signature, constexprs, attrs = fn._pack_args(backend, opts, bound, spec)
    src = ASTSource(fn, signature, constexprs, attrs)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            tmp = stack.enter_context(tempfile.TemporaryDirectory())
            stack.enter_context(knobs.nvidia.scope())
            stack.enter_context(knobs.cache.scope())
            knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed by Triton's own ptxas call
            knobs.cache.dir = tmp  # a fresh cache: always compile, so the report is always printed
            stack.enter_context(contextlib.redirect_stdout(log))
            kernel = triton.compile(src, target=target, options=options.__dict__)
    except Exception as e:  # noqa: BLE001 - a compile error is a fact to report
        facts.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        facts.compile_s = time.perf_counter() - t0
        return facts
    facts.compile_s = time.perf_counter() - t0
    report = log.getvalue()
    if not _PTXAS.search(report):  # a Triton that does not print the report: run its ptxas on the PTX
        report = _ptxas_report(kernel.asm["ptx"], capability)
    m = _PTXAS.search(report)
    if m:
        facts.stack, facts.spill_stores, facts.spill_loads = map(int, m.groups())
    m = _REGS.search(report)
    if m:
        facts.regs = int(m.group(1))
    facts.shared = int(kernel.metadata.shared)
    ptx = kernel.asm["ptx"]
    facts.wgmma = ptx.count("wgmma.mma_async")
    facts.tma_loads = ptx.count("cp.async.bulk.tensor")
    facts.mma_sync = len(re.findall(r"\bmma\.sync\b", ptx))
    facts.wgmma_shapes = tuple(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))))
    facts.dots, facts.dup, facts.p_via_smem = analyse_ttgir(kernel.asm["ttgir"])
    return facts


# ----------------------------------------------------------------------------------------------------------
# cases, the whole check, the facts file
# ----------------------------------------------------------------------------------------------------------


def _work(planned: Iterable[tuple[Case, bool, str]]):
    """``(launch, config, arch, case, pinned)`` for every distinct compile (same kernel, constexprs, argument
    specialisation and configuration compiled once per target, under the first case that needs it)."""
    seen = set()
    for case, every, arch in planned:
        for launch in launches_for(case, arch=arch):
            configs = launch.configs if every else launch.configs[:1]
            for i, config in enumerate(configs):
                spec = tuple(sorted((k, str(v)) for k, v in launch.consts.items()))
                args = tuple((type(a).__name__, str(getattr(a, "dtype", "")),
                              a if isinstance(a, int) and a in (0, 1) else
                              (a % 16 == 0 if isinstance(a, int) else None)) for a in launch.args.values())
                key = (launch.name, spec, args, str(config), arch)
                if key in seen:
                    continue
                seen.add(key)
                yield launch, config, arch, case, i == 0


def lesson_facts(jobs: int = 1, items: Sequence = LESSONS) -> list[Facts]:
    """Compile the configurations of :data:`LESSONS` for sm_90a: why the library splits the maps at d = 128 (or
    of ``items``, such as :data:`EXCLUSIONS`)."""
    from diffattn_tutorial.kernels.triton.configs import TMA_KERNELS, config

    work = []
    for case, kernel, configs in items:
        launch = next(x for x in launches_for(case) if x.name == kernel)
        work += [(launch, config(*c, tma=False if kernel in TMA_KERNELS else None), "sm_90a", case, False)
                 for c in configs]
    if jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(jobs) as pool:
            rows = list(pool.map(_compile_job, work))
    else:
        rows = [_compile_job(w) for w in work]
    return [Facts.from_row(r) for r in rows]


def _compile_job(job) -> dict:
    launch, config, arch, case, pinned = job
    return {**compile_one(launch, config, arch, case, pinned).row(), "key": fact_key(launch, config, arch)}


def _run_here(planned: Sequence[tuple[Case, bool, str]], jobs: int, progress=None,
              cache: Optional[dict] = None) -> list[Facts]:
    """Compile the distinct launches of ``planned``; a row of ``cache`` (``fact_key -> row``) stands for its compile."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when unset; 1 is its default
    work = list(_work(planned))
    done: dict[int, dict] = {}
    for i, (launch, config, arch, case, pinned) in enumerate(work):
        row = (cache or {}).get(fact_key(launch, config, arch))
        if row is not None:
            done[i] = {**row, "case": case.label, "pinned": pinned}
    left = [i for i in range(len(work)) if i not in done]
    if progress and done:
        print(f"{len(done)} of {len(work)} compiles from the record (same kernel source, configuration, target)")
    if jobs > 1 and len(left) > 1:
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        try:
            with ProcessPoolExecutor(jobs) as pool:
                for i, row in zip(left, pool.map(_compile_job, [work[i] for i in left])):
                    done[i] = row
                    if progress:
                        progress(Facts.from_row(row))
        except BrokenProcessPool:  # a worker was killed (out of memory on a shared machine): finish here
            pass
    for i, w in enumerate(work):
        if i not in done:
            done[i] = _compile_job(w)
            if progress:
                progress(Facts.from_row(done[i]))
    return [Facts.from_row(done[i]) for i in range(len(work))]


def compile_check(cases: Optional[Sequence[tuple[Case, bool]]] = None, archs: Sequence[str] = ("sm_90a",), *,
                  every_config: Optional[bool] = None, jobs: int = 1,
                  also: Sequence[tuple[Case, bool, str]] = ()) -> list[Facts]:
    """Compile the launches of ``cases`` (``(case, every_config)`` pairs, default each target's
    :func:`subset_cases`) for ``archs``, each case as it runs there (:func:`case_on`): the pinned configuration
    of each launch, or every configuration its autotuner may pick, then ``also`` (more :func:`plan_work` triples,
    compiled in the same run). Runs in a subprocess when this process's triton is in interpreter mode. Returns one
    :class:`Facts` per distinct compile."""
    if cases is None:
        planned = [p for a in archs for p in plan_work(subset_cases(a), [a], every_config)]
    else:
        planned = plan_work(cases, archs, every_config)
    planned += list(also)
    if not _interpreted():
        return _run_here(planned, jobs)
    spec = json.dumps({"planned": [[dataclasses.asdict(c), e, a] for c, e, a in planned], "jobs": jobs})
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "diffattn_tutorial.kernels.triton.aot", "--spec", spec, "--json", "-"],
                          capture_output=True, text=True, env=env, check=False)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"the compile-check subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = json.loads(proc.stdout)["facts"]
    return [Facts.from_row(r) for r in rows]


def table(facts: Sequence[Facts]) -> str:
    """A Markdown table of the facts, one row per compile."""
    lines = ["| kernel | form | d | dtype | arch | config | regs | spills st/ld | smem KiB | wgmma shapes | mma.sync "
             "| dup | problems |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in facts:
        probs = "; ".join(f.problems()) or "-"
        lines.append(f"| {f.kernel.replace('_diff_attn_', '')} | {f.form} | {f.head_dim} | {f.dtype} | {f.arch} | "
                     f"{f.config}{' (pinned)' if f.pinned else ''} | {f.regs} | {f.spill_stores}/{f.spill_loads} | "
                     f"{(f.shared or 0) / 1024:.0f} | {' '.join(f.wgmma_shapes) or '-'} | {f.mma_sync} | {f.dup:g} | "
                     f"{probs} |")
    return "\n".join(lines)


def _versions() -> dict:
    import platform

    import torch
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__, "python": platform.python_version()}


def merge_runs(old: Optional[dict], new: dict) -> dict:
    """The facts file after a run over some targets: ``new``'s targets replaced, the others kept from ``old`` when
    both come from the same kernel source and Triton (one run per subset of targets keeps each run short);
    otherwise ``new`` alone (the old facts describe other code)."""
    run = {k: new["recorded"][k] for k in ("archs", "date", "wall_s", "jobs", "command")} | {
        "compiles": len(new["facts"])}
    fresh = {**new, "recorded": {**new["recorded"], "runs": [run]}}
    same = old is not None and all(old.get("recorded", {}).get(k) == new["recorded"][k]
                                   for k in ("source_hash", "triton"))
    if not same:
        return fresh
    redone = set(new["recorded"]["archs"])
    kept_archs = [a for a in old["recorded"]["archs"] if a not in redone]
    archs = [a for a in ARCHS if a in redone or a in kept_archs]
    runs = [r for r in old["recorded"].get("runs", []) if set(r["archs"]) - redone] + [run]
    return {"schema": SCHEMA,
            "recorded": {**new["recorded"], "archs": archs, "runs": runs,
                         "wall_s": round(sum(r["wall_s"] for r in runs), 1),
                         "command": " && ".join(r["command"] for r in runs if r.get("command"))},
            "cases": [c for c in old["cases"] if c.split(":")[0] in kept_archs] + new["cases"],
            "facts": [f for f in old["facts"] if f["arch"] in kept_archs] + new["facts"],
            "lessons": new["lessons"] or old["lessons"], "excluded": new.get("excluded") or old.get("excluded", [])}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description="Compile the Triton kernels for the GPU targets in ARCHS (sm_90a, "
                                             "sm_89, sm_86, sm_80, sm_75) without a GPU and check registers, "
                                             "spills, shared memory and the matrix instructions.")
    ap.add_argument("--all", action="store_true", help="every case (all head dims, bf16 and fp16, variants), "
                                                       "every autotune configuration, every target (or --archs)")
    ap.add_argument("--archs", nargs="+", default=None, choices=list(ARCHS))
    ap.add_argument("--head-dims", type=int, nargs="+", default=None)
    ap.add_argument("--dtypes", nargs="+", default=None, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--every-config", action="store_true", help="all autotune configurations, not the pinned one")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    ap.add_argument("--decode", action="store_true", help="the decode kernels' cases (decode_cases) instead; with "
                                                          f"--write, into {DECODE_FACTS_FILE.name}")
    ap.add_argument("--lessons", action="store_true", help="also compile the fused plan at d = 128 (notebook 09's "
                                                           "counter-examples) and EXCLUSIONS; implied by --all with "
                                                           "sm_90a")
    ap.add_argument("--write", type=Path, nargs="?", const=FACTS_FILE, default=None,
                    help=f"write the facts file (default {FACTS_FILE.relative_to(FACTS_FILE.parents[2])}); with "
                         f"--archs, only those targets' facts are replaced (same source and Triton)")
    ap.add_argument("--json", default=None, help="write the facts as JSON to this path ('-': stdout)")
    ap.add_argument("--no-cache", action="store_true", help="compile everything again (with --write, rows of the "
                                                             "record whose fact_key is unchanged are reused)")
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if _interpreted():
        raise SystemExit("run this without TRITON_INTERPRET=1 (the compiler needs the real @triton.jit kernels)")
    every = True if args.every_config else None
    if args.spec:
        spec = json.loads(args.spec)
        planned = [(Case(**c), e, a) for c, e, a in spec["planned"]]
        jobs = spec["jobs"]
    else:
        archs = args.archs or (list(ARCHS) if args.all else ["sm_90a"])
        jobs = args.jobs
        if args.decode:
            planned = plan_work(decode_cases(args.head_dims or DECODE_HEAD_DIMS, args.dtypes or DTYPES), archs, every)
        elif args.dtypes:
            planned = plan_work(all_cases(args.head_dims or HEAD_DIMS, args.dtypes), archs, every)
        elif args.all or args.head_dims:
            planned = [p for a in archs for p in plan_work(record_cases(a, args.head_dims or HEAD_DIMS), [a], every)]
        else:
            planned = [p for a in archs for p in plan_work(subset_cases(a), [a], every)]
    archs = list(dict.fromkeys(a for _, _, a in planned))
    quiet = args.json == "-"
    t0 = time.perf_counter()

    def progress(f: Facts) -> None:
        if not quiet:
            probs = "; ".join(f.problems()) or "ok"
            print(f"{f.kernel:<26} {f.form:<5} d{f.head_dim:<3} {f.dtype:<8} {f.arch:<6} {f.config:<15} "
                  f"regs {f.regs} spill {f.spill_stores}/{f.spill_loads} smem {f.shared} "
                  f"wgmma {','.join(f.wgmma_shapes) or '-'} mma.sync {f.mma_sync} dup {f.dup:g} "
                  f"{f.compile_s:.1f}s: {probs}", flush=True)

    if not quiet:
        print(f"{len(list(_work(planned)))} compiles for {', '.join(archs)} in {jobs} process(es)", flush=True)
    if args.decode and args.write == FACTS_FILE:
        args.write = DECODE_FACTS_FILE
    cache = {}
    if args.write and args.write.exists() and not args.no_cache:
        cache = {r["key"]: r for r in json.loads(args.write.read_text())["facts"] if r.get("key")}
    facts = _run_here(planned, jobs, progress, cache)
    with_lessons = not args.decode and (args.lessons or (args.all and "sm_90a" in archs))
    lessons = lesson_facts(jobs) if with_lessons and not args.spec else []
    excluded = lesson_facts(jobs, EXCLUSIONS) if with_lessons and not args.spec else []
    for f in lessons + excluded:
        progress(f)
    bad = [f for f in facts if f.problems()]
    result = {"schema": SCHEMA, "recorded": {**_versions(), "date": time.strftime("%Y-%m-%d", time.gmtime()),
                                              "source_hash": decode_source_hash() if args.decode else source_hash(),
                                              "archs": archs, "every_config": every,
                                              "jobs": jobs, "wall_s": round(time.perf_counter() - t0, 1),
                                              "command": " ".join(["python -m diffattn_tutorial.kernels.triton.aot",
                                                                   *(sys.argv[1:] if argv is None else argv)])},
              "cases": [f"{a}: {c.label}" + (" (every config)" if e else "") for c, e, a in planned],
              "facts": [f.row() for f in facts],
              "lessons": [{**f.row(), "problems": f.problems()} for f in lessons],
              "excluded": [{**f.row(), "problems": f.problems()} for f in excluded]}
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.write:
        old = json.loads(args.write.read_text()) if args.write.exists() else None
        merged = merge_runs(old, result)
        args.write.write_text(json.dumps(merged, indent=1) + "\n")
        if not quiet:
            print(f"wrote {args.write}: targets {', '.join(merged['recorded']['archs'])}, "
                  f"{len(merged['facts'])} compiles")
    if not quiet:
        print(f"{len(facts)} compiles in {time.perf_counter() - t0:.0f} s, {len(bad)} with problems")
        for f in bad:
            print(f"  {f.kernel} {f.form} d{f.head_dim} {f.dtype} {f.arch} {f.config} [{f.case}]: "
                  f"{'; '.join(f.problems())}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
