"""The machinery every exercise check uses: compare a learner's function with the library on fresh random
inputs, and when it differs, name the most likely mistake by matching known wrong answers.

A check raises :class:`CheckFailed` (an ``AssertionError``) whose message is the hint, or prints one
success line. Checks never use the learner's output to decide what is right: the library is the reference.

In Jupyter (IPython) a failed check shows one line, ``FAILED: <hint>``, and a stub that still raises
``NotImplementedError`` shows ``TASK n not attempted yet: ...`` (:class:`NotAttempted`): both exceptions render
themselves through IPython's ``_render_traceback_``, so the learner never sees a traceback into the check's
source (which holds the right answer). Every public check is wrapped by :func:`exercise_check`, which also
turns anything unexpected into a one-line :class:`CheckFailed`; it runs the check on one CPU thread (its inputs
are tiny, and small ops on several threads crawl when another process holds a core).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import os
import sys
import sysconfig
import threading
import traceback
from typing import Callable, Mapping, NoReturn, Optional, Sequence, Union

import torch

from diffattn_tutorial.measure.cpu_threads import threads

Tensor = torch.Tensor

_RED, _YELLOW, _RESET = "\x1b[1;31m", "\x1b[1;33m", "\x1b[0m"


class CheckFailed(AssertionError):
    """A learner's answer is wrong; the message says what is most likely wrong and the idea that fixes it."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows instead of a traceback: the hint, on one line."""
        return [f"{_RED}FAILED:{_RESET} {self}"]


class NotAttempted(NotImplementedError):
    """The learner's function still raises ``NotImplementedError``: the task has not been attempted yet."""

    def __init__(self, task: Optional[int] = None, name: str = "") -> None:
        where = f" in `{name}`" if name else ""
        head = f"TASK {task} not attempted yet" if task is not None else "Not attempted yet"
        super().__init__(f"{head}: replace `raise NotImplementedError`{where} with your answer")
        self.task, self.name = task, name

    def _render_traceback_(self) -> list[str]:
        return [f"{_YELLOW}{self}{_RESET}"]


def fail(hint: str) -> NoReturn:
    raise CheckFailed(hint)


def exercise_check(task: int, name: str, refuses: Optional[Callable[[], Mapping[Callable, str]]] = None
                   ) -> Callable[[Callable], Callable]:
    """Mark a ``check_*`` as the check of ``TASK task`` whose function is called ``name``, and make its errors
    one clean line: a ``NotImplementedError`` from the learner's stub becomes :class:`NotAttempted`, a
    :class:`CheckFailed` loses the traceback into the check, anything else becomes a :class:`CheckFailed`.

    ``refuses`` returns ``{implementation: what it is}``: the library's or PyTorch's implementations of what the
    task asks to build; the learner's function may not call them (:func:`refusing`)."""

    def decorate(check: Callable) -> Callable:
        @functools.wraps(check)
        def wrapper(fn, *args, **kwargs):
            try:
                with threads(1), _torch_state_kept():  # tiny inputs: one thread is fastest, steady when busy
                    watched = refusing(fn, refuses(), name=name) if refuses is not None and callable(fn) else fn
                    return check(watched, *args, **kwargs)
            except NotImplementedError:
                raise NotAttempted(task, name) from None
            except CheckFailed as e:
                raise CheckFailed(str(e)) from None
            except Exception as e:  # noqa: BLE001 - a learner's odd return value must not show the check's source
                raise CheckFailed(f"the check could not use what `{name}` returned ({type(e).__name__}: "
                                  f"{_first_line(e)}); compare its type and shape with the docstring") from None

        wrapper.task, wrapper.function_name = task, name  # type: ignore[attr-defined]
        wrapper.refuses = refuses  # type: ignore[attr-defined]
        return wrapper

    return decorate


@contextlib.contextmanager
def _torch_state_kept():
    """Run a check with gradients on, and give torch's grad mode, default dtype and deterministic mode back as they
    were: a notebook cell or an answer that changes them must not decide this check or a later one."""
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    det, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    try:
        torch.set_grad_enabled(True)
        yield
    finally:
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
        if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != \
                (det, warn_only):  # only when changed: its first call imports torch's compiler (seconds)
            torch.use_deterministic_algorithms(det, warn_only=warn_only)


def _op_builtins(f: Callable) -> list:
    """The builtins that run PyTorch's operator ``f`` when called through ``torch.ops.aten`` (its packet's and
    each overload's), so that ``torch.ops.aten.scaled_dot_product_attention`` counts as ``f`` itself."""
    ours = not hasattr(f, "__code__") and (getattr(f, "__module__", None) or "").startswith("torch")  # not len()
    packet = getattr(torch.ops.aten, getattr(f, "__name__", ""), None) if ours else None
    if packet is None or not hasattr(packet, "overloads"):
        return []
    return [packet._op, *(getattr(packet, overload)._op for overload in packet.overloads())]


def refusing(fn: Callable, refused: Mapping[Callable, str], *, name: str) -> Callable:
    """``fn`` watched while it runs: if it calls one of ``refused`` (a Python function, matched by its code, so an
    alias or a method call counts too; or a builtin such as PyTorch's ``scaled_dot_product_attention``, matched
    by identity, also through ``torch.ops.aten``), the call fails with the rule, naming what it called, even when
    the answer it returns is right.

    The watch is ``sys.setprofile`` (and ``threading.setprofile``, for the threads the answer starts) for the
    duration of the learner's call only: the check's own references run unwatched. An answer that switches the
    watch off fails. A profiler set before (a debugger's) is restored after."""
    unwrapped = {inspect.unwrap(f): what for f, what in refused.items()}  # a decorator's wrapper code is shared
    codes = {f.__code__: what for f, what in unwrapped.items() if hasattr(f, "__code__")}
    builtins = {id(b): what for f, what in unwrapped.items() if not hasattr(f, "__code__") for b in (f, *_op_builtins(f))}

    @functools.wraps(fn)
    def watched(*args, **kwargs):
        hits: list[str] = []

        def profile(frame, event, arg):
            what = codes.get(frame.f_code) if event == "call" else builtins.get(id(arg)) if event == "c_call" else None
            if what is not None and not hits:
                hits.append(what)

        before, before_threads = sys.getprofile(), threading.getprofile()
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            return fn(*args, **kwargs)
        finally:
            switched_off = sys.getprofile() is not profile
            _restore_profile(before)
            threading.setprofile(before_threads)
            if hits:
                raise CheckFailed(f"`{name}` calls {hits[0]}: this task asks you to build that yourself (rule: "
                                  f"an answer may not call the library's or PyTorch's implementation of what its "
                                  f"task builds)")
            if switched_off:
                raise CheckFailed(f"`{name}` switches off the check's watch (sys.setprofile) while it runs, which "
                                  f"looks for calls to the implementation this task builds; remove the "
                                  f"sys.setprofile call (or a profiler's) from `{name}`")

    return watched


def _restore_profile(before) -> None:
    """Put back the profiler that ran before the watch: a Python profile function as it was, or a C profiler
    (``cProfile``, ``%prun``), which ``sys.getprofile`` returns as an object that is no function, by its ``enable``."""
    if before is not None and not callable(before) and hasattr(before, "enable"):
        sys.setprofile(None)
        before.enable()
    else:
        sys.setprofile(before)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


_LIBRARY_DIRS = tuple(os.path.normcase(os.path.realpath(p)) for p in {
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # diffattn_tutorial/
    *(sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")),
} if p)


def _learner_line(tb) -> str:
    """`` (line n: `code`)`` for the deepest traceback frame in the learner's own code (a notebook cell), or ""."""
    found = ""
    for frame in traceback.extract_tb(tb):
        path = os.path.normcase(os.path.realpath(frame.filename)) if not frame.filename.startswith("<") else ""
        if path and path.startswith(_LIBRARY_DIRS) or "site-packages" in frame.filename:
            continue
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        if line:
            found = f" (line {frame.lineno} of its cell: `{line}`)"
    return found


def passed(message: str) -> None:
    """Print the short success line every check ends with."""
    print(f"PASSED: {message}")


def close(a: object, b: Tensor, *, rtol: float = 1e-4, atol: float = 1e-5) -> bool:
    """True if ``a`` is a tensor of ``b``'s shape whose values match ``b`` within tolerance."""
    return isinstance(a, Tensor) and a.shape == b.shape and bool(torch.allclose(a.detach().to(b.dtype), b, rtol=rtol, atol=atol))


def call(fn: Callable, *args, what: str, **kwargs):
    """Call the learner's function, turning a crash into a hint (``NotImplementedError`` passes through)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except CheckFailed:
        raise
    except Exception as e:  # noqa: BLE001 - anything the learner's code raises is reported, not hidden
        fail(f"{what} raised {type(e).__name__}: {_first_line(e)}{_learner_line(e.__traceback__)}")


def expect(got: object, expected: Tensor, *, what: str, wrong: Optional[Mapping[str, Tensor]] = None,
           rtol: float = 1e-4, atol: float = 1e-5, default_hint: str = "") -> None:
    """Fail unless ``got`` matches ``expected``; if it matches one of the ``wrong`` answers, say which.

    ``wrong`` maps a hint (the likely mistake and its fix) to the output that mistake would produce.
    """
    if not isinstance(got, Tensor):
        fail(f"{what} should return a torch.Tensor, got {type(got).__name__}")
    if got.shape != expected.shape:
        fail(f"{what} returned shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if got.dtype != expected.dtype and not got.is_floating_point():
        fail(f"{what} returned dtype {got.dtype}, expected a floating-point tensor like {expected.dtype}")
    if torch.isnan(got).any() and not torch.isnan(expected).any():
        for hint, candidate in (wrong or {}).items():  # a mistake that gives NaN: the same NaN, the same numbers
            if isinstance(candidate, Tensor) and candidate.shape == got.shape and bool(torch.allclose(
                    got.detach().to(candidate.dtype), candidate, rtol=rtol, atol=atol, equal_nan=True)):
                fail(f"{what} is not right. Likely mistake: {hint}")
        fail(f"{what} returned NaN values (a softmax over a row of -inf? a division by zero?)")
    if close(got, expected, rtol=rtol, atol=atol):
        return
    for hint, candidate in (wrong or {}).items():
        if close(got, candidate, rtol=rtol, atol=atol):
            fail(f"{what} is not right. Likely mistake: {hint}")
    err = (got.detach().to(expected.dtype) - expected).abs().max().item()
    fail(f"{what} differs from the reference (max abs error {err:.3g}). {default_hint}".strip())


def expect_grads(fn: Callable[..., Tensor], ref: Callable[..., Tensor],
                 inputs: Union[Mapping[str, Tensor], Sequence[Tensor]], *, what: str,
                 missing_hints: Optional[Mapping[str, str]] = None, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Fail unless ``fn`` and ``ref`` give the same gradients for every input (through a random upstream).

    ``inputs`` is a sequence (named ``input 0``, ``input 1``, ... in hints) or a mapping from names to tensors;
    both functions get them as positional arguments, in order. ``missing_hints`` gives, per name, the hint for an
    input that gets no gradient (default: asks about constant copies).
    """
    named = dict(inputs) if isinstance(inputs, Mapping) else {f"input {i}": t for i, t in enumerate(inputs)}
    ins_a = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in named.values()]
    ins_b = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in named.values()]
    out_b = ref(*ins_b)
    g = torch.randn(out_b.shape, generator=torch.Generator().manual_seed(1234), dtype=out_b.dtype)
    out_a = call(fn, *ins_a, what=what)
    if not isinstance(out_a, Tensor) or not out_a.requires_grad:
        fail(f"{what}: the output does not depend differentiably on the inputs (did you call .detach(), .item(), "
             f"or build a new tensor from Python numbers?)")
    (out_a * g.to(out_a.dtype)).sum().backward()
    (out_b * g).sum().backward()
    for name, a, b in zip(named, ins_a, ins_b):
        if b.grad is None:
            continue
        if a.grad is None or not bool(a.grad.abs().sum() > 0) and bool(b.grad.abs().sum() > 0):
            hint = (missing_hints or {}).get(name)
            fail(f"{what}: {name} gets no gradient. " + (hint or "Is it used through a constant copy, like "
                                                                  ".item(), float() or .detach()?"))
        if not close(a.grad, b.grad, rtol=rtol, atol=atol):
            fail(f"{what}: the gradient with respect to {name} is wrong although the forward matches "
                 f"(an in-place edit, or a .detach() somewhere?)")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float64) -> Tensor:
    """Fresh random inputs from a private generator (checks never disturb the learner's RNG state)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
