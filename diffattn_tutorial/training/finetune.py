"""Fine-tune notebook 07's trained baseline after converting it to differential attention (notebook 14).

:func:`finetune_study` takes the baseline :func:`~diffattn_tutorial.training.study.retrieval_study` trained (from
the cache when notebook 07 ran), converts it with :func:`diffattn_tutorial.layers.convert.convert_model`
(``attention="diff_v2"`` or ``"diff"``; ``"baseline"`` keeps it as it is, to continue its training for the same
budget), measures the gap the conversion opens (largest logit change and retrieval loss on the evaluation data),
fine-tunes with the study's own loop (:func:`~diffattn_tutorial.training.study.train_toy_model`) and measures the
result with the study's :func:`~diffattn_tutorial.training.study.measure`.

While it trains, the loop's step function (``train_toy_model(on_step=...)``) raises the negative branch's factor
``lambda_mix`` of a conversion with ``warmup=True`` linearly from 0 to 1 over ``warmup_steps``
(:func:`~diffattn_tutorial.layers.convert.warmup_mix` of the step number) before each step's forward, and forward
hooks record every layer's lambda at every step (V1: the scalar; V2: the mean of the per-token lambda over the batch).
With ``cache=True`` the fine-tuned weights, losses, lambdas and metrics are saved like notebook 07's models
(:mod:`~diffattn_tutorial.training.cache`; the key holds the config, the base run's key and the source of the study,
the conversion and this module), so a second run loads them.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from types import ModuleType
from typing import Callable, Mapping, Optional

import torch
import torch.nn.functional as F

from diffattn_tutorial.layers import convert as convert_mod
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadDiffAttn
from diffattn_tutorial.layers.convert import (
    conversion_options,
    convert_model,
    finish_warmup,
    set_warmup,
    warmup_layers,
    warmup_mix,
)
from diffattn_tutorial.training.cache import CacheSetting, cache_file, cache_lock, read_cached, write_cached
from diffattn_tutorial.training.needle import IGNORE
from diffattn_tutorial.training.study import (
    StudyConfig,
    StudyMetrics,
    deterministic,
    measure,
    retrieval_study,
    study_sources,
    train_toy_model,
)

Tensor = torch.Tensor

LR_WARMUP = 10
"""Learning-rate warm-up steps of a fine-tune (the study's schedule, shortened: the weights are trained already)."""


def _option_pairs(options: object) -> tuple[tuple[str, object], ...]:
    """``options`` (a mapping or ``(name, value)`` pairs) as sorted pairs, the one form whose repr is the cache key;
    a name given twice is refused (the conversion would see the last, the key both)."""
    items = list(options.items()) if isinstance(options, Mapping) else options
    pairs = isinstance(items, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == 2
                                                     and isinstance(p[0], str) for p in items)
    if not pairs:
        raise TypeError(f"options must be (name, value) pairs or a dict, got {options!r}")
    names = [name for name, _ in items]
    for name in names:
        if names.count(name) > 1:
            raise ValueError(f"option {name!r} given twice in {options!r}: give each once")
    return tuple(sorted(((name, value) for name, value in items), key=lambda p: p[0]))


@dataclass(frozen=True)
class FinetuneConfig:
    """One fine-tune: the base run, the conversion and the budget.

    Attributes:
        attention: ``"baseline"`` (no conversion: continue training), ``"diff"`` (V1) or ``"diff_v2"``.
        options: the conversion's options as sorted ``(name, value)`` pairs (see ``layers.convert``).
        steps, lr, batch_size: the fine-tuning budget (AdamW, ``LR_WARMUP`` steps of warm-up, cosine decay).
        warmup_steps: steps over which ``lambda_mix`` goes from 0 to 1 (needs ``warmup=True`` in ``options``).
        seed: seeds the fine-tuning data (and the new lambda parameters); 1 by default, so the batches differ
            from the ones the base run (seed 0) trained on.
        base: the :class:`StudyConfig` of the baseline to start from (notebook 07's by default).
    """

    attention: str
    options: tuple[tuple[str, object], ...] = ()
    steps: int = 100
    lr: float = 1e-3
    batch_size: int = 32
    warmup_steps: int = 0
    seed: int = 1
    base: StudyConfig = field(default_factory=lambda: StudyConfig("baseline"))

    def __post_init__(self) -> None:
        if self.attention not in ("baseline", "diff", "diff_v2"):
            raise ValueError(f"attention must be 'baseline', 'diff' or 'diff_v2', got {self.attention!r}")
        for name, least in (("steps", 1), ("batch_size", 1), ("warmup_steps", 0), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a positive finite number, got {self.lr!r}")
        if not isinstance(self.base, StudyConfig):
            raise TypeError(f"base must be a StudyConfig (the baseline run to start from, e.g. "
                            f"StudyConfig('baseline', steps=500)), got {type(self.base).__name__} {self.base!r}")
        if self.base.attention != "baseline":
            raise ValueError(f"base must be a baseline run, got attention={self.base.attention!r}")
        object.__setattr__(self, "options", _option_pairs(self.options))
        if self.attention == "baseline" and self.options:
            raise ValueError("attention='baseline' continues training without a conversion: pass no options")
        warm = False  # every option's value checked now, before the base run trains (layers.convert)
        if self.attention != "baseline":
            warm = conversion_options(self.attention, **dict(self.options))["warmup"]
        if self.warmup_steps and not warm:
            raise ValueError("warmup_steps needs a conversion with warmup=True (a lambda_mix to raise)")
        if warm and not 0 < self.warmup_steps < self.steps:
            raise ValueError(f"warmup=True needs 0 < warmup_steps < steps={self.steps}, got {self.warmup_steps}")

    def cache_key(self) -> dict:
        """Everything that changes the fine-tuned weights, as text (with :func:`sources`, the cache key)."""
        key = {f.name: repr(getattr(self, f.name)) for f in fields(self) if f.name != "base"}
        key.update(attention=f"finetune_{self.attention}", seed=self.seed, base=repr(self.base.cache_key()))
        return key


def sources() -> tuple[ModuleType, ...]:
    """The modules whose source a fine-tune's numbers depend on: the study's, the conversion and this one."""
    return (*study_sources(), convert_mod, sys.modules[__name__])


@dataclass
class FinetuneResult:
    """A fine-tuned model and its measurements.

    Attributes:
        config: the run. metrics: :class:`StudyMetrics` after fine-tuning. losses: per step.
        lambdas: per step, one lambda per layer (V1: the scalar, times ``lambda_mix``; V2: the batch mean of the
            per-token lambda, times ``lambda_mix``); None for the baseline.
        conversion_logit_error: largest ``|logit|`` change the conversion makes on the evaluation data (0 for
            the baseline). conversion_loss: retrieval loss of the converted model before fine-tuning, next to
            ``base_loss``, the baseline's, on the same data.
        seconds: fine-tuning wall time (when it was trained). cached: loaded from the cache.
        model: the fine-tuned model (warm-up finished: plain layers), eval mode.
    """

    config: FinetuneConfig
    metrics: StudyMetrics
    losses: list[float]
    lambdas: Optional[list[list[float]]]
    conversion_logit_error: float
    conversion_loss: float
    base_loss: float
    seconds: float
    cached: bool
    model: torch.nn.Module


@torch.no_grad()
def _eval_loss(model: torch.nn.Module, tokens: Tensor, targets: Tensor) -> tuple[Tensor, float]:
    logits = model(tokens)
    return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE).item()


def _warmup_and_record(model: torch.nn.Module, warmup_steps: int) -> tuple[list, Callable[[int], None], list]:
    """The fine-tune's step function and lambda record: before step ``t``'s forward, ``on_step(t)`` sets the
    warm-up's ``lambda_mix`` to ``warmup_mix(t, warmup_steps)`` (a conversion with ``warmup=True``) and opens the
    step's row; forward hooks write each layer's lambda of that step's first training forward into it."""
    record: list[list[float]] = []
    layers = [m for m in model.modules() if isinstance(m, (DiffAttnV2, MultiheadDiffAttn))]
    warm = bool(warmup_layers(model))

    def on_step(t: int) -> None:
        if warm:
            set_warmup(model, warmup_mix(t, warmup_steps))
        record.append([])

    def after(layer, args, output):
        if layer.training and record and len(record[-1]) < len(layers):
            lam = layer.lambda_full(args[0]) if isinstance(layer, DiffAttnV2) else layer.lambda_full()
            record[-1].append(lam.detach().float().mean().item())

    return record, on_step, [layer.register_forward_hook(after) for layer in layers]


def run_finetune(config: FinetuneConfig, *, cache: CacheSetting = False, progress: bool = True) -> FinetuneResult:
    """Load (or train) the base run, convert it, measure the conversion's gap, fine-tune (or load), measure."""
    base = retrieval_study("baseline", cache=cache, progress=progress,
                           **{f.name: getattr(config.base, f.name) for f in fields(config.base) if f.name != "attention"})
    batch = base.eval_batch
    path = cache_file(cache, config.cache_key(), sources()) if cache else None
    with deterministic(config.base.num_threads), cache_lock(path):
        torch.manual_seed(config.seed)  # the new lambda parameters
        model = copy.deepcopy(base.model) if config.attention == "baseline" else \
            convert_model(base.model, config.attention, **dict(config.options))
        base_logits, base_loss = _eval_loss(base.model, batch.tokens, batch.targets)
        logits, conv_loss = _eval_loss(model, batch.tokens, batch.targets)
        gap = (logits - base_logits).abs().max().item()
        saved = read_cached(path)
        if saved is not None:
            model.load_state_dict(saved["state_dict"])
            losses, lambdas, seconds = saved["losses"], saved["lambdas"], saved["seconds"]
        else:
            lambdas, on_step, handles = _warmup_and_record(model, config.warmup_steps)
            t0 = time.perf_counter()
            try:
                losses = train_toy_model(model, config.base.task, steps=config.steps, batch_size=config.batch_size,
                                         lr=config.lr, settings=config.base.settings, warmup=LR_WARMUP,
                                         seed=config.seed, progress=progress, desc=f"fine-tune {config.attention}",
                                         on_step=on_step)
            finally:
                for h in handles:
                    h.remove()
            seconds = time.perf_counter() - t0
        entry = saved or {"state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},  # warm-up
                          "losses": losses, "seconds": seconds, "lambdas": lambdas}                       # layers
        if warmup_layers(model):
            set_warmup(model, 1.0)
            finish_warmup(model)
        model.eval()
        if "metrics" in entry:  # measured by this code when it was fine-tuned (the cache key says so)
            metrics = StudyMetrics(**entry["metrics"])
        else:
            metrics, _ = measure(model, config.base.task, config.base.settings, config.base.n_eval, config.base.device)
            if path is not None:
                write_cached(path, {**entry, "metrics": asdict(metrics)})
    return FinetuneResult(config=config, metrics=metrics, losses=losses,
                          lambdas=lambdas if config.attention != "baseline" else None,
                          conversion_logit_error=gap, conversion_loss=conv_loss, base_loss=base_loss,
                          seconds=seconds, cached=saved is not None, model=model)


def finetune_study(attention: str, *, cache: CacheSetting = False, progress: bool = True, steps: int = 100,
                   lr: float = 1e-3, batch_size: int = 32, warmup_steps: int = 0, seed: int = 1,
                   base: Optional[StudyConfig] = None, **options) -> FinetuneResult:
    """``run_finetune(FinetuneConfig(attention, options, ...))``: the short form notebook 14 uses, e.g.
    ``finetune_study("diff_v2", negative="mirror", cache=True)``. ``options`` go to the conversion."""
    config = FinetuneConfig(attention, tuple(sorted(options.items())), steps=steps, lr=lr, batch_size=batch_size,
                            warmup_steps=warmup_steps, seed=seed, **({"base": base} if base is not None else {}))
    return run_finetune(config, cache=cache, progress=progress)


__all__ = ["LR_WARMUP", "FinetuneConfig", "FinetuneResult", "run_finetune", "finetune_study"]
