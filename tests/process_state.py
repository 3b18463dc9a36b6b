"""What a test must leave as it found it: the process state that a later test in the same worker would inherit.

``snapshot()`` reads it; ``changes(before, after)`` names what differs. Libraries add warnings filters when they are
first imported; when a test imported new modules, only filters it removed count. ``conftest.py`` fails any test that leaves
a difference, so the suite passes in any order and any split across workers.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch


def _stable_repr(value) -> str:
    """``repr``, with a set's members sorted: a set copied or rebuilt may list the same members in another order."""
    if isinstance(value, (set, frozenset)):
        return f"{type(value).__name__}({sorted(map(repr, value))})"
    return repr(value)


def _config(module) -> dict[str, str]:
    return {k: _stable_repr(v) for k, v in module.get_config_copy().items()}


def _inductor_config() -> dict[str, str]:
    import sys

    mod = sys.modules.get("torch._inductor.config")  # only once something imported it: reading it imports inductor
    return _config(mod) if mod is not None else {}


def _registry() -> tuple:
    from diffattn_tutorial import backends

    return tuple(sorted(backends._REGISTRY)), tuple(sorted((k, repr(v)) for k, v in backends._AUTO.items()))


def snapshot() -> dict[str, object]:
    """The state, by name: each value compares with ``==``."""
    return {
        "torch._dynamo.config": _config(torch._dynamo.config),
        "torch._inductor.config": _inductor_config(),
        "default dtype": torch.get_default_dtype(),
        "default device": str(torch.get_default_device()),
        "torch threads": torch.get_num_threads(),
        "grad mode": torch.is_grad_enabled(),
        "environment": dict(os.environ),
        "backend registry": _registry(),
        "warnings filters": list(warnings.filters),
        "modules": frozenset(sys.modules),
    }


def _dict_changes(name: str, before: dict, after: dict) -> list[str]:
    keys = sorted(set(before) | set(after), key=str)
    return [f"{name}[{k!r}]: {before.get(k, '<unset>')!s:.80} -> {after.get(k, '<unset>')!s:.80}"
            for k in keys if before.get(k, "<unset>") != after.get(k, "<unset>")]


def changes(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """One line per entry that differs; a config entry that disappeared shows as ``<unset>``."""
    out = []
    imported = before["modules"] != after["modules"]
    for name, old in before.items():
        new = after[name]
        if name == "modules":
            continue  # not state a test restores: read to tell a library's import-time filters from a test's
        if name == "warnings filters" and imported:
            # importing numpy, IPython, urllib3, ... adds filters of their own; a filter the test removed still counts
            out += [f"warnings filters: {f} removed" for f in old if f not in new]
        elif isinstance(old, dict) and isinstance(new, dict):
            out += _dict_changes(name, old, new)
        elif old != new:
            out.append(f"{name}: {old!s:.200} -> {new!s:.200}")
    return out
