"""Exercise checks: ``from diffattn_tutorial.checks import check_...``.

Each notebook's checks live in a submodule ``nbNN`` (``nb01`` ... ``nb09``); every public ``check_*`` name of
every submodule is re-exported here, so exercises import from one place. Each check belongs to one task of one
exercise notebook (``check.task``, ``check.function_name``); a failure is one line, :class:`CheckFailed` (the
hint), and an unattempted stub is :class:`NotAttempted`.
"""

from __future__ import annotations

import importlib
import pkgutil

from diffattn_tutorial.checks._core import CheckFailed, NotAttempted

__all__ = ["CheckFailed", "NotAttempted"]

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name.startswith("nb"):
        _mod = importlib.import_module(f"{__name__}.{_info.name}")
        for _name in getattr(_mod, "__all__", [n for n in dir(_mod) if n.startswith("check_")]):
            globals()[_name] = getattr(_mod, _name)
            __all__.append(_name)
