"""The backends of ``diff_attention``, each declared once: what it is, where and on what it runs, what it can do,
how ``backend="auto"`` ranks it, how to ask whether it works here, and how to run it.

A backend is a :class:`Backend`; :func:`register_backend` adds one (``functional`` declares the library's own:
``naive``, ``sdpa_*``, ``chunked``, ``triton``, ``cpu_fused``). Everything else reads this registry:
:func:`resolve_backend`, :func:`backend_status` (and ``diffattn-tutorial doctor``), ``diff_attention``'s dispatch,
the name lists :data:`BACKENDS`, :data:`FORWARD_ONLY` and :data:`SDPA_FORMULATIONS`, and the prose about them
(:func:`describe_auto`, :func:`backend_table`). Two names are aliases, resolved from the registry per call:

* ``"sdpa"``: the best SDPA formulation for the call (the lowest ``sdpa_rank`` that takes it);
* ``"auto"``: the first backend, by its ``auto_rank`` for the device, that takes the call (its dtype, a gradient
  to q, k, v, lam or a learned mask, dropout, being compiled) and works here (its ``status``).

>>> resolve_backend("auto", "cpu", dropout=True)
'sdpa_wide'
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Sequence
from typing import Callable, Iterator, Mapping, NamedTuple, Optional, Union

import torch

Tensor = torch.Tensor

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""The dtypes ``diff_attention`` takes (a backend takes all of them unless it says otherwise)."""

ALIASES: dict[str, str] = {
    "sdpa": "the best SDPA formulation for the call",
    "auto": "the first backend, by rank for the device, that takes the call and works here",
}
"""Names that stand for a backend chosen per call (:func:`resolve_backend`)."""

REFERENCE = "naive"
"""The backend every other one is tested against (explicit maps); it takes every call."""

OTHER_DEVICES = "*"
"""The key of ``Backend.auto_rank`` that ranks the device types no backend names (a GPU, unless one does)."""

CAUSAL_MODES = ("mask", "sdpa", "own")
"""How a backend applies ``causal=True``: as part of the mask (``"mask"``); with SDPA's ``is_causal``, which is
top-left aligned, so only where ``Nq == Nk`` and no other mask is given (``"sdpa"``); with its own bottom-right
causal masking where no other mask is given (``"own"``)."""

_DEVICE_WORDS = {"cpu": "a CPU", "cuda": "a GPU", OTHER_DEVICES: "other devices"}


class Call(NamedTuple):
    """A validated ``diff_attention`` call, as a backend's ``run`` gets it.

    q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``, lam a 0-dim or 4-D tensor broadcastable
    to ``(B, H, Nq, 1)``. ``mask``: for a ``raw_mask`` backend the caller's 4-D mask (or None); for the others the
    caller's mask combined with the causal one (unless ``is_causal``), fully masked rows made harmless (the caller
    zeroes them after), or None. ``causal``: the caller's flag; ``is_causal``: the backend applies it itself.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    lam: Tensor
    mask: Optional[Tensor]
    causal: bool
    is_causal: bool
    scale: float
    dropout_p: float


class Needs(NamedTuple):
    """What a call asks of a backend. ``dtype=None``: any dtype (the backend must take every one)."""

    dtype: Optional[torch.dtype] = None
    grad: bool = False  # a gradient to q, k, v or lam
    mask_grad: bool = False  # a gradient to an additive mask (a learned bias)
    dropout: bool = False
    compiling: bool = False  # traced by torch.compile
    queries: Optional[int] = None  # Nq, the query rows of the call (None: any number)
    head_dim: Optional[int] = None  # d, the q/k head dim of the call (None: any)


ANY_CALL = Needs(dtype=None, grad=True, mask_grad=True)
"""The needs of a call :func:`resolve_backend` knows nothing about: any dtype, gradients wanted."""


def constant_under_compile(fn: Callable) -> Callable:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: while ``torch.compile`` traces a call of it,
    it runs once, eagerly, and its answer is kept as a constant (a backend's ``status`` is asked while ``"auto"``
    is traced, and a status that builds or loads something cannot be traced). Unlike the public decorator this does
    not import ``torch._dynamo`` (a second, and the allocator state of every process that imports the library);
    ``tests/test_backends.py`` checks the mark is the one the decorator sets."""
    fn._dynamo_marked_constant = True
    return fn


def _pure_pytorch(device: torch.device) -> tuple[bool, str]:
    return True, "pure PyTorch"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend of ``diff_attention``, declared once (see the module docstring)."""

    name: str
    summary: str
    """What it is, in one line (the README's backend table)."""
    run: Callable[[Call], Tensor]
    """Computes ``(B, H, Nq, 2d)`` in q's dtype from a :class:`Call` (fully masked rows: anything finite)."""
    status: Callable[[torch.device], tuple[bool, str]] = _pure_pytorch
    """``(works here, why / note)`` on a device it runs on; never raises. It is asked while ``torch.compile`` traces
    ``"auto"``: one that does more than return constants calls a function marked :func:`constant_under_compile`."""
    devices: Optional[tuple[str, ...]] = None
    """Device types it runs on; None: every device PyTorch runs on."""
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    compute_dtype: Optional[torch.dtype] = None
    """The dtype it computes in whatever the input's (None: the input's, softmax in float32 for 16-bit inputs)."""
    backward: bool = True
    dropout: bool = True
    mask_grad: bool = True
    """Whether a learned additive mask gets its gradient."""
    compiles: bool = True
    """Whether it runs inside ``torch.compile(fullgraph=True)`` (as PyTorch ops or a registered operator)."""
    auto_rank: Mapping[str, int] = dataclasses.field(default_factory=dict)
    """Device type -> rank for ``"auto"``, lower preferred; absent: never chosen there. A device type that no
    backend names is ranked by the key :data:`OTHER_DEVICES`."""
    auto_dtypes: Optional[tuple[torch.dtype, ...]] = None
    """The dtypes ``"auto"`` chooses it for (None: all of ``dtypes``)."""
    auto_max_queries: Optional[int] = None
    """``"auto"`` chooses it only for calls with at most this many query rows (None: any number)."""
    auto_grad_min_head_dim: Optional[int] = None
    """``"auto"`` chooses it for a call that needs a gradient only where the head dim is at least this (None: any)."""
    sdpa_rank: Optional[int] = None
    """Its rank for the alias ``"sdpa"`` (None: the alias never chooses it)."""
    family: str = "maps"
    """``"maps"`` (explicit maps), ``"sdpa"`` (scaled_dot_product_attention calls) or ``"kernel"`` (a fused one)."""
    origin: str = ""
    """The reference implementation whose formulation it is ("" for the project's own)."""
    requires: str = ""
    """What it needs beyond PyTorch ("" for nothing)."""
    causal: str = "mask"
    """One of :data:`CAUSAL_MODES`."""
    raw_mask: bool = False
    """It takes the caller's mask and ``causal`` as they are, and zeroes fully masked rows itself."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name in ALIASES:
            raise ValueError(f"a backend's name must be an identifier other than {tuple(ALIASES)}, got {self.name!r}")
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"backend {self.name!r}: causal must be one of {CAUSAL_MODES}, got {self.causal!r}")
        if self.raw_mask and self.causal != "own":
            raise ValueError(f"backend {self.name!r}: a raw_mask backend applies causal itself (causal='own')")
        if not set(self.auto_dtypes or ()) <= set(self.dtypes):
            raise ValueError(f"backend {self.name!r}: auto_dtypes must be some of its dtypes {self.dtypes}")
        object.__setattr__(self, "auto_rank", types.MappingProxyType(dict(self.auto_rank)))

    def runs_on(self, device: torch.device) -> bool:
        return self.devices is None or device.type in self.devices

    def applies_causal(self, nq: int, nk: int, masked: bool) -> bool:
        """Whether it applies ``causal=True`` itself on this call (else the causal mask joins the mask)."""
        if self.raw_mask:
            return True
        if masked or self.causal == "mask":
            return False
        if self.causal == "own" or nq == nk:  # a branch, not the comparison itself: under torch.compile with
            return True  # dynamic shapes nq == nk is a SymBool, which SDPA's is_causal refuses
        return False


_REGISTRY: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to the registry (after those there: it is listed last). Raises ValueError for a name
    already taken (:func:`registered` adds one for a ``with`` block, e.g. in a test)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend takes a Backend, got {type(backend).__name__}")
    if backend.name in _REGISTRY:
        raise ValueError(f"a backend named {backend.name!r} is already registered; choose another name")
    _REGISTRY[backend.name] = backend
    return backend


@contextlib.contextmanager
def registered(backend: Backend) -> Iterator[Backend]:
    """``backend`` registered for the ``with`` block, removed after (also on an error)."""
    register_backend(backend)
    try:
        yield backend
    finally:
        _REGISTRY.pop(backend.name, None)


def get_backend(name: str) -> Backend:
    """The registered backend ``name`` (not an alias). Raises ValueError naming the choices."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown backend {name!r}; choose one of {('auto',) + names()}")
    return _REGISTRY[name]


def registry() -> tuple[Backend, ...]:
    """Every registered backend, in the order registered."""
    return tuple(_REGISTRY.values())


def names(select: Callable[[Backend], bool] = lambda b: True, *, aliases: bool = True) -> tuple[str, ...]:
    """The names of the backends ``select`` keeps, in registry order; with ``aliases``, ``"sdpa"`` listed before
    the first SDPA formulation it chooses among (``"auto"`` is never listed)."""
    out = []
    for b in _REGISTRY.values():
        if aliases and b.sdpa_rank is not None and "sdpa" not in out:
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


def _takes(b: Backend, device: torch.device, needs: Needs, *, by_auto: bool) -> bool:
    """Whether ``b`` can take a call with ``needs`` on ``device`` (``by_auto``: as ``"auto"`` would choose it:
    its ``auto_dtypes``, and only what runs under ``torch.compile`` while compiling). Status not consulted."""
    dtypes = (b.auto_dtypes or b.dtypes) if by_auto else b.dtypes
    dtype_ok = set(FLOAT_DTYPES) <= set(dtypes) if needs.dtype is None else needs.dtype in dtypes
    queries_ok = (not by_auto or b.auto_max_queries is None
                  or (needs.queries is not None and needs.queries <= b.auto_max_queries))
    grad_ok = b.backward or not needs.grad
    if grad_ok and needs.grad and by_auto and b.auto_grad_min_head_dim is not None:
        grad_ok = needs.head_dim is not None and needs.head_dim >= b.auto_grad_min_head_dim
    return (b.runs_on(device) and dtype_ok and queries_ok and grad_ok
            and (b.dropout or not needs.dropout) and (b.mask_grad or not needs.mask_grad)
            and (b.compiles or not needs.compiling or not by_auto))


def _auto_key(device: torch.device) -> Callable[[Backend], Optional[int]]:
    """A backend's rank for ``"auto"`` on ``device``: by the device's type where some backend ranks it, else by
    :data:`OTHER_DEVICES` (None: never chosen there)."""
    named = any(device.type in b.auto_rank for b in _REGISTRY.values())
    key = device.type if named else OTHER_DEVICES
    return lambda b: b.auto_rank.get(key)


def _ranked(key: Callable[[Backend], Optional[int]]) -> list[Backend]:
    return sorted((b for b in _REGISTRY.values() if key(b) is not None), key=key)


def _choose(alias: str, device: torch.device, needs: Needs, usable: Callable[[Backend], bool]) -> Optional[Backend]:
    key = _auto_key(device) if alias == "auto" else (lambda b: b.sdpa_rank)
    return next((b for b in _ranked(key) if _takes(b, device, needs, by_auto=True) and usable(b)), None)


def _works_here(device: torch.device) -> Callable[[Backend], bool]:
    return lambda b: b.status(device)[0]


def resolve(backend: str, device: Union[str, torch.device], needs: Needs = ANY_CALL) -> str:
    """The backend ``backend`` means for a call with ``needs`` on ``device``: an alias resolved (the backend
    chosen works here), a name checked to exist and, with dropout, to take it. Raises ValueError naming the fix."""
    device = torch.device(device)
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
    return backend


def resolve_backend(backend: str, device: Union[str, torch.device], *, dropout: bool = False) -> str:
    """The concrete backend ``backend`` means on ``device`` for any call (any dtype, gradients wanted):
    ``"auto"`` and ``"sdpa"`` resolved, a name checked.

    ``"auto"`` follows measurements (``benchmarks/bench_cpu_auto.py``, notebook 08): on a CPU the two-call
    padded formulation (``sdpa_padded``: half the fused calls of ``sdpa_split``, the same FLOPs, less than a
    tenth of ``naive``'s memory); elsewhere the four-call equal-dim formulation (``sdpa_split``), which reaches
    the GPU's flash kernels at any head dim they take. (``chunked`` can be fast on an idle CPU, but its many
    small parallel ops slow down about 10x when a core is busy, so it is never ranked.) With dropout,
    ``"auto"`` and ``"sdpa"`` mean ``sdpa_wide``.

    A particular call can do better: ``diff_attention`` resolves ``"auto"`` for the call itself, so on a CPU a
    float32 call runs the fused CPU kernel (``cpu_fused``; ``benchmarks/bench_cpu_auto.py`` for inference,
    ``benchmarks/bench_cpu_train.py`` for training) wherever it builds, also under ``torch.compile``, unless it
    trains heads narrower than 32 or a learned mask (:func:`describe_auto` says it in a sentence).
    """
    return resolve(backend, device, ANY_CALL._replace(dropout=dropout))


def check_call(name: str, device: torch.device, needs: Needs) -> None:
    """A backend asked for by name: refuse, naming the fix, a call it cannot take or a backend that does not work
    here (dropout is :func:`resolve`'s to refuse). The fix names what ``"auto"`` would run instead."""
    b = get_backend(name)

    def auto_for(**need) -> str:
        return resolve("auto", device, needs._replace(**need))

    if not b.runs_on(device):
        raise ValueError(f"backend {name!r} runs on {_where(b)}, the inputs are on {device}; use backend='auto'")
    if needs.dtype not in b.dtypes:
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
    ok, why = b.status(device)
    if not ok:
        raise RuntimeError(f"backend {name!r} is unavailable here: {why}")


# --------------------------------------------------------------------------------------------
# what works here, and the prose about it
# --------------------------------------------------------------------------------------------


def _condition(b: Backend) -> str:
    """The calls ``"auto"`` gives ``b``, beyond what every backend takes: "float32 inference", ..."""
    dtypes = b.auto_dtypes or b.dtypes
    words = [] if set(FLOAT_DTYPES) <= set(dtypes) else ["/".join(_dtype_name(d) for d in dtypes)]
    if b.backward and b.auto_grad_min_head_dim is not None:
        no_mask = "" if b.mask_grad else " and no learned mask"
        words.append(f"inference and for training with a head dim of at least {b.auto_grad_min_head_dim}{no_mask}")
    else:
        words.append("inference" if not b.backward else "calls without a learned mask" if not b.mask_grad else "calls")
    if b.auto_max_queries is not None:
        rows = "one query row" if b.auto_max_queries == 1 else f"at most {b.auto_max_queries} query rows"
        words.append(f"with {rows} (decoding)")
    if not b.compiles:
        words.append("outside torch.compile")
    return " ".join(words)


def _auto_rule(device: torch.device, usable: Callable[[Backend], bool], notes: bool, tick: str = "") -> str:
    """``"cpu_fused for float32 inference, else sdpa_padded (sdpa_wide with dropout)"``: the backends ``"auto"``
    tries before the one that takes any call, with their conditions, then that one and the one for dropout."""
    main = _choose("auto", device, ANY_CALL, usable)
    drop = _choose("auto", device, ANY_CALL._replace(dropout=True), usable)
    if main is None or drop is None:
        return "no registered backend takes every call here"
    rank = _auto_key(device)
    before = [b for b in _ranked(rank) if rank(b) < rank(main) and b.runs_on(device) and usable(b)]
    clauses = [f"{tick}{b.name}{tick} for {_condition(b)}" + (f" (needs {b.requires})" if notes and b.requires else "")
               for b in before]
    rule = ", else ".join([*clauses, f"{tick}{main.name}{tick}"])
    return rule + ("" if drop is main else f" ({tick}{drop.name}{tick} with dropout)")


def describe_auto(device: Union[str, torch.device]) -> str:
    """One sentence on what ``backend="auto"`` runs on ``device``'s type, from the registry alone (what the
    machine at hand has is :func:`backend_status`'s), e.g. for a CPU: "On a CPU, ``backend="auto"`` runs
    `cpu_fused` for float32 inference (needs a C++ compiler), else `sdpa_padded` (`sdpa_wide` with dropout)."."""
    device = torch.device(device)
    where = _DEVICE_WORDS.get(device.type, f"{device.type} devices")
    return f'On {where}, `backend="auto"` runs {_auto_rule(device, lambda b: True, notes=True, tick="`")}.'


def backend_status(device: Union[str, torch.device] = "cpu") -> dict[str, tuple[bool, str]]:
    """For each name in :data:`BACKENDS`, then ``"auto"``: ``(usable here, why / note)`` on ``device``."""
    device = torch.device(device)
    status = {}
    for name in BACKENDS:
        if name in ALIASES:
            status[name] = (True, f"-> {_sdpa_rule(device)}")
            continue
        b = _REGISTRY[name]
        status[name] = b.status(device) if b.runs_on(device) else (False, f"runs on {_where(b)} only")
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
    rows = ["| backend | what it is | runs on | dtypes | backward | dropout | learned mask | torch.compile |",
            "|---|---|---|---|---|---|---|---|"]
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for name in BACKENDS:
        if name == "sdpa":
            rows.append(f"| `sdpa` | {ALIASES['sdpa']}: {_sdpa_rule(cpu, tick='`')} | as chosen | | | | | |")
            continue
        b = _REGISTRY[name]
        dtypes = ", ".join(_dtype_name(d) for d in b.dtypes)
        if b.compute_dtype is not None:
            dtypes += f" (computed in {_dtype_name(b.compute_dtype)})"
        where = _where(b) + (f" (needs {b.requires})" if b.requires else "")
        rows.append(f"| `{name}` | {b.summary} | {where} | {dtypes} | {_yes(b.backward)} | {_yes(b.dropout)} | "
                    f"{_yes(b.mask_grad)} | {_yes(b.compiles)} |")
    auto = "; ".join(f"on {_DEVICE_WORDS[d.type]}: {_auto_rule(d, lambda b: True, notes=True, tick='`')}"
                     for d in (cpu, gpu))
    rows.append(f"| `auto` | {auto} | as chosen | | | | | |")
    return "\n".join(rows) + "\n"


__all__ = ["Backend", "Call", "Needs", "ANY_CALL", "ALIASES", "REFERENCE", "FLOAT_DTYPES", "BACKENDS",
           "FORWARD_ONLY", "SDPA_FORMULATIONS", "constant_under_compile", "register_backend",
           "registered", "get_backend", "registry", "names", "resolve", "resolve_backend", "check_call",
           "backend_status", "describe_auto", "backend_table"]
