"""The rules that read the backend table (:mod:`diffattn_tutorial.backend_table`): which backend a call runs,
which calls a backend refuses, what works here, and the prose about it.

* ``"auto"`` walks the device's list in :data:`~diffattn_tutorial.backend_table.AUTO` and runs the first backend
  that takes the call (its dtype, a gradient to q, k, v, lam or a learned mask, dropout, being compiled, the
  number of query rows) and works here (its ``status``; one that raises counts as not working), the reference last
  (an order of forward-only backends still trains); ``"sdpa"`` walks
  :data:`~diffattn_tutorial.backend_table.SDPA_ORDER` the same way.
* A backend asked for by name refuses, naming the fix, a call it cannot take (:func:`resolve`, every refusal in
  one place).
* The name lists :data:`BACKENDS`, :data:`FORWARD_ONLY` and :data:`SDPA_FORMULATIONS` are views of the registry,
  which starts as the table; :func:`registered` adds a backend for a ``with`` block (a test's).
* :func:`backend_status` (and ``diffattn-tutorial doctor``), :func:`describe_auto` and :func:`backend_table`
  (the README's) say it in words, from the table alone.

>>> resolve_backend("auto", "cpu", dropout=True)
'sdpa_wide'
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Callable, Iterator, Mapping, Optional, Union

import torch
from torch import Tensor

from diffattn_tutorial.backend_table import (
    ALIASES,
    ANY_CALL,
    AUTO,
    FLOAT_DTYPES,
    OTHER_DEVICES,
    REFERENCE,
    SDPA_ORDER,
    TABLE,
    Backend,
    Call,
    Choice,
    Needs,
    constant_under_compile,
)

_DEVICE_WORDS = {"cpu": "a CPU", "cuda": "a GPU", OTHER_DEVICES: "other devices"}

_REGISTRY: dict[str, Backend] = {b.name: b for b in TABLE}
_AUTO: dict[str, tuple[Choice, ...]] = dict(AUTO)


_BUILT_IN = frozenset(_REGISTRY)
"""The table's backends; the output of a backend registered later is checked on every call (:func:`checked_output`)."""


def _check_choices(registry: Mapping[str, Backend], auto: Mapping[str, tuple[Choice, ...]]) -> None:
    """Every key of ``"auto"`` is a device type (or :data:`OTHER_DEVICES`), and every choice names a registered
    backend and some of its dtypes."""
    for device, choices in auto.items():
        if device != OTHER_DEVICES and (not isinstance(device, str) or _device_type(device) != device):
            raise ValueError(f"auto's key {device!r} is not a device type: auto's order is per type ('cpu', 'cuda', "
                             f"'mps', ...; {OTHER_DEVICES!r} for the types it does not name)")
        if not isinstance(choices, (tuple, list)) or not choices or not all(isinstance(c, Choice) for c in choices):
            raise TypeError(f"auto[{device!r}] must be a non-empty tuple of Choice, e.g. "
                            f"(Choice('mine'), *auto_order({device!r})), got {choices!r}")
        for c in choices:
            if c.backend not in registry:
                raise ValueError(f"auto's list for {device!r} names {c.backend!r}, which is not registered")
            if not set(c.dtypes or ()) <= set(registry[c.backend].dtypes):
                raise ValueError(f"auto's choice of {c.backend!r} on {device!r}: dtypes must be some of its dtypes "
                                 f"{registry[c.backend].dtypes}")


def _device_type(device: str) -> Optional[str]:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


def checked_output(b: Backend, call: Call, out: object) -> Tensor:
    """``out``, the result of ``b.run(call)``, when it is what ``diff_attention`` returns: a tensor
    ``(B, H, Nq, 2d)`` in q's dtype on q's device. Only a backend registered after the table's is checked (the
    table's are tested); a wrong result raises, naming the backend, instead of flowing on."""
    if b.name in _BUILT_IN:
        return out
    B, H2, Nq, _ = call.q.shape
    want = (B, H2 // 2, Nq, call.v.shape[-1])
    if not isinstance(out, Tensor) or tuple(out.shape) != want or out.dtype != call.q.dtype or \
            out.device != call.q.device:
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, Tensor) else type(out).__name__)
        raise RuntimeError(f"backend {b.name!r} returned {got}; its run must return (B, H, Nq, 2d) = {want} "
                           f"{call.q.dtype} on {call.q.device}, as diff_attention does")
    return out


_check_choices(_REGISTRY, _AUTO)


def register_backend(backend: Backend, *, auto: Optional[Mapping[str, tuple[Choice, ...]]] = None) -> Backend:
    """Add ``backend`` to the registry (listed last); ``auto`` replaces the order of ``"auto"`` for the device types
    it names (``{"cpu": (Choice(backend.name), *auto_order("cpu"))}`` tries it first on a CPU). Raises ValueError
    for a name already taken or a choice that does not fit, TypeError for an order that is not a tuple of
    :class:`Choice`."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend, got {type(backend).__name__}")
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered; choose another name")
    auto = auto or {}
    _check_choices({**_REGISTRY, backend.name: backend}, auto)
    _REGISTRY[backend.name] = backend
    _AUTO.update({device: tuple(choices) for device, choices in auto.items()})
    return backend


@contextlib.contextmanager
def registered(backend: Backend, *, auto: Optional[Mapping[str, tuple[Choice, ...]]] = None) -> Iterator[Backend]:
    """``backend`` registered (as :func:`register_backend` does) for the ``with`` block, removed after (also on an
    error), with ``"auto"``'s order as it was."""
    before = dict(_AUTO)
    register_backend(backend, auto=auto)
    try:
        yield backend
    finally:
        _REGISTRY.pop(backend.name, None)
        _AUTO.clear()
        _AUTO.update(before)


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (not an alias). Raises ValueError naming the choices."""
    check_name(name)
    return _REGISTRY[name]


def check_name(backend: object, allowed: Optional[Sequence[str]] = None) -> str:
    """``backend`` where it is one of ``allowed`` (default: ``"auto"`` and every name ``diff_attention`` takes);
    else the one error every entry point gives (``diff_attention``, the layers, ``--attn-backend``)."""
    allowed = ("auto",) + names() if allowed is None else tuple(allowed)
    if not isinstance(backend, str) or backend not in allowed:
        raise ValueError(f"unknown backend {backend!r}; choose one of {allowed}")
    return backend


def registry() -> tuple[Backend, ...]:
    """Every registered backend, in the order registered."""
    return tuple(_REGISTRY.values())


def as_device(device: Union[str, torch.device]) -> torch.device:
    """``torch.device(device)``, or a ``ValueError`` that names the device strings there are (``"gpu"`` is none)."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device: give 'cpu', 'cuda' (or 'cuda:1', ...), 'mps' "
                         f"or a torch.device") from None


def auto_order(device: Union[str, torch.device]) -> tuple[Choice, ...]:
    """``"auto"``'s order on ``device``'s type (:data:`~diffattn_tutorial.backend_table.AUTO`)."""
    return _AUTO.get(as_device(device).type, _AUTO[OTHER_DEVICES])


def _auto_with_reference(device: torch.device) -> tuple[Choice, ...]:
    """``"auto"``'s order with the reference last (it takes every call): an order registered with only forward-only
    (or dropout-free, ...) backends still trains, on the reference, instead of refusing every such call."""
    order = auto_order(device)
    return order + (Choice(REFERENCE),)


def names(select: Callable[[Backend], bool] = lambda b: True, *, aliases: bool = True) -> tuple[str, ...]:
    """The names of the backends ``select`` keeps, in registry order; with ``aliases``, ``"sdpa"`` listed before
    the first SDPA formulation it chooses among (``"auto"`` is never listed)."""
    out = []
    for b in _REGISTRY.values():
        if aliases and b.name in SDPA_ORDER and "sdpa" not in out:
            out.append("sdpa")
        if select(b):
            out.append(b.name)
    return tuple(out)


class NameView(Sequence):
    """A read-only tuple of backend names that follows the registry (a backend registered later appears in it).
    Compares equal to the tuple it holds; ``+`` with a tuple gives a tuple."""

    def __init__(self, select: Callable[[Backend], bool], *, aliases: bool = True) -> None:
        self._select, self._aliases = select, aliases

    def _names(self) -> tuple[str, ...]:
        return names(self._select, aliases=self._aliases)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __add__(self, other: tuple) -> tuple:
        return self._names() + tuple(other)

    def __radd__(self, other: tuple) -> tuple:
        return tuple(other) + self._names()

    def __eq__(self, other: object) -> bool:
        return self._names() == (tuple(other) if isinstance(other, (tuple, NameView)) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(self._names())


BACKENDS = NameView(lambda b: True)
"""Every backend name ``diff_attention`` accepts, besides ``"auto"``."""

FORWARD_ONLY = NameView(lambda b: not b.backward, aliases=False)
"""Backends without autograd, for inference (``"auto"`` picks them only where no gradient is needed)."""

SDPA_FORMULATIONS = NameView(lambda b: b.family == "sdpa" and bool(b.origin), aliases=False)
"""The SDPA formulations of the reference implementations, which notebook 08 compares, selectable by name
(``"sdpa_padded"``, the project's own and the CPU's ``"auto"``, has a section of its own there)."""


# --------------------------------------------------------------------------------------------
# what a backend takes, and the aliases
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _words(items: Sequence[str], last: str = "and") -> str:
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


def _where(b: Backend) -> str:
    return "any device" if b.devices is None else _words([_DEVICE_WORDS.get(d, d) for d in b.devices], "or")


def _takes(b: Backend, device: torch.device, needs: Needs) -> bool:
    """Whether ``b`` can take a call with ``needs`` on ``device`` (its status not consulted)."""
    dtype_ok = set(FLOAT_DTYPES) <= set(b.dtypes) if needs.dtype is None else needs.dtype in b.dtypes
    return (b.runs_on(device) and dtype_ok and (b.backward or not needs.grad) and (b.dropout or not needs.dropout)
            and (b.mask_grad or not needs.mask_grad))


def _chosen_for(c: Choice, needs: Needs) -> bool:
    """Whether ``"auto"`` gives a call with ``needs`` to choice ``c`` (beyond what its backend takes)."""
    b = _REGISTRY[c.backend]
    dtype_ok = c.dtypes is None or (needs.dtype is not None and needs.dtype in c.dtypes)
    queries_ok = c.max_queries is None or (needs.queries is not None and needs.queries <= c.max_queries)
    training_ok = not needs.grad or (c.training and (c.train_min_head_dim is None or (
        needs.head_dim is not None and needs.head_dim >= c.train_min_head_dim)))
    return (dtype_ok and queries_ok and training_ok and (b.compiles or not needs.compiling)
            and (b.transforms or not needs.transforms))


def _order(alias: str, device: torch.device) -> tuple[Choice, ...]:
    return _auto_with_reference(device) if alias == "auto" else tuple(Choice(n) for n in SDPA_ORDER if n in _REGISTRY)


def _choose(alias: str, device: torch.device, needs: Needs, usable: Callable[[Backend], bool]) -> Optional[Backend]:
    """The first backend of ``alias``'s order on ``device`` that takes the call and is ``usable``."""
    return next((_REGISTRY[c.backend] for c in _order(alias, device) if _chosen_for(c, needs)
                 and _takes(_REGISTRY[c.backend], device, needs) and usable(_REGISTRY[c.backend])), None)


def _works_here(device: torch.device) -> Callable[[Backend], bool]:
    return lambda b: status_of(b, device)[0]


def status_of(b: Backend, device: torch.device) -> tuple[bool, str]:
    """``b.status(device)``, or ``(False, why)`` where it raises or answers something other than ``(bool, str)``:
    a registered backend's broken status makes it unavailable, not every listing of the backends."""
    if b.name in _BUILT_IN:  # the table's never raise (tested)
        return b.status(device)
    try:
        answer = b.status(device)
    except Exception as e:  # noqa: BLE001 - whatever it is, the backend is not usable here
        return False, f"its status raised {type(e).__name__}: {e}"
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)
            and isinstance(answer[1], str)):
        return False, f"its status answered {answer!r}, not (works: bool, why: str)"
    return answer


def resolve(backend: str, device: Union[str, torch.device], needs: Needs = ANY_CALL, *, check: bool = True) -> str:
    """The backend ``backend`` means for a call with ``needs`` on ``device``: an alias resolved (the backend
    chosen works here); a name checked to exist and, with ``check``, to take the call and work here. Every
    refusal names the fix (what ``"auto"`` would run instead)."""
    device = as_device(device)
    if backend in ALIASES:
        chosen = _choose(backend, device, needs, _works_here(device))
        if chosen is None:
            raise ValueError(f"no registered backend takes this call on {device} ({needs}) for backend="
                             f"{backend!r}; use backend={REFERENCE!r}")
        return chosen.name
    b = get_backend(backend)
    if needs.dropout and not b.dropout:
        takers = names(lambda c: c.dropout, aliases=False)
        raise ValueError(f"backend {backend!r} does not support attention dropout; use backend='auto' or one of "
                         f"{takers}, or dropout_p=0")
    if check:
        _refuse(b, device, needs)
    return backend


def resolve_backend(backend: str, device: Union[str, torch.device], *, dropout: bool = False) -> str:
    """The concrete backend ``backend`` means on ``device`` for any call (any dtype, gradients wanted):
    ``"auto"`` and ``"sdpa"`` resolved, a name checked to exist and, with ``dropout``, to take it.
    ``diff_attention`` resolves ``"auto"`` for the call itself, which can do better (:func:`describe_auto`)."""
    return resolve(backend, device, ANY_CALL._replace(dropout=dropout), check=False)


def _refuse(b: Backend, device: torch.device, needs: Needs) -> None:
    """Raise, naming the fix, where ``b`` cannot take a call with ``needs`` on ``device`` or does not work here."""
    def auto_for(**need) -> str:
        return resolve("auto", device, needs._replace(**need))

    name = b.name
    if not b.runs_on(device):
        raise ValueError(f"backend {name!r} runs on {_where(b)}, the inputs are on {device}; use backend='auto'")
    if needs.dtype is not None and needs.dtype not in b.dtypes:
        computes = f" (it computes in {_dtype_name(b.compute_dtype)})" if b.compute_dtype else ""
        short = _dtype_name(needs.dtype)
        raise TypeError(f"backend {name!r} takes {_words([_dtype_name(d) for d in b.dtypes])}{computes}, got "
                        f"{short}; for {short} use backend='auto' or {REFERENCE!r}")
    if needs.grad and not b.backward:
        raise ValueError(f"backend {name!r} is forward-only (no autograd); to train use backend='auto' or "
                         f"{auto_for()!r}, or call it under torch.no_grad()")
    if needs.mask_grad and not b.mask_grad:
        others = dict.fromkeys([auto_for(), REFERENCE])
        raise ValueError(f"attn_mask requires grad (a learned bias?), but backend {name!r} gives a mask no "
                         f"gradient; use backend='auto', {_words([repr(n) for n in others], 'or')} for it, or "
                         f"pass attn_mask.detach() if it is not to be learned")
    if needs.transforms and not b.transforms:
        raise ValueError(f"backend {name!r} does not run under torch.func transforms (grad, vmap, jacrev, ...): it "
                         f"hands its inputs' memory to a kernel; use backend='auto' or {auto_for()!r} there")
    ok, why = status_of(b, device)
    if not ok:
        raise RuntimeError(f"backend {name!r} is unavailable here: {why}")


# --------------------------------------------------------------------------------------------
# what works here, and the prose about it
# --------------------------------------------------------------------------------------------


def _condition(c: Choice) -> str:
    """The calls ``"auto"`` gives choice ``c``, beyond what every backend takes: "float32 inference", ..."""
    b = _REGISTRY[c.backend]
    dtypes = c.dtypes or b.dtypes
    words = [] if set(FLOAT_DTYPES) <= set(dtypes) else ["/".join(_dtype_name(d) for d in dtypes)]
    training = b.backward and c.training
    if training and c.train_min_head_dim is not None:
        no_mask = "" if b.mask_grad else " and no learned mask"
        words.append(f"inference and for training with a head dim of at least {c.train_min_head_dim}{no_mask}")
    else:
        words.append("inference" if not training else "calls without a learned mask" if not b.mask_grad else "calls")
    if c.max_queries is not None:
        rows = "one query row" if c.max_queries == 1 else f"at most {c.max_queries} query rows"
        words.append(f"with {rows} (decoding)")
    if not b.compiles:
        words.append("outside torch.compile")
    return " ".join(words) + ("" if b.transforms else ", outside torch.func transforms")


def _auto_rule(device: torch.device, usable: Callable[[Backend], bool], notes: bool, tick: str = "") -> str:
    """``"cpu_fused for float32 inference, else sdpa_padded (sdpa_wide with dropout)"``: the backends ``"auto"``
    tries before the one that takes any call, with their conditions, then that one and the one for dropout."""
    main = _choose("auto", device, ANY_CALL, usable)
    drop = _choose("auto", device, ANY_CALL._replace(dropout=True), usable)
    if main is None or drop is None:
        return "no registered backend takes every call here"
    order = _auto_with_reference(device)
    first_main = next(i for i, c in enumerate(order) if c.backend == main.name and _chosen_for(c, ANY_CALL))
    before = [c for c in order[:first_main] if _REGISTRY[c.backend].runs_on(device) and usable(_REGISTRY[c.backend])]
    clauses = [f"{tick}{c.backend}{tick} for {_condition(c)}"
               + (f" (needs {_REGISTRY[c.backend].requires})" if notes and _REGISTRY[c.backend].requires else "")
               for c in before]
    rule = ", else ".join([*clauses, f"{tick}{main.name}{tick}"])
    return rule + ("" if drop is main else f" ({tick}{drop.name}{tick} with dropout)")


def describe_auto(device: Union[str, torch.device]) -> str:
    """One sentence on what ``backend="auto"`` runs on ``device``'s type, from the registry alone (what the
    machine at hand has is :func:`backend_status`'s), e.g. for a CPU: "On a CPU, ``backend="auto"`` runs
    `cpu_fused` for float32 inference (needs a C++ compiler), else `sdpa_padded` (`sdpa_wide` with dropout)."."""
    device = as_device(device)
    where = _DEVICE_WORDS.get(device.type, f"{device.type} devices")
    return f'On {where}, `backend="auto"` runs {_auto_rule(device, lambda b: True, notes=True, tick="`")}.'


def backend_status(device: Union[str, torch.device] = "cpu") -> dict[str, tuple[bool, str]]:
    """For each name in :data:`BACKENDS`, then ``"auto"``: ``(usable here, why / note)`` on ``device``."""
    device = as_device(device)
    status = {}
    for name in BACKENDS:
        if name in ALIASES:
            status[name] = (True, f"-> {_sdpa_rule(device)}")
            continue
        b = _REGISTRY[name]
        status[name] = status_of(b, device) if b.runs_on(device) else (False, f"runs on {_where(b)} only")
    status["auto"] = (True, f"-> {_auto_rule(device, lambda b: b.runs_on(device) and status[b.name][0], notes=False)}")
    return status


def _sdpa_rule(device: torch.device, tick: str = "") -> str:
    """``"sdpa_split (sdpa_wide with dropout)"``: what the alias ``"sdpa"`` means."""
    best = resolve("sdpa", device, ANY_CALL)
    drop = resolve("sdpa", device, ANY_CALL._replace(dropout=True))
    return f"{tick}{best}{tick}" + ("" if drop == best else f" ({tick}{drop}{tick} with dropout)")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def backend_table() -> str:
    """The README's backend table, in Markdown (a header and one row per name of :data:`BACKENDS`, then
    ``auto``): what each is, where it runs, the dtypes it takes, and what it can do."""
    rows = ["| backend | what it is | runs on | dtypes | backward | dropout | learned mask | torch.compile "
            "| torch.func |", "|---|---|---|---|---|---|---|---|---|"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for name in BACKENDS:
        if name == "sdpa":
            rows.append(f"| `sdpa` | {ALIASES['sdpa']}: {_sdpa_rule(cpu, tick='`')} | as chosen | | | | | | |")
            continue
        b = _REGISTRY[name]
        dtypes = ", ".join(_dtype_name(d) for d in b.dtypes)
        if b.compute_dtype is not None:
            dtypes += f" (computed in {_dtype_name(b.compute_dtype)})"
        where = _where(b) + (f" (needs {b.requires})" if b.requires else "")
        rows.append(f"| `{name}` | {b.summary} | {where} | {dtypes} | {_yes(b.backward)} | {_yes(b.dropout)} | "
                    f"{_yes(b.mask_grad)} | {_yes(b.compiles)} | {_yes(b.transforms)} |")
    auto = "; ".join(f"on {_DEVICE_WORDS[d.type]}: {_auto_rule(d, lambda b: True, notes=True, tick='`')}"
                     for d in (cpu, gpu))
    rows.append(f"| `auto` | {auto} | as chosen | | | | | | |")
    return "\n".join(rows) + "\n"


__all__ = ["Backend", "Call", "Needs", "Choice", "ANY_CALL", "ALIASES", "REFERENCE", "FLOAT_DTYPES", "BACKENDS",
           "FORWARD_ONLY", "SDPA_FORMULATIONS", "constant_under_compile", "register_backend", "registered",
           "get_backend", "registry", "auto_order", "names", "resolve", "resolve_backend", "backend_status",
           "describe_auto", "backend_table"]
