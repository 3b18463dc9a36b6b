"""Every backend of ``diff_attention``, declared once, and the order in which ``backend="auto"`` tries them.

A :class:`Backend` says what a backend is (a line of the README's table), where and on what it runs (devices,
dtypes), what it can do (backward, dropout, a learned mask's gradient, ``torch.compile``), how it takes ``causal``
and the mask, how to ask whether it works here (``status``) and how to run it (``run``, on a :class:`Call`).
:data:`TABLE` lists them all. :data:`AUTO` holds, per device type, the ordered list of :class:`Choice` that
``"auto"`` walks: the first one that takes the call and works here runs it. :data:`SDPA_ORDER` is the same list
for the alias ``"sdpa"``.

The fused kernels are loaded lazily: the ``run`` and ``status`` of ``triton`` and ``cpu_fused`` import their kernel
module on first use, so importing the library compiles, builds and loads nothing. The rules that read the table
(the aliases, the refusals, status, the prose and the README's table) are in :mod:`diffattn_tutorial.backends`;
the formulas the pure-PyTorch entries run are in :mod:`diffattn_tutorial.formulations`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Optional

import torch

from diffattn_tutorial import formulations

Tensor = torch.Tensor

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
"""The dtypes ``diff_attention`` takes (a backend takes all of them unless it says otherwise)."""

ALIASES: dict[str, str] = {
    "sdpa": "the first SDPA formulation, in a fixed order (not the recorded fastest), that takes the call",
    "auto": "the first backend, in the device's order, that takes the call and works here",
}
"""Names that stand for a backend chosen per call."""

REFERENCE = "naive"
"""The backend every other one is tested against (explicit maps); it takes every call."""

PLAIN_BACKENDS = ("auto", "naive", "sdpa")
"""The backends of plain softmax attention (``softmax_attention``, DIFF V2 and the baseline layers)."""

OTHER_DEVICES = "*"
"""The key of :data:`AUTO` for the device types it does not name (a GPU, unless it names one)."""

CAUSAL_MODES = ("mask", "sdpa", "own")
"""How a backend applies ``causal=True``: as part of the mask (``"mask"``); with SDPA's ``is_causal``, which is
top-left aligned, so only where ``Nq == Nk`` and no other mask is given (``"sdpa"``); with its own bottom-right
causal masking where no other mask is given (``"own"``)."""

FAMILIES = ("maps", "sdpa", "kernel")
"""The values of :attr:`Backend.family`."""


class Call(NamedTuple):
    """A validated ``diff_attention`` call, as a backend's ``run`` gets it.

    q ``(B, 2H, Nq, d)``, k ``(B, 2Hkv, Nk, d)``, v ``(B, Hkv, Nk, 2d)``; lam a 0-dim or 4-D tensor broadcastable
    to ``(B, H, Nq, 1)``; ``attn_mask``: the caller's mask as a 4-D view, or None; ``causal``: the caller's flag.
    ``mask``: the one mask to apply, ``attn_mask`` combined with the causal mask (unless ``is_causal``), fully
    masked rows made harmless (they are zeroed after), or None where there is nothing to apply or the backend
    takes ``attn_mask`` and ``causal`` itself (``Backend.raw_mask``). ``is_causal``: the backend applies
    ``causal`` itself on this call.
    """

    q: Tensor
    k: Tensor
    v: Tensor
    lam: Tensor
    attn_mask: Optional[Tensor]
    causal: bool
    mask: Optional[Tensor]
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
    transforms: bool = False  # traced by a torch.func transform (grad, vmap, jacrev, ...)
    queries: Optional[int] = None  # Nq, the query rows of the call (None: any number)
    head_dim: Optional[int] = None  # d, the q/k head dim of the call (None: any)


ANY_CALL = Needs(dtype=None, grad=True, mask_grad=True)
"""The needs of a call nothing is known about: any dtype, gradients wanted."""


def constant_under_compile(fn: Callable) -> Callable:
    """Mark ``fn`` as ``torch.compiler.assume_constant_result`` does: while ``torch.compile`` traces a call of it,
    it runs once, eagerly, and its answer is kept as a constant (a status that builds or loads something cannot be
    traced). Unlike the public decorator this does not import ``torch._dynamo`` with the library."""
    fn._dynamo_marked_constant = True
    return fn


def _device_type(device: str) -> Optional[str]:
    """The device type ``device`` names (``"cuda"`` for ``"cuda:1"``), or None where it names none."""
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


def _pure_pytorch(device: torch.device) -> tuple[bool, str]:
    return True, "pure PyTorch"


@dataclasses.dataclass(frozen=True)
class Backend:
    """One backend of ``diff_attention`` (see the module docstring)."""

    name: str
    summary: str
    """What it is, in one line (the README's backend table)."""
    run: Callable[[Call], Tensor]
    """Computes ``(B, H, Nq, 2d)`` in q's dtype from a :class:`Call` (fully masked rows: anything finite)."""
    status: Callable[[torch.device], tuple[bool, str]] = _pure_pytorch
    """``(works here, why / note)`` on a device it runs on; never raises (a registered one that raises, or answers
    something else, counts as not working here, its reason shown by ``backend_status``). It is asked while ``torch.compile`` traces
    ``"auto"``: one that does more than return constants is marked :func:`constant_under_compile`."""
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
    transforms: bool = True
    """Whether it runs under ``torch.func`` transforms (``grad``, ``vmap``, ``jacrev``, ...): PyTorch ops do; a kernel
    handed its inputs' memory does not (a transform's tensors have none of their own)."""
    second_derivative: bool = True
    """Whether a gradient of its gradients can be taken (``create_graph=True``, a gradient penalty): not where a fused
    kernel's backward has no derivative (``diff_attention`` then refuses a second derivative by name)."""
    family: str = "maps"
    """``"maps"`` (explicit maps), ``"sdpa"`` (scaled_dot_product_attention calls) or ``"kernel"`` (a fused one)."""
    origin: str = ""
    """The reference implementation whose formulation it is ("" for the project's own)."""
    requires: str = ""
    """What it needs beyond PyTorch ("" for nothing)."""
    causal: str = "mask"
    """One of :data:`CAUSAL_MODES`."""
    raw_mask: bool = False
    """It takes the caller's ``attn_mask`` and ``causal`` as they are, and zeroes fully masked rows itself."""
    run_scanning: Optional[Callable[[Call], Optional[Tensor]]] = None
    """``run`` that also scans q, k and v for NaN and infinities as it reads them: None where it finds one. Where
    it is given, ``diff_attention``'s eager CPU calls make no summing pass of their own over q, k and v first, and
    take the careful path (which calls ``run``) only on None."""
    nan_contract: bool = False
    """Its ``run`` meets the NaN contract itself on every device (the kernel scans q, k and v as it reads them and,
    only where it met a NaN or an infinity, recomputes on the device, with no host synchronisation): then
    ``diff_attention`` makes no pass of its own over q, k, v or the output."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise TypeError(f"a backend's name must be a string (an identifier), got {self.name!r}")
        if not self.name.isidentifier() or self.name in ALIASES:
            raise ValueError(f"a backend's name must be an identifier other than {tuple(ALIASES)}, got {self.name!r}")
        if self.causal not in CAUSAL_MODES:
            raise ValueError(f"backend {self.name!r}: causal must be one of {CAUSAL_MODES}, got {self.causal!r}")
        if self.raw_mask and self.causal != "own":
            raise ValueError(f"backend {self.name!r}: a raw_mask backend applies causal itself (causal='own')")
        for field in ("run", "status", "run_scanning"):
            fn = getattr(self, field)
            if not callable(fn) and not (field == "run_scanning" and fn is None):
                raise TypeError(f"backend {self.name!r}: {field} must be a function (got {fn!r}); to reuse a "
                                f"registered backend's, pass get_backend('naive').{field}")
        self._check_devices()
        self._check_fields()

    def _check_fields(self) -> None:
        """dtypes, compute_dtype, the flags and family of the right kinds: a string where a dtype goes would refuse
        every call with "takes float32, got float32", a flag given as a string would be truthy."""
        dtypes = self.dtypes
        if not isinstance(dtypes, tuple) or not dtypes or not all(isinstance(t, torch.dtype) for t in dtypes):
            raise TypeError(f"backend {self.name!r}: dtypes must be a non-empty tuple of torch dtypes such as "
                            f"(torch.float32,), got {dtypes!r}")
        if self.compute_dtype is not None and not isinstance(self.compute_dtype, torch.dtype):
            raise TypeError(f"backend {self.name!r}: compute_dtype must be None or a torch dtype, got "
                            f"{self.compute_dtype!r}")
        for flag in ("backward", "dropout", "mask_grad", "compiles", "transforms", "second_derivative", "raw_mask",
                     "nan_contract"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"backend {self.name!r}: {flag} must be True or False, got {getattr(self, flag)!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"backend {self.name!r}: family must be one of {FAMILIES}, got {self.family!r}")

    def _check_devices(self) -> None:
        """``devices`` is None or a tuple of device types: ``("gpu",)`` would match no tensor and never run."""
        if self.devices is None:
            return
        if isinstance(self.devices, str) or not isinstance(self.devices, (tuple, list)) or not self.devices:
            raise TypeError(f"backend {self.name!r}: devices must be None or a non-empty tuple of device types such "
                            f"as ('cuda', 'cpu'), got {self.devices!r}")
        for d in self.devices:
            if not isinstance(d, str) or _device_type(d) != d:
                hint = " (a GPU is 'cuda')" if d == "gpu" else ""
                raise ValueError(f"backend {self.name!r}: devices names {d!r}, which is not a torch device type"
                                 f"{hint}; give types such as 'cpu', 'cuda', 'mps'")

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


class Choice(NamedTuple):
    """One step of ``"auto"``'s order for a device: ``backend``, for the calls it takes, narrowed to ``dtypes``
    (None: all it takes), to calls of at most ``max_queries`` query rows (None: any number), unless ``training`` to
    calls that need no gradient, and to training calls with a head dim of at least ``train_min_head_dim``."""

    backend: str
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    max_queries: Optional[int] = None
    training: bool = True
    train_min_head_dim: Optional[int] = None


# --------------------------------------------------------------------------------------------
# how each backend runs
# --------------------------------------------------------------------------------------------


def _run_naive(c: Call) -> Tensor:
    return formulations.naive(c.q, c.k, c.v, c.lam, c.mask, c.scale, c.dropout_p)


def _run_chunked(c: Call) -> Tensor:
    return formulations.chunked(c.q, c.k, c.v, c.lam, c.mask, c.scale, c.dropout_p, causal=c.causal)


def _on_sdpa(name: str) -> Callable[[Call], Tensor]:
    """A backend's ``run`` from the SDPA formulation ``formulations.<name>``."""
    def run(c: Call) -> Tensor:
        formulation = getattr(formulations, name)
        return formulation(c.q, c.k, c.v, c.lam, c.mask, c.is_causal, c.scale, c.dropout_p)

    return run


def _sdpa_status(device: torch.device) -> tuple[bool, str]:
    return True, "torch.nn.functional.scaled_dot_product_attention"


@constant_under_compile  # asked while torch.compile traces a call: answered eagerly, once
def triton_available() -> tuple[bool, str]:
    """Whether the Triton kernels can run here (:func:`diffattn_tutorial.kernels.triton.flash_diff.triton_available`)."""
    try:
        from diffattn_tutorial.kernels.triton.flash_diff import triton_available as available
    except ImportError as e:  # triton not installed (e.g. macOS)
        return False, f"triton is not importable ({e})"
    return available()


def _triton_status(device: torch.device) -> tuple[bool, str]:
    ok, why = triton_available()
    if ok and device.type == "cpu":
        why = "Triton interpreter (TRITON_INTERPRET=1): exact but slow, for learning and tests"
    return ok, why


def _run_triton(c: Call) -> Tensor:
    from diffattn_tutorial.kernels.triton.flash_diff import triton_diff_attention

    return triton_diff_attention(c.q, c.k, c.v, c.lam, causal=c.causal, attn_mask=c.attn_mask, scale=c.scale)


@constant_under_compile  # asked while torch.compile traces a call: answered eagerly, once
def _cpu_fused_status(device: torch.device) -> tuple[bool, str]:
    from diffattn_tutorial.kernels.cpu import build, cpu_fused

    if build.loaded() is not None:
        return cpu_fused.kernel_status()
    with torch.device("cpu"):  # the first load's self-check allocates: on the CPU, whatever the caller's default
        return cpu_fused.kernel_status()


def _run_cpu_fused(c: Call, scan: bool = False) -> Optional[Tensor]:
    from diffattn_tutorial.kernels.cpu import cpu_fused

    return cpu_fused.fused_diff_attention(c.q, c.k, c.v, c.lam, attn_mask=c.mask, causal=c.is_causal, scale=c.scale,
                                          scan=scan)


def _run_cpu_fused_scanning(c: Call) -> Optional[Tensor]:
    return _run_cpu_fused(c, scan=True)


# --------------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------------

_FLOAT32_OR_16BIT = (torch.float32, torch.float16, torch.bfloat16)
_SDPA = dict(family="sdpa", causal="sdpa", status=_sdpa_status)

TABLE: tuple[Backend, ...] = (
    Backend("naive", "explicit maps `(A1 - lambda A2) V`: the teaching version", _run_naive,
            origin="unilm multihead_diffattn"),
    Backend("sdpa_wide", "two SDPA calls with V of width 2d (timm, unilm `flashdiff_1`)", _on_sdpa("sdpa_wide"),
            origin="timm, unilm multihead_flashdiff_1", **_SDPA),
    Backend("sdpa_split", "four SDPA calls with V split in halves, equal head dims (unilm `flashdiff_2`): reaches "
            "fused kernels", _on_sdpa("sdpa_split"), dropout=False, second_derivative=False, origin="unilm multihead_flashdiff_2", **_SDPA),
    Backend("sdpa_stacked", "one SDPA call over 4H stacked heads (vasqu `multihead-sdpadiff`)",
            _on_sdpa("sdpa_stacked"), dropout=False, second_derivative=False, origin="vasqu multihead-sdpadiff", **_SDPA),
    Backend("sdpa_padded", "two SDPA calls with q and k zero-padded to width 2d (q.k unchanged), V whole: both reach "
            "the fused CPU kernel", _on_sdpa("sdpa_padded"), dropout=False, second_derivative=False, **_SDPA),
    Backend("chunked", "the same arithmetic over cache-sized query chunks; causal chunks skip invisible keys",
            _run_chunked),
    Backend("triton", "the fused differential flash-attention kernel (`kernels/triton/flash_diff`), forward and "
            "backward; on a CPU only in Triton's interpreter, slowly", _run_triton, status=_triton_status,
            devices=("cuda", "cpu"), dtypes=_FLOAT32_OR_16BIT, dropout=False, mask_grad=False, transforms=False,
            second_derivative=False, family="kernel", requires="Triton; on a CPU, TRITON_INTERPRET=1", causal="own",
            raw_mask=True, nan_contract=True),
    Backend("cpu_fused", "a fused C++ CPU kernel (`kernels/cpu/diff_attention_cpu.cpp`, compiled on first use by the "
            "system's C++ compiler, a registered torch operator): naive's arithmetic with a block of rows' maps kept "
            "in cache", _run_cpu_fused, status=_cpu_fused_status, devices=("cpu",), dtypes=_FLOAT32_OR_16BIT,
            compute_dtype=torch.float32, dropout=False, mask_grad=False, transforms=False, second_derivative=False,
            family="kernel", requires="a C++ compiler", causal="own", run_scanning=_run_cpu_fused_scanning),
)
"""Every backend, in the order the lists of names show them."""

DECODE_QUERIES = 1
"""On a CPU ``"auto"`` runs ``naive`` for calls with at most this many query rows: decoding one token. This is a
choice, not a measurement: whether the fused kernel's cost per call (heads padded to a width of 32, the call
itself) is repaid at one row for the course's small heads (d = 16) is UNMEASURED, because
``benchmarks/bench_cpu_queries.py`` times a head dim of 64 only, and there the kernel is the faster from one row
(``benchmarks/results_cpu_queries_*.json``). No head-dim rule for decoding is made until d = 16 is measured."""

CPU_FUSED_TRAIN_MIN_HEAD_DIM = 32
"""On a CPU ``"auto"`` trains with the fused kernel only where the head dim is at least this: narrower heads are
padded to 32 columns, which costs the kernel most of its lead. The course's toy DIFF model (notebook 07: 2
differential heads with q/k maps 16 wide) trains below the rule, on ``sdpa_padded``; what the kernel would gain there
is measured by ``python benchmarks/bench_cpu_train.py --rule`` (``benchmarks/NOTES.md``)."""

AUTO: dict[str, tuple[Choice, ...]] = {
    "cpu": (Choice("naive", max_queries=DECODE_QUERIES),
            Choice("cpu_fused", dtypes=(torch.float32,), train_min_head_dim=CPU_FUSED_TRAIN_MIN_HEAD_DIM),
            Choice("sdpa_padded"), Choice("sdpa_wide")),
    OTHER_DEVICES: (Choice("sdpa_split"), Choice("sdpa_wide")),
}
"""``"auto"``'s order per device type, first tried first. On a CPU (from ``benchmarks/bench_cpu_auto.py`` and
``bench_cpu_train.py --rule``): ``naive`` for one query row (a choice; ``bench_cpu_queries.py`` times head dim 64
only), the fused kernel for float32 (training too, from a head dim of 32), then the padded SDPA formulation, the
fastest SDPA formulation in the CPU record, then ``sdpa_wide`` (dropout). Elsewhere the equal-dim formulation
``sdpa_split``, which every fused GPU kernel takes, then ``sdpa_wide`` (dropout): a fixed order, not the recorded
fastest, since the recorded GPU runs (``diffattn_tutorial/recorded/bench_sdpa_*.json``, notebook 08) have
``sdpa_wide`` faster in most cases. ``chunked`` is in neither: its many small parallel ops slow down most when a
core is busy (``benchmarks/bench_busy_cpu.py``)."""

SDPA_ORDER: tuple[str, ...] = ("sdpa_split", "sdpa_wide")
"""The alias ``"sdpa"``'s order on every device: the first of these that takes the call. A fixed order, not the
recorded fastest: ``sdpa_wide`` was faster than ``sdpa_split`` in most recorded GPU cases and ``sdpa_padded`` on the
CPU (notebook 08, the README's tables); ``sdpa_split`` is first because every fused kernel takes its calls."""


__all__ = ["Backend", "Call", "Needs", "Choice", "ANY_CALL", "ALIASES", "REFERENCE", "PLAIN_BACKENDS", "FLOAT_DTYPES",
           "OTHER_DEVICES", "CAUSAL_MODES", "DECODE_QUERIES", "CPU_FUSED_TRAIN_MIN_HEAD_DIM", "TABLE", "AUTO", "SDPA_ORDER",
           "constant_under_compile", "triton_available"]
