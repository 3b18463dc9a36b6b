"""Train the library's :class:`~diffattn_tutorial.model.TinyLM` with the standard PyTorch stack, on one CPU or
many GPUs: ``python -m diffattn_tutorial.train`` (also ``diffattn-tutorial train``), launched by ``torchrun``.

    python -m diffattn_tutorial.train --attention diff --steps 200 --out runs/diff             # one process
    torchrun --nproc_per_node=2 -m diffattn_tutorial.train --attention diff --strategy fsdp2 \\
        --global-batch 32 --batch-size 8 --out runs/diff                                          # two processes

What the script does, and where each piece lives:

* **Data** (:class:`RunConfig` ``task``): the multi-needle retrieval task (:class:`~diffattn_tutorial.data.
  NeedleTask`, step ``t`` on setting ``SETTINGS[t % 4]`` as in notebook 07) or the generated text corpus
  (:class:`~diffattn_tutorial.corpus.TextTask`). Row ``i`` of step ``t``'s global batch is drawn from its own
  generator seeded by ``(seed, t, i)``, so the global batch is the same whatever the number of processes; each
  rank builds only its rows (:func:`~diffattn_tutorial.distributed.micro_batch_rows`).
* **Global batch** = ``batch_size`` (per rank and micro-step) x world size x ``grad_accum``. Give
  ``--global-batch`` and the accumulation is derived for the world size at hand, so the same command trains the
  same model on 1 CPU process or 8 GPUs. Each micro-step's loss is its rows' mean divided by ``grad_accum``;
  all rows hold the same number of targets, so the averaged gradients are those of the global batch's mean loss.
* **Parallelism** (``--strategy``): ``ddp`` or ``fsdp2`` (``fully_shard``, one unit per block), gloo on CPUs,
  NCCL on GPUs (:mod:`diffattn_tutorial.distributed`).
* **Mixed precision** on GPU only (``--precision auto`` = bf16 there, fp32 on CPU): DDP runs the forward under
  ``torch.autocast(bfloat16)``, FSDP2 gathers bf16 weights (``MixedPrecisionPolicy``) and reduces gradients in
  float32; the optimizer always holds float32 weights.
* **torch.compile** (``--compile``): each block is compiled in place before wrapping, so checkpoint keys do not
  change. Which attention backends compile as one graph is measured by :func:`graph_breaks`
  (``torch._dynamo.explain`` of one block's forward). On torch 2.13 the SDPA path (``auto``, ``sdpa`` and
  every SDPA formulation) traces with no graph break for all three attention kinds (asserted in
  ``tests/test_train.py``); ``naive`` and ``chunked`` break the graph a few times per block, at a data-dependent
  check for fully masked rows (notebook 12 prints the counts). ``triton`` calls a custom kernel and is not
  measured here.
* **Checkpoints** (``--checkpoint-every``, ``--resume``): ``torch.distributed.checkpoint`` (DCP) saves model and
  AdamW state sharded, one file per rank, and loads them into any world size or strategy; the learning rate is a
  function of the step and the data of ``(seed, step)``, so a resumed run continues the same loss curve.
* **Output** (``--out DIR``): ``config.json``, ``metrics.jsonl`` (JSON lines, :mod:`diffattn_tutorial.runlog`,
  plotted by :func:`~diffattn_tutorial.runlog.plot_loss_curves`), ``checkpoints/step_NNNNNN/``; a ``tqdm`` bar
  on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Union

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from diffattn_tutorial import distributed as D
from diffattn_tutorial.cli import int_at_least
from diffattn_tutorial.corpus import TextTask
from diffattn_tutorial.data import NeedleTask
from diffattn_tutorial.experiments import SETTINGS, lr_factor, retrieval_loss
from diffattn_tutorial.functional import BACKENDS
from diffattn_tutorial.model import ATTENTIONS, LMConfig, TinyLM
from diffattn_tutorial.modules import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.runlog import MetricsLog

Tensor = torch.Tensor

TASKS: tuple[str, ...] = ("needle", "text")
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16")

RUN_DEFINING: tuple[str, ...] = ("task", "attention", "d_model", "n_layers", "n_heads", "seq_len", "steps", "lr",
                                 "warmup", "weight_decay", "clip", "seed", "global_batch")
"""The fields a resumed run must share with its checkpoint (the rest, such as the world size, the strategy or
how the global batch is split into micro-batches, may change between the two)."""


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run (the command line's options, resolved for the world size).

    Model: ``attention`` (baseline / diff / diff_v2), ``d_model``, ``n_layers``, ``n_heads`` (the baseline's
    heads, as in :class:`~diffattn_tutorial.model.LMConfig`), ``attn_backend``. Data: ``task`` (needle / text),
    ``seq_len`` (text windows). Optimisation: ``steps``, AdamW ``lr`` (linear warm-up over ``warmup`` steps, then
    cosine to 0), ``weight_decay``, gradient-norm ``clip``, ``seed``. Batch: ``batch_size`` rows per rank and
    micro-step, ``grad_accum`` micro-steps, ``global_batch = batch_size x world x grad_accum``. Run:
    ``strategy``, ``precision``, ``compile``, ``device``, ``threads`` (torch CPU threads; None: as set, which
    ``torchrun`` makes 1 per process), ``out``, ``checkpoint_every`` (0: only at the end),
    ``stop_at`` (stop after that step, as a time-limited job would), ``resume``, ``progress``.
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
    progress: bool = True

    def __post_init__(self) -> None:
        choices = {"task": TASKS, "attention": ATTENTIONS, "strategy": D.STRATEGIES, "precision": PRECISIONS,
                   "attn_backend": ("auto",) + BACKENDS, "device": ("auto", "cpu", "cuda")}
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
        if not (self.lr > 0 and math.isfinite(self.lr)) or not self.clip > 0 or self.weight_decay < 0:
            raise ValueError(f"need lr > 0, clip > 0 and weight_decay >= 0, got lr={self.lr}, clip={self.clip}, "
                             f"weight_decay={self.weight_decay}")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in 1..steps={self.steps}, got {self.stop_at}")
        if self.global_batch % (self.batch_size * self.grad_accum):
            raise ValueError(f"global_batch={self.global_batch} is not batch_size={self.batch_size} x world x "
                             f"grad_accum={self.grad_accum}")
        if self.attn_backend != "auto" and self.attention != "diff" and self.attn_backend not in ("naive", "sdpa"):
            raise ValueError(f"attn_backend {self.attn_backend!r} is a differential-attention backend; "
                             f"attention={self.attention!r} takes 'auto', 'naive' or 'sdpa'")

    @property
    def world_size(self) -> int:
        return self.global_batch // (self.batch_size * self.grad_accum)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


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


# --- model -----------------------------------------------------------------------------------------------------

def build(cfg: RunConfig, vocab_size: int, max_len: int) -> TinyLM:
    """The run's model, initialised from ``cfg.seed`` on the CPU (the same weights on every device and rank)."""
    torch.manual_seed(cfg.seed)
    model = TinyLM(LMConfig(vocab_size=vocab_size, attention=cfg.attention, d_model=cfg.d_model,
                            n_layers=cfg.n_layers, n_heads=cfg.n_heads, max_len=max_len))
    set_attention_backend(model, cfg.attn_backend)
    return model


def set_attention_backend(model: TinyLM, backend: str) -> None:
    """Make every attention layer of ``model`` call ``backend`` (see ``functional.diff_attention``)."""
    for block in model.blocks:
        attn = block.attn
        plain = isinstance(attn, (MultiheadAttention, DiffAttnV2))
        if plain and backend not in ("auto", "naive", "sdpa"):
            raise ValueError(f"{type(attn).__name__} takes backend 'auto', 'naive' or 'sdpa', got {backend!r}")
        if not isinstance(attn, (MultiheadAttention, DiffAttnV2, MultiheadDiffAttn)):
            raise TypeError(f"unknown attention layer {type(attn).__name__}")
        attn.backend = backend


def graph_breaks(attention: str, backend: str, *, d_model: int = 32, n_heads: int = 4, seq_len: int = 16) -> int:
    """Graph breaks ``torch.compile`` meets in one training forward of a ``TinyLM`` block, from
    ``torch._dynamo.explain`` (0: the block compiles as a single graph). Runs on the CPU in a second or two."""
    import torch._dynamo

    model = TinyLM(LMConfig(vocab_size=16, attention=attention, d_model=d_model, n_heads=n_heads, n_layers=1,
                            max_len=seq_len))
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


def _autocast(cfg: RunConfig, ctx: D.DistContext) -> contextlib.AbstractContextManager:
    """bf16 autocast for DDP (and single-process) runs on a GPU; FSDP2 casts through its own policy."""
    if _mixed_precision(cfg, ctx) and cfg.strategy == "ddp":
        return torch.autocast(ctx.device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _mixed_precision(cfg: RunConfig, ctx: D.DistContext) -> bool:
    if cfg.precision == "bf16" and ctx.device.type != "cuda":
        raise ValueError("precision='bf16' needs a CUDA GPU (mixed precision is for GPUs only); use 'auto' or 'fp32'")
    return cfg.precision == "bf16" or (cfg.precision == "auto" and ctx.device.type == "cuda")


# --- checkpoints -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it saves or loads "in a single process" when there is no process group: that is the
    intended use here (one process, or ``load_model`` after a run), so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def checkpoint_dir(out: Union[str, Path], step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(out: Union[str, Path]) -> Optional[Path]:
    """The newest complete checkpoint under ``out/checkpoints`` (DCP writes ``.metadata`` last), or None."""
    done = sorted(p.parent for p in (Path(out) / "checkpoints").glob("step_*/.metadata"))
    return done[-1] if done else None


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, out: Union[str, Path]) -> Path:
    """Model and optimizer state after ``step`` optimizer steps, sharded by DCP (every rank writes its part)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    path = checkpoint_dir(out, step)
    with _single_process_quiet():
        dcp.save({"model": model_sd, "optim": optim_sd, "progress": {"step": step}}, checkpoint_id=str(path))
    return path


def load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: Union[str, Path]) -> int:
    """Load a :func:`save_checkpoint` folder into ``model`` and ``opt`` (any world size or strategy, DCP
    reshards); returns the step it was saved after."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "progress": {"step": -1}}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["progress"]["step"])


def load_model(out: Union[str, Path], step: Optional[int] = None) -> TinyLM:
    """The model of run folder ``out`` (its latest checkpoint, or that of ``step``), in one process, on the CPU,
    in eval mode: whatever world size and strategy trained it."""
    import torch.distributed.checkpoint as dcp

    cfg = RunConfig(**json.loads((Path(out) / "config.json").read_text()))
    path = checkpoint_dir(out, step) if step is not None else latest_checkpoint(out)
    if path is None or not (path / ".metadata").exists():
        raise FileNotFoundError(f"no checkpoint {'for step ' + str(step) if step else ''} in {out}/checkpoints")
    source = DataSource(cfg)
    model = build(cfg, source.vocab_size, source.max_len)
    state = {"model": model.state_dict()}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))
    model.load_state_dict(state["model"])
    return model.eval()


def _check_resumable(cfg: RunConfig) -> None:
    """A resumed run must define the same training as its checkpoint (:data:`RUN_DEFINING`)."""
    saved = json.loads((Path(cfg.out) / "config.json").read_text())
    differ = [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in RUN_DEFINING
              if saved.get(k) != getattr(cfg, k)]
    if differ:
        raise ValueError(f"--resume: this command trains a different run than the checkpoint in {cfg.out} "
                         f"({'; '.join(differ)}); use the checkpoint's settings or another --out")


# --- the loop --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _torch_threads_kept() -> Iterator[None]:
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def train(cfg: RunConfig, ctx: D.DistContext) -> list[float]:
    """Run (or resume) the training ``cfg`` describes in this process; returns this session's step losses
    (the global batch's mean loss after each optimizer step)."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    source = DataSource(cfg)
    model = build(cfg, source.vocab_size, source.max_len)
    if cfg.compile:
        for block in model.blocks:
            block.compile(backend=cfg.compile_backend)
    mixed = _mixed_precision(cfg, ctx)
    model = D.wrap(model.to(ctx.device), ctx, cfg.strategy,
                   param_dtype=torch.bfloat16 if mixed and cfg.strategy == "fsdp2" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    log = MetricsLog(Path(cfg.out) / "metrics.jsonl", enabled=ctx.is_main)
    start = 0
    if cfg.resume:
        path = latest_checkpoint(cfg.out)
        if path is None or not (Path(cfg.out) / "config.json").exists():
            raise ValueError(f"--resume: no checkpoint in {cfg.out}/checkpoints; run without --resume first")
        _check_resumable(cfg)
        start = load_checkpoint(model, opt, path)
        log.truncate_after(start)
    elif ctx.is_main:
        Path(cfg.out).mkdir(parents=True, exist_ok=True)
        (Path(cfg.out) / "metrics.jsonl").unlink(missing_ok=True)
        (Path(cfg.out) / "config.json").write_text(json.dumps(cfg.to_json(), indent=1) + "\n")
    stop = cfg.stop_at or cfg.steps
    log.write({"event": "start", "step": start, "world_size": ctx.world_size, "strategy": cfg.strategy,
               "device": str(ctx.device), "backend": ctx.backend, "mixed_precision": mixed,
               "torch": torch.__version__, "python": platform.python_version(),
               "params": sum(p.numel() for p in model.parameters()),
               "params_per_rank": D.gather_ints(D.local_numel(model), ctx), "config": cfg.to_json()})
    losses, t0 = [], time.perf_counter()
    tokens = sum(cfg.global_batch * source.row_len(s) for s in range(start))
    bar = tqdm(range(start, stop), desc=f"{cfg.attention} x{ctx.world_size}", disable=not (cfg.progress and ctx.is_main),
               initial=start, total=stop, mininterval=1.0)
    model.train()
    for step in bar:
        loss = _train_step(model, opt, source, cfg, ctx, step)
        grad_norm = _clip(model, cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(D.mean_over_ranks(loss, ctx))
        tokens += cfg.global_batch * source.row_len(step)
        log.write({"event": "step", "step": step + 1, "loss": losses[-1], "lr": opt.param_groups[0]["lr"],
                   "grad_norm": grad_norm, "tokens": tokens,
                   "seconds": round(time.perf_counter() - t0, 3)})
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step + 1 == stop or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
            save_checkpoint(model, opt, step + 1, cfg.out)
    bar.close()
    log.write({"event": "end", "step": stop, "seconds": round(time.perf_counter() - t0, 3)})
    return losses


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, source: DataSource, cfg: RunConfig,
                ctx: D.DistContext, step: int) -> Tensor:
    """Forward and backward over this rank's rows of step ``step``; returns its mean loss (detached)."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup)
    total = torch.zeros((), device=ctx.device)
    for micro in range(cfg.grad_accum):
        batch = source.rows(step, D.micro_batch_rows(micro, ctx.rank, cfg.batch_size, ctx.world_size))
        batch = LMBatch(*(t.to(ctx.device, non_blocking=True) for t in batch))
        with D.gradient_sync(model, enabled=micro == cfg.grad_accum - 1):
            with _autocast(cfg, ctx):
                loss = retrieval_loss(model, batch).float() / cfg.grad_accum
            loss.backward()
        total += loss.detach()
    if not torch.isfinite(total):
        raise FloatingPointError(f"step {step + 1}: the loss is {total.item()}; lower --lr or raise --warmup")
    return total


def _clip(model: nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (across ranks and shards) to ``max_norm``; returns the norm before."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# --- command line ----------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors raise :class:`UsageError` (``main`` prints them, exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


class UsageError(ValueError):
    """A bad command line: the message names the option and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m diffattn_tutorial.train", description=__doc__.splitlines()[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = RunConfig()
    p.add_argument("--task", choices=TASKS, default=d.task, help="needle retrieval or the generated text corpus")
    p.add_argument("--attention", choices=ATTENTIONS, default=d.attention)
    p.add_argument("--d-model", type=_positive, default=d.d_model)
    p.add_argument("--n-layers", type=_positive, default=d.n_layers)
    p.add_argument("--n-heads", type=_positive, default=d.n_heads, help="the baseline's heads (LMConfig)")
    p.add_argument("--attn-backend", choices=("auto",) + BACKENDS, default=d.attn_backend)
    p.add_argument("--seq-len", type=_positive, default=d.seq_len, help="text windows (task text)")
    p.add_argument("--steps", type=_positive, default=d.steps, help="optimizer steps of the whole run")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=_non_negative, default=d.warmup)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip", type=float, default=d.clip, help="gradient-norm clip")
    p.add_argument("--seed", type=_non_negative, default=d.seed)
    p.add_argument("--batch-size", type=_positive, default=d.batch_size, help="rows per rank and micro-step")
    p.add_argument("--grad-accum", type=_positive, default=None, help="micro-steps per optimizer step (default 1, "
                   "or derived from --global-batch)")
    p.add_argument("--global-batch", type=_positive, default=None,
                   help="rows per optimizer step; must be batch-size x world x grad-accum")
    p.add_argument("--strategy", choices=D.STRATEGIES, default=d.strategy)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision, help="auto: bf16 on GPU, fp32 on CPU")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--compile-backend", default=d.compile_backend, help="torch.compile backend (eager: trace only)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=d.device)
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch CPU threads per process (default: as set; torchrun sets OMP_NUM_THREADS=1)")
    p.add_argument("--out", default=d.out, help="run folder: config.json, metrics.jsonl, checkpoints/")
    p.add_argument("--checkpoint-every", type=_non_negative, default=d.checkpoint_every,
                   help="save every N steps (0: only at the end)")
    p.add_argument("--stop-at", type=_positive, default=None,
                   help="stop (and checkpoint) after this step of the --steps schedule; --resume continues")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return p


_positive, _non_negative = int_at_least(1), int_at_least(0)


def config_from_args(argv: Optional[list[str]], world_size: int) -> RunConfig:
    """Parse ``argv`` into a :class:`RunConfig` for ``world_size`` processes; bad input raises
    :class:`UsageError` naming the option and the fix."""
    args = vars(build_parser().parse_args(argv))
    per_step = args["batch_size"] * world_size
    if args["global_batch"] is None:
        args["grad_accum"] = args["grad_accum"] or 1
        args["global_batch"] = per_step * args["grad_accum"]
    else:
        if args["global_batch"] % per_step:
            raise UsageError(f"--global-batch {args['global_batch']} is not a multiple of --batch-size "
                             f"{args['batch_size']} x {world_size} processes = {per_step}; choose a global batch "
                             f"divisible by {per_step} or another --batch-size")
        derived = args["global_batch"] // per_step
        if args["grad_accum"] not in (None, derived):
            raise UsageError(f"--grad-accum {args['grad_accum']} contradicts --global-batch {args['global_batch']} "
                             f"= {args['batch_size']} x {world_size} x {derived}; give only one of the two")
        args["grad_accum"] = derived
    try:
        return RunConfig(**args)
    except ValueError as e:
        raise UsageError(str(e)) from None


def main(argv: Optional[list[str]] = None) -> int:
    """The command line: parse, join the process group (under ``torchrun``), train, leave. Returns the exit
    code: 0 on success, 2 for a usage error (printed to stderr, with the usage line)."""
    parser = build_parser()
    try:
        cfg = config_from_args(argv, int(os.environ.get("WORLD_SIZE", "1")))
        ctx = D.init(cfg.device)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        with _torch_threads_kept():
            losses = train(cfg, ctx)
        if ctx.is_main and losses:
            how = cfg.strategy if ctx.distributed else "no process group"
            print(f"{cfg.attention}: {len(losses)} steps on {ctx.world_size} x {ctx.device.type} ({how}), "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; log {Path(cfg.out) / 'metrics.jsonl'}")
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    finally:
        D.shutdown(ctx)
    return 0


__all__ = ["TASKS", "PRECISIONS", "RUN_DEFINING", "RunConfig", "LMBatch", "DataSource", "row_generator",
           "lr_factor", "build", "set_attention_backend", "graph_breaks", "checkpoint_dir", "latest_checkpoint",
           "save_checkpoint", "load_checkpoint", "load_model", "train", "UsageError", "build_parser",
           "config_from_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
