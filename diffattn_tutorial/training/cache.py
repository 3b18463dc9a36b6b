"""The cache of trained runs the toy study (notebooks 07 and 10) and the fine-tunes (notebook 14) share.

One entry per run, a ``torch.save`` file in the user's cache folder (:func:`~diffattn_tutorial.paths.cache_dir`),
named by :func:`cache_file` from the run's config, the torch version and the source of the modules that train and
measure it (a change to any of them is a new entry, never a stale answer). :func:`cache_lock` holds the entry's
file lock (the ``filelock`` package, on every platform) while it is loaded or trained, so two processes asking for
one run train it once; :func:`write_cached` writes atomically and :func:`read_cached` takes a damaged entry for a
miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Iterator, Mapping, Optional, Sequence, Union

import filelock
import torch

from diffattn_tutorial.paths import CACHE_ENV, cache_dir

CacheSetting = Union[bool, str, os.PathLike]
REQUIRED: tuple[str, ...] = ("state_dict", "losses", "seconds")
"""What every entry holds (the measured ``metrics`` are added once measured)."""


def cache_file(cache: CacheSetting, key: Mapping, sources: Sequence[ModuleType]) -> Optional[Path]:
    """Where the run ``key`` (a dict with ``attention`` and ``seed``, every value that changes the weights or the
    measurements) lives: ``cache`` is True (the folder :func:`cache_dir` names) or a folder; the file's name holds a
    hash of ``key``, the torch version and the source of ``sources``. None when caching is off."""
    folder = cache_dir() if cache is True else Path(cache)
    if folder is None:
        return None
    h = hashlib.sha256(repr(sorted(key.items())).encode() + torch.__version__.encode())
    for mod in sources:
        h.update(Path(mod.__file__).read_bytes())
    return folder / f"study_{key['attention']}_seed{key['seed']}_{h.hexdigest()[:16]}.pt"


@contextlib.contextmanager
def cache_lock(path: Optional[Path]) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s entry (``path.lock``) while loading or training it, so two processes
    asking for the same run (two notebooks, parallel tests) train it once: the second waits, then loads. A folder
    where no lock file can be made runs unlocked (:func:`write_cached` then says what is wrong)."""
    if path is None:
        yield
        return
    lock = filelock.FileLock(path.with_suffix(".lock"))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def read_cached(path: Optional[Path]) -> Optional[dict]:
    """An entry's contents, or None when there is none. A damaged entry (a killed process, a full disk) is a miss,
    said once, and is replaced by the retrained model: never a traceback, never a wrong model."""
    if path is None or not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=True)
        if not set(REQUIRED) <= set(saved):
            raise ValueError(f"keys {sorted(saved)}")
        return saved
    except Exception as e:  # noqa: BLE001 - whatever a damaged file raises, the answer is to retrain
        warnings.warn(f"the cached training run {path} is damaged ({type(e).__name__}: {str(e)[:120]}); "
                      f"training again and replacing it", stacklevel=3)
        return None


def write_cached(path: Path, payload: dict) -> None:
    """Save atomically (a reader sees the whole file or none); an unwritable cache costs a warning, not the run."""
    tmp = path.with_suffix(f".tmp{os.getpid()}_{threading.get_ident()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not save the trained model to the cache {path.parent} ({e.strerror or e}); the "
                      f"results are fine but will be trained again next time: set {CACHE_ENV} to a writable "
                      f"folder (or {CACHE_ENV}=0 to switch the cache off)", stacklevel=3)
    finally:  # whatever stopped the write (a full disk, Ctrl-C, a payload torch.save cannot pickle)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


__all__ = ["REQUIRED", "cache_file", "cache_lock", "read_cached", "write_cached"]
