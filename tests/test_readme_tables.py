"""The README's measured tables and figures are generated from the results files (``tools/make_readme_tables.py``):
the committed README must be what the files give, and the tool must notice a hand edit, a stale file and a
missing or unknown block."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_readme_tables.py"
_spec = importlib.util.spec_from_file_location("make_readme_tables", TOOL)
tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tables)


def test_the_committed_readme_is_what_the_results_files_give():
    run = subprocess.run([sys.executable, str(TOOL), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_hand_edited_number_is_caught(tmp_path):
    text = (ROOT / "README.md").read_text()
    block = next(m for m in tables.BLOCK.finditer(text) if m.group("name") == "cpu-table")
    body = block.group("body")
    edited = body.replace("| naive |", "| naive (hand-edited) |", 1)
    assert edited != body
    readme = tmp_path / "README.md"
    readme.write_text(text.replace(body, edited))
    assert "cpu-table" not in tables.stale_blocks(text)
    assert "cpu-table" in tables.stale_blocks(readme.read_text())
    assert tables.main(["--check", "--readme", str(readme)]) == 1
    assert tables.main(["--readme", str(readme)]) == 0 and tables.stale_blocks(readme.read_text()) == []


def test_a_block_nobody_writes_or_a_missing_block_is_an_error():
    text = (ROOT / "README.md").read_text()
    with pytest.raises(SystemExit, match="no generator writes"):
        tables.render(text + "\n<!-- generated:no-such-block -->\n<!-- /generated -->\n")
    without = tables.BLOCK.sub(lambda m: "" if m.group("name") == "mutation" else m.group(0), text)
    with pytest.raises(SystemExit, match="lacks the generated blocks"):
        tables.render(without)


def test_the_gpu_block_shows_each_recorded_session_or_says_none_is(tmp_path, monkeypatch):
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    assert tables.gpu_block(tmp_path).startswith("**GPU speed: not yet measured.**")
    from diffattn_tutorial.measure import gpu

    session = {"schema": gpu.SESSION_SCHEMA, "recorded": {"device": "Tesla T4", "date": "2026-01-02 03:04 UTC"},
               "steps": {"tests": {"status": "passed", "seconds": 61.2, "what": "w", "command": "c", "returncode": 0}}}
    gpu.write_json(gpu.recorded_path("gpu_session", "Tesla T4", tmp_path), session)
    block = tables.gpu_block(tmp_path)
    assert block.startswith("**Recorded on Tesla T4**")
    assert "`tests` passed (61 s)" in block and "2026-01-02 03:04 UTC" in block
    assert "best SDPA" not in block  # no bench_triton file beside it: no table


def test_the_compile_facts_block_compares_the_triton_the_gpu_sessions_ran(tmp_path, monkeypatch):
    """The sm_90a compiles of the GPU sessions' Triton against the record's, entry by entry; nothing when the
    sessions ran the record's Triton; a sentence saying so when that version's compiles are not recorded."""
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    from diffattn_tutorial.measure import gpu

    session = {"schema": gpu.SESSION_SCHEMA, "recorded": {"device": "NVIDIA H100", "triton": "3.6.0"}, "steps": {}}
    gpu.write_json(gpu.recorded_path("gpu_session", "NVIDIA H100", tmp_path), session)

    def fact(m, regs, spill, arch="sm_90a", tma=False):
        return {"kernel": "_k", "form": "map", "case": "d64 bfloat16", "arch": arch, "block_m": m, "block_n": 64,
                "num_warps": 8, "num_stages": 2, "tma": tma, "regs": regs, "spill_stores": spill,
                "spill_loads": spill}

    ours = [fact(64, 200, 0), fact(128, 255, 24), fact(32, 100, 0), fact(64, 90, 0, arch="sm_80"),
            fact(16, 80, 0)]
    assert tables._other_triton(ours, "3.9.0", tmp_path) == (
        "\nThe recorded GPU sessions ran Triton 3.6.0; no sm_90a compile with it is recorded.\n")
    assert tables._other_triton(ours, "3.6.0", tmp_path) == ""  # the record is that Triton's own
    theirs = {"recorded": {"triton": "3.6.0", "date": "d", "command": "c", "source_hash": "h"},
              "facts": [fact(64, 255, 16), fact(128, 250, 0), fact(32, 100, 0), fact(64, 90, 8, tma=True)]}
    (tmp_path / "compile_facts_sm90a_triton-3.6.0.json").write_text(json.dumps(theirs))
    text = tables._other_triton(ours, "3.9.0", tmp_path)
    assert "kernel source hash h) compiles" in text  # no record hash given: nothing said of it
    assert "kernel source hash h, the record's) compiles" in tables._other_triton(ours, "3.9.0", tmp_path,
                                                                                record_hash="h")
    assert "not the record's g: compiled from another kernel source, so what follows is stale" in \
        tables._other_triton(ours, "3.9.0", tmp_path, record_hash="g")
    assert "3 of the 4 sm_90a compiles above have a counterpart there" in text  # not sm_80's, not the unmatched one
    assert "Registers per thread differ in 2 of them (-5 to +55); 1 spill there against 1 here" in text
    assert "Clean here, spilling there (1): `_k` (map) 64x64 w8 s2 [d64 bfloat16] 16 B stored" in text
    assert "Spilling here, clean there (1): `_k` (map) 128x64 w8 s2 [d64 bfloat16] 24 B stored here" in text


def test_the_launches_of_one_configuration_pair_in_order_or_not_at_all(tmp_path, monkeypatch):
    """A configuration launched once per map is two compiles alike: they pair first with first, second with
    second; where one file holds another number of them, none of them pairs (which would be which is unknown)."""
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    from diffattn_tutorial.measure import gpu

    session = {"schema": gpu.SESSION_SCHEMA, "recorded": {"device": "NVIDIA H100", "triton": "3.6.0"}, "steps": {}}
    gpu.write_json(gpu.recorded_path("gpu_session", "NVIDIA H100", tmp_path), session)

    def fact(m, regs, spill):
        return {"kernel": "_k", "form": "map", "case": "d128 bfloat16", "arch": "sm_90a", "block_m": m,
                "block_n": 64, "num_warps": 8, "num_stages": 2, "tma": False, "regs": regs, "spill_stores": spill,
                "spill_loads": spill}

    def compare(ours, theirs):
        data = {"recorded": {"triton": "3.6.0"}, "facts": theirs}
        (tmp_path / "compile_facts_sm90a_triton-3.6.0.json").write_text(json.dumps(data))
        return tables._other_triton(ours, "3.9.0", tmp_path)

    ours = [fact(128, 200, 0), fact(128, 210, 0), fact(64, 150, 8)]
    text = compare(ours, [fact(128, 200, 0), fact(128, 230, 12), fact(64, 150, 16)])
    assert "3 of the 3 sm_90a compiles above have a counterpart there" in text
    assert "Registers per thread differ in 1 of them (+0 to +20)" in text  # the second launch against the second
    assert "Clean here, spilling there (1): `_k` (map) 128x64 w8 s2 [d128 bfloat16] (launch 2 of 2) 12 B" in text
    assert "Spilling in both, by a different amount: 1." in text
    text = compare(ours, [fact(128, 230, 12), fact(64, 150, 0), fact(32, 90, 0)])  # one of the two launches
    assert "1 of the 3 sm_90a compiles above have a counterpart there" in text
    assert "Clean here, spilling there (0): none" in text and "2 compiles there have none here" in text


def test_speedup_is_a_ratio_of_medians():
    # per-round ratios 4, 1, 1 have median 1; the medians 2 and 1 give 2: the project's definition is the second
    assert tables.speedup([4.0, 2.0, 1.0], [1.0, 2.0, 1.0]) == pytest.approx(2.0)


def test_every_results_file_says_how_it_was_made():
    """Device, versions, date and command: each is in the file, or the file says it was not recorded."""
    files = sorted((ROOT / "benchmarks").glob("results_*.json")) + [tables.MUTATION]
    for path in files:
        data = json.loads(path.read_text())
        missing = {"device", "torch", "python", "date", "command"} - set(data)
        assert not missing, f"{path.name} lacks {sorted(missing)} (write 'not recorded' where a value is unknown)"


def test_the_mutation_block_reports_the_recorded_counts(tmp_path, monkeypatch):
    record = {"command": "python tools/mutation.py --record", "device": "CPU", "torch": "x", "python": "y",
              "date": "z", "total": {"mutants": 10, "caught": 9, "hint": 5, "generic": 4, "crash": 0, "survived": 1}}
    path = tmp_path / "mutation.json"
    path.write_text(json.dumps(record))
    monkeypatch.setattr(tables, "MUTATION", path)
    monkeypatch.setattr(tables, "ROOT", tmp_path)
    text = tables.mutation_block()
    assert "9 of 10 (90.0%; 5 of them with a named hint" in text and "The 1 survivors" in text


def test_the_readme_states_no_measured_number_by_hand():
    """Outside the generated blocks, a measured-looking number (a decimal, a multiple, a percentage, a large count:
    the drift test's rule) is allowed only where its sentence names an outside source (the paper, a datasheet)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import test_prose_drift as drift

    text = tables.BLOCK.sub("", (ROOT / "README.md").read_text())
    found = [f"{n.text!r} in: {sentence[:100]}" for block, _ in drift._blocks(drift._prose(text))
             for sentence in drift._sentences(block) if not drift.SOURCE.search(sentence)
             for n in drift.prose_numbers(sentence)]
    assert not found, "numbers written by hand in README.md (generate them, tools/make_readme_tables.py):\n" + \
        "\n".join(found)
