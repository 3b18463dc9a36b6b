"""A training run's configuration (:class:`RunConfig`, the options that define a run), the data it reads
(:class:`DataSource`: every row a function of seed, step and row) and the model it builds."""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from diffattn_tutorial import backends
from diffattn_tutorial.backend_table import ALIASES, PLAIN_BACKENDS, Needs
from diffattn_tutorial.layers.attention import (
    DiffAttnV2,
    MultiheadAttention,
    MultiheadDiffAttn,
)
from diffattn_tutorial.training import distributed
from diffattn_tutorial.training.corpus import TextTask, next_character_loss
from diffattn_tutorial.training.model import ATTENTIONS, TinyLM, build_model, check_compile_backend
from diffattn_tutorial.training.needle import SETTINGS, NeedleTask, retrieval_loss

Tensor = torch.Tensor


TASKS: tuple[str, ...] = ("needle", "text")
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")

RUN_DEFINING: tuple[str, ...] = ("task", "attention", "d_model", "n_layers", "n_heads", "seq_len", "steps", "lr",
                                 "warmup", "weight_decay", "clip", "seed", "global_batch")
"""The fields a resumed run must share with its checkpoint (the rest, such as the world size, the strategy or
how the global batch is split into micro-batches, may change between the two)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run (the command line's options, resolved for the world size).

    Model: ``attention`` (baseline / diff / diff_v2), ``d_model``, ``n_layers``, ``n_heads`` (the baseline's
    heads, as in :class:`~diffattn_tutorial.training.model.LMConfig`), ``attn_backend``. Data: ``task`` (needle / text),
    ``seq_len`` (text windows). Optimisation: ``steps``, AdamW ``lr`` (linear warm-up over ``warmup`` steps, then
    cosine to 0), ``weight_decay``, gradient-norm ``clip``, ``seed``. Batch: ``batch_size`` rows per rank and
    micro-step, ``grad_accum`` micro-steps, ``global_batch = batch_size x world x grad_accum``. Run:
    ``strategy``, ``precision``, ``compile``, ``device``, ``threads`` (torch CPU threads; None: as set, which
    ``torchrun`` makes 1 per process), ``out``, ``checkpoint_every`` (0: only at the end),
    ``stop_at`` (stop after that step, as a time-limited job would), ``resume``, ``overwrite`` (clear ``out``
    first), ``allow_unverified`` (load checkpoints without a valid manifest: trusted folders only), ``progress``.
    """

    task: str = "needle"
    attention: str = "diff"
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    attn_backend: str = "auto"
    seq_len: int = 128
    steps: int = 200
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    batch_size: int = 8
    grad_accum: int = 1
    global_batch: int = 8
    strategy: str = "ddp"
    precision: str = "auto"
    compile: bool = False
    compile_backend: str = "inductor"
    device: str = "auto"
    threads: Optional[int] = None
    out: str = "runs/train"
    checkpoint_every: int = 0
    stop_at: Optional[int] = None
    resume: bool = False
    overwrite: bool = False
    allow_unverified: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        choices = {"task": TASKS, "attention": ATTENTIONS, "strategy": distributed.STRATEGIES, "precision": PRECISIONS,
                   "device": ("auto", "cpu", "cuda")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "steps", "batch_size", "grad_accum",
                     "global_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if self.threads is not None and (isinstance(self.threads, bool) or not isinstance(self.threads, int)
                                         or self.threads < 1):
            raise ValueError(f"threads must be a whole number >= 1 or None, got {self.threads!r}")
        if self.warmup < 0 or self.checkpoint_every < 0:
            raise ValueError("warmup and checkpoint_every must be >= 0")
        self._check_floats()
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of the two")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in 1..steps={self.steps}, got {self.stop_at}")
        if self.global_batch % (self.batch_size * self.grad_accum):
            raise ValueError(f"global_batch={self.global_batch} is not batch_size={self.batch_size} x world x "
                             f"grad_accum={self.grad_accum}")
        try:  # the layers' own check: the baselines take only the plain backends
            backends.check_name(self.attn_backend, None if self.attention == "diff" else PLAIN_BACKENDS)
        except ValueError as e:
            raise ValueError(f"attn_backend (attention={self.attention!r}): {e}") from None
        if self.compile or self.compile_backend != "inductor":
            check_compile_backend(self.compile_backend, what="compile_backend")

    def _check_floats(self) -> None:
        """``lr``, ``weight_decay`` and ``clip``: finite, in the ranges where AdamW and clipping mean something."""
        bad = [f"{name}={value!r}" for name in ("lr", "weight_decay", "clip")
               for value in [getattr(self, name)] if isinstance(value, bool) or not isinstance(value, (int, float))
               or not math.isfinite(value)]
        if bad:
            raise ValueError(f"{', '.join(bad)}: lr, weight_decay and clip must be finite numbers (e.g. lr=3e-3, "
                             f"weight_decay=0.01, clip=1.0)")
        if not 0 < self.lr <= MAX_LR:
            raise ValueError(f"lr must lie in (0, {MAX_LR}], got {self.lr}: AdamW moves every weight by about lr "
                             f"per step, so a larger one diverges at once (try 1e-4 to 1e-2)")
        if not 0 <= self.weight_decay * self.lr < 1:
            raise ValueError(f"weight_decay must be >= 0 and below 1/lr = {1 / self.lr:.4g} (AdamW multiplies the "
                             f"weights by 1 - lr x weight_decay each step), got {self.weight_decay}; try 0.01")
        if not self.clip > 0:
            raise ValueError(f"clip (the gradient-norm limit) must be > 0, got {self.clip}; try 1.0")

    @property
    def world_size(self) -> int:
        return self.global_batch // (self.batch_size * self.grad_accum)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


MAX_LR = 1.0
"""The largest learning rate :class:`RunConfig` accepts."""


def check_backend_here(backend: str, device: torch.device) -> None:
    """Refuse, before any model is built, an attention backend that cannot train on ``device`` here (forward-only,
    another device, not working here: ``triton`` without a GPU or ``TRITON_INTERPRET=1``), with the refusal
    ``backends.resolve`` gives a training call, which names the fix. ``"auto"`` and ``"sdpa"`` choose one that can."""
    if backend in ALIASES:
        return
    try:
        backends.resolve(backend, device, Needs(grad=True))
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"--attn-backend {backend}: {e}") from None


# --- model -----------------------------------------------------------------------------------------------------

def build_run_model(cfg: RunConfig, vocab_size: int, max_len: int) -> TinyLM:
    """The model of the training run ``cfg``: :func:`~diffattn_tutorial.training.model.build_model` with the run's
    shape, initialised from ``cfg.seed`` on the CPU (the same weights on every device and rank), its attention
    layers set to ``cfg.attn_backend``."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.attention, vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                        max_len=max_len)
    set_attention_backend(model, cfg.attn_backend)
    return model


def set_attention_backend(model: TinyLM, backend: str) -> None:
    """Make every attention layer of ``model`` call ``backend`` (see ``functional.diff_attention``)."""
    for block in model.blocks:
        attn = block.attn
        if not isinstance(attn, (MultiheadAttention, DiffAttnV2, MultiheadDiffAttn)):
            raise TypeError(f"unknown attention layer {type(attn).__name__}")
        plain = isinstance(attn, (MultiheadAttention, DiffAttnV2))
        attn.backend = backends.check_name(backend, PLAIN_BACKENDS if plain else None)  # as the layer's constructor


def graph_breaks(attention: str, backend: str, *, d_model: int = 32, n_heads: int = 4, seq_len: int = 16) -> int:
    """Graph breaks ``torch.compile`` meets in one training forward of a ``TinyLM`` block, from
    ``torch._dynamo.explain`` (0: the block compiles as a single graph). Runs on the CPU in a second or two."""
    import torch._dynamo

    model = build_model(attention, 16, d_model=d_model, n_heads=n_heads, n_layers=1, max_len=seq_len)
    set_attention_backend(model, backend)
    block, x = model.blocks[0], torch.randn(2, seq_len, d_model)
    rope = (model.rope_cos[:seq_len], model.rope_sin[:seq_len])
    dynamo_log = logging.getLogger("torch._dynamo")
    level = dynamo_log.level
    dynamo_log.setLevel(logging.ERROR)  # explain() counts the breaks; their warnings would repeat them
    try:
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(block)(x, rope)
    finally:
        torch._dynamo.reset()
        dynamo_log.setLevel(level)
    return explanation.graph_break_count


# --- data ------------------------------------------------------------------------------------------------------

class LMBatch(NamedTuple):
    """Rows of a global batch: ``tokens (b, L)`` and ``targets (b, L)`` (the next token, or ``IGNORE``)."""

    tokens: Tensor
    targets: Tensor


def row_generator(seed: int, step: int, row: int) -> torch.Generator:
    """The generator of row ``row`` of step ``step``'s global batch: the same in every process."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_000_033 + row) % (2 ** 63))


class DataSource:
    """The rows of each step's global batch for a run's ``task`` (see the module doc)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.needle = NeedleTask() if cfg.task == "needle" else None
        self.text = TextTask(seq_len=cfg.seq_len) if cfg.task == "text" else None

    @property
    def vocab_size(self) -> int:
        return self.needle.vocab_size if self.needle else self.text.vocab_size

    @property
    def max_len(self) -> int:
        return max(self.needle.seq_len(r) for _, r in SETTINGS) if self.needle else self.cfg.seq_len

    def row_len(self, step: int) -> int:
        """Tokens in each row of step ``step`` (the needle task's length depends on the step's setting)."""
        return self.needle.seq_len(SETTINGS[step % len(SETTINGS)][1]) if self.needle else self.cfg.seq_len

    def rows(self, step: int, rows: range) -> LMBatch:
        """Rows ``rows`` of step ``step``'s global batch (0-based step)."""
        toks, tgts = [], []
        for row in rows:
            g = row_generator(self.cfg.seed, step, row)
            if self.needle is not None:
                n, r = SETTINGS[step % len(SETTINGS)]
                b = self.needle.sample(1, n, r, generator=g)
                toks.append(b.tokens[0])
                tgts.append(b.targets[0])
            else:
                t, y = self.text.sample_row(g)
                toks.append(t)
                tgts.append(y)
        return LMBatch(torch.stack(toks), torch.stack(tgts))

    def loss(self, model: TinyLM, batch: LMBatch) -> Tensor:
        """The task's loss on ``batch``: the needle task's at the queried keys, the text task's at every position."""
        if self.needle is not None:
            return retrieval_loss(model, batch)
        return next_character_loss(model, batch.tokens, batch.targets)


__all__ = ["TASKS", "PRECISIONS", "RUN_DEFINING", "MAX_LR", "RunConfig", "check_backend_here", "build_run_model", "set_attention_backend", "graph_breaks", "LMBatch", "row_generator", "DataSource"]
