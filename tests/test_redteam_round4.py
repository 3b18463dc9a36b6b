"""Issue 48's closing red-team pass over the round's changed entry points (the CPU kernel's boundary, the Triton
public path, conversion's warm-up, the loaders, the training cache, validation's checkers, the registry, the
CLI and decoding): each failure found, reproduced first. Crash-prone cases run in a child process."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from forked import run_module

from diffattn_tutorial import validation
from diffattn_tutorial.functional import diff_attention


def inputs(d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 5, d, generator=g), torch.randn(1, 4, 5, d, generator=g),
            torch.randn(1, 2, 5, 2 * d, generator=g))


def run_child(module: str) -> str:
    """``python -m children.MODULE`` in a child process (the kernel loads there); its stdout. Fails on a nonzero
    exit."""
    proc = run_module(f"children.{module}", timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_cpu_fused_inference_under_a_meta_default_device():
    """The operator's scan flag was made by ``torch.tensor(flag)`` on the default device: under
    ``with torch.device("meta")`` every CPU inference call through the fused kernel failed with "Tensor.item() cannot
    be called on meta tensors"."""
    out = run_child("meta_device_inference").split()
    assert out[:2] == ["cpu", "cpu"] and float(out[2]) < 1e-5


@pytest.mark.parametrize("lam", [np.float32(0.5), np.float64(0.5), np.int64(1)])
def test_lam_as_a_numpy_number(lam):
    """A numpy number (an ``np.float32`` read from an array, as ``scale`` and ``dropout_p`` take) was refused with
    "lam must be a float or a tensor, got float32"; it is a number like 0.5."""
    q, k, v = inputs()
    expected = diff_attention(q, k, v, float(lam), backend="naive")
    assert torch.equal(diff_attention(q, k, v, lam, backend="naive"), expected)


@pytest.mark.parametrize("lam", [np.bool_(True), True, "0.5", np.array([0.5])])
def test_lam_refused_when_not_a_number(lam):
    q, k, v = inputs()
    with pytest.raises(TypeError, match="lam must be"):
        diff_attention(q, k, v, lam, backend="naive")


def test_scale_too_large_for_a_float_named():
    """``scale=10**400`` gave OverflowError "int too large to convert to float" from inside the check."""
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        validation.check_scale(10 ** 400)
    q, k, v = inputs()
    with pytest.raises(ValueError, match="scale must be a positive finite number"):
        diff_attention(q, k, v, 0.5, scale=10 ** 400)


@pytest.mark.parametrize("p", ["0.1", None, torch.tensor(0.1), np.bool_(True)])
def test_dropout_p_not_a_number_named(p):
    """``dropout_p="0.1"`` gave "'<=' not supported between instances of 'float' and 'str'"."""
    q, k, v = inputs()
    with pytest.raises(TypeError, match="dropout_p must be a number"):
        diff_attention(q, k, v, 0.5, dropout_p=p, backend="naive")


def test_dropout_p_numpy_number_taken():
    q, k, v = inputs()
    assert torch.equal(diff_attention(q, k, v, 0.5, dropout_p=np.float32(0.0), backend="naive"),
                       diff_attention(q, k, v, 0.5, backend="naive"))


# --- the interop loaders ------------------------------------------------------------------------------------------


def unilm_state():
    from diffattn_tutorial import interop
    from diffattn_tutorial.layers.attention import MultiheadDiffAttn

    torch.manual_seed(0)
    return interop.to_unilm(MultiheadDiffAttn(16, 2, depth=0))


@pytest.mark.parametrize("kind, match", [
    ("bool", "is torch.bool"), ("int", "is torch.int64"), ("complex", "is torch.complex64"),
    ("meta", "meta tensor"), ("sparse", "sparse_coo"), ("int_key", "key 0 is not a string")])
def test_loader_refuses_values_it_cannot_load(kind, match):
    """A bool or int checkpoint entry was cast to 0/1 or whole numbers, a complex one lost its imaginary part (a
    warning only); a meta tensor or a sparse one gave torch's copy error, an int key AttributeError 'partition'."""
    from diffattn_tutorial import interop

    sd = dict(unilm_state())
    w = sd["q_proj.weight"]
    change = {"bool": lambda: {"q_proj.weight": w > 0}, "int": lambda: {"q_proj.weight": w.long()},
              "complex": lambda: {"q_proj.weight": w.to(torch.complex64)},
              "meta": lambda: {"q_proj.weight": w.to("meta")},
              "sparse": lambda: {"q_proj.weight": w.to_sparse()}, "int_key": lambda: {0: w}}[kind]
    sd.update(change())
    with pytest.raises(TypeError, match=match):
        interop.from_unilm(sd, embed_dim=16, num_heads=2, depth=0)


def test_loader_under_a_meta_default_device_refused():
    """Under ``with torch.device("meta")`` the layer was built on meta and loading copied nothing into it: the
    loader returned a layer with no weights at all, without a word."""
    from diffattn_tutorial import interop

    sd = unilm_state()
    with torch.device("meta"), pytest.raises(ValueError, match="meta"):
        interop.from_unilm(sd, embed_dim=16, num_heads=2, depth=0)


def test_loader_takes_half_precision_values():
    from diffattn_tutorial import interop

    sd = {k: v.half() for k, v in unilm_state().items()}
    layer = interop.from_unilm(sd, embed_dim=16, num_heads=2, depth=0)
    assert torch.equal(layer.q_proj.weight, sd["q_proj.weight"].float())


# --- the training cache and the metrics log -----------------------------------------------------------------------


def test_write_cached_interrupted_leaves_no_temporary_file(tmp_path):
    """Only an OSError removed the temporary file: a payload torch.save cannot pickle (or a KeyboardInterrupt
    mid-write) left ``*.tmp<pid>_<thread>`` beside the cache entry for good."""
    from diffattn_tutorial.training.cache import write_cached

    path = tmp_path / "entry.pt"
    with pytest.raises(Exception):
        write_cached(path, {"state_dict": {}, "losses": [], "seconds": 0.0, "bad": lambda: None})
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("step", [float("nan"), "3", None, True, 2.5])
def test_truncate_after_refuses_a_step_that_is_not_a_whole_number(tmp_path, step):
    """``truncate_after(nan)`` dropped every record of the log (``s <= nan`` is False); a string raised ``'<='
    not supported`` only after reading the log."""
    from diffattn_tutorial.training.runlog import MetricsLog, read_records

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        log.write({"event": "step", "step": s})
    with pytest.raises(TypeError, match="step must be a whole number"):
        log.truncate_after(step)
    assert [r["step"] for r in read_records(log.path)] == [1, 2, 3]


def test_truncate_after_numpy_step(tmp_path):
    from diffattn_tutorial.training.runlog import MetricsLog, read_records

    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        log.write({"event": "step", "step": s})
    log.truncate_after(np.int64(2))
    assert [r["step"] for r in read_records(log.path)] == [1, 2]


# --- the backend registry -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(name=123), TypeError, "name must be a string"),
    (dict(name=None), TypeError, "name must be a string"),
    (dict(dtypes=torch.float32), TypeError, "dtypes must be a non-empty tuple of torch dtypes"),
    (dict(dtypes=("float32",)), TypeError, "dtypes must be a non-empty tuple of torch dtypes"),
    (dict(dtypes=()), TypeError, "dtypes must be a non-empty tuple of torch dtypes"),
    (dict(compute_dtype="float32"), TypeError, "compute_dtype must be None or a torch dtype"),
    (dict(backward="no"), TypeError, "backward must be True or False"),
    (dict(second_derivative=None), TypeError, "second_derivative must be True or False"),
    (dict(family="bogus"), ValueError, "family must be one of"),
])
def test_backend_construction_refuses_fields_that_would_fail_or_mislead_later(kwargs, error, match):
    """``Backend(123, ...)`` gave AttributeError 'isidentifier'; ``dtypes=("float32",)`` was taken and every call
    then refused with "takes float32, got float32"; ``dtypes=torch.float32`` failed each call with "argument of type
    'torch.dtype' is not iterable"; ``backward="no"`` was truthy."""
    from diffattn_tutorial.backends import Backend, get_backend

    fields = {**dict(name="mine", summary="s", run=get_backend("naive").run), **kwargs}
    with pytest.raises(error, match=match):
        Backend(**fields)


# --- decoding -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", [[float("nan"), 0.0], [float("inf"), 0.0], [float("-inf"), float("-inf")]])
def test_next_token_sampling_from_logits_with_no_distribution_named(row):
    """Sampling from logits holding NaN or +inf, or only -inf, gave torch.multinomial's "probability tensor
    contains either `inf`, `nan` or element < 0", naming neither ``logits`` nor the row."""
    from diffattn_tutorial.training.model import next_token

    logits = torch.tensor([[0.0, 1.0], row])
    with pytest.raises(ValueError, match=r"logits row 1 .* no distribution to sample"):
        next_token(logits, temperature=1.0)


# --- the fine-tune's config -----------------------------------------------------------------------------------------


def test_finetune_config_refuses_an_option_given_twice():
    """``options=(("warmup", True), ("warmup", False))`` was taken: the conversion saw the last (no warm-up) while the
    cache key held both."""
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises(ValueError, match="option 'negative' given twice"):
        FinetuneConfig("diff_v2", options=(("negative", "mirror"), ("negative", "zero")))


@pytest.mark.parametrize("options", [{"negative": "zero"}, [["negative", "zero"]], (("negative", "zero"),)])
def test_finetune_config_options_one_form_one_cache_key(options):
    """A dict or a list of lists was taken as it was: the frozen config could not be hashed and the same run had
    another cache key (its repr) than the sorted pairs it documents."""
    from diffattn_tutorial.training.finetune import FinetuneConfig

    config = FinetuneConfig("diff_v2", options=options)
    assert config.options == (("negative", "zero"),)
    hash(config)


def test_finetune_config_refuses_options_that_are_not_pairs():
    from diffattn_tutorial.training.finetune import FinetuneConfig

    with pytest.raises(TypeError, match=r"options must be \(name, value\) pairs"):
        FinetuneConfig("diff_v2", options=("negative",))
