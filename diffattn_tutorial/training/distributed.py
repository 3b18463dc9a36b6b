"""The ``torch.distributed`` pieces of :mod:`diffattn_tutorial.training.loop`, each small enough to read in one go.

* :func:`init` / :func:`shutdown`: join the process group ``torchrun`` describes in the environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``): NCCL on GPUs, gloo on CPUs. Without those
  variables (plain ``python``) there is no process group and :class:`DistContext` says rank 0 of 1.
* :func:`micro_batch_rows`: which rows of a step's global batch one rank reads at one accumulation micro-step.
  Global batch ``G = per_rank x world x accum``; every ``(micro_step, rank)`` gets a disjoint block, and together
  they cover the global batch once, so one process and many processes train on the same data.
* :func:`wrap`: data parallelism the two standard ways. ``"ddp"`` keeps a full copy of the model on every rank
  and averages gradients with ``all_reduce``; ``"fsdp2"`` (``torch.distributed.fsdp.fully_shard``) keeps
  :func:`fsdp_local_shard` of every parameter, gradient and optimizer state on each rank and gathers a block's
  full weights only while it runs.
* :func:`gradient_sync`: skip the gradient exchange on the micro-steps before the last one (accumulation).
* :func:`deferred_sigint` / :func:`any_rank`: Ctrl-C as a request that every rank acts on after the same step.
* :func:`torchrun_command` / :func:`launch`: run a module under ``torchrun`` on a free port, with a timeout, as
  the tests and notebook 12 do.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from diffattn_tutorial.paths import package_root

Tensor = torch.Tensor
T = TypeVar("T")

STRATEGIES: tuple[str, ...] = ("ddp", "fsdp2")
"""Data-parallel strategies :func:`wrap` knows."""


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: ``rank`` of ``world_size``, its ``device``, and the collective ``backend``
    (``"nccl"``, ``"gloo"``, or ``None`` without a process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: Optional[str] = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that prints, logs and shows the progress bar."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    return default if text is None else int(text)


def init(device: str = "auto") -> DistContext:
    """Join the process group described by ``torchrun``'s environment, or stay single-process without one.

    ``device``: ``"auto"`` (CUDA when present, else CPU), ``"cpu"`` or ``"cuda"``. On CUDA each process takes
    GPU ``LOCAL_RANK`` and the backend is NCCL; on CPU it is gloo.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; use device='cpu' (or 'auto')")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world, rank, local = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if use_cuda:
        torch.cuda.set_device(local)
    dev = torch.device("cuda", local) if use_cuda else torch.device("cpu")
    if "WORLD_SIZE" not in os.environ:
        return DistContext(device=dev)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, device_id=dev if use_cuda else None)
    return DistContext(rank=rank, world_size=world, local_rank=local, device=dev, backend=backend)


def shutdown(ctx: DistContext) -> None:
    """Leave the process group (a no-op without one), all ranks together.

    The barrier matters: a rank that tears down its gloo connections while another rank still holds them open
    (rank 0 writing the last log line, say) can abort at exit with ``terminate called without an active
    exception`` (SIGABRT; how often, with and without the barrier: ``benchmarks/NOTES.md``)."""
    if ctx.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def micro_batch_rows(micro_step: int, rank: int, per_rank: int, world_size: int) -> range:
    """Rows of the global batch that ``rank`` reads at accumulation ``micro_step``.

    The global batch has ``per_rank x world_size x accum`` rows; micro-step ``m`` covers the block
    ``[m * per_rank * world_size, (m + 1) * per_rank * world_size)`` and rank ``r`` its ``r``-th slice of
    ``per_rank`` rows. Every row is read exactly once per step, by one rank.

    >>> [list(micro_batch_rows(m, r, 2, 2)) for m in range(2) for r in range(2)]
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    """
    start = (micro_step * world_size + rank) * per_rank
    return range(start, start + per_rank)


def fsdp_local_shard(param: Tensor, rank: int, world_size: int) -> Tensor:
    """The rows of ``param`` (shape ``(n, ...)``) that FSDP2 keeps on ``rank``: ``torch.chunk`` along dim 0.

    Every rank's shard is padded to ``ceil(n / world_size)`` rows in memory; the last ranks hold fewer real rows,
    possibly none (a ``(0, ...)`` tensor), when ``n`` does not divide evenly.
    """
    chunks = torch.chunk(param, world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return param.new_empty((0, *param.shape[1:]))


def wrap(model: nn.Module, ctx: DistContext, strategy: str, *,
         param_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """``model`` prepared for data-parallel training with ``strategy`` (``"ddp"`` or ``"fsdp2"``).

    Without a process group the model is returned as it is. For ``"fsdp2"`` each block of ``model.blocks`` is
    its own FSDP unit (its full weights exist only while it runs), then the root module; ``param_dtype`` (GPU
    mixed precision, e.g. ``torch.bfloat16``) is the dtype of the gathered weights, with gradients reduced in
    float32. The returned module's ``state_dict`` keys are handled by
    ``torch.distributed.checkpoint.state_dict.get_state_dict``.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if not ctx.distributed:
        return model
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Run a forward/backward with (``enabled``) or without the cross-rank gradient exchange.

    Accumulation micro-steps before the last skip it: DDP through ``no_sync()``, FSDP2 through
    ``set_requires_gradient_sync(False)``; the last micro-step exchanges the summed gradients once.
    """
    if enabled:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        yield
    elif hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        yield
    else:
        yield


def mean_over_ranks(value: Tensor, ctx: DistContext) -> float:
    """The mean of a scalar tensor over all ranks (itself without a process group)."""
    value = value.detach().float().reshape(())
    if ctx.distributed:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value = value / ctx.world_size
    return value.item()


def on_main(fn: Callable[[], T], ctx: DistContext) -> T:
    """``fn()`` run on rank 0 only, its result handed to every rank; an exception it raises is raised on every
    rank (rank 0's own, the others' a copy of its type and message), so no rank waits for one that failed.

    For the work one process must do alone, such as preparing a run folder or choosing a checkpoint.
    """
    outcome: tuple = ("ok", None)
    if ctx.is_main:
        try:
            outcome = ("ok", fn())
        except Exception as e:
            if not ctx.distributed:
                raise
            outcome = ("error", e)
    if ctx.distributed:
        box = [_picklable(outcome)]
        dist.broadcast_object_list(box, src=0)
        if not ctx.is_main:
            outcome = box[0]
    if outcome[0] == "error":
        raise outcome[1]
    return outcome[1]


def _picklable(outcome: tuple) -> tuple:
    """An ``("error", exception)`` outcome whose exception may not survive pickling becomes a ``RuntimeError``."""
    if outcome[0] != "error":
        return outcome
    e = outcome[1]
    try:
        pickle.loads(pickle.dumps(e))
        return outcome
    except Exception:  # noqa: BLE001 - an exception class that cannot be rebuilt from its arguments
        return ("error", RuntimeError(f"{type(e).__name__}: {e}"))


def any_rank(flag: bool, ctx: DistContext) -> bool:
    """Whether ``flag`` holds on at least one rank (itself without a process group): every rank gets the same
    answer, so all of them can act on it together."""
    if not ctx.distributed:
        return flag
    value = torch.tensor(int(flag), device=ctx.device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


@contextlib.contextmanager
def deferred_sigint() -> Iterator[Callable[[], bool]]:
    """Hold Ctrl-C (SIGINT) while the block runs: the signal only sets a flag, read by calling the yielded
    function, and the caller stops where stopping is safe (the training loop: after a step and the checkpoint it
    writes, all ranks after the same step through :func:`any_rank`; ``torchrun`` forwards Ctrl-C to every worker).

    Raising ``KeyboardInterrupt`` wherever the signal lands instead would cut a checkpoint short, or abort the
    process when it lands in a write that C++ makes through Python (``torch.save``), and would leave the other
    ranks waiting in a collective. Only Python's default handler is replaced (an ignored SIGINT stays ignored,
    someone else's handler stays theirs), and only in the main thread, where signal handlers run.
    """
    received: list[int] = []
    install = (threading.current_thread() is threading.main_thread()
               and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum)) if install else None
    try:
        yield lambda: bool(received)
    finally:
        if install:
            signal.signal(signal.SIGINT, previous)


def gather_ints(value: int, ctx: DistContext) -> list[int]:
    """``value`` from every rank, in rank order (``[value]`` without a process group)."""
    if not ctx.distributed:
        return [value]
    out: list = [None] * ctx.world_size
    dist.all_gather_object(out, value)
    return [int(v) for v in out]


def local_numel(model: nn.Module) -> int:
    """Numbers of parameters this rank stores: the whole model under DDP, its shards under FSDP2."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel()
    return total


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (for ``--master_port``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(module: str, args: Sequence[str], *, nproc: int = 2, port: Optional[int] = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node=NPROC ... -m MODULE ARGS`` on one machine."""
    port = free_port() if port is None else port
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={port}", "-m", module, *args]


def launch(module: str, args: Sequence[str], *, nproc: int = 2, timeout: float = 300,
           threads: int = 1) -> subprocess.CompletedProcess:
    """Run ``module`` under ``torchrun`` with ``nproc`` processes and wait at most ``timeout`` seconds.

    Each process gets ``OMP_NUM_THREADS=threads``, and the folder holding this package is put on
    ``PYTHONPATH`` so the children import the same ``diffattn_tutorial``. Returns the finished process, its
    stdout and stderr together in ``.stdout``. Raises ``RuntimeError`` with the output's tail when the run fails,
    and ``subprocess.TimeoutExpired`` when it hangs (after killing ``torchrun`` and all its workers).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_root()), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(torchrun_command(module, args, nproc=nproc), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_tree(proc.pid)  # torchrun and every worker it started (workers may lead sessions of their own)
        proc.communicate()
        raise
    if proc.returncode != 0:
        tail = "\n".join(output.strip().splitlines()[-25:])
        raise RuntimeError(f"torchrun {module} exited with {proc.returncode}:\n{tail}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, output, "")


def _descendants(pid: int) -> list[int]:
    """Every process started, directly or not, by ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the process ended while we looked
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid``, its process group and every descendant: torchrun starts each worker in a new session,
    so killing torchrun's group alone leaves the workers running (and holding the output pipe open)."""
    for target in [*_descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


__all__ = ["STRATEGIES", "DistContext", "init", "shutdown", "micro_batch_rows", "fsdp_local_shard", "wrap",
           "gradient_sync", "mean_over_ranks", "on_main", "any_rank", "deferred_sigint", "gather_ints", "local_numel",
           "free_port", "torchrun_command", "launch"]
