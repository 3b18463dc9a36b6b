"""Mutation test of the exercise checks (``tools/mutation.py``): one-edit mutants of every solution's answer
cells must fail their CHECK cell, the way ``diffattn-tutorial check`` grades a learner's notebook.

The operators: sign, axis, constant, index, exponent, reduction, transpose, one-minus, abs/clamp added or
dropped, renormalisation added, a term dropped, arguments swapped, off-by-one and a guard dropped. Everything
runs in this process (no Jupyter kernel per mutant), on one CPU thread per check.

At least 90% of the mutants must be caught, and every survivor must be listed in ``EQUIVALENT`` below with the
reason it is no mistake at all: a new survivor (a check that got weaker, or a solution edit that made a plausible
mistake slip through) fails this test, and so does a listed survivor that is caught now (remove it).

The counts (mutants, caught with a named hint, generic, crash, survived, per notebook) must equal the recorded
ones in ``diffattn_tutorial/recorded/mutation.json``, which the README's figures are generated from: after a
change to a solution or a check, run ``python tools/mutation.py --record`` and ``python tools/make_readme_tables.py``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("diffattn_mutation", ROOT / "tools" / "mutation.py")
mutation = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutation  # dataclasses look their module up there
_spec.loader.exec_module(mutation)

SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
    # the notebook-09 checks need Triton's interpreter: not installed, or left off by the GPU session
    SOLUTIONS = [p for p in SOLUTIONS if not p.name.startswith("09_")]

REQUIRED_OPERATORS = {"sign", "axis", "constant", "index", "exponent", "reduction", "transpose", "one-minus",
                      "abs added", "clamp added", "abs/clamp dropped", "renormalisation added", "term dropped",
                      "arguments swapped", "off-by-one", "guard dropped"}

# Survivors that are no mistake: each computes exactly what the solution computes, on every input the task allows.
EQUIVALENT = {
    # +inf (a perfectly matched amplifier) is positive: its absolute value and its clamp at 0 are +inf.
    "01_differential_amplifier task 3 | abs added: math.inf -> _mut.abs(math.inf, returned=True)",
    "01_differential_amplifier task 3 | clamp added: math.inf -> _mut.clamp0(math.inf, returned=True)",
    # lambda_init = 0.8 - 0.6 exp(-0.3 depth) lies in [0.2, 0.8) for every depth >= 0: never negative.
    "04_lambda_reparameterisation task 1 | abs added: 0.8 - 0.6 * math.exp(-0.3 * depth) -> "
    "_mut.abs(0.8 - 0.6 * math.exp(-0.3 * depth), returned=True)",
    "04_lambda_reparameterisation task 1 | clamp added: 0.8 - 0.6 * math.exp(-0.3 * depth) -> "
    "_mut.clamp0(0.8 - 0.6 * math.exp(-0.3 * depth), returned=True)",
    # A ratio of two magnitudes (|logits|) is never negative.
    "07_experiments task 2 | abs added: (magnitude.max() / magnitude.median()).item() -> "
    "_mut.abs((magnitude.max() / magnitude.median()).item(), returned=True)",
    "07_experiments task 2 | clamp added: (magnitude.max() / magnitude.median()).item() -> "
    "_mut.clamp0((magnitude.max() / magnitude.median()).item(), returned=True)",
    # A FLOP count is never negative.
    "08_gpu_sdpa task 2 | abs added: total * (0.5 if causal else 1.0) -> "
    "_mut.abs(total * (0.5 if causal else 1.0), returned=True)",
    "08_gpu_sdpa task 2 | clamp added: total * (0.5 if causal else 1.0) -> "
    "_mut.clamp0(total * (0.5 if causal else 1.0), returned=True)",
    # The running sum l is a sum of exp2(...) >= 0 terms, before and after the step: abs and clamp keep it.
    "09_triton_kernel task 1 | abs added: (start of the function) -> l = tl.abs(l)",
    "09_triton_kernel task 1 | clamp added: (start of the function) -> l = tl.maximum(l, 0.0)",
    "09_triton_kernel task 1 | abs added: l_new -> tl.abs(l_new)",
    "09_triton_kernel task 1 | clamp added: l_new -> tl.maximum(l_new, 0.0)",
    # max(a, b) == max(b, a).
    "09_triton_kernel task 1 | arguments swapped: tl.maximum(m, tl.max(s_t, 0)) -> tl.maximum(tl.max(s_t, 0), m)",
    # The finite reference for a row that has seen no key: any finite value gives weights exp2(-inf - c) = 0.
    "09_triton_kernel task 1 | constant: 0.0 -> 1.0",
    # The running sums l1, l2 are >= 0.
    "09_triton_kernel task 2 | abs added: (start of the function) -> l1 = tl.abs(l1)",
    "09_triton_kernel task 2 | clamp added: (start of the function) -> l1 = tl.maximum(l1, 0.0)",
    "09_triton_kernel task 2 | abs added: (start of the function) -> l2 = tl.abs(l2)",
    "09_triton_kernel task 2 | clamp added: (start of the function) -> l2 = tl.maximum(l2, 0.0)",
    # What a row with l == 0 is divided by: its accumulator is 0 too, so any nonzero divisor gives 0.
    "09_triton_kernel task 2 | constant: 1.0 -> 2.0",
    "09_triton_kernel task 2 | constant: 1.0 (#2) -> 2.0",
    # p1, p2 are probabilities, >= 0.
    "09_triton_kernel task 3 | abs added: (start of the function) -> p1 = tl.abs(p1)",
    "09_triton_kernel task 3 | clamp added: (start of the function) -> p1 = tl.maximum(p1, 0.0)",
    "09_triton_kernel task 3 | abs added: (start of the function) -> p2 = tl.abs(p2)",
    "09_triton_kernel task 3 | clamp added: (start of the function) -> p2 = tl.maximum(p2, 0.0)",
    # k_new and v_new hold one token, (B, H, 1, d): index 0 and index -1 of that dim are the same slice.
    "13_serving task 1 | index: 0 (#2) -> (-1)",
    "13_serving task 1 | index: 0 (#3) -> (-1)",
    # min is symmetric in its two arguments.
    "13_serving task 3 | arguments swapped: min(top_k, scaled.shape[-1]) -> min(scaled.shape[-1], top_k)",
    # min(a, b) == min(b, a): the warm-up factor is the same.
    "14_converting_trained_models task 3 | arguments swapped: min(1.0, t / warmup_steps) -> "
    "min(t / warmup_steps, 1.0)",
}


pytestmark = pytest.mark.slow  # mutates every solution answer and runs its check (about a minute)


@pytest.fixture(scope="module")
def reports():
    t0 = time.perf_counter()
    out = [mutation.run_notebook(p) for p in SOLUTIONS]
    s = mutation.summary(out)
    print(f"\nmutation test: {s['caught']}/{s['mutants']} caught ({s['rate']:.1%}; named hint "
          f"{s[mutation.CAUGHT_HINT]}), {s[mutation.SURVIVED]} survived, {time.perf_counter() - t0:.1f} s")
    return out


def test_every_exercise_is_mutated(reports):
    for r in reports:
        tasks = {o.mutant.task for o in r.outcomes}
        assert tasks, f"{r.path.name}: no mutants"
        assert len(r.outcomes) >= 5 * len(tasks), f"{r.path.name}: only {len(r.outcomes)} mutants"
    ops = {o.mutant.op for r in reports for o in r.outcomes}
    assert REQUIRED_OPERATORS <= ops, f"operators that made no mutant: {sorted(REQUIRED_OPERATORS - ops)}"


def test_checks_are_fast(reports):
    """Each check, on the right answer (the slowest case: every input runs), takes a few seconds at most."""
    slow = {f"{r.path.stem} task {t}": round(sec, 2) for r in reports for t, sec in r.check_seconds.items() if sec > 5}
    assert not slow, f"checks slower than 5 s: {slow}"


def test_every_named_mistake_gets_a_named_hint(reports):
    """The mistakes learners were seen to make (``NAMED_MISTAKES``) are each caught with a hint that names them."""
    named = [o for r in reports for o in r.outcomes if o.mutant.op == "named"]
    ran = {r.path.stem for r in reports}
    assert len(named) == sum(len(v) for (nb, _), v in mutation.NAMED_MISTAKES.items() if nb in ran)
    generic = [f"{o.mutant.key}: {o.status}: {o.message[:160]}" for o in named if o.status != mutation.CAUGHT_HINT]
    assert not generic, "named mistakes without a named hint:\n" + "\n".join(generic)


def test_a_named_mistake_follows_the_solution():
    src = "def f(x):\n    return x.sum(0)\n"
    mutation.NAMED_MISTAKES[("t", 1)] = [((("x.sum(0)", "x.sum(1)"),), "the wrong axis")]
    try:
        [m] = mutation.named_mutants(src, notebook="t", task=1)
        assert m.source == "def f(x):\n    return x.sum(1)\n" and m.op == "named"
        with pytest.raises(ValueError, match="expects 'x.sum\\(0\\)'"):
            mutation.named_mutants("def f(x):\n    return x.mean(0)\n", notebook="t", task=1)
    finally:
        del mutation.NAMED_MISTAKES[("t", 1)]


def test_at_least_90_percent_are_caught(reports):
    s = mutation.summary(reports)
    assert s["rate"] >= 0.90, f"only {s['caught']}/{s['mutants']} mutants caught ({s['rate']:.1%})"


def test_every_survivor_is_argued_equivalent(reports):
    survivors = {o.mutant.key for r in reports for o in r.outcomes if o.status == mutation.SURVIVED}
    new = sorted(survivors - EQUIVALENT)
    assert not new, "mutants no check catches (make a check catch them, or argue them equivalent in " \
                    "EQUIVALENT):\n" + "\n".join(new)
    ran = {r.path.stem for r in reports}
    stale = sorted(k for k in EQUIVALENT - survivors if k.split(" task ")[0] in ran)
    assert not stale, "listed as equivalent but caught now (or gone), remove them:\n" + "\n".join(stale)


def test_the_counts_are_the_recorded_ones(reports):
    """The README's mutation figures come from the record: a live run must give exactly its counts."""
    recorded = json.loads(mutation.RECORD.read_text())
    assert {"command", "date", "python", "torch", "device"} <= set(recorded)
    live = mutation.counts(reports)
    differ = {name: {"live": c, "recorded": recorded["notebooks"].get(name)} for name, c in live["notebooks"].items()
              if c != recorded["notebooks"].get(name)}
    assert not differ, ("the mutation counts differ from diffattn_tutorial/recorded/mutation.json: run `python "
                        f"tools/mutation.py --record` and `python tools/make_readme_tables.py`: {differ}")
    if len(reports) == len(recorded["notebooks"]):
        assert live["total"] == recorded["total"]


def test_the_mutants_are_one_edit_each():
    src = "def f(x, w):\n    return (1 - w) * x.sum(-1)\n"
    ms = mutation.mutants_of(src, notebook="t", task=1)
    assert len({m.source for m in ms}) == len(ms) and all(m.source != src for m in ms)
    assert {m.op for m in ms} >= {"one-minus", "axis", "reduction", "term dropped", "sign", "abs added"}
    one_minus = [m for m in ms if m.op == "one-minus"]
    assert [m.source for m in one_minus] == ["def f(x, w):\n    return (w) * x.sum(-1)\n"]
