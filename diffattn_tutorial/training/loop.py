"""Train the library's :class:`~diffattn_tutorial.training.model.TinyLM` with the standard PyTorch stack, on one CPU or
many GPUs: ``python -m diffattn_tutorial.training.loop`` (also ``diffattn-tutorial train``), launched by ``torchrun``.

    python -m diffattn_tutorial.training.loop --attention diff --steps 200 --out runs/diff             # one process
    torchrun --nproc_per_node=2 -m diffattn_tutorial.training.loop --attention diff --strategy fsdp2 \\
        --global-batch 32 --batch-size 8 --out runs/diff                                          # two processes

What the script does, and where each piece lives:

* **Data** (:class:`RunConfig` ``task``): the multi-needle retrieval task (:class:`~diffattn_tutorial.training.needle.
  NeedleTask`, step ``t`` on setting ``SETTINGS[t % 4]`` as in notebook 07) or the generated text corpus
  (:class:`~diffattn_tutorial.training.corpus.TextTask`). Row ``i`` of step ``t``'s global batch is drawn from its own
  generator seeded by ``(seed, t, i)``, so the global batch is the same whatever the number of processes; each
  rank builds only its rows (:func:`~diffattn_tutorial.training.distributed.micro_batch_rows`).
* **Global batch** = ``batch_size`` (per rank and micro-step) x world size x ``grad_accum``. Give
  ``--global-batch`` and the accumulation is derived for the world size at hand, so the same command trains the
  same model on 1 CPU process or 8 GPUs. Each micro-step's loss is its rows' mean divided by ``grad_accum``;
  all rows hold the same number of targets, so the averaged gradients are those of the global batch's mean loss.
* **Parallelism** (``--strategy``): ``ddp`` or ``fsdp2`` (``fully_shard``, one unit per block), gloo on CPUs,
  NCCL on GPUs (:mod:`diffattn_tutorial.training.distributed`).
* **Mixed precision** on GPU only (``--precision auto`` = the GPU's 16-bit dtype, fp32 on CPU): bf16 from compute
  capability 8.0 (A100, RTX 30xx/40xx, L4, H100), fp16 below (Colab's T4), as ``gpu_bench.preferred_half_dtype``
  decides; ``bf16`` asked for on a T4 is refused, naming fp16. DDP runs the forward under ``torch.autocast`` in
  that dtype, FSDP2 gathers 16-bit weights (``MixedPrecisionPolicy``) and reduces gradients in float32; the
  optimizer always holds float32 weights. fp16 trains with a ``torch.amp.GradScaler`` (the loss scaled before the
  backward, the gradients unscaled before clipping, a step with inf/NaN gradients skipped; the scale is not
  checkpointed and re-calibrates after a resume), with DDP only: with FSDP2 each rank would check only its own
  gradient shards for inf (use ``--strategy ddp`` or ``--precision fp32`` there).
* **torch.compile** (``--compile``): each block is compiled in place before wrapping, so checkpoint keys do not
  change. Which attention backends compile as one graph is measured by :func:`graph_breaks`
  (``torch._dynamo.explain`` of one block's forward). On torch 2.13 the SDPA path (``auto``, ``sdpa`` and
  every SDPA formulation) traces with no graph break for all three attention kinds, and so do ``naive`` and
  ``chunked`` for DIFF attention (asserted in ``tests/test_train.py``). ``triton`` calls a custom kernel and is
  not measured here.
* **Checkpoints** (``--checkpoint-every``, ``--resume``): ``torch.distributed.checkpoint`` (DCP) saves model and
  AdamW state sharded, one file per rank, and loads them into any world size or strategy; the learning rate is a
  function of the step and the data of ``(seed, step)``, so a resumed run continues the same loss curve. When
  a checkpoint is complete, rank 0 writes its ``manifest.json`` (atomically, last): the sha256 of every file, the
  step, the run's config and its run id. ``--resume`` takes the newest checkpoint whose files match their
  manifest (naming and skipping damaged or unfinished ones) and whose run id and config match the run's.
* **Trust**: DCP reads a checkpoint's ``.metadata`` with ``pickle``, which runs whatever code the file names. Only
  load checkpoint folders you trust (your own runs). The manifest is checked before torch reads a byte, so a
  damaged or altered file is refused, but whoever can write the folder can also write a matching manifest: the
  hashes catch accidents, not attacks. A checkpoint without a valid manifest is refused unless you pass
  ``--allow-unverified-checkpoint`` (``allow_unverified=True``).
* **Output** (``--out DIR``, a new or empty folder; ``--resume`` continues the run in it, ``--overwrite`` clears
  it first): ``config.json``, ``metrics.jsonl`` (JSON lines, :mod:`diffattn_tutorial.training.runlog`, plotted by
  :func:`~diffattn_tutorial.training.runlog.plot_loss_curves`), ``checkpoints/step_NNNNNN/``; a ``tqdm`` bar on rank 0.
  Ctrl-C stops a run with "stopped at step N" and the checkpoint to resume from, exit code 130 (under ``torchrun``,
  torchrun reports its workers' end); bad options exit with 2 and one line naming the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, NamedTuple, Optional, Union

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from diffattn_tutorial.training import distributed as D
from diffattn_tutorial.argtypes import int_at_least
from diffattn_tutorial.training.corpus import TextTask
from diffattn_tutorial.training.needle import NeedleTask
from diffattn_tutorial.training.study import SETTINGS, lr_factor, retrieval_loss
from diffattn_tutorial.functional import BACKENDS, FORWARD_ONLY
from diffattn_tutorial.training.model import ATTENTIONS, LMConfig, TinyLM
from diffattn_tutorial.layers.attention import DiffAttnV2, MultiheadAttention, MultiheadDiffAttn
from diffattn_tutorial.training.runlog import MetricsLog, read_records

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
        self._check_floats()
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite deletes it: give one of the two")
        if self.stop_at is not None and not 1 <= self.stop_at <= self.steps:
            raise ValueError(f"stop_at must lie in 1..steps={self.steps}, got {self.stop_at}")
        if self.global_batch % (self.batch_size * self.grad_accum):
            raise ValueError(f"global_batch={self.global_batch} is not batch_size={self.batch_size} x world x "
                             f"grad_accum={self.grad_accum}")
        if self.attn_backend != "auto" and self.attention != "diff" and self.attn_backend not in ("naive", "sdpa"):
            raise ValueError(f"attn_backend {self.attn_backend!r} is a differential-attention backend; "
                             f"attention={self.attention!r} takes 'auto', 'naive' or 'sdpa'")
        if self.attn_backend in FORWARD_ONLY:
            raise ValueError(f"attn_backend {self.attn_backend!r} is forward-only (inference, no gradients); to "
                             f"train use 'auto', 'naive', 'chunked' or an sdpa formulation")
        if self.compile or self.compile_backend != "inductor":
            _check_compile_backend(self.compile_backend)

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


def _check_compile_backend(name: str) -> None:
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise ValueError(f"compile_backend {name!r} is not a torch.compile backend; choose one of "
                         f"{', '.join(torch._dynamo.list_backends())} or 'eager' (trace only)")


def check_backend_here(backend: str, device: torch.device) -> None:
    """Refuse an attention backend that cannot run on ``device`` before any model is built (``triton`` needs a
    CUDA GPU, or ``TRITON_INTERPRET=1`` on a CPU), naming the fix."""
    if backend != "triton":
        return
    from diffattn_tutorial.functional import _triton_available

    ok, why = _triton_available()
    if not ok:
        raise ValueError(f"--attn-backend triton cannot run here ({why}); use --attn-backend auto")


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
    """16-bit autocast for DDP (and single-process) runs on a GPU; FSDP2 casts through its own policy."""
    dtype = half_dtype(cfg.precision, ctx.device, cfg.strategy)
    if dtype is not None and cfg.strategy == "ddp":
        return torch.autocast(ctx.device.type, dtype=dtype)
    return contextlib.nullcontext()


def half_dtype(precision: str, device: torch.device, strategy: str = "ddp") -> Optional[torch.dtype]:
    """The 16-bit dtype a run computes in, or None for float32: ``auto`` is fp32 on a CPU and
    ``gpu_bench.preferred_half_dtype`` on a GPU (bf16 from compute capability 8.0, fp16 below); ``bf16`` and
    ``fp16`` need a GPU, ``bf16`` one with bf16 arithmetic, ``fp16`` (loss-scaled) the ``ddp`` strategy."""
    from diffattn_tutorial.measure.gpu import check_half_dtype, preferred_half_dtype

    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if device.type != "cuda":
        raise ValueError(f"precision={precision!r} needs a CUDA GPU (mixed precision is for GPUs only); use 'auto' "
                         f"or 'fp32'")
    dtype = preferred_half_dtype(device) if precision == "auto" else {"bf16": torch.bfloat16,
                                                                        "fp16": torch.float16}[precision]
    check_half_dtype(dtype, device, what=f"precision={precision!r}")
    if dtype == torch.float16 and strategy != "ddp":
        raise ValueError(f"precision fp16 (this GPU's 16-bit dtype{' under auto' if precision == 'auto' else ''}) "
                         f"trains with a GradScaler, whose inf check would see only each rank's gradient shards "
                         f"under {strategy}; use --strategy ddp, or --precision fp32")
    return dtype


def _mixed_precision(cfg: RunConfig, ctx: D.DistContext) -> bool:
    return half_dtype(cfg.precision, ctx.device, cfg.strategy) is not None


def _grad_scaler(cfg: RunConfig, ctx: D.DistContext) -> torch.amp.GradScaler:
    """Loss scaling for fp16 (its small exponent range underflows gradients); a no-op for fp32 and bf16."""
    fp16 = half_dtype(cfg.precision, ctx.device, cfg.strategy) == torch.float16
    return torch.amp.GradScaler(ctx.device.type, enabled=fp16)


# --- checkpoints -----------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns that it saves or loads "in a single process" when there is no process group: that is the
    intended use here (one process, or ``load_model`` after a run), so the warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


MANIFEST = "manifest.json"
"""The file rank 0 writes last into a complete checkpoint folder (see :func:`write_manifest`)."""

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints")
"""What a run folder holds: the only entries ``--overwrite`` deletes."""


class CheckpointError(ValueError):
    """A checkpoint that is not loaded: damaged, unfinished, unverified or of another run. The message names the
    folder, what is wrong and what to do."""


class UnverifiedCheckpoint(CheckpointError):
    """A checkpoint without a usable manifest (an unfinished save, or not written by this library)."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (a full disk, a lost folder): the message names it."""


def checkpoint_dir(out: Union[str, Path], step: int) -> Path:
    return Path(out) / "checkpoints" / f"step_{step:06d}"


def list_checkpoints(out: Union[str, Path]) -> list[Path]:
    """Every ``step_NNNNNN`` folder under ``out/checkpoints``, complete or not, oldest first."""
    folder = Path(out) / "checkpoints"
    return sorted(p for p in folder.glob("step_*") if p.is_dir()) if folder.is_dir() else []


def latest_checkpoint(out: Union[str, Path]) -> Optional[Path]:
    """The newest checkpoint under ``out/checkpoints`` whose save finished (its :data:`MANIFEST` is written last),
    or None. Whether its files are intact is :func:`verify_checkpoint`'s question."""
    done = [p for p in list_checkpoints(out) if (p / MANIFEST).is_file()]
    return done[-1] if done else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(path: Union[str, Path], *, step: int, run_id: Optional[str], config: Optional[dict]) -> Path:
    """Write ``path/manifest.json``: the size and sha256 of every file of the finished checkpoint ``path``, its
    ``step``, the run's ``config`` and ``run_id``. Written to a temporary name, flushed to disk, then renamed, so
    a manifest exists only complete, and only for a complete checkpoint."""
    path = Path(path)
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(MANIFEST)}
    manifest = {"format": 1, "step": step, "run_id": run_id, "config": config, "files": files}
    tmp = path / f"{MANIFEST}.tmp"
    with tmp.open("w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MANIFEST)
    with contextlib.suppress(OSError):  # make the rename itself durable where the platform allows it
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return path / MANIFEST


def _read_manifest(path: Path) -> dict:
    """``path/manifest.json`` parsed and shape-checked; :class:`CheckpointError` when missing or unreadable."""
    where = path / MANIFEST
    if not where.is_file():
        raise UnverifiedCheckpoint(f"checkpoint {path} has no {MANIFEST} (its save did not finish, or it was "
                                   f"not written by this library)")
    try:
        manifest = json.loads(where.read_text())
        files = manifest["files"]
        if not (isinstance(files, dict) and all(isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
                                                for v in files.values()) and isinstance(manifest["step"], int)):
            raise ValueError("unexpected layout")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UnverifiedCheckpoint(f"checkpoint {path} has a damaged {MANIFEST} ({type(e).__name__}: "
                                   f"{' '.join(str(e).split())[:120]})") from None
    return manifest


def verify_checkpoint(path: Union[str, Path], *, allow_unverified: bool = False) -> Optional[dict]:
    """Check a checkpoint folder against its manifest before anything reads it; returns the manifest.

    Raises :class:`CheckpointError` naming ``path`` when a file is missing, has another size (truncated) or
    another sha256 (damaged or changed), or when the manifest is missing or unreadable (an unfinished save). With
    ``allow_unverified=True`` a checkpoint without a usable manifest is let through (None is returned): only for
    folders you trust, since torch unpickles ``.metadata`` (see the module doc). Files the manifest does not list
    are not read by a load and are ignored.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a folder)")
    try:
        manifest = _read_manifest(path)
    except UnverifiedCheckpoint:
        if allow_unverified:
            return None
        raise
    if ".metadata" not in manifest["files"]:
        raise CheckpointError(f"checkpoint {path}: its {MANIFEST} does not cover .metadata")
    for name, want in manifest["files"].items():
        file = path / name
        if Path(name).name != name or not file.is_file():
            raise CheckpointError(f"checkpoint {path} is damaged: {name} is missing")
        size = file.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} has {size} bytes, the manifest says "
                                  f"{want['bytes']} (truncated?)")
        if _sha256(file) != want["sha256"]:
            raise CheckpointError(f"checkpoint {path} is damaged: {name} differs from the sha256 in its manifest")
    if path.name.startswith("step_") and path.name != f"step_{manifest['step']:06d}":
        raise CheckpointError(f"checkpoint {path}: its manifest says step {manifest['step']}")
    return manifest


def _is_main_rank() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, step: int, out: Union[str, Path], *,
                    run_id: Optional[str] = None, config: Optional[dict] = None) -> Path:
    """Model and optimizer state after ``step`` optimizer steps, sharded by DCP (every rank writes its part),
    then rank 0's :func:`write_manifest` (with ``run_id`` and ``config``). A folder left by an earlier attempt at
    the same step is cleared first, so the manifest lists this save's files only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    path = checkpoint_dir(out, step)
    if _is_main_rank() and path.exists():
        shutil.rmtree(path)
    _barrier()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet():
            dcp.save({"model": model_sd, "optim": optim_sd, "progress": {"step": step}}, checkpoint_id=str(path))
    except CheckpointException as e:  # DCP wraps each rank's error, Ctrl-C included, in this BaseException
        inner = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(inner, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise CheckpointSaveError(f"cannot save checkpoint {path} ({type(inner).__name__}: "
                                  f"{' '.join(str(inner).split())[:200]}); it has no manifest, so --resume skips "
                                  f"it") from None
    if _is_main_rank():
        write_manifest(path, step=step, run_id=run_id, config=config)
    _barrier()
    return path


def _dcp_load(state: dict, path: Path) -> None:
    """``dcp.load`` with its failure as one :class:`CheckpointError` naming ``path`` (not a traceback per rank)."""
    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, holding each rank's error

    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)  # DCP logs each failed metadata read with a traceback on the root logger
    try:
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - unpickling, shapes, keys: "not this checkpoint"
        if isinstance(e, CheckpointException) and e.failures:
            e = next(iter(e.failures.values()))[0]
        what = " ".join(f"{type(e).__name__}: {e}".split())[:200]
        raise CheckpointError(f"checkpoint {path} could not be loaded ({what}); it is damaged or not this run's: "
                              f"delete it to resume from an earlier one") from None
    finally:
        logging.disable(disabled)


def load_checkpoint(model: nn.Module, opt: torch.optim.Optimizer, path: Union[str, Path], *,
                    allow_unverified: bool = False, verified: bool = False) -> int:
    """Load a :func:`save_checkpoint` folder into ``model`` and ``opt`` (any world size or strategy, DCP
    reshards); returns the step it was saved after.

    Only load checkpoints you trust: DCP unpickles ``.metadata``. The folder is first checked against its
    manifest (:func:`verify_checkpoint`; ``verified=True`` when the caller just did), so a damaged one raises
    :class:`CheckpointError` naming it, before torch reads anything.
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not verified:
        verify_checkpoint(path, allow_unverified=allow_unverified)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "progress": {"step": -1}}
    _dcp_load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["progress"]["step"])


def read_run_config(out: Union[str, Path]) -> tuple[dict, Optional[str]]:
    """``(config, run_id)`` of run folder ``out`` from its ``config.json``; a missing, broken or edited file is a
    ``ValueError`` naming it."""
    where = Path(out) / "config.json"
    try:
        saved = json.loads(where.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist: {out} is not a training run's folder") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} is broken ({' '.join(str(e).split())[:120]}); restore it, or start the run "
                         f"again with --overwrite") from None
    run_id = saved.pop("run_id", None)
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    unknown = sorted(set(saved) - fields)
    if unknown:
        raise ValueError(f"{where} has keys RunConfig does not know ({', '.join(unknown)}); restore the file "
                         f"(it was written by another version of this library, or edited)")
    return saved, run_id


def load_model(out: Union[str, Path], step: Optional[int] = None, *, allow_unverified: bool = False) -> TinyLM:
    """The model of run folder ``out`` (its latest checkpoint, or that of ``step``), in one process, on the CPU,
    in eval mode: whatever world size and strategy trained it.

    Only load run folders you trust: DCP unpickles the checkpoint's ``.metadata``. The checkpoint is checked
    against its manifest first (:func:`verify_checkpoint`): a damaged or unverified one raises
    :class:`CheckpointError` naming it (``allow_unverified=True`` loads one without a manifest).
    """
    path = checkpoint_dir(out, step) if step is not None else latest_checkpoint(out)
    if path is None and allow_unverified:
        done = [p for p in list_checkpoints(out) if (p / ".metadata").is_file()]
        path = done[-1] if done else None
    if path is None or not path.is_dir():
        raise FileNotFoundError(f"no checkpoint {'for step ' + str(step) + ' ' if step else ''}in {out}/checkpoints")
    manifest = verify_checkpoint(path, allow_unverified=allow_unverified)
    saved = manifest["config"] if manifest and manifest.get("config") else read_run_config(out)[0]
    saved = {k: v for k, v in saved.items() if k != "out"}
    try:
        cfg = RunConfig(**saved, out=str(out))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its config is not a valid RunConfig ({e})") from None
    source = DataSource(cfg)
    model = build(cfg, source.vocab_size, source.max_len)
    state = {"model": model.state_dict()}
    _dcp_load(state, path)
    model.load_state_dict(state["model"])
    return model.eval()


def _differences(cfg: RunConfig, saved: dict) -> list[str]:
    return [f"{k}: checkpoint {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in RUN_DEFINING
            if saved.get(k) != getattr(cfg, k)]


def _check_resumable(cfg: RunConfig, path: Path, manifest: Optional[dict], run_id: Optional[str],
                     saved: dict) -> None:
    """A resumed run must define the same training as its checkpoint (:data:`RUN_DEFINING`), and the checkpoint
    must belong to the run of the folder's ``config.json`` (the same run id)."""
    if manifest is not None and manifest.get("run_id") != run_id:
        raise CheckpointError(f"--resume: checkpoint {path} belongs to run {manifest.get('run_id')}, but "
                              f"{cfg.out}/config.json to run {run_id}: the folder mixes two runs; start again with "
                              f"--overwrite or use another --out")
    if manifest is not None and manifest.get("config"):
        saved = manifest["config"]
    differ = _differences(cfg, saved)
    if differ:
        raise ValueError(f"--resume: this command trains a different run than the checkpoint in {cfg.out} "
                         f"({'; '.join(differ)}); use the checkpoint's settings or another --out")


class RunStart(NamedTuple):
    """Where a run starts: its id, the checkpoint it resumes from (None: step 0), and the checkpoints skipped as
    damaged or unfinished (one message each)."""

    run_id: str
    checkpoint: Optional[str]
    skipped: tuple[str, ...]


def _resume_from(cfg: RunConfig) -> RunStart:
    """Rank 0's choice for ``--resume``: the newest intact checkpoint of the folder's run, checked against it."""
    if not (Path(cfg.out) / "config.json").exists() or not list_checkpoints(cfg.out):
        raise ValueError(f"--resume: no checkpoint in {cfg.out}/checkpoints; run without --resume first")
    saved, run_id = read_run_config(cfg.out)
    if (Path(cfg.out) / "metrics.jsonl").exists():
        read_records(Path(cfg.out) / "metrics.jsonl")  # a damaged log is named now, not by rank 0 alone later
    skipped, unverified = [], False
    for path in reversed(list_checkpoints(cfg.out)):
        try:
            manifest = verify_checkpoint(path, allow_unverified=cfg.allow_unverified)
            if manifest is None and not (path / ".metadata").is_file():
                raise CheckpointError(f"checkpoint {path} has no .metadata (its save did not finish)")
        except CheckpointError as e:
            skipped.append(str(e))
            unverified = unverified or isinstance(e, UnverifiedCheckpoint)
            continue
        _check_resumable(cfg, path, manifest, run_id, saved)
        return RunStart(run_id or uuid.uuid4().hex, str(path), tuple(skipped))
    raise CheckpointError(f"--resume: no intact checkpoint in {cfg.out}/checkpoints ({'; '.join(skipped)}); "
                          f"start again with --overwrite"
                          + (", or pass --allow-unverified-checkpoint if you trust these folders" if unverified
                             else ""))


def _start_fresh(cfg: RunConfig) -> RunStart:
    """Rank 0's set-up of a new run: ``out`` new or empty (or cleared with ``--overwrite``), ``config.json`` with a
    new run id."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; choose another --out")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not cfg.overwrite:
        raise ValueError(f"--out {out} is not empty ({', '.join(entries[:4])}{', ...' if len(entries) > 4 else ''}): "
                         f"continue its run with --resume, delete it with --overwrite, or choose another --out")
    foreign = [e for e in entries if e not in RUN_FILES]
    if foreign:
        raise ValueError(f"--overwrite: {out} holds files that are not a training run's ({', '.join(foreign[:4])}), "
                         f"so it is not cleared; choose another --out")
    try:
        for name in entries:
            target = out / name
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        out.mkdir(parents=True, exist_ok=True)
        run_id = uuid.uuid4().hex
        tmp = out / "config.json.tmp"
        tmp.write_text(json.dumps({**cfg.to_json(), "run_id": run_id}, indent=1) + "\n")
        os.replace(tmp, out / "config.json")
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write the run folder ({e.strerror or e}"
                         f"{': ' + str(e.filename) if e.filename else ''}); choose a folder you can write to") from None
    return RunStart(run_id, None, ())


# --- the loop --------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _torch_threads_kept() -> Iterator[None]:
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Interrupted(Exception):
    """Ctrl-C during training: ``step`` optimizer steps done of ``stop``, the newest checkpoint at ``saved``
    (None: none yet)."""

    def __init__(self, step: int, stop: int, saved: Optional[int]) -> None:
        super().__init__(step, stop, saved)
        self.step, self.stop, self.saved = step, stop, saved

    def __str__(self) -> str:
        if self.saved is None:
            return (f"stopped at step {self.step} of {self.stop}, before any checkpoint was saved; start again with "
                    f"--overwrite (--checkpoint-every N saves every N steps)")
        redo = f" (steps {self.saved + 1}-{self.step} will run again)" if self.saved < self.step else ""
        return f"stopped at step {self.step} of {self.stop}; resume with --resume from step {self.saved}{redo}"


def train(cfg: RunConfig, ctx: D.DistContext) -> list[float]:
    """Run (or resume) the training ``cfg`` describes in this process; returns this session's step losses
    (the global batch's mean loss after each optimizer step). Ctrl-C raises :class:`Interrupted`."""
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    check_backend_here(cfg.attn_backend, ctx.device)
    run = D.on_main(lambda: _resume_from(cfg) if cfg.resume else _start_fresh(cfg), ctx)
    for reason in run.skipped if ctx.is_main else ():
        print(f"warning: {reason}; skipped", file=sys.stderr, flush=True)
    if ctx.is_main and run.skipped:
        print(f"resuming from {run.checkpoint}", file=sys.stderr, flush=True)
    source = DataSource(cfg)
    model = build(cfg, source.vocab_size, source.max_len)
    if cfg.compile:
        for block in model.blocks:
            block.compile(backend=cfg.compile_backend)
    mixed = _mixed_precision(cfg, ctx)
    scaler = _grad_scaler(cfg, ctx)
    model = D.wrap(model.to(ctx.device), ctx, cfg.strategy,
                   param_dtype=half_dtype(cfg.precision, ctx.device, cfg.strategy) if cfg.strategy == "fsdp2"
                   else None)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=cfg.weight_decay)
    log = MetricsLog(Path(cfg.out) / "metrics.jsonl", enabled=ctx.is_main)
    start = 0
    if run.checkpoint is not None:
        start = load_checkpoint(model, opt, run.checkpoint, verified=True)  # rank 0 checked it in _resume_from
    stop = cfg.stop_at or cfg.steps
    if start > stop:
        raise ValueError(f"--stop-at {stop} lies before step {start} of the checkpoint {run.checkpoint}; give a later "
                         f"--stop-at, or none")
    if run.checkpoint is not None:
        log.truncate_after(start)
    log.write({"event": "start", "step": start, "world_size": ctx.world_size, "strategy": cfg.strategy,
               "device": str(ctx.device), "backend": ctx.backend, "mixed_precision": mixed,
               "torch": torch.__version__, "python": platform.python_version(),
               "params": sum(p.numel() for p in model.parameters()),
               "params_per_rank": D.gather_ints(D.local_numel(model), ctx), "config": cfg.to_json(),
               **({"resumed_from": Path(run.checkpoint).name} if run.checkpoint else {}),
               **({"skipped_checkpoints": list(run.skipped)} if run.skipped else {})})
    _mixed_precision(cfg, ctx)  # its refusals (a precision this device lacks) come before the run folder is touched
    losses, t0 = [], time.perf_counter()
    tokens = sum(cfg.global_batch * source.row_len(s) for s in range(start))
    bar = tqdm(range(start, stop), desc=f"{cfg.attention} x{ctx.world_size}", disable=not (cfg.progress and ctx.is_main),
               initial=start, total=stop, mininterval=1.0)
    model.train()
    done, saved = start, (start if run.checkpoint is not None else None)
    try:
        for step in bar:
            loss = _train_step(model, opt, source, cfg, ctx, step, scaler)
            scaler.unscale_(opt)  # fp16: true gradients before clipping (a no-op otherwise)
            grad_norm = _clip(model, cfg.clip)
            scaler.step(opt)  # fp16: skipped when a gradient is inf/NaN; otherwise opt.step()
            scaler.update()
            opt.zero_grad(set_to_none=True)
            losses.append(D.mean_over_ranks(loss, ctx))
            done = step + 1
            tokens += cfg.global_batch * source.row_len(step)
            log.write({"event": "step", "step": step + 1, "loss": losses[-1], "lr": opt.param_groups[0]["lr"],
                       "grad_norm": grad_norm, "tokens": tokens,
                       "seconds": round(time.perf_counter() - t0, 3)})
            if step % 10 == 0:
                bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if step + 1 == stop or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0):
                save_checkpoint(model, opt, step + 1, cfg.out, run_id=run.run_id, config=cfg.to_json())
                saved = step + 1
    except KeyboardInterrupt:
        bar.close()
        log.write({"event": "interrupted", "step": done, "seconds": round(time.perf_counter() - t0, 3)})
        raise Interrupted(done, stop, saved) from None
    bar.close()
    log.write({"event": "end", "step": stop, "seconds": round(time.perf_counter() - t0, 3)})
    return losses


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, source: DataSource, cfg: RunConfig,
                ctx: D.DistContext, step: int, scaler: torch.amp.GradScaler) -> Tensor:
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
            scaler.scale(loss).backward()
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


def build_parser(prog: str = "python -m diffattn_tutorial.training.loop") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=__doc__.splitlines()[0],
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
    p.add_argument("--lr", type=_finite, default=d.lr, help=f"AdamW peak learning rate, in (0, {MAX_LR}]")
    p.add_argument("--warmup", type=_non_negative, default=d.warmup)
    p.add_argument("--weight-decay", type=_finite, default=d.weight_decay, help="AdamW weight decay, >= 0")
    p.add_argument("--clip", type=_finite, default=d.clip, help="gradient-norm clip, > 0")
    p.add_argument("--seed", type=_non_negative, default=d.seed)
    p.add_argument("--batch-size", type=_positive, default=d.batch_size, help="rows per rank and micro-step")
    p.add_argument("--grad-accum", type=_positive, default=None, help="micro-steps per optimizer step (default 1, "
                   "or derived from --global-batch)")
    p.add_argument("--global-batch", type=_positive, default=None,
                   help="rows per optimizer step; must be batch-size x world x grad-accum")
    p.add_argument("--strategy", choices=D.STRATEGIES, default=d.strategy)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision,
                   help="auto: fp32 on CPU; on a GPU bf16, or fp16 (loss-scaled) below compute capability 8.0")
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
    p.add_argument("--resume", action="store_true", help="continue from the newest intact checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the run already in --out (config.json, metrics.jsonl, checkpoints/) and start again")
    p.add_argument("--allow-unverified-checkpoint", dest="allow_unverified", action="store_true",
                   help="let --resume load a checkpoint without a valid manifest.json (DCP unpickles it: only for "
                        "folders you trust)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    return p


_positive, _non_negative = int_at_least(1), int_at_least(0)


def _finite(text: str) -> float:
    """An argparse ``type``: a finite number (``nan`` and ``inf`` are refused here, ranges by RunConfig)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


_finite.__name__ = "number"


def config_from_args(argv: Optional[list[str]], world_size: int,
                     prog: str = "python -m diffattn_tutorial.training.loop") -> RunConfig:
    """Parse ``argv`` into a :class:`RunConfig` for ``world_size`` processes; bad input raises
    :class:`UsageError` naming the option and the fix."""
    args = vars(build_parser(prog).parse_args(argv))
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


def main(argv: Optional[list[str]] = None, prog: str = "python -m diffattn_tutorial.training.loop") -> int:
    """The command line: parse, join the process group (under ``torchrun``), train, leave. Returns the exit
    code: 0 on success, 2 for a usage error or a run that cannot start (one line on stderr naming the fix), 1 when
    training fails (a diverging loss, a full disk), 130 after Ctrl-C (``prog``: the command's name in messages)."""
    parser = build_parser(prog)
    try:
        cfg = config_from_args(argv, int(os.environ.get("WORLD_SIZE", "1")), prog)
        ctx = D.init(cfg.device)
    except UsageError as e:
        return _error(parser, f"{e} (see {prog} --help)", 2)
    except ValueError as e:
        return _error(parser, e, 2)
    except KeyboardInterrupt:
        return 130
    code = 0
    try:
        with _torch_threads_kept():
            losses = train(cfg, ctx)
        if ctx.is_main and losses:
            how = cfg.strategy if ctx.distributed else "no process group"
            print(f"{cfg.attention}: {len(losses)} steps on {ctx.world_size} x {ctx.device.type} ({how}), "
                  f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; log {Path(cfg.out) / 'metrics.jsonl'}")
        elif ctx.is_main:
            print(f"{cfg.out} is already at step {cfg.stop_at or cfg.steps}; nothing to train")
    except Interrupted as e:
        code = _error(parser, e, 130, main_only=not ctx.is_main, label="")
    except KeyboardInterrupt:
        code = _error(parser, "stopped before the first step", 130, main_only=not ctx.is_main, label="")
    except ValueError as e:
        code = _error(parser, e, 2)
    except FloatingPointError as e:
        code = _error(parser, f"{e}; then start again with --overwrite (the settings are part of the run)", 1)
    except (OSError, CheckpointSaveError) as e:
        code = _error(parser, e, 1)
    finally:
        D.shutdown(ctx)
    return code


def _error(parser: argparse.ArgumentParser, message: object, code: int, main_only: bool = False,
           label: str = "error: ") -> int:
    """Print ``message`` as one line on stderr (not on ranks other than 0 when ``main_only``); return ``code``."""
    if not main_only:
        print(f"{parser.prog}: {label}{' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


__all__ = ["TASKS", "PRECISIONS", "RUN_DEFINING", "RunConfig", "LMBatch", "DataSource", "row_generator",
           "lr_factor", "build", "set_attention_backend", "graph_breaks", "checkpoint_dir", "latest_checkpoint",
           "list_checkpoints", "write_manifest", "verify_checkpoint", "save_checkpoint", "load_checkpoint",
           "read_run_config", "load_model", "CheckpointError", "UnverifiedCheckpoint",
           "CheckpointSaveError", "MANIFEST", "MAX_LR",
           "check_backend_here", "Interrupted", "train", "UsageError", "build_parser", "config_from_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
