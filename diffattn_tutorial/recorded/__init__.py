"""Results recorded by the project's scripts, shipped inside the package so a notebook finds them anywhere.

Each ``NAME.json`` file says how it was made: the script and command, the device, the torch version, the date
and the settings. Notebooks show these tables labelled as recorded; tests re-run a part and compare.
"""

from __future__ import annotations

import json
from importlib import resources


def load(name: str) -> dict:
    """The recorded results ``NAME.json`` (e.g. ``load("seed_study")``), as a dict."""
    files = resources.files(__name__)
    path = files / f"{name}.json"
    if not path.is_file():
        known = sorted(p.name[:-5] for p in files.iterdir() if p.name.endswith(".json"))
        raise FileNotFoundError(f"no recorded results named {name!r}; recorded: {known}")
    return json.loads(path.read_text())


def available() -> list[str]:
    """Names of the recorded results files."""
    return sorted(p.name[:-5] for p in resources.files(__name__).iterdir() if p.name.endswith(".json"))


__all__ = ["load", "available"]
