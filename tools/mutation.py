"""Mutation test of the exercise checks: do they fail on plausible one-edit mistakes?

    python tools/mutation.py                        # every solutions/NN_*.ipynb: rate, survivors
    python tools/mutation.py solutions/03_*.ipynb   # some notebooks
    python tools/mutation.py --list                 # also every mutant and what caught it
    python tools/mutation.py --record               # every solution; write diffattn_tutorial/recorded/mutation.json

For every ``# TASK`` cell of a solution notebook this makes one-edit mutants of its code (a sign, an axis, a
constant, an index, an exponent, a reduction, a transpose, a one-minus, abs/clamp added or dropped, a
renormalisation added, a term dropped, arguments swapped, an off-by-one, a guard dropped) and runs the task's
``# CHECK`` cell against each, the way ``diffattn-tutorial check`` grades a learner's notebook: a mutant is
**caught** when the CHECK cell raises. Everything runs in this process, no Jupyter kernel: the notebook's
set-up cells run once, then each mutant's TASK cell and the CHECK cell run in a fresh copy of the namespace.

Besides the one-edit operators, ``NAMED_MISTAKES`` lists mistakes learners were seen to make (some of them two
edits), by the text they change in a solution's answer; each is a mutant like the others (operator ``named``),
and ``tests/test_mutation.py`` requires each to be caught with a named hint.

A mutant that ``check`` catches with a named hint (``Likely mistake: ...`` or another specific message) is
counted apart from one caught only by a generic "differs from the reference" message or a crash.

``tests/test_mutation.py`` runs this on every solution and requires a catch rate of at least 90%, with every
survivor listed there and argued equivalent. ``--record`` writes the counts, per notebook and in total, to
``diffattn_tutorial/recorded/mutation.json`` (with the command, date and versions): the README's mutation figures
are generated from that file (``tools/make_readme_tables.py``), and the test fails when a live run's counts
differ from it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import linecache
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "diffattn_tutorial" / "recorded" / "mutation.json"

CAUGHT_HINT, CAUGHT_GENERIC, CAUGHT_CRASH, SURVIVED = "hint", "generic", "crash", "survived"
GENERIC_MARKERS = ("differs from the reference", " returned NaN values")


# ---------------------------------------------------------------------------------------------------------------
# the mutants
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    """One edit of a TASK cell: ``source`` is the whole edited cell; ``key`` names the edit (operator, before,
    after), stable while the solution's text stays the same."""

    notebook: str
    task: int
    op: str
    before: str
    after: str
    source: str

    @property
    def key(self) -> str:
        return f"{self.notebook} task {self.task} | {self.op}: {self.before} -> {self.after}"


class _Helpers:
    """What the "added" operators wrap a value in (``_mut.abs(x)``). They act on floating-point tensors (and
    ``abs``/``clamp0`` on a returned Python float) and leave anything else alone (an int size, a module, a bool
    mask, a hyper-parameter): such an edit is no plausible mistake. ``applied`` records whether the wrapper
    ever met a value it acts on; a mutant whose wrapper never did is the solution itself and is not counted."""

    def __init__(self):
        self.applied = False

    def _tensor(self, x, min_dim=0) -> bool:
        import torch

        ok = isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= min_dim
        self.applied |= ok
        return ok

    def _float(self, x, allow: bool) -> bool:
        ok = allow and isinstance(x, float)
        self.applied |= ok
        return ok

    def abs(self, x, returned=False):
        return x.abs() if self._tensor(x) else (abs(x) if self._float(x, returned) else x)

    def clamp0(self, x, returned=False):
        return x.clamp(min=0) if self._tensor(x) else (max(x, 0.0) if self._float(x, returned) else x)

    def renorm(self, x, returned=False):
        return x / x.sum(-1, keepdim=True) if self._tensor(x, min_dim=1) else x


def _one_line(text: str) -> str:
    return " ".join(text.split())


_AXIS_FUNCS = {"sum", "mean", "max", "min", "amax", "amin", "softmax", "log_softmax", "logsumexp", "cat", "stack",
               "chunk", "split", "flatten", "repeat_interleave", "cumsum", "norm", "var", "std", "argmax", "unbind"}
_AXIS_SWAP = {-1: -2, -2: -1, 0: 1, 1: 0, 2: 1, 3: 2}
_REDUCTIONS = {"sum": "mean", "mean": "sum", "max": "min", "min": "max", "amax": "amin", "maximum": "minimum",
               "minimum": "maximum"}
_EXPONENTIALS = {"exp": "exp2", "exp2": "exp", "log10": "log", "log": "log10", "log2": "log"}
_DROPPABLE_FUNCS = {"exp", "exp2", "sqrt", "rsqrt", "abs", "log", "log2", "log10", "clamp", "clamp_min"}
_DROPPABLE_METHODS = {"abs", "clamp", "clamp_min", "clamp_max", "sqrt", "rsqrt", "exp", "masked_fill", "transpose",
                      "t", "relu", "detach"}


def _int_value(node) -> Optional[int]:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")


class _Sites(ast.NodeVisitor):
    """Collects ``(op, node, replacement_node_or_text)`` for every one-edit mutation of a cell."""

    def __init__(self, triton: bool):
        self.triton = triton
        self.edits: list[tuple[str, ast.AST, object]] = []
        self.skip_constants: set[int] = set()  # ids of int constants that are axes (mutated as axes only)
        self.docstrings: set[int] = set()

    def add(self, op, node, new):
        self.edits.append((op, node, new))

    def wrap(self, kind: str, expr: ast.expr, returned: bool = False) -> str:
        text = ast.unparse(expr)
        if self.triton:
            return {"abs": f"tl.abs({text})", "clamp0": f"tl.maximum({text}, 0.0)"}.get(kind, "")
        return f"_mut.{kind}({text}, returned=True)" if returned else f"_mut.{kind}({text})"

    # --- functions: parameters and return values -----------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef):
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.docstrings.add(id(body[0].value))
        params = [a.arg for a in node.args.args + node.args.kwonlyargs]
        first = body[1] if len(body) > 1 and id(getattr(body[0], "value", None)) in self.docstrings else body[0]
        for p in params:
            for kind, op in (("abs", "abs added"), ("clamp0", "clamp added"), ("renorm", "renormalisation added")):
                wrapped = self.wrap(kind, ast.Name(p))
                if wrapped:
                    self.add(op, first, ("insert_before", f"{p} = {wrapped}"))
        self.generic_visit(node)

    def visit_Return(self, node: ast.Return):
        if node.value is not None:
            vals = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for v in vals:
                for kind, op in (("abs", "abs added"), ("clamp0", "clamp added"), ("renorm", "renormalisation added")):
                    wrapped = self.wrap(kind, v, returned=True)
                    if wrapped:
                        self.add(op, v, wrapped)
            if isinstance(node.value, ast.Tuple) and len(vals) == 2:
                self.add("arguments swapped", node.value, f"({ast.unparse(vals[1])}, {ast.unparse(vals[0])})")
        self.generic_visit(node)

    def visit_If(self, node: ast.If):
        if not node.orelse:
            self.add("guard dropped", node, ("replace_stmt", "pass"))
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp):
        self.add("guard dropped", node, node.body)
        self.add("guard dropped", node, node.orelse)
        self.generic_visit(node)

    # --- arithmetic -------------------------------------------------------------------------------------------
    def visit_BinOp(self, node: ast.BinOp):
        op = node.op
        if isinstance(op, (ast.Add, ast.Sub)):
            flipped = copy.copy(node)
            flipped.op = ast.Sub() if isinstance(op, ast.Add) else ast.Add()
            self.add("sign", node, flipped)
        if isinstance(op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            self.add("term dropped", node, node.left)
            if not isinstance(op, ast.Sub):
                self.add("term dropped", node, node.right)
        if isinstance(op, ast.Sub) and _is_number(node.left, 1):
            self.add("one-minus", node, node.right)
        if isinstance(op, (ast.Sub, ast.Div, ast.MatMult)):
            swapped = copy.copy(node)
            swapped.left, swapped.right = node.right, node.left
            self.add("arguments swapped", node, swapped)
        if isinstance(op, ast.Pow):
            neg = copy.copy(node)
            neg.right = ast.UnaryOp(ast.USub(), node.right)
            self.add("exponent", node, neg)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp):
        if isinstance(node.op, ast.USub) and id(node) not in self.skip_constants:
            self.add("sign", node, node.operand)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare):
        flips = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
        if len(node.ops) == 1 and type(node.ops[0]) in flips:
            new = copy.copy(node)
            new.ops = [flips[type(node.ops[0])]()]
            self.add("off-by-one", node, new)
            swapped = copy.copy(node)
            swapped.left, swapped.comparators = node.comparators[0], [node.left]
            self.add("arguments swapped", node, swapped)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant):
        v = node.value
        if id(node) in self.skip_constants or id(node) in self.docstrings or isinstance(v, bool):
            return
        if isinstance(v, str) and "->" in v:  # an einops pattern: swap two axes on the output side
            swapped = _swap_pattern(v)
            if swapped:
                self.add("transpose", node, ast.Constant(swapped))
            return
        if isinstance(v, (int, float)):
            if isinstance(v, int):
                self.add("off-by-one", node, ast.Constant(v + 1))
                if v != 0:
                    self.add("off-by-one", node, ast.Constant(v - 1))
            else:
                self.add("constant", node, ast.Constant(v * 2 if v != 0 else 1.0))

    # --- indexing ---------------------------------------------------------------------------------------------
    def visit_Subscript(self, node: ast.Subscript):
        idx = node.slice
        parts = idx.elts if isinstance(idx, ast.Tuple) else [idx]
        for sub in ast.walk(idx):  # an integer index or slice bound: one position off
            v = _int_value(sub)
            if v is not None and id(sub) not in self.skip_constants:
                self.skip_constants.add(id(sub))
                if isinstance(sub, ast.UnaryOp):
                    self.skip_constants.add(id(sub.operand))
                self.add("index", sub, ast.Constant(v + 1))
                self.add("index", sub, ast.Constant(v - 1))
        for i, part in enumerate(parts):
            if isinstance(part, ast.Slice):
                lo, hi = part.lower, part.upper
                if (lo is None) != (hi is None) and part.step is None:  # ":d" <-> "d:"
                    new_part = ast.Slice(hi, lo, part.step)
                    self.add("index", node, _with_part(node, i, new_part))
                if part.step is not None and lo is None:  # "0::2" written as "::2" -> "1::2"
                    self.add("index", node, _with_part(node, i, ast.Slice(ast.Constant(1), hi, part.step)))
            elif isinstance(part, ast.Constant) and part.value is None and len(parts) == 2:  # [:, None] <-> [None, :]
                other = parts[1 - i]
                if isinstance(other, ast.Slice) and other.lower is None and other.upper is None:
                    new = copy.copy(node)
                    new.slice = ast.Tuple([parts[1], parts[0]], ast.Load())
                    self.add("transpose", node, new)
        self.generic_visit(node)

    # --- calls: axes, reductions, exponentials, transposes, argument order ---------------------------------
    def visit_Call(self, node: ast.Call):
        name = _call_name(node)
        is_method = isinstance(node.func, ast.Attribute)
        # axes
        for kw in node.keywords:
            if kw.arg in ("dim", "axis"):
                v = _int_value(kw.value)
                if v is not None:
                    self._mark_axis(kw.value)
                    if v in _AXIS_SWAP:
                        self.add("axis", kw.value, ast.Constant(_AXIS_SWAP[v]))
            if kw.arg == "keepdim":
                self.add("axis", node, _without_keyword(node, "keepdim"))
        if name in _AXIS_FUNCS:
            pos = [a for a in node.args if _int_value(a) is not None]
            # the axis is the only int argument of a method (x.sum(-1)) or the last one of a function
            cand = node.args[-1] if node.args and _int_value(node.args[-1]) is not None else None
            if name in ("chunk", "split") and len(node.args) >= 2:
                cand = node.args[1]
            if cand is not None and (is_method or len(node.args) >= 2):
                self._mark_axis(cand)
                v = _int_value(cand)
                if v in _AXIS_SWAP:
                    self.add("axis", cand, ast.Constant(_AXIS_SWAP[v]))
            del pos
        if name == "transpose" and is_method and len(node.args) == 2:
            for a in node.args:
                self._mark_axis(a)
        # reductions and exponentials: the function's name changes
        if name in _REDUCTIONS:
            self.add("reduction", node, _renamed(node, _REDUCTIONS[name]))
        if name in _EXPONENTIALS:
            self.add("exponent", node, _renamed(node, _EXPONENTIALS[name]))
        # a function or method dropped
        if is_method and name in _DROPPABLE_METHODS:
            op = "transpose" if name in ("transpose", "t") else ("abs/clamp dropped" if name.startswith(("abs", "clamp", "relu"))
                                                               else "term dropped")
            self.add(op, node, node.func.value)
        elif node.args and name in _DROPPABLE_FUNCS:
            op = "abs/clamp dropped" if name.startswith(("abs", "clamp")) else "exponent"
            if name in ("exp", "exp2", "log", "log2", "log10"):
                op = "exponent"
            self.add(op, node, node.args[0])
        if name == "where" and len(node.args) == 3:
            self.add("guard dropped", node, node.args[2])
        # arguments swapped: adjacent positional arguments, elements of a list argument
        for i in range(len(node.args) - 1):
            a, b = node.args[i], node.args[i + 1]
            if isinstance(a, ast.Starred) or isinstance(b, ast.Starred):
                continue
            if ast.unparse(a) == ast.unparse(b) or _int_value(a) is not None and _int_value(b) is not None:
                continue
            new = copy.copy(node)
            new.args = list(node.args)
            new.args[i], new.args[i + 1] = b, a
            self.add("arguments swapped", node, new)
        for arg in node.args:
            if isinstance(arg, (ast.List, ast.Tuple)) and len(arg.elts) == 2:
                new = copy.copy(arg)
                new.elts = [arg.elts[1], arg.elts[0]]
                self.add("arguments swapped", arg, new)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute):
        if node.attr in ("T", "mT"):
            self.add("transpose", node, node.value)
        self.generic_visit(node)

    def _mark_axis(self, node):
        for sub in ast.walk(node):
            self.skip_constants.add(id(sub))


def _is_number(node, value) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value == value


def _with_part(node: ast.Subscript, i: int, part) -> ast.Subscript:
    new = copy.copy(node)
    if isinstance(node.slice, ast.Tuple):
        elts = list(node.slice.elts)
        elts[i] = part
        new.slice = ast.Tuple(elts, ast.Load())
    else:
        new.slice = part
    return new


def _renamed(node: ast.Call, name: str) -> ast.Call:
    new = copy.copy(node)
    if isinstance(node.func, ast.Attribute):
        new.func = ast.Attribute(node.func.value, name, ast.Load())
    else:
        new.func = ast.Name(name, ast.Load())
    return new


def _without_keyword(node: ast.Call, kw: str) -> ast.Call:
    new = copy.copy(node)
    new.keywords = [k for k in node.keywords if k.arg != kw]
    return new


def _swap_pattern(pattern: str) -> Optional[str]:
    """Swap two axis names on the output side of an einops pattern ("b n (h e)" -> "b n (e h)")."""
    if pattern.count("->") != 1:
        return None
    left, right = pattern.split("->")
    if "(" in right:
        start, end = right.index("("), right.index(")")
        names = right[start + 1:end].split()
        if len(names) >= 2:
            names[0], names[1] = names[1], names[0]
            return f"{left}->{right[:start + 1]}{' '.join(names)}{right[end:]}"
    names = right.split()
    if len(names) >= 2 and all(n.isidentifier() for n in names[-2:]):
        names[-1], names[-2] = names[-2], names[-1]
        return f"{left}-> {' '.join(names)}"
    return None


def _offsets(source: str) -> list[int]:
    """Byte offset of the start of every line (ast columns count UTF-8 bytes)."""
    out, pos = [0], 0
    for line in source.encode().splitlines(keepends=True):
        pos += len(line)
        out.append(pos)
    return out


def mutants_of(source: str, *, notebook: str, task: int) -> list[Mutant]:
    """Every distinct one-edit mutant of a TASK cell's source that still parses."""
    tree = ast.parse(source)
    triton = "@triton.jit" in source
    sites = _Sites(triton)
    # axes are marked before constants are visited: visit calls first
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in ("dim", "axis"):
                    sites._mark_axis(kw.value)
            if _call_name(node) in _AXIS_FUNCS and node.args and _int_value(node.args[-1]) is not None:
                sites._mark_axis(node.args[-1])
            if _call_name(node) in ("chunk", "split") and len(node.args) >= 2:
                sites._mark_axis(node.args[0])
                sites._mark_axis(node.args[1])
            if _call_name(node) == "transpose":
                for a in node.args:
                    sites._mark_axis(a)
    sites.visit(tree)
    raw = source.encode()
    starts = _offsets(source)
    seen = {source}
    out: list[Mutant] = []
    counts: dict[str, int] = {}
    for op, node, new in sites.edits:
        a = starts[node.lineno - 1] + node.col_offset
        b = starts[node.end_lineno - 1] + node.end_col_offset
        before = raw[a:b].decode()
        if isinstance(new, tuple) and new[0] == "insert_before":  # a new statement above `node`
            line_start = starts[node.lineno - 1]
            indent = " " * node.col_offset
            text = (raw[:line_start] + f"{indent}{new[1]}\n".encode() + raw[line_start:]).decode()
            before, after = "(start of the function)", new[1]
        elif isinstance(new, tuple) and new[0] == "replace_stmt":
            after = new[1]
            text = (raw[:a] + after.encode() + raw[b:]).decode()
            before = before.splitlines()[0] + " ..."
        else:
            after = new if isinstance(new, str) else ast.unparse(new)
            atom = isinstance(new, str) or isinstance(new, (ast.Name, ast.Attribute, ast.Call, ast.Subscript,
                                                               ast.List, ast.Tuple)) \
                or isinstance(new, ast.Constant) and not (isinstance(new.value, (int, float)) and new.value < 0)
            if isinstance(node, ast.expr) and not atom:
                after = f"({after})"  # keep precedence when an expression becomes an operator expression
            text = (raw[:a] + after.encode() + raw[b:]).decode()
        if text in seen:
            continue
        try:
            ast.parse(text)
        except SyntaxError:
            continue
        seen.add(text)
        m = Mutant(notebook, task, op, _one_line(before), _one_line(after), text)
        n = counts.get(m.key, 0) + 1
        counts[m.key] = n
        if n > 1:
            m = Mutant(notebook, task, op, f"{_one_line(before)} (#{n})", _one_line(after), text)
        out.append(m)
    return out


# Mistakes learners made (issue 34's list), as (edits of the answer's text, what they are): each becomes one mutant.
NAMED_MISTAKES: dict[tuple[str, int], list[tuple[tuple[tuple[str, str], ...], str]]] = {
    ("02_softmax_attention_and_noise", 1): [
        ((('float("-inf")', "0.0"),), "padding scores set to 0 instead of -inf"),
        ((("scores = scores.masked_fill(~keep[:, None, None, :], float(\"-inf\"))", "pass"),
          ("return weights @ v", "return weights.masked_fill(~keep[:, None, None, :], 0.0) @ v")),
         "padding weights zeroed after the softmax, not renormalised"),
        ((("~keep[:, None, None, :]", "~keep[:, None, :, None]"),), "the mask over the queries instead of the keys"),
        ((("~keep[:, None, None, :]", "keep[:, None, None, :]"),), "the mask inverted"),
    ],
    ("03_dual_softmax", 2): [
        ((("(q1, q2), (k1, k2) = q.chunk(2, dim=1), k.chunk(2, dim=1)",
           "(q1, q2), (k1, k2) = split_pairs(q), split_pairs(k)"),), "Task 1's interleaved split on blocked heads"),
    ],
    ("01_differential_amplifier", 1): [
        ((("v_cm + v_d / 2, v_cm - v_d / 2", "v_cm + v_d, v_cm - v_d"),), "the whole difference on each wire"),
        ((("v_plus, v_minus = v_cm + v_d / 2, v_cm - v_d / 2", "v_plus, v_minus = v_cm, v_d"),),
         "the modes taken for the wires (the chapter's formula)"),
    ],
    ("01_differential_amplifier", 2): [
        ((("amplifier(0.5, -0.5) - offset", "amplifier(0.5, -0.5)"), ("amplifier(1.0, 1.0) - offset", "amplifier(1.0, 1.0)")),
         "the offset not taken out"),
    ],
    ("05_subnorm", 1): [
        ((("x.unflatten(-1, (-1, group))", "x.unflatten(-1, (group, -1))"),), "groups of D/g instead of g features"),
    ],
    ("05_subnorm", 2): [
        ((("weight.repeat(num_heads)", "weight.repeat_interleave(num_heads)"),), "the weight spread entry by entry"),
        ((("rms_norm(x, w, eps, group=width)", "rms_norm(x, w, eps)"),), "all heads normalised together"),
    ],
    ("10_diff_v2", 1): [
        ((("k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)",
           "k.repeat(1, per_group, 1, 1), v.repeat(1, per_group, 1, 1)"),), "the KV heads tiled"),
        ((("triu(nk - nq + 1)", "triu(1)"),), "the causal mask aligned top-left"),
        ((("triu(nk - nq + 1)", "triu(nk - nq)"),), "the causal mask hides the diagonal"),
    ],
    ("10_diff_v2", 3): [
        ((("diff_v2(q, k, v, layer.lambda_proj(x))", "diff_v2(q, k, v, torch.sigmoid(layer.lambda_proj(x)))"),),
         "the sigmoid applied twice"),
        ((('"b h n d -> b n (h d)"', '"b h n d -> b n (d h)"'),), "heads merged feature by feature"),
        ((("layer.k_proj(memory)", "layer.k_proj(x)"), ("layer.v_proj(memory)", "layer.v_proj(x)")),
         "keys and values from x"),
    ],
    ("14_converting_trained_models", 2): [
        ((("wide = torch.cat([v[:, :half], v[:, half:]], dim=-1)", "wide = torch.cat([v[:, 0::2], v[:, 1::2]], dim=-1)"),
          ("softmax_attention(q[:, :half], k[:, :half], wide", "softmax_attention(q[:, 0::2], k[:, 0::2], wide")),
         "adjacent pairs (the chapter's) instead of halves"),
    ],
    ("11_diff_attention_in_the_wild", 2): [
        ((("torch.ones(paths, paths, dtype=torch.bool).tril()", "torch.ones(paths, paths, dtype=torch.bool)"),),
         "every path reads every path"),
        ((("torch.ones(paths, paths, dtype=torch.bool).tril()", "torch.eye(paths, dtype=torch.bool)"),),
         "each path reads only its own keys"),
        ((("dtype=torch.bool).tril()", "dtype=torch.bool).tril(-1)"),), "each path reads only the earlier paths"),
    ],
    ("04_lambda_reparameterisation", 2): [
        ((("(lambda_q1 * lambda_k1).sum(-1)", "(lambda_q1 * lambda_k1).sum()"),
          ("(lambda_q2 * lambda_k2).sum(-1)", "(lambda_q2 * lambda_k2).sum()")), "summed over every head too"),
        ((("(lambda_q1 * lambda_k1).sum(-1)", "(lambda_q1 @ lambda_k1.T)"),
          ("(lambda_q2 * lambda_k2).sum(-1)", "(lambda_q2 @ lambda_k2.T)")), "every head against every head"),
    ],
    ("04_lambda_reparameterisation", 1): [
        ((("return 0.8 - 0.6 * math.exp(-0.3 * depth)", "return 1 - (0.8 - 0.6 * math.exp(-0.3 * depth))"),),
         "returned 1 - lambda_init"),
    ],
    ("06_full_module", 3): [
        ((("attn[:, 0::2] - lam * attn[:, 1::2]", "attn[:, :H] - lam * attn[:, H:]"),), "maps paired in blocks"),
        ((("layer.lambda_k2)) + layer.lambda_init)", "layer.lambda_k2)))"),), "lambda without lambda_init"),
        ((("attn[:, 0::2] - lam * attn[:, 1::2]", "attn[:, 0::2] + lam * attn[:, 1::2]"),), "lambda A2 added"),
        ((("layer.subln(heads) * (1 - layer.lambda_init)", "layer.subln(heads) * (1 - lam)"),),
         "(1 - lambda) as the factor"),
        ((("layer.subln(heads) * (1 - layer.lambda_init)", "layer.subln(heads * (1 - layer.lambda_init))"),),
         "the factor before the sub-norm"),
    ],
    ("09_triton_kernel", 1): [
        ((("m_new = tl.maximum(m, tl.max(s_t, 0))", "m_new = tl.max(s_t, 0)"),), "the tile's max as the running max"),
        ((("tl.max(s_t, 0))", "tl.max(s_t, 1))"),), "the max over the wrong axis of the transposed tile"),
        ((("tl.dot(tl.trans(p_t), v)", "tl.dot(p_t, v)"),), "the weights not transposed before the dot"),
    ],
    ("09_triton_kernel", 3): [
        ((("p1 * (dp - delta1[:, None])", "p1 * (dp - delta2[:, None])"),
          ("p2 * (dp - delta2[:, None])", "p2 * (dp - delta1[:, None])")), "delta1 and delta2 swapped"),
        ((("delta1[:, None]", "delta1[None, :]"), ("delta2[:, None]", "delta2[None, :]")),
         "the row statistics broadcast along the wrong axis"),
    ],
    ("13_serving", 1): [
        ((("[None, :] <= pos[:, None]", "[None, :] < pos[:, None]"),), "keys < pos instead of <= pos"),
    ],
    ("13_serving", 2): [
        ((("w = torch.exp(lses - m)", "w = torch.exp(lses)"), ("m + torch.log(w.sum(dim=0))", "torch.log(w.sum(dim=0))")),
         "no max subtracted"),
        ((("m = lses.amax(dim=0)", "m = lses.amax()"),), "a global max instead of the max over the splits"),
    ],
}


def named_mutants(source: str, *, notebook: str, task: int) -> list[Mutant]:
    """The mutants of ``NAMED_MISTAKES`` for this task; an entry whose text the answer no longer holds is an error
    (the list must follow the solutions)."""
    out = []
    for edits, label in NAMED_MISTAKES.get((notebook, task), []):
        text = source
        for before, after in edits:
            if before not in text:
                raise ValueError(f"NAMED_MISTAKES: {notebook} task {task} ({label}) expects {before!r} in the answer")
            text = text.replace(before, after, 1)
        out.append(Mutant(notebook, task, "named", label, "; ".join(a for _, a in edits), text))
    return out


# ---------------------------------------------------------------------------------------------------------------
# running them
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # CAUGHT_HINT, CAUGHT_GENERIC, CAUGHT_CRASH or SURVIVED
    message: str = ""
    seconds: float = 0.0


@dataclass
class NotebookReport:
    path: Path
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    check_seconds: dict[int, float] = field(default_factory=dict)  # task -> its check on the right answer


class _Timeout(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int) -> Iterator[None]:
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"ran past {seconds} s")

    old = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


_COUNTER = [0]


def _run_cell(source: str, ns: dict, tag: str) -> None:
    """Execute a cell's code in ``ns``, registered in linecache (Triton reads a function's source)."""
    _COUNTER[0] += 1
    filename = f"<mutation-{tag}-{_COUNTER[0]}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), ns)  # noqa: S102 - the course's own notebooks and their mutants


def _classify(exc: BaseException) -> tuple[str, str]:
    from diffattn_tutorial.checks import CheckFailed

    msg = " ".join(str(exc).split())
    if isinstance(exc, CheckFailed):
        if any(marker in msg for marker in GENERIC_MARKERS):
            return CAUGHT_GENERIC, msg
        return CAUGHT_HINT, msg
    return CAUGHT_CRASH, f"{type(exc).__name__}: {msg}"


def run_notebook(path: Path, *, only_task: Optional[int] = None, timeout: int = 30) -> NotebookReport:
    """Mutate every TASK cell of the solution notebook at ``path`` and run its CHECK cell on each mutant."""
    import nbformat
    import torch

    from diffattn_tutorial.course.scorecard import find_tasks

    t0 = time.perf_counter()
    nb = nbformat.read(path, as_version=4)
    tasks = find_tasks(nb)
    task_cells = {t.task_cell: t for t in tasks}
    check_cells = {t.check_cell for t in tasks}
    report = NotebookReport(path)
    ns: dict = {"__name__": "__main__", "_mut": _Helpers()}
    cwd = os.getcwd()
    os.chdir(path.parent)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i, cell in enumerate(nb.cells):
                if cell.cell_type != "code" or i in check_cells:
                    continue
                if i not in task_cells:  # set-up and demo cells: run once, as the notebook does
                    try:
                        _run_cell(cell.source, ns, "setup")
                    except Exception:  # noqa: BLE001 - a demo cell that needs a GPU; the tasks do not
                        pass
                    continue
                task = task_cells[i]
                check_src = nb.cells[task.check_cell].source
                if only_task is None or only_task == task.number:
                    original = _run_mutant(Mutant(path.stem, task.number, "none", "", "", cell.source), ns,
                                           check_src, timeout)
                    if original is None or original.status != SURVIVED:
                        raise RuntimeError(f"{path.name}: the solution of TASK {task.number} fails its own check: "
                                           f"{original.message if original else ''}")
                    report.check_seconds[task.number] = original.seconds
                    for m in mutants_of(cell.source, notebook=path.stem, task=task.number) + \
                            named_mutants(cell.source, notebook=path.stem, task=task.number):
                        outcome = _run_mutant(m, ns, check_src, timeout)
                        if outcome is not None:
                            report.outcomes.append(outcome)
                _run_cell(cell.source, ns, "task")  # the right answer, for the tasks that build on it
    finally:
        os.chdir(cwd)
    del torch
    report.seconds = time.perf_counter() - t0
    return report


def _run_mutant(m: Mutant, ns: dict, check_src: str, timeout: int) -> Optional[Outcome]:
    """Run one mutant's TASK cell and the CHECK cell; None when the mutant turned out to be no edit at all."""
    import torch

    if os.environ.get("MUTATION_TRACE"):
        print(m.key, file=sys.__stderr__, flush=True)
    t = time.perf_counter()
    local = dict(ns)
    helpers = local["_mut"] = _Helpers()
    torch.manual_seed(0)
    try:
        with _time_limit(timeout):
            _run_cell(m.source, local, "mutant")
            _run_cell(check_src, local, "check")
        out = Outcome(m, SURVIVED, "", time.perf_counter() - t)
    except _Timeout as e:
        out = Outcome(m, CAUGHT_CRASH, f"timeout: {e}", time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - whatever the check cell raises means the grader fails the task
        status, msg = _classify(e)
        out = Outcome(m, status, msg, time.perf_counter() - t)
    if "_mut." in m.source and not helpers.applied:
        return None  # the wrapper only ever met values it leaves alone (sizes, modules, masks)
    return out


def summary(reports: list[NotebookReport]) -> dict:
    outs = [o for r in reports for o in r.outcomes]
    n = len(outs)
    by = {s: sum(o.status == s for o in outs) for s in (CAUGHT_HINT, CAUGHT_GENERIC, CAUGHT_CRASH, SURVIVED)}
    return {"mutants": n, **by, "caught": n - by[SURVIVED], "rate": (n - by[SURVIVED]) / n if n else 1.0,
            "seconds": sum(r.seconds for r in reports)}


def counts(reports: list[NotebookReport]) -> dict:
    """The recorded numbers: per notebook (by file name) and in total, mutants and what caught them."""
    keys = ("mutants", "caught", CAUGHT_HINT, CAUGHT_GENERIC, CAUGHT_CRASH, SURVIVED)
    per = {r.path.name: {k: summary([r])[k] for k in keys} for r in reports}
    return {"total": {k: summary(reports)[k] for k in keys}, "notebooks": per}


def sources_hash(root: Path = ROOT) -> str:
    """sha256 of what the counts depend on: every check's source (``diffattn_tutorial/checks/*.py``), this tool
    (its operators and ``NAMED_MISTAKES``) and the code cells of every solution (not their outputs). The record
    keeps it, and ``tests/test_mutation_record.py`` fails when a check changed after the record was made."""
    import hashlib
    import json

    h = hashlib.sha256()
    files = sorted((root / "diffattn_tutorial" / "checks").glob("*.py")) + [root / "tools" / "mutation.py"]
    for p in files:
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes().replace(b"\r\n", b"\n") + b"\0")
    for p in sorted((root / "solutions").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(p.read_text())["cells"]
        code = "\n\0".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        h.update(p.name.encode() + b"\0" + code.encode() + b"\0")
    return h.hexdigest()


def record(reports: list[NotebookReport], path: Path = RECORD) -> dict:
    """Write :func:`counts` with how they were made to ``path`` (``diffattn_tutorial/recorded/mutation.json``)."""
    import datetime
    import json
    import platform

    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    data = {"schema": "diffattn-tutorial/mutation/1", "command": "python tools/mutation.py --record",
            "device": f"CPU ({platform.machine()}), checks on 1 torch thread", "torch": torch.__version__,
            "triton": triton_version, "python": platform.python_version(),
            "date": datetime.date.today().isoformat(), "sources_sha256": sources_hash(), **counts(reports)}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", type=Path)
    ap.add_argument("--list", action="store_true", help="print every mutant and its outcome")
    ap.add_argument("--task", type=int, default=None, help="only this task number")
    ap.add_argument("--record", action="store_true",
                    help=f"run every solution and write the counts to {RECORD.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    if args.record and (args.paths or args.task is not None):
        ap.error("--record runs every solution: pass no paths and no --task")
    os.environ.setdefault("TRITON_INTERPRET", "1")
    paths = [p.resolve() for p in args.paths] or sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
    reports = []
    for p in paths:
        r = run_notebook(p, only_task=args.task)
        reports.append(r)
        s = summary([r])
        checks = ", ".join(f"{t}: {sec:.2f}" for t, sec in r.check_seconds.items())
        print(f"{p.name}: {s['caught']}/{s['mutants']} caught ({s['rate']:.0%}; named hint {s[CAUGHT_HINT]}, "
              f"generic {s[CAUGHT_GENERIC]}, crash {s[CAUGHT_CRASH]}) in {r.seconds:.1f} s; the checks on the "
              f"solution (task: s) {checks}", flush=True)
        for o in r.outcomes:
            if args.list or o.status == SURVIVED:
                print(f"  {o.status:8s} {o.seconds:5.2f}s {o.mutant.key}" + (f"\n           {o.message[:300]}" if args.list and o.message else ""))
    s = summary(reports)
    print(f"total: {s['caught']}/{s['mutants']} caught ({s['rate']:.1%}; named hint {s[CAUGHT_HINT]}, generic "
          f"{s[CAUGHT_GENERIC]}, crash {s[CAUGHT_CRASH]}), {s[SURVIVED]} survived, {s['seconds']:.1f} s")
    if args.record:
        record(reports)
        print(f"wrote {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
