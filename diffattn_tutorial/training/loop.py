"""Train the library's :class:`~diffattn_tutorial.training.model.TinyLM` with the standard PyTorch stack, on one CPU or
many GPUs: ``python -m diffattn_tutorial.training.loop`` (also ``diffattn-tutorial train``), launched by ``torchrun``::

    python -m diffattn_tutorial.training.loop --attention diff --steps 200 --out runs/diff             # one process
    torchrun --nproc_per_node=2 -m diffattn_tutorial.training.loop --attention diff --strategy fsdp2 \\
        --global-batch 32 --batch-size 8 --out runs/diff                                          # two processes

The contract, and where each piece lives:

* **Same model whatever the world size**: row ``i`` of step ``t`` is drawn from a generator seeded by
  ``(seed, t, i)`` (:class:`~diffattn_tutorial.training.config.DataSource`); ``--global-batch`` fixes the batch and the
  gradient accumulation is derived for the number of processes.
* **Parallelism** ``--strategy ddp|fsdp2`` (:mod:`diffattn_tutorial.training.distributed`); **precision** ``auto`` is the
  GPU's 16-bit dtype (``measure.gpu.preferred_half_dtype``; fp16 with a GradScaler, DDP only), float32 on a CPU;
  ``--compile`` compiles each block in place (:func:`~diffattn_tutorial.training.config.graph_breaks` measures breaks).
* **Checkpoints** (:mod:`diffattn_tutorial.training.checkpoints`): DCP, sharded, with a sha256 manifest written last;
  ``--resume`` continues from the newest verified one (from step 0 when the run stopped before its first). DCP reads
  ``.metadata`` with pickle: load only folders you trust; the manifest catches accidents, not attacks.
* **Output** ``--out DIR`` (new or empty; ``--overwrite`` clears it): ``config.json``, ``metrics.jsonl``
  (:mod:`diffattn_tutorial.training.runlog`), ``checkpoints/step_NNNNNN/``. Every refusal comes before the folder is
  touched. Ctrl-C lets the step and a checkpoint being written finish, then stops every rank after the same step
  ("stopped at step N", exit 130); bad options exit 2 with one line naming the fix.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from diffattn_tutorial import backends
from diffattn_tutorial.argtypes import Parser, UsageError, int_at_least, print_usage_error
from diffattn_tutorial.backends import BACKENDS
from diffattn_tutorial.measure.cpu_threads import threads
from diffattn_tutorial.training import distributed
from diffattn_tutorial.training.checkpoints import (
    RUN_FILES,
    CheckpointError,
    CheckpointSaveError,
    UnverifiedCheckpoint,
    list_checkpoints,
    load_checkpoint,
    read_run_config,
    save_checkpoint,
    verify_checkpoint,
)
from diffattn_tutorial.training.config import (
    MAX_LR,
    PRECISIONS,
    RUN_DEFINING,
    TASKS,
    DataSource,
    LMBatch,
    RunConfig,
    build_run_model,
    check_backend_here,
)
from diffattn_tutorial.training.model import ATTENTIONS
from diffattn_tutorial.training.runlog import MetricsLog, read_records
from diffattn_tutorial.training.schedule import lr_factor

Tensor = torch.Tensor

def _autocast(cfg: RunConfig, ctx: distributed.DistContext) -> contextlib.AbstractContextManager:
    """16-bit autocast for DDP (and single-process) runs on a GPU; FSDP2 casts through its own policy."""
    dtype = half_dtype(cfg.precision, ctx.device, cfg.strategy)
    if dtype is not None and cfg.strategy == "ddp":
        return torch.autocast(ctx.device.type, dtype=dtype)
    return contextlib.nullcontext()


def half_dtype(precision: str, device: torch.device, strategy: str = "ddp") -> Optional[torch.dtype]:
    """The 16-bit dtype a run computes in, or None for float32: ``auto`` is fp32 on a CPU and
    ``measure.gpu.preferred_half_dtype`` on a GPU (bf16 from compute capability 8.0, fp16 below); ``bf16`` and
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


def _mixed_precision(cfg: RunConfig, ctx: distributed.DistContext) -> bool:
    return half_dtype(cfg.precision, ctx.device, cfg.strategy) is not None


def _grad_scaler(cfg: RunConfig, ctx: distributed.DistContext) -> torch.amp.GradScaler:
    """Loss scaling for fp16 (its small exponent range underflows gradients); a no-op for fp32 and bf16."""
    fp16 = half_dtype(cfg.precision, ctx.device, cfg.strategy) == torch.float16
    return torch.amp.GradScaler(ctx.device.type, enabled=fp16)


# --- starting or resuming a run ------------------------------------------------------------------------------

def _differences(cfg: RunConfig, saved: dict, what: str) -> list[str]:
    return [f"{k}: {what} {saved.get(k)!r}, now {getattr(cfg, k)!r}" for k in RUN_DEFINING
            if saved.get(k) != getattr(cfg, k)]


def _check_resumable(cfg: RunConfig, path: Optional[Path], manifest: Optional[dict], run_id: Optional[str],
                     saved: dict) -> None:
    """A resumed run must define the same training as its checkpoint (:data:`RUN_DEFINING`; ``path`` None: as
    the folder's ``config.json``, for a run stopped before its first checkpoint), and the checkpoint must belong
    to the run of the folder's ``config.json`` (the same run id)."""
    if manifest is not None and manifest.get("run_id") != run_id:
        raise CheckpointError(f"--resume: checkpoint {path} belongs to run {manifest.get('run_id')}, but "
                              f"{cfg.out}/config.json to run {run_id}: the folder mixes two runs; start again with "
                              f"--overwrite or use another --out")
    if manifest is not None and manifest.get("config"):
        saved = manifest["config"]
    what = "checkpoint" if path is not None else "run"
    differ = _differences(cfg, saved, what)
    if differ:
        raise ValueError(f"--resume: this command trains a different run than the {what} in {cfg.out} "
                         f"({'; '.join(differ)}); use the {what}'s settings or another --out")


class RunStart(NamedTuple):
    """Where a run starts: its id, the checkpoint it resumes from (None: step 0), and the checkpoints skipped as
    damaged or unfinished (one message each)."""

    run_id: str
    checkpoint: Optional[str]
    skipped: tuple[str, ...]


def _resume_from(cfg: RunConfig) -> RunStart:
    """Rank 0's choice for ``--resume``: the newest intact checkpoint of the folder's run, checked against it;
    step 0 for a run stopped before its first checkpoint (its folder holds ``config.json`` and no checkpoint)."""
    if not (Path(cfg.out) / "config.json").exists():
        raise ValueError(f"--resume: {cfg.out} holds no run to continue (no config.json); run without --resume "
                         f"first")
    saved, run_id = read_run_config(cfg.out)
    if (Path(cfg.out) / "metrics.jsonl").exists():
        read_records(Path(cfg.out) / "metrics.jsonl")  # a damaged log is named now, not by rank 0 alone later
    if not list_checkpoints(cfg.out):
        _check_resumable(cfg, None, None, run_id, saved)
        return RunStart(run_id or uuid.uuid4().hex, None, ())
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

class Interrupted(Exception):
    """Ctrl-C during training: ``step`` optimizer steps done of ``stop``, the newest checkpoint at ``saved``
    (None: none yet)."""

    def __init__(self, step: int, stop: int, saved: Optional[int]) -> None:
        super().__init__(step, stop, saved)
        self.step, self.stop, self.saved = step, stop, saved

    def __str__(self) -> str:
        if self.saved is None:
            return (f"stopped at step {self.step} of {self.stop}, before any checkpoint was saved; --resume starts "
                    f"it again from step 0 (--checkpoint-every N saves every N steps)")
        redo = f" (steps {self.saved + 1}-{self.step} will run again)" if self.saved < self.step else ""
        return f"stopped at step {self.step} of {self.stop}; resume with --resume from step {self.saved}{redo}"


def train(cfg: RunConfig, ctx: distributed.DistContext) -> list[float]:
    """Run (or resume) the training ``cfg`` describes in this process, one of torchrun's (the toy study's trainer
    is :func:`diffattn_tutorial.training.study.train_toy_model`); returns this session's step losses (the global
    batch's mean loss after each optimizer step). Ctrl-C raises :class:`Interrupted`. (``cfg.threads`` is applied
    around it by :func:`main`.)"""
    # every refusal (a backend or precision this device lacks, a model shape such as d_model not divisible by
    # n_heads) comes before the run folder is touched, so the corrected command needs no --overwrite
    check_backend_here(cfg.attn_backend, ctx.device)
    _mixed_precision(cfg, ctx)
    source = DataSource(cfg)
    model = build_run_model(cfg, source.vocab_size, source.max_len)
    run = distributed.on_main(lambda: _resume_from(cfg) if cfg.resume else _start_fresh(cfg), ctx)
    for reason in run.skipped if ctx.is_main else ():
        print(f"warning: {reason}; skipped", file=sys.stderr, flush=True)
    if ctx.is_main and run.skipped:
        print(f"resuming from {run.checkpoint}", file=sys.stderr, flush=True)
    if cfg.compile:
        for block in model.blocks:
            block.compile(backend=cfg.compile_backend)
    mixed = _mixed_precision(cfg, ctx)
    scaler = _grad_scaler(cfg, ctx)
    model = distributed.wrap(model.to(ctx.device), ctx, cfg.strategy,
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
    if cfg.resume:
        log.truncate_after(start)  # drop what the run did after its checkpoint (all its steps when it had none)
    log.write({"event": "start", "step": start, "world_size": ctx.world_size, "strategy": cfg.strategy,
               "device": str(ctx.device), "backend": ctx.backend, "mixed_precision": mixed,
               "torch": torch.__version__, "python": platform.python_version(),
               "params": sum(p.numel() for p in model.parameters()),
               "params_per_rank": distributed.gather_ints(distributed.local_numel(model), ctx), "config": cfg.to_json(),
               **({"resumed_from": Path(run.checkpoint).name} if run.checkpoint else {}),
               **({"skipped_checkpoints": list(run.skipped)} if run.skipped else {})})
    losses, t0 = [], time.perf_counter()
    tokens = sum(cfg.global_batch * source.row_len(s) for s in range(start))
    bar = tqdm(range(start, stop), desc=f"{cfg.attention} x{ctx.world_size}", disable=not (cfg.progress and ctx.is_main),
               initial=start, total=stop, mininterval=1.0)
    model.train()
    done, saved = start, (start if run.checkpoint is not None else None)
    try:
        with distributed.deferred_sigint() as ctrl_c:  # Ctrl-C lets the step and its checkpoint finish (see deferred_sigint)
            for step in bar:
                loss = _train_step(model, opt, source, cfg, ctx, step, scaler)
                scaler.unscale_(opt)  # fp16: true gradients before clipping (a no-op otherwise)
                grad_norm = _clip(model, cfg.clip)
                scaler.step(opt)  # fp16: skipped when a gradient is inf/NaN; otherwise opt.step()
                scaler.update()
                opt.zero_grad(set_to_none=True)
                losses.append(distributed.mean_over_ranks(loss, ctx))
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
                if step + 1 < stop and distributed.any_rank(ctrl_c(), ctx):
                    raise KeyboardInterrupt  # on every rank after the same step
    except KeyboardInterrupt:
        bar.close()
        log.write({"event": "interrupted", "step": done, "seconds": round(time.perf_counter() - t0, 3)})
        raise Interrupted(done, stop, saved) from None
    bar.close()
    log.write({"event": "end", "step": stop, "seconds": round(time.perf_counter() - t0, 3)})
    return losses


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, source: DataSource, cfg: RunConfig,
                ctx: distributed.DistContext, step: int, scaler: torch.amp.GradScaler) -> Tensor:
    """Forward and backward over this rank's rows of step ``step``; returns its mean loss (detached)."""
    for group in opt.param_groups:
        group["lr"] = cfg.lr * lr_factor(step, cfg.steps, cfg.warmup)
    total = torch.zeros((), device=ctx.device)
    for micro in range(cfg.grad_accum):
        batch = source.rows(step, distributed.micro_batch_rows(micro, ctx.rank, cfg.batch_size, ctx.world_size))
        batch = LMBatch(*(t.to(ctx.device, non_blocking=True) for t in batch))
        with distributed.gradient_sync(model, enabled=micro == cfg.grad_accum - 1):
            with _autocast(cfg, ctx):
                loss = source.loss(model, batch).float() / cfg.grad_accum
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

def build_parser(prog: str = "python -m diffattn_tutorial.training.loop") -> argparse.ArgumentParser:
    p = Parser(prog=prog, description=__doc__.splitlines()[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = RunConfig()
    p.add_argument("--task", choices=TASKS, default=d.task, help="needle retrieval or the generated text corpus")
    p.add_argument("--attention", choices=ATTENTIONS, default=d.attention)
    p.add_argument("--d-model", type=_positive, default=d.d_model)
    p.add_argument("--n-layers", type=_positive, default=d.n_layers)
    p.add_argument("--n-heads", type=_positive, default=d.n_heads, help="the baseline's heads (LMConfig)")
    p.add_argument("--attn-backend", type=_backend, default=d.attn_backend,
                   help=f"one of {', '.join(('auto',) + BACKENDS)}")
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
    p.add_argument("--strategy", choices=distributed.STRATEGIES, default=d.strategy)
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
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="hide the tqdm progress bar (shown on rank 0 unless this is given)")
    return p


_positive, _non_negative = int_at_least(1), int_at_least(0)


def _backend(text: str) -> str:
    """An argparse ``type``: a backend name, checked by the one check the layers and ``diff_attention`` use."""
    try:
        return backends.check_name(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        ctx = distributed.init(cfg.device)
    except UsageError as e:
        return print_usage_error(e, prog)
    except ValueError as e:
        return _error(parser, e, 2)
    except KeyboardInterrupt:
        return 130
    code = 0
    try:
        with threads(cfg.threads):
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
        distributed.shutdown(ctx)
    return code


def _error(parser: argparse.ArgumentParser, message: object, code: int, main_only: bool = False,
           label: str = "error: ") -> int:
    """Print ``message`` as one line on stderr (not on ranks other than 0 when ``main_only``); return ``code``."""
    if not main_only:
        print(f"{parser.prog}: {label}{' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return code


__all__ = ["Interrupted", "train", "UsageError", "build_parser", "config_from_args", "main"]

if __name__ == "__main__":
    sys.exit(main())
