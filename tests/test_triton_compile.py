"""The Triton kernels compile for the GPUs learners have without one (H100 sm_90a, L4 / RTX 40xx sm_89, RTX 30xx
sm_86, A100 sm_80, T4 sm_75): no register spills, shared memory and registers within each target's limits, on
sm_90a every 16-bit dot on ``wgmma`` and none computed twice, on sm_80-89 every 16-bit dot on ``mma.sync``
(``diffattn_tutorial.kernels.triton.aot``).

* ``test_pinned_launches_compile_clean_for_hopper`` and ``..._for_turing`` compile a sample here, every time: the
  pinned configuration of every launch of the plain training case where each target works hardest (d = 128 in
  bf16 on sm_90a; d = 64 in fp16 on sm_75, the largest it trains), in a subprocess (Triton's compiler cannot run
  where ``TRITON_INTERPRET=1`` was set); ``test_the_live_sample_compiles_as_recorded`` checks that each of these
  compiles equals its row of the record, which covers the rest;
* ``test_recorded_facts_cover_every_config_and_are_current`` checks the full run,
  ``diffattn_tutorial/recorded/compile_facts.json`` (``aot.record_cases``: every autotune configuration of each
  target's table in its first dtype at every head dim, the careful launch and the inference forward pinned, on
  sm_90a the heaviest variant, GQA 4:1 and the plans chosen by name in every configuration: ``python -m diffattn_tutorial.kernels.triton.aot --all --jobs 2
  --write``, which reuses every row whose ``aot.fact_key`` is unchanged), against the kernels' current source, so a
  kernel or table change without a new run fails here;
* the decode kernels (``kernels/triton/decode.py``) have their own record,
  ``diffattn_tutorial/recorded/compile_facts_decode.json`` (``... aot --decode --all --write``), checked the same
  way against :func:`~diffattn_tutorial.kernels.triton.aot.decode_source_hash`, and their T4 launch (the target
  where a 64-key tile spilled) is compiled here.
"""

import time

import pytest

triton = pytest.importorskip("triton")

from diffattn_tutorial.kernels.triton import aot as tc  # noqa: E402

pytestmark = pytest.mark.slow  # compiles kernels for GPU targets (ptxas)


def _nvidia_backend() -> bool:
    from triton.backends import backends

    return "nvidia" in backends


needs_nvidia = pytest.mark.skipif(not _nvidia_backend(), reason="this triton build has no NVIDIA backend")

TTGIR = """
#mma = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [4, 2], instrShape = [16, 128, 16]}>
#mma1 = #ttg.nvidia_mma<{versionMajor = 3, versionMinor = 0, warpsPerCTA = [8, 1], instrShape = [16, 32, 16]}>
      %s1 = ttng.warp_group_dot %q, %k, %c {inputPrecision = 0 : i32} : !ttg.memdesc<64x64xbf16> * !ttg.memdesc<64x64xbf16> -> tensor<64x64xf32, #mma1>
      %p = ttg.convert_layout %x : tensor<64x64xbf16, #mma1> -> tensor<64x64xbf16, #ttg.dot_op<{opIdx = 0, parent = #mma, kWidth = 2}>>
      %o = ttng.warp_group_dot %p, %v, %acc {inputPrecision = 0 : i32} : tensor<64x64xbf16> * !ttg.memdesc<64x256xbf16> -> tensor<64x256xf32, #mma>
"""


def test_ttgir_analysis_finds_a_dot_done_twice():
    """The layout issue #13 found at d = 128: 8 warps (two warpgroups) over a 64-row score tile."""
    dots, dup, p_via_smem = tc.analyse_ttgir(TTGIR)
    assert dots == 2 and dup == 2.0 and p_via_smem


def test_problems_name_what_is_wrong():
    f = tc.Facts(kernel="_diff_attn_fwd", form="map", case="d128 bfloat16", arch="sm_90a", dtype="bfloat16",
                 head_dim=128, block_m=64, block_n=64, num_warps=8, num_stages=2, pinned=True, regs=255,
                 spill_stores=192, spill_loads=212, stack=120, shared=240 * 1024, dots=4, wgmma=8, mma_sync=2,
                 dup=2.0)
    text = "; ".join(f.problems())
    assert "spills" in text and "shared memory" in text and "not on wgmma" in text and "2 times" in text
    f80 = tc.Facts(**{**f.row(), "arch": "sm_80", "wgmma_shapes": (), "spill_stores": 0, "spill_loads": 0,
                      "shared": 1000})
    assert f80.problems() == []  # Ampere has no wgmma: dots there are mma.sync by design
    few_rows = tc.Facts(**{**f80.row(), "kernel": "_decode_partial", "arch": "sm_90a", "block_m": 16, "dup": 1.0})
    assert few_rows.problems() == []  # 16 query rows: wgmma is m64, mma.sync is the tensor-core path
    assert "not on tensor cores" in "; ".join(tc.Facts(**{**few_rows.row(), "mma_sync": 0}).problems())
    fma = tc.Facts(**{**f80.row(), "arch": "sm_86", "mma_sync": 0})
    assert "not on tensor cores" in "; ".join(fma.problems())
    t4 = tc.Facts(**{**f80.row(), "arch": "sm_75", "mma_sync": 0, "shared": 70000, "regs": 255, "num_warps": 16})
    text = "; ".join(t4.problems())  # this Triton has no tensor-core path on sm_75: FMA dots are not a problem there
    assert "over the sm_75 limit 65536 B" in text and "block limit 65536" in text and "tensor cores" not in text


def test_targets_and_what_runs_on_them():
    assert {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90a"} <= set(tc.ARCHS)
    assert tc.ARCHS["sm_75"].shared == 65536 and tc.ARCHS["sm_86"].shared == tc.ARCHS["sm_89"].shared == 101376
    assert tc.case_on(tc.Case(64, "bfloat16"), "sm_75") is None  # no bfloat16 arithmetic on a T4
    assert tc.case_on(tc.Case(128, "float16"), "sm_75") == tc.Case(128, "float16", grad=False)
    assert tc.case_on(tc.Case(128, "bfloat16"), "sm_86") == tc.Case(128, "bfloat16")


DECODE_T4 = tc.Case(128, "float16", causal=True, grad=False, decode=True)  # the decode kernels' T4 launch


@pytest.fixture(scope="module")
def pinned() -> dict[str, list]:
    """The facts of the compiles below, by target (``"decode"``: the decode kernels' T4 launch), from one compiler
    subprocess (each start of one imports torch and Triton again)."""
    t0 = time.perf_counter()
    sample = tc.plan_work([(tc.Case(64, "float16"), False)], ["sm_75"]) + tc.plan_work(
        [(tc.Case(128, "bfloat16"), False)], ["sm_90a"]) + tc.plan_work([(DECODE_T4, False)], ["sm_75"])
    facts = tc.compile_check([], archs=(), jobs=2, also=sample)
    print(f"{len(facts)} compiles in {time.perf_counter() - t0:.0f} s")
    decode = [f for f in facts if f.kernel.startswith("_decode")]
    assert {f.arch for f in facts} == {"sm_75", "sm_90a"} and {f.arch for f in decode} == {"sm_75"}
    return {"decode": decode, **{arch: [f for f in facts if f.arch == arch and f not in decode]
                                 for arch in ("sm_75", "sm_90a")}}


@needs_nvidia
def test_pinned_launches_compile_clean_for_turing(pinned):
    """Colab's free T4: fp16, 64 KiB of shared memory, FMA dots (this Triton has no tensor-core path there)."""
    facts = pinned["sm_75"]
    assert {(64, "map"), (64, "dv"), (64, "dk_map"), (64, "dq_map"), (64, "pre")} <= {(f.head_dim, f.form) for f in facts}
    assert {f.dtype for f in facts} == {"float16"}
    bad = {f"{f.kernel} {f.form} d{f.head_dim} {f.config}": f.problems() for f in facts if f.problems()}
    assert not bad, bad
    assert all(f.shared <= 65536 for f in facts)


@needs_nvidia
def test_pinned_launches_compile_clean_for_hopper(pinned):
    facts = pinned["sm_90a"]
    forms = {(f.head_dim, f.form) for f in facts}
    assert {(128, "map"), (128, "dv"), (128, "dk_map"), (128, "dq_map"), (128, "pre")} <= forms, forms
    bad = {f"{f.kernel} {f.form} d{f.head_dim} {f.config}": f.problems() for f in facts if f.problems()}
    assert not bad, bad
    for f in facts:
        if f.form != "pre":
            assert f.wgmma_shapes and all(s.startswith("m64") for s in f.wgmma_shapes), f


@needs_nvidia
def test_the_live_sample_compiles_as_recorded(pinned):
    """The record is the compiler's word: each live compile with the record's Triton equals its recorded row (same
    ``fact_key``: kernel source, configuration, target) in registers, spills and shared memory."""
    rec, recorded, _ = tc.recorded_facts()
    decode_rec, decode_recorded, _ = tc.recorded_facts(tc.DECODE_FACTS_NAME)
    if rec["triton"] != triton.__version__:
        pytest.skip(f"the record was made with triton {rec['triton']}, this is {triton.__version__}")
    rows = {f.key: f for f in [*recorded, *decode_recorded]}
    live = [f for fs in pinned.values() for f in fs]
    missing = [f"{f.kernel} {f.form} {f.arch} {f.config}" for f in live if f.key not in rows]
    assert not missing, f"not in the record (re-record: python -m diffattn_tutorial.kernels.triton.aot --all --write): {missing}"
    differ = {f"{f.kernel} {f.form} {f.arch} {f.config}": (got, want) for f in live
              for got, want in [((f.regs, f.spill_stores, f.shared), (rows[f.key].regs, rows[f.key].spill_stores,
                                                                       rows[f.key].shared))] if got != want}
    assert not differ, differ


def test_recorded_facts_cover_every_config_and_are_current():
    from diffattn_tutorial.kernels.triton.configs import label

    assert tc.FACTS_FILE.exists(), "run: python -m diffattn_tutorial.kernels.triton.aot --all --jobs 8 --write"
    rec, facts, lessons = tc.recorded_facts()
    assert rec["schema"] == tc.SCHEMA
    assert rec["source_hash"] == tc.source_hash(), (
        "the kernels or their autotune tables changed since diffattn_tutorial/recorded/compile_facts.json was "
        "written; run python -m diffattn_tutorial.kernels.triton.aot --all --jobs 8 --write")
    bad = [f"{f.kernel} {f.form} d{f.head_dim} {f.dtype} {f.arch} {f.config} [{f.case}]: {f.problems()}"
           for f in facts if f.problems()]
    assert not bad, bad
    assert lessons and all(f.head_dim == 128 for f in lessons)
    assert rec["archs"] == list(tc.ARCHS), "a target is missing: python -m diffattn_tutorial.kernels.triton.aot --all --archs ..."
    planned = [p for a in tc.ARCHS for p in tc.plan_work(tc.record_cases(a), [a])]  # the record's scope, as today
    assert sorted(rec["cases"]) == sorted(f"{a}: {c.label}" + (" (every config)" if e else "") for c, e, a in planned), (
        "aot_cases.record_cases changed since the record was written; run python -m "
        "diffattn_tutorial.kernels.triton.aot --all --jobs 8 --write")
    seen = {(f.arch, f.dtype, f.kernel, f.form, f.head_dim, f.config) for f in facts}
    for arch in tc.ARCHS:  # every configuration the autotuner may pick, as the host code launches them, in the
        dtype = tc.ARCHS[arch].dtypes[0]  # target's first dtype (the record's scope: aot.record_cases)
        for d in tc.HEAD_DIMS:
            case = tc.case_on(tc.Case(d, dtype), arch)
            for launch in tc.launches_for(case, arch=arch):
                if launch.name == "_diff_attn_bwd_preprocess":
                    continue
                for c in launch.configs:  # a careful launch has one: the pinned configuration
                    key = (arch, dtype, launch.name, tc.kernel_and_form(launch.name, launch.consts)[1], d, label(c))
                    assert key in seen, key


def test_an_unmasked_only_entry_is_offered_without_a_mask_and_never_pinned():
    """``configs.UNMASKED_ONLY``: the d = 128 forward's 128x128 tile (too much shared memory beside a mask tile) is
    one the autotuner may pick for a call without a mask only; with a bool or additive mask it is not offered,
    and the pinned (first) configuration is the same for every variant."""
    import torch

    from diffattn_tutorial.kernels.triton import configs
    from diffattn_tutorial.kernels.triton.flags import MAPS_1, MASK_ADD, MASK_BOOL, MASK_NONE

    def offered(mask_kind):
        consts = {"MAPS": MAPS_1, "BLOCK_D": 128, "MASK_KIND": mask_kind}
        return [f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                for c in configs.autotune_configs("_diff_attn_fwd", consts, torch.bfloat16, 90)]

    assert offered(MASK_NONE) == ["128x64 w8 s2", "128x128 w8 s2"]
    assert offered(MASK_BOOL) == offered(MASK_ADD) == ["128x64 w8 s2"]
    tables = configs.config_tables()
    for kernel, variant, d, label in configs.UNMASKED_ONLY:
        listed = [f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                  for c in tables["hopper"][(kernel, variant)][d]]
        assert label in listed[1:], (kernel, variant, d, label, listed)


def test_a_non_causal_only_entry_is_offered_to_calls_that_are_not_causal_and_never_pinned():
    """``configs.NON_CAUSAL_ONLY``: the fused plan's dK/dV tile 32x128 w8 s2 at d = 64 (it spills when causal with a
    per-token lambda, whose kind is no constexpr) is offered without causal masking and without a mask only
    (it is in ``UNMASKED_ONLY`` too), its TMA twin likewise; every other call gets the pinned 16x128 w8 s1, clean
    in every recorded variant."""
    import torch

    from diffattn_tutorial.kernels.triton import configs
    from diffattn_tutorial.kernels.triton.flags import MAPS_BOTH, MASK_ADD, MASK_NONE

    def offered(causal, mask_kind):
        consts = {"DV_OUT": True, "DK_MAPS": MAPS_BOTH, "BLOCK_D": 64, "CAUSAL": causal, "MASK_KIND": mask_kind}
        return [configs.shape(c) for c in configs.autotune_configs("_diff_attn_bwd_dkdv", consts, torch.bfloat16)]

    assert offered(False, MASK_NONE) == ["16x128 w8 s1", "32x128 w8 s2"]
    assert offered(True, MASK_NONE) == offered(False, MASK_ADD) == offered(True, MASK_ADD) == ["16x128 w8 s1"]
    for causal, mask_kind in ((True, MASK_NONE), (False, MASK_ADD)):  # a twin is filtered as its pointer entry
        consts = {"DV_OUT": True, "DK_MAPS": MAPS_BOTH, "BLOCK_D": 64, "CAUSAL": causal, "MASK_KIND": mask_kind}
        assert [configs.label(c) for c in configs.autotune_configs("_diff_attn_bwd_dkdv", consts, torch.bfloat16,
                                                                   tma=None)] == ["16x128 w8 s1", "16x128 w8 s1 tma"]
    tables = configs.config_tables()
    for kernel, variant, d, label in configs.NON_CAUSAL_ONLY:
        assert label in [configs.shape(c) for c in tables["hopper"][(kernel, variant)][d]][1:], (kernel, d, label)


def test_every_entry_kept_from_a_variant_is_recorded_failing_in_it():
    """Each entry of ``configs.UNMASKED_ONLY`` (``NON_CAUSAL_ONLY``) is recorded compiled in a variant with a mask
    (causal) with a problem there (spills, or more shared memory than sm_90a has): ``aot_cases.EXCLUSIONS``, so the
    tables' reasons are evidence, not a note; and every recorded exclusion shows a problem, as do the calls the
    ``fused_atomic`` plan refuses."""
    from diffattn_tutorial.kernels.triton import configs

    excluded = tc.excluded_facts()
    assert excluded and all(f.problems() and f.arch == "sm_90a" for f in excluded)
    assert sorted((f.case, f.kernel, f.shape) for f in excluded) == sorted(  # the record's rows are EXCLUSIONS'
        (case.label, kernel, f"{bm}x{bn} w{w} s{s}") for case, kernel, cs in tc.EXCLUSIONS for bm, bn, w, s in cs)
    for table, alone in ((configs.UNMASKED_ONLY, lambda c: "mask=" in c and "causal" not in c),
                         (configs.NON_CAUSAL_ONLY, lambda c: "causal" in c and "mask=" not in c)):
        for kernel, variant, d, label in table:  # failing in that variant alone, not only in the heaviest
            rows = [f for f in excluded if (f.kernel, f.form.split("/")[0], f.head_dim, f.shape) == (kernel, variant, d, label)
                    and alone(f.case)]
            assert rows, (kernel, variant, d, label)
    # a plan that refuses causal calls and additive masks (refusals.check_plan) is recorded failing there too
    for name in (n for n, p in configs.PLANS.items() if p.kq_dv):
        for needs in ("causal", "mask=additive"):
            assert any(f"plan={name}" in f.case and needs in f.case for f in excluded), (name, needs)


def test_a_run_over_some_targets_keeps_the_others_and_the_lists_it_did_not_compile():
    """``aot.merge_runs``: a run over sm_80 replaces sm_80's facts and keeps sm_90a's (same source and Triton);
    the lessons and the excluded rows (compiled only with sm_90a) come from the old record when the run has none,
    also from a record written before the excluded rows existed; another source hash starts afresh."""
    def run(archs, facts, lessons=(), excluded=(), source="s1"):
        rec = {"archs": archs, "date": "d", "wall_s": 1.0, "jobs": 2, "command": "c", "source_hash": source,
               "triton": "3.9.0"}
        return {"schema": tc.SCHEMA, "recorded": rec, "cases": [f"{a}: x" for a in archs],
                "facts": [{"arch": a, "n": n} for a, n in facts], "lessons": list(lessons), "excluded": list(excluded)}

    old = run(["sm_90a", "sm_80"], [("sm_90a", 1), ("sm_80", 2)], lessons=[{"l": 1}], excluded=[{"e": 1}])
    merged = tc.merge_runs(old, run(["sm_80"], [("sm_80", 3)]))
    assert merged["facts"] == [{"arch": "sm_90a", "n": 1}, {"arch": "sm_80", "n": 3}]
    assert merged["lessons"] == [{"l": 1}] and merged["excluded"] == [{"e": 1}]
    partial = run(["sm_80"], [("sm_80", 3)])
    del partial["excluded"]  # a run that built no excluded list
    assert tc.merge_runs(old, partial)["excluded"] == [{"e": 1}]
    del old["excluded"]  # a record from before 2026-11-29
    assert tc.merge_runs(old, run(["sm_80"], [("sm_80", 3)]))["excluded"] == []
    fresh = tc.merge_runs(old, run(["sm_80"], [("sm_80", 3)], source="s2"))
    assert fresh["facts"] == [{"arch": "sm_80", "n": 3}] and fresh["lessons"] == []


def test_a_kernel_change_recompiles_only_that_kernel():
    """The record's cache key (``aot.fact_key``) follows each kernel's own source closure: the forward's and the
    dQ kernel's differ, a jit helper only the forward calls is in the forward's, and a configuration or target
    changes the key."""
    from diffattn_tutorial.kernels.triton import dq_kernels, flash_kernels

    fwd, dq = tc.kernel_source_hash(flash_kernels._diff_attn_fwd), tc.kernel_source_hash(dq_kernels._diff_attn_bwd_dq)
    assert fwd != dq and len(fwd) == 16
    launch = next(x for x in tc.launches_for(tc.Case(64)) if x.name == "_diff_attn_fwd")
    c0, c1 = launch.configs[:2]
    assert tc.fact_key(launch, c0, "sm_90a") != tc.fact_key(launch, c1, "sm_90a")
    assert tc.fact_key(launch, c0, "sm_90a") != tc.fact_key(launch, c0, "sm_80")
    assert tc.fact_key(launch, c0, "sm_90a") == tc.fact_key(launch, c0, "sm_90a")


def _rerecord_minutes(times: list[float], jobs: int = 2) -> float:
    """Wall minutes of compiles taking ``times`` seconds each, ``jobs`` at a time: at least the longest one."""
    return max(sum(times) / jobs, max(times)) / 60


def test_the_record_is_small_enough_to_redo_after_a_change():
    """Issue 51: re-recording after a change to one kernel must fit 15 minutes on two cores. A row is recompiled
    when its kernel's source (its jit helpers' included) changes, so a change to one kernel costs that kernel's
    rows again: the record's own compile times (each row's ``compile_s``, compiled two at a time) say how long.
    A change to a helper that every kernel shares recompiles every row, longer (printed, not bounded; some of the dQ
    kernel's sm_90a rows take minutes each). The compile count is printed beside them."""
    from collections import defaultdict

    from diffattn_tutorial.kernels.triton.configs import shape

    planned = [p for a in tc.ARCHS for p in tc.plan_work(tc.record_cases(a), [a])]
    n = len(list(tc._work(planned))) + sum(len(cs) for *_, cs in (*tc.LESSONS, *tc.EXCLUSIONS))  # those: uncached
    _, facts, lessons = tc.recorded_facts()
    times = defaultdict(list)
    for f in (*facts, *lessons):
        times[f.kernel].append(f.compile_s)
    per_kernel = {kernel: _rerecord_minutes(ts) for kernel, ts in times.items()}
    print(n, "compiles;", ", ".join(f"{k} {m:.1f} min" for k, m in per_kernel.items()),
          f"; every row {_rerecord_minutes([t for ts in times.values() for t in ts]):.1f} min (two jobs)")
    assert max(per_kernel.values()) <= 15, per_kernel
    for arch in tc.ARCHS:  # each target's autotune space stays small: at most two configurations per entry, and
        dtype = tc.ARCHS[arch].dtypes[0]  # TMA twins of those (the same tile read by tensor descriptor)
        for d in tc.HEAD_DIMS:
            for launch in tc.launches_for(tc.case_on(tc.Case(d, dtype), arch), arch=arch):
                if launch.name == "_diff_attn_bwd_preprocess":  # one configuration, no tiles
                    continue
                pointers = [shape(c) for c in launch.configs if not c.kwargs.get("TMA")]
                twins = [shape(c) for c in launch.configs if c.kwargs.get("TMA")]
                assert len(pointers) <= 2 and set(twins) <= set(pointers), (arch, launch.name, d, launch.configs)


def test_tma_twins_use_the_copy_engine_and_spill_no_more_than_their_pointer_entries():
    """``configs.TMA_TWINS``: in the record, every TMA twin's PTX has the copy engine's loads
    (``cp.async.bulk.tensor``), and in every case recorded (the heaviest variant and GQA 4:1 too) it spills no more
    than the pointer entry of the same tile and launch (why it may share that entry's ``MEASURED_SPILLS``); the
    pointer entries have none. A launch's configurations are recorded in their list's
    order, so a twin's pointer entry is the nearest row before it with the same case, kernel, form and tile."""
    _, facts, _ = tc.recorded_facts()
    twins = [f for f in facts if f.tma]
    assert {f.arch for f in twins} == {"sm_90a"} and {f.head_dim for f in twins} == {64, 128}, twins
    assert {f.case for f in twins} >= {f"d{d} bfloat16 causal mask=additive lam=token{i}" for d in (64, 128)
                                       for i in ("", " inference")} | {"d64 bfloat16 gqa4"}
    assert all(not f.tma_loads for f in facts if not f.tma)
    for i, f in enumerate(facts):
        if not f.tma:
            continue
        p = next(g for g in reversed(facts[:i]) if not g.tma and (g.arch, g.case, g.kernel, g.form, g.shape) ==
                 (f.arch, f.case, f.kernel, f.form, f.shape))
        assert f.tma_loads > 0, f
        assert f.spill_stores <= p.spill_stores and f.spill_loads <= p.spill_loads, (f, p)


def test_under_the_gpu_sessions_triton_some_tma_twin_spills_more_than_its_pointer_entry():
    """Notebook 09 says so of the sm_90a compiles with the Triton the recorded GPU sessions ran
    (``recorded/compile_facts_sm90a_triton-<version>.json``; the record's Triton holds the test above): the twins
    paired with their pointer entries as above."""
    from diffattn_tutorial import recorded
    from diffattn_tutorial.measure import gpu

    versions = {data["recorded"]["triton"] for _, data in gpu.find_recorded("gpu_session", None)}
    assert versions, "no recorded GPU session"
    for version in versions:
        facts = recorded.load(f"compile_facts_sm90a_triton-{version}")["facts"]
        shape = lambda f: (f["case"], f["kernel"], f["form"], f["block_m"], f["block_n"], f["num_warps"],  # noqa: E731
                           f["num_stages"])
        more = [f for i, f in enumerate(facts) if f.get("tma") and f["spill_stores"] > next(
            g for g in reversed(facts[:i]) if not g.get("tma") and shape(g) == shape(f))["spill_stores"]]
        assert more, f"no TMA twin spills more than its pointer entry under Triton {version}: notebook 09 says some do"


@needs_nvidia
def test_decode_launches_compile_clean_for_turing(pinned):
    """The decode kernels on a T4 at d = 128: 16-key tiles (:data:`~diffattn_tutorial.kernels.triton.decode.BLOCK_KEYS_TURING`;
    64 spilled and needed 80 KiB of shared memory there), 8 warps, and the combine over 64 splits."""
    facts = pinned["decode"]
    assert [(f.kernel, f.block_n, f.num_warps) for f in facts] == [("_decode_partial", 16, 8),
                                                                   ("_decode_combine", 0, 4)], facts
    bad = {f"{f.kernel} {f.config}": f.problems() for f in facts if f.problems()}
    assert not bad, bad


def test_recorded_decode_facts_cover_every_case_and_are_current():
    assert tc.DECODE_FACTS_FILE.exists(), "run: python -m diffattn_tutorial.kernels.triton.aot --decode --all --write"
    rec, facts, lessons = tc.recorded_facts(tc.DECODE_FACTS_NAME)
    assert rec["schema"] == tc.SCHEMA and not lessons
    assert rec["source_hash"] == tc.decode_source_hash(), (
        "the decode kernels or their launch constants changed since diffattn_tutorial/recorded/"
        "compile_facts_decode.json was written; run python -m diffattn_tutorial.kernels.triton.aot --decode --all "
        "--write")
    assert rec["archs"] == list(tc.ARCHS), "a target is missing: ... aot --decode --all --archs ... --write"
    bad = [f"{f.kernel} d{f.head_dim} {f.dtype} {f.arch} {f.config} [{f.case}]: {f.problems()}"
           for f in facts if f.problems()]
    assert not bad, bad
    seen = {(f.arch, f.case, f.kernel, f.config) for f in facts}
    combines = {(f.arch, f.dtype, f.head_dim) for f in facts if f.kernel == "_decode_combine"}
    for case, _ in tc.decode_cases():
        for arch in tc.ARCHS:
            on = tc.case_on(case, arch)
            if on is None:
                continue
            partial, combine = tc.launches_for(on, arch=arch)
            (c,) = partial.configs
            config = f"{partial.consts['BLOCK_M']}x{partial.consts['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
            assert (arch, on.label, "_decode_partial", config) in seen, (arch, on.label, config)
            assert (arch, on.dtype, on.head_dim) in combines
    assert {f.dtype for f in facts if f.arch == "sm_75"} == {"float16"}
