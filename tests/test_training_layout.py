"""training/'s layout (issue 50, item 5): the trainers stand on their own modules, not on the toy study; one file
lock and one cache key for the study and the fine-tunes; the warm-up is a buffer of the plain layers, stepped by the
fine-tune loop's step number; the conversion's option sets checked in one place."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import pytest
import torch

import diffattn_tutorial.training as training_pkg
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.layers.convert import conversion_options, convert_layer, convert_model, why_not_exact
from diffattn_tutorial.training.cache import cache_lock
from diffattn_tutorial.training.model import build_model
from diffattn_tutorial.training.needle import NeedleTask

TRAINING = Path(training_pkg.__file__).parent


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """``(module, names)`` of every ``from module import names`` and ``import module`` in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
    return out


def test_the_trainers_import_nothing_from_the_toy_study():
    study = "diffattn_tutorial.training.study"
    users = sorted(p.name for p in TRAINING.glob("*.py")
                   if any(m == study or (m == "diffattn_tutorial.training" and "study" in names)
                          for m, names in _imports(p)))
    assert users == ["finetune.py"]  # the fine-tunes of the study's baseline, through its public names only
    private = [(m, n) for m, names in _imports(TRAINING / "finetune.py") for n in names if n.startswith("_")]
    assert private == []


def test_one_file_lock_and_no_posix_only_locks():
    root = TRAINING.parents[1]  # the repository: the package, the test set-up, the tools
    users = [p.relative_to(root).as_posix() for folder in ("diffattn_tutorial", "tools", "benchmarks")
             for p in (root / folder).rglob("*.py") if "import fcntl" in p.read_text()]
    users += [name for name in ("conftest.py", "tests/conftest.py") if "import fcntl" in (root / name).read_text()]
    assert users == []  # file locks are filelock's (every platform), as in training/cache.py


def test_the_cache_lock_makes_a_second_holder_wait(tmp_path):
    entry, order = tmp_path / "study_x.pt", []

    def second():
        with cache_lock(entry):
            order.append("second")

    with cache_lock(entry):
        waiter = threading.Thread(target=second)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()
        order.append("first")
    waiter.join(30)
    assert order == ["first", "second"]


@pytest.mark.parametrize("attention,options,cls", [("diff_v2", dict(negative="zero"), DiffAttnV2),
                                                   ("diff", dict(heads="double", subln=False), MultiheadDiffAttn)])
def test_the_warmup_is_a_buffer_of_the_plain_layer(attention, options, cls):
    fresh = DiffAttnV2(32, 4) if cls is DiffAttnV2 else MultiheadDiffAttn(32, 2)
    assert fresh.lambda_mix is None and "lambda_mix" not in fresh.state_dict()
    torch.manual_seed(0)
    warm = convert_layer(MultiheadAttention(32, 4), attention, warmup=True, **options)
    assert type(warm) is cls and float(warm.state_dict()["lambda_mix"]) == 0.0


def test_the_finetune_steps_the_warmup_by_the_step_number_not_by_forward_calls():
    """A second forward in a step (an evaluation, a gradient-accumulation micro-batch) must not move the warm-up."""
    from diffattn_tutorial.training import finetune

    torch.manual_seed(0)
    task = NeedleTask(context_len=12)
    base = build_model("baseline", task.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=task.seq_len(2))
    model = convert_model(base, "diff_v2", negative="zero", warmup=True).train()
    record, on_step, handles = finetune._warmup_and_record(model, warmup_steps=4)
    tokens = task.sample(2, 2, 2, generator=torch.Generator().manual_seed(0)).tokens
    try:
        for t in range(3):
            on_step(t)
            model(tokens)
            model(tokens)  # a second forward in the same step
    finally:
        for h in handles:
            h.remove()
    assert [row[0] for row in record] == [0.0, 0.125, 0.25]  # mix t / 4 times lambda = sigmoid(0)
    assert float(model.blocks[0].attn.lambda_mix) == 0.5


def test_train_toy_model_calls_on_step_before_each_forward():
    from diffattn_tutorial.training.study import train_toy_model

    torch.manual_seed(0)
    task = NeedleTask(context_len=12)
    model = build_model("baseline", task.vocab_size, d_model=16, n_layers=1, n_heads=2, max_len=task.seq_len(2))
    events = []
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    train_toy_model(model, task, steps=3, batch_size=2, settings=((1, 1),), progress=False,
                    on_step=lambda t: events.append(t))
    assert events == [0, "forward", 1, "forward", 2, "forward"]


@pytest.mark.parametrize("attention,options", [
    ("diff_v2", dict(negative="bogus")), ("diff", dict(heads="tripple")), ("diff", dict(negative="mirror")),
    ("diff_v2", dict(warmup="no")), ("diff", dict(subln="no")), ("diff_v2", dict(heads="split")),
])
def test_one_check_of_the_option_sets_gives_every_entry_point_the_same_answer(attention, options):
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises((TypeError, ValueError)) as want:
        conversion_options(attention, **options)
    calls = [lambda: why_not_exact(attention, **options),
             lambda: convert_layer(MultiheadAttention(32, 4), attention, **options),
             lambda: FinetuneConfig(attention, tuple(sorted(options.items())))]
    for call in calls:
        with pytest.raises(type(want.value)) as got:
            call()
        assert str(got.value) == str(want.value)
