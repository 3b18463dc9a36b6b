"""Train a :class:`~diffattn_tutorial.training.model.TinyLM` on the multi-needle task and measure what the paper measures.

One study is three named steps, each usable on its own:

* :class:`StudyConfig` says what to train (attention kind, seed, budget, model shape, threads);
* :func:`run_study` loads it from the cache or trains it (:func:`train_toy_model`), then :func:`measure` finds
  :class:`StudyMetrics`: retrieval ``accuracy`` per ``needles/queried`` setting (Table 2), the share of the
  query's attention on the answer needle and on the rest of the haystack (Table 3), and the largest and median
  attention logit ``|q.k| / sqrt(d)`` and their ratio (Table 5);
* the :class:`StudyResult` holds the config, the metrics, the losses and the trained model;
  :meth:`StudyResult.summary` is the row a results file records.

:func:`retrieval_study` is the short form the notebooks use: ``retrieval_study("diff", seed=0, cache=True)``.
With ``cache=True`` a run's weights and losses are saved in the user's cache folder (:func:`cache_dir`) under a
key made of its config, the torch version and the source of the code that trains and measures, so a second
notebook asking for the same run (notebook 10 reusing notebook 07's) loads it instead of training again
(``result.cached`` says so).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from tqdm.auto import tqdm

from diffattn_tutorial.measure.attention_stats import (
    answer_noise_shares,
    top1_over_median,
)
from diffattn_tutorial.measure.cpu_threads import threads
from diffattn_tutorial.paths import cache_dir  # noqa: F401 - the study's cache folder, as the notebooks import it
from diffattn_tutorial.training.cache import CacheSetting, cache_file, cache_lock, read_cached, write_cached
from diffattn_tutorial.training.model import (
    ATTENTIONS,
    AttentionProbe,
    LMConfig,
    TinyLM,
)
from diffattn_tutorial.training.needle import SETTINGS, NeedleBatch, NeedleTask, retrieval_loss
from diffattn_tutorial.training.schedule import lr_factor

Tensor = torch.Tensor

EVAL_SEED = 12345
"""Seed of the evaluation data: the same sequences for every training seed and attention kind."""


@contextlib.contextmanager
def deterministic(num_threads: Optional[int] = 1) -> Iterator[None]:
    """Fixed thread count and deterministic kernels inside the block (restored after).

    CPU matmuls can sum in a different order with a different number of threads, so a fixed count makes
    training bit-for-bit repeatable on one machine.
    """
    old_det = torch.are_deterministic_algorithms_enabled()
    with threads(num_threads):
        try:
            torch.use_deterministic_algorithms(True, warn_only=True)
            yield
        finally:
            torch.use_deterministic_algorithms(old_det)


def train_toy_model(model: TinyLM, task: NeedleTask, *, steps: int, batch_size: int = 32, lr: float = 3e-3,
                    settings: Sequence[tuple[int, int]] = SETTINGS, warmup: int = 50, weight_decay: float = 0.01,
                    seed: int = 0, progress: bool = True, desc: str = "train",
                    on_step: Optional[Callable[[int], None]] = None) -> list[float]:
    """Train the study's toy model on the needle task in this process (the torchrun loop for a run folder is
    :func:`diffattn_tutorial.training.loop.train`): AdamW with linear warm-up and cosine decay
    (:func:`~diffattn_tutorial.training.schedule.lr_factor`); step ``t`` trains on ``settings[t % len(settings)]``.
    ``on_step(t)``, when given, runs before step ``t``'s forward (a fine-tune sets its warm-up there).

    Returns the loss of every step. Data come from a generator seeded with ``seed``.
    """
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, steps, warmup))
    model.train()
    losses = []
    bar = tqdm(range(steps), desc=desc, disable=not progress, mininterval=1.0)
    for t in bar:
        n, r = settings[t % len(settings)]
        batch = _to(task.sample(batch_size, n, r, generator=gen), device)
        if on_step is not None:
            on_step(t)
        loss = retrieval_loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if t % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


def _to(batch: NeedleBatch, device: torch.device) -> NeedleBatch:
    return NeedleBatch(*(t.to(device) for t in batch))


@torch.no_grad()
def accuracy(model: TinyLM, batch: NeedleBatch) -> float:
    """Share of queries whose greedy next token after the queried key is the right value."""
    logits = model(batch.tokens)
    pred = logits.gather(1, batch.query_pos[..., None].expand(-1, -1, logits.shape[-1])).argmax(-1)
    return (pred == batch.answers).float().mean().item()


def attention_scores(probes: list[AttentionProbe], batch: NeedleBatch, layer: int = -1) -> dict[str, Tensor]:
    """Table 3's shares from one layer's maps: ``{"answer": (B, H, R), "noise": (B, H, R)}``.

    For every query row (the queried key, ``batch.query_pos``), example and head: the share of its attention
    on the answer needle and on the other haystack positions (filler, bare values and the other needles).
    DIFF maps count with their sign (a row sums to ``1 - lambda``), as in the paper.
    """
    maps = probes[layer].maps  # (B, H, L, L)
    B, H, L, _ = maps.shape
    rows = maps.gather(2, batch.query_pos[:, None, :, None].expand(B, H, -1, L))  # (B, H, R, L)
    answer = batch.answer_mask[:, None]  # (B, 1, R, L)
    context = batch.context_mask.expand_as(answer)
    to_answer, to_noise = answer_noise_shares(rows, answer, context)
    return {"answer": to_answer, "noise": to_noise}


def logit_outliers(probes: list[AttentionProbe]) -> float:
    """Table 5's ratio ``max |logit| / median |logit|`` over the causal attention logits of every layer/head."""
    return top1_over_median(_finite_logits(probes)).item()


def _finite_logits(probes: list[AttentionProbe]) -> Tensor:
    return torch.cat([p.logits[torch.isfinite(p.logits)] for p in probes])


DEPTH_BINS: tuple[str, ...] = ("0-20%", "20-40%", "40-60%", "60-80%", "80-100%")
"""Where the answer sits in the haystack, in five bins (the paper's Table 3 uses depths 0, 25, ..., 100%)."""


@dataclass(frozen=True)
class StudyMetrics:
    """What :func:`measure` finds in a trained model of the study: its result numbers (see the module doc for
    the paper's tables; the functions computing them live in :mod:`diffattn_tutorial.measure.attention_stats`, and
    a torchrun training run's ``metrics.jsonl`` is :mod:`diffattn_tutorial.training.runlog`'s, another thing).

    ``attn_*`` are shares of the query's attention in ``attn_layer``, the layer whose query attends most to the
    answer (mean over heads, queries and examples of the hardest setting); ``..._by_head`` per head,
    ``attn_by_layer`` and ``attn_by_depth`` as ``(answer, noise)`` pairs. ``logit_*`` are over ``|q.k| / sqrt(d)``
    of every layer's causal attention logits. ``lambdas``: each DIFF layer's lambda (None for other kinds).
    """

    accuracy: float
    accuracy_by_setting: dict[str, float]
    attn_layer: int
    attn_to_answer: float
    attn_to_noise: float
    attn_to_answer_by_head: list[float]
    attn_to_noise_by_head: list[float]
    attn_by_layer: list[tuple[float, float]]
    attn_by_depth: dict[str, tuple[float, float]]
    logit_top1: float
    logit_median: float
    logit_top1_over_median: float
    hidden_top1_over_median: float
    lambdas: Optional[list[float]]


def _eval_batches(task: NeedleTask, settings: Sequence[tuple[int, int]] = SETTINGS, n_eval: int = 256,
                 device: Union[str, torch.device] = "cpu") -> list[NeedleBatch]:
    """The fixed evaluation data, one batch per setting: drawn from ``EVAL_SEED``, the same for every seed and kind."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    return [_to(task.sample(n_eval, n, r, generator=gen), torch.device(device)) for n, r in settings]


@torch.no_grad()
def measure(model: TinyLM, task: NeedleTask, settings: Sequence[tuple[int, int]] = SETTINGS, n_eval: int = 256,
            device: Union[str, torch.device] = "cpu") -> tuple[StudyMetrics, NeedleBatch]:
    """Every metric of a trained ``model`` on the fixed evaluation data (the same for every seed and kind).

    Returns the metrics and the evaluation batch of the last (hardest) setting, on which the attention and
    logit metrics are measured.
    """
    acc, batch = {}, None
    for (n, r), batch in zip(settings, _eval_batches(task, settings, n_eval, device)):
        acc[f"{n}/{r}"] = accuracy(model, batch)
    probes = model.probe(batch.tokens)
    by_layer = [attention_scores(probes, batch, layer=i) for i in range(len(probes))]
    layer = max(range(len(probes)), key=lambda i: by_layer[i]["answer"].mean().item())
    shares = by_layer[layer]
    bins = (batch.depth * len(DEPTH_BINS)).long().clamp_max(len(DEPTH_BINS) - 1)  # (B, R)
    by_depth = {}
    for i, name in enumerate(DEPTH_BINS):
        sel = (bins == i)[:, None].expand_as(shares["answer"])
        by_depth[name] = (shares["answer"][sel].mean().item(), shares["noise"][sel].mean().item())
    finite = _finite_logits(probes)
    logits = finite.abs()
    lambdas = [b.attn.lambda_full().item() for b in model.blocks] if model.cfg.attention == "diff" else None
    metrics = StudyMetrics(
        accuracy=sum(acc.values()) / len(acc), accuracy_by_setting=acc, attn_layer=layer,
        attn_to_answer=shares["answer"].mean().item(), attn_to_noise=shares["noise"].mean().item(),
        attn_to_answer_by_head=shares["answer"].mean((0, 2)).tolist(),
        attn_to_noise_by_head=shares["noise"].mean((0, 2)).tolist(),
        attn_by_layer=[(s["answer"].mean().item(), s["noise"].mean().item()) for s in by_layer],
        attn_by_depth=by_depth, logit_top1=logits.max().item(), logit_median=logits.median().item(),
        logit_top1_over_median=top1_over_median(finite).item(),  # logit_outliers(probes), its logits found once
        hidden_top1_over_median=top1_over_median(probes[-1].hidden).item(), lambdas=lambdas)
    return metrics, batch


def study_sources() -> tuple[ModuleType, ...]:
    """The modules whose source the study's numbers depend on (data, attention, model, schedule, measurements and
    this one): part of every cache key (:func:`~diffattn_tutorial.training.cache.cache_file`)."""
    import diffattn_tutorial.functional as functional_mod
    import diffattn_tutorial.layers.attention as modules_mod
    import diffattn_tutorial.layers.rope as rope_mod
    import diffattn_tutorial.measure.attention_stats as attention_stats_mod
    import diffattn_tutorial.training.needle as data_mod
    import diffattn_tutorial.training.schedule as schedule_mod

    return (data_mod, functional_mod, attention_stats_mod, modules_mod, rope_mod, sys.modules[TinyLM.__module__],
            schedule_mod, sys.modules[__name__])


def _cache_file(cache: CacheSetting, key: dict) -> Optional[Path]:
    """Where a study's results live (:func:`~diffattn_tutorial.training.cache.cache_file` over
    :func:`study_sources`); ``None`` when caching is off."""
    return cache_file(cache, key, study_sources())


@dataclass(frozen=True)
class StudyConfig:
    """One training run of :func:`retrieval_study`: what to train, on what, for how long, where.

    Attributes:
        attention: ``"baseline"``, ``"diff"`` or ``"diff_v2"``.
        seed: seeds the initial weights and the training data. The evaluation data are the same for every
            seed and attention kind, so models are compared on identical sequences.
        steps, batch_size, lr: the training budget (step ``t`` uses ``settings[t % len(settings)]``).
        task: the haystack (default :class:`~diffattn_tutorial.training.needle.NeedleTask`).
        settings: ``(needles, queried)`` pairs to train and evaluate on; the attention and logit metrics use
            the last (hardest) one.
        n_eval: evaluation sequences per setting.
        d_model, n_layers, n_heads: model shape (``n_heads`` = the baseline's heads; see ``LMConfig``).
        num_threads: torch threads while training (``None``: leave as is). One thread is the default: a fixed
            count makes CPU training repeatable on one machine, and a single thread keeps its speed when another
            program holds a core, where two threads wait on each other.
        device: where to train (``"cpu"``).
    """

    attention: str
    seed: int = 0
    steps: int = 500
    batch_size: int = 32
    lr: float = 3e-3
    task: NeedleTask = field(default_factory=NeedleTask)
    settings: tuple[tuple[int, int], ...] = SETTINGS
    n_eval: int = 256
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    num_threads: Optional[int] = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        object.__setattr__(self, "settings", tuple(tuple(s) for s in self.settings))
        object.__setattr__(self, "device", torch.device(self.device).type)

    def lm_config(self) -> LMConfig:
        """The model this run trains (its context fits the longest setting)."""
        return LMConfig(vocab_size=self.task.vocab_size, attention=self.attention, d_model=self.d_model,
                        n_layers=self.n_layers, n_heads=self.n_heads,
                        max_len=max(self.task.seq_len(r) for _, r in self.settings))

    def cache_key(self) -> dict:
        """Everything that changes the trained weights or the measurements, as text (part of the cache key)."""
        key = {f.name: getattr(self, f.name) for f in fields(self)}
        key.update(task=repr(self.task), settings=repr(self.settings), cfg=repr(self.lm_config()))
        return key


@dataclass
class StudyResult:
    """A trained model and its measurements: what :func:`retrieval_study` returns.

    Attributes:
        config: the run. params: the model's parameter count. metrics: :class:`StudyMetrics`.
        losses: the training loss of every step. seconds: training wall time (when it was trained).
        cached: loaded from the cache instead of trained now. model: the trained model, eval mode.
        eval_batch: the hardest setting's evaluation batch (the same for every seed and kind).
    """

    config: StudyConfig
    params: int
    metrics: StudyMetrics
    losses: list[float]
    seconds: float
    cached: bool
    model: TinyLM
    eval_batch: NeedleBatch

    @property
    def final_loss(self) -> float:
        """Mean loss of the last 50 steps (or of every step, for shorter runs)."""
        tail = self.losses[-50:]
        return sum(tail) / len(tail)

    def summary(self) -> dict:
        """Plain JSON-ready numbers, the row a results file records: ``attention``, ``seed``, ``steps``,
        :data:`SUMMARY_KEYS`, ``final_loss`` and training ``seconds``."""
        row = {"attention": self.config.attention, "seed": self.config.seed, "steps": self.config.steps}
        row.update({k: getattr(self.metrics, k) for k in SUMMARY_KEYS})
        row.update(final_loss=self.final_loss, seconds=round(self.seconds, 1))
        return row


def _measured(saved: Mapping, model: TinyLM, config: StudyConfig) -> tuple[StudyMetrics, NeedleBatch]:
    """:func:`measure`'s answer for a run: the metrics its cache entry keeps (measured by this code, this torch and
    thread count when the run was trained: the cache key names them), else measured now."""
    if "metrics" in saved:
        return StudyMetrics(**saved["metrics"]), _eval_batches(config.task, config.settings, config.n_eval,
                                                               config.device)[-1]
    return measure(model, config.task, config.settings, config.n_eval, config.device)


def _load_or_train(config: StudyConfig, path: Optional[Path], progress: bool) -> tuple[TinyLM, dict, bool]:
    """The model of ``config`` and its cache entry's contents (``losses``, ``seconds``, maybe ``metrics``): from the
    cache file ``path`` when it exists, else trained now (``run_study`` saves it with its metrics)."""
    torch.manual_seed(config.seed)
    model = TinyLM(config.lm_config()).to(config.device)
    saved = read_cached(path)
    if saved is not None:
        model.load_state_dict(saved["state_dict"])
        model.eval()
        if progress:
            print(f"{config.attention}: loaded from the cache, trained earlier on this machine "
                  f"({config.steps} steps, seed {config.seed}; DIFFATTN_CACHE=0 retrains)")
        return model, saved, True
    t0 = time.perf_counter()
    losses = train_toy_model(model, config.task, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                             settings=config.settings, seed=config.seed, progress=progress, desc=config.attention)
    return model, {"losses": losses, "seconds": time.perf_counter() - t0}, False


def run_study(config: StudyConfig, *, cache: CacheSetting = False,
              progress: bool = True) -> StudyResult:
    """Train (or load) the model of ``config`` and measure it.

    Args:
        cache: ``True`` (the folder :func:`cache_dir` names; ``DIFFATTN_CACHE=0`` switches it off) or a folder:
            reuse the weights, losses and metrics of an identical earlier run (same config, torch version and
            library source, so the same measurements), else train, measure and save.
        progress: show a tqdm bar while training.
    """
    path = _cache_file(cache, config.cache_key()) if cache else None
    with deterministic(config.num_threads), cache_lock(path):
        model, saved, cached = _load_or_train(config, path, progress)
        losses, seconds = saved["losses"], saved["seconds"]
        metrics, batch = _measured(saved, model, config)
        if path is not None and "metrics" not in saved:  # trained now (or an entry written without them)
            write_cached(path, {**saved, "state_dict": model.state_dict(), "metrics": asdict(metrics)})
    return StudyResult(config=config, params=model.num_parameters(), metrics=metrics, losses=losses,
                       seconds=seconds, cached=cached, model=model, eval_batch=batch)


def retrieval_study(attention: str, *, cache: CacheSetting = False, progress: bool = True,
                    **config) -> StudyResult:
    """Train one model on the multi-needle task and measure it: ``run_study(StudyConfig(attention, **config))``.

    ``config``: any :class:`StudyConfig` field (``seed``, ``steps``, ``lr``, ``num_threads``, ...); ``cache`` and
    ``progress`` as in :func:`run_study`. ``retrieval_study("diff", seed=1, cache=True).metrics.accuracy``.
    """
    return run_study(StudyConfig(attention, **config), cache=cache, progress=progress)


SUMMARY_KEYS: tuple[str, ...] = (
    "accuracy", "accuracy_by_setting", "attn_layer", "attn_to_answer", "attn_to_noise", "logit_top1",
    "logit_median", "logit_top1_over_median", "hidden_top1_over_median", "lambdas")
"""The :class:`StudyMetrics` a results file records for each run (with ``final_loss``)."""


def _numbers(result: Union[StudyResult, Mapping]) -> Mapping:
    """A study result's numbers as a mapping: a :class:`StudyResult`'s summary, or a recorded row as it is."""
    return result.summary() if isinstance(result, StudyResult) else result


def compare_claims(baseline: Union[StudyResult, Mapping], diff: Union[StudyResult, Mapping]
                   ) -> dict[str, tuple[float, float, bool]]:
    """The paper's claims, checked on two studies (:class:`StudyResult` or recorded rows):
    ``{claim: (baseline, diff, holds)}``.

    Table 2: DIFF's accuracy is at least the baseline's in every needle setting (the value shown is the
    smallest margin ``diff - baseline``, baseline column 0). Table 3: more attention to the answer, less to the
    noise. Table 5: a smaller largest attention logit.
    """
    baseline, diff = _numbers(baseline), _numbers(diff)
    margin = min(diff["accuracy_by_setting"][k] - baseline["accuracy_by_setting"][k]
                 for k in baseline["accuracy_by_setting"])
    return {
        "accuracy >= baseline in every setting (min margin)": (0.0, margin, margin >= 0),
        "attention to answer: higher": (baseline["attn_to_answer"], diff["attn_to_answer"],
                                        diff["attn_to_answer"] > baseline["attn_to_answer"]),
        "attention to noise: lower": (baseline["attn_to_noise"], diff["attn_to_noise"],
                                      diff["attn_to_noise"] < baseline["attn_to_noise"]),
        "top-1 attention logit: lower": (baseline["logit_top1"], diff["logit_top1"],
                                         diff["logit_top1"] < baseline["logit_top1"]),
    }


def claim_lines(baseline: Union[StudyResult, Mapping], diff: Union[StudyResult, Mapping]) -> list[str]:
    """One line per :func:`compare_claims` claim, ``"holds: ..."`` or ``"FAILS: ..."``, without the measured
    numbers: the text a notebook keeps in its outputs, identical on every machine where the claims hold."""
    return [f"{'holds' if holds else 'FAILS'}: {claim}" for claim, (*_, holds) in compare_claims(baseline, diff).items()]


RECORD_TOLERANCE: dict[str, tuple[str, float]] = {
    "accuracy": ("abs", 0.03), "attn_to_answer": ("abs", 0.02), "attn_to_noise": ("abs", 0.02),
    "logit_top1": ("rel", 0.10), "final_loss": ("rel", 0.15)}
"""How far a re-run may land from a recorded row (``abs`` or ``rel`` difference). Training on another CPU,
thread count or BLAS build sums in another order, and 500 steps amplify that; these margins are wide enough
for it and far narrower than the gaps between attention kinds the notebooks assert."""


def disagreements(rerun: Union[StudyResult, Mapping], recorded_row: Mapping) -> list[str]:
    """The :data:`RECORD_TOLERANCE` metrics where a re-run and a recorded row differ by more than the
    tolerance, as readable lines; empty when they agree."""
    summary, out = _numbers(rerun), []
    for key, (kind, tol) in RECORD_TOLERANCE.items():
        new, old = summary[key], recorded_row[key]
        gap = abs(new - old) if kind == "abs" else abs(new - old) / abs(old)
        if not gap <= tol:
            out.append(f"{key}: re-run {new:.4f}, recorded {old:.4f} ({kind} difference {gap:.4f} > {tol})")
    return out


__all__ = ["SETTINGS", "EVAL_SEED", "study_sources", "DEPTH_BINS", "deterministic", "retrieval_loss", "lr_factor", "train_toy_model",
           "accuracy", "attention_scores", "logit_outliers", "measure", "StudyMetrics", "StudyConfig", "StudyResult",
           "run_study", "retrieval_study", "SUMMARY_KEYS", "compare_claims", "claim_lines", "RECORD_TOLERANCE",
           "disagreements"]
