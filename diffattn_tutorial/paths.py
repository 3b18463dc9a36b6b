"""Where the course keeps what it makes: one cache folder for trained toy models and compiled kernels (a leaf
module: it imports nothing of the package)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

CACHE_ENV = "DIFFATTN_CACHE"
"""Environment variable: a folder for the cache, or ``0`` to switch the cache off."""


def cache_dir() -> Optional[Path]:
    """The cache folder: ``$DIFFATTN_CACHE``, else ``$XDG_CACHE_HOME/diffattn_tutorial``, else
    ``~/.cache/diffattn_tutorial``. ``None`` when ``DIFFATTN_CACHE=0`` switches caching off."""
    setting = os.environ.get(CACHE_ENV, "").strip()
    if setting == "0":
        return None
    if setting:
        return Path(setting).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "diffattn_tutorial"


def package_root() -> Path:
    """The folder holding the ``diffattn_tutorial`` package, for a child process to import this very copy (put on
    its ``PYTHONPATH``)."""
    return Path(__file__).resolve().parents[1]


__all__ = ["CACHE_ENV", "cache_dir", "package_root"]
