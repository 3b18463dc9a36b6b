"""Run folders and checkpoints: ``torch.distributed.checkpoint`` folders with a manifest of hashes written last,
verified before torch reads anything, resumed only into the run that wrote them.

Only load checkpoint folders you trust: PyTorch's distributed checkpoint reads ``.metadata`` with pickle. The
manifest catches damage and mix-ups (a cut-short save, another run's folder), not someone who rewrites it too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Iterator, Optional, Union

import torch
import torch.nn as nn

from diffattn_tutorial.training.config import DataSource, RunConfig, build_run_model
from diffattn_tutorial.training.model import TinyLM

Tensor = torch.Tensor


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
        f.write(json.dumps(manifest, indent=1))
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
    from torch.distributed.checkpoint.api import (
        CheckpointException,  # a BaseException, holding each rank's error
    )

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


def _no_checkpoint(out: Union[str, Path], step: Optional[int], allow_unverified: bool) -> None:
    """Raise the error for :func:`load_model` finding no checkpoint to load, naming the step folders there are."""
    found = list_checkpoints(out)
    names = ", ".join(p.name for p in found[-4:]) + (f" and {len(found) - 4} older" if len(found) > 4 else "")
    where, have = f"{out}/checkpoints", "has" if len(found) == 1 else "have"
    if not found:
        raise FileNotFoundError(f"no checkpoint {'' if step is None else f'for step {step} '}in {where}: {out} is "
                                f"not a training run's folder, or its run stopped before the first checkpoint")
    if step is not None:
        raise FileNotFoundError(f"no checkpoint for step {step} in {where} (it holds {names}); pass one of those "
                                f"steps, or step=None for the newest")
    if allow_unverified:
        raise CheckpointError(f"no finished checkpoint in {where}: {names} {have} no .metadata (a save that "
                              f"did not finish)")
    raise UnverifiedCheckpoint(f"no verified checkpoint in {where}: {names} {have} no {MANIFEST} (a save that did "
                               f"not finish, or folders not written by this library); if you trust them, "
                               f"load_model(..., allow_unverified=True) loads the newest with a .metadata (DCP "
                               f"unpickles it)")


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
        _no_checkpoint(out, step, allow_unverified)
    manifest = verify_checkpoint(path, allow_unverified=allow_unverified)
    saved = manifest["config"] if manifest and manifest.get("config") else read_run_config(out)[0]
    saved = {k: v for k, v in saved.items() if k != "out"}
    try:
        cfg = RunConfig(**saved, out=str(out))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: its config is not a valid RunConfig ({e})") from None
    source = DataSource(cfg)
    model = build_run_model(cfg, source.vocab_size, source.max_len)
    state = {"model": model.state_dict()}
    _dcp_load(state, path)
    model.load_state_dict(state["model"])
    return model.eval()


__all__ = ["MANIFEST", "RUN_FILES", "CheckpointError", "UnverifiedCheckpoint", "CheckpointSaveError", "checkpoint_dir", "list_checkpoints", "latest_checkpoint", "write_manifest", "verify_checkpoint", "save_checkpoint", "load_checkpoint", "read_run_config", "load_model"]
