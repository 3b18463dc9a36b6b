"""Small plotting helpers the notebooks share: attention heatmaps side by side, curves, share bars and sliders.

Pure presentation: no attention maths lives here (that is ``functional`` and ``measure.attention_stats``). Every helper
takes torch tensors or NumPy arrays, draws with matplotlib at the course's modest size, and returns the
figure and axes so a notebook can add to them. End a notebook cell with ``plt.show()``.

>>> import torch
>>> a1 = torch.softmax(torch.randn(4, 6), -1); a2 = torch.softmax(torch.randn(4, 6), -1)
>>> fig, axes = attention_heatmaps([a1, a2, a1 - 0.5 * a2], ["A1", "A2", "A1 - 0.5 A2"])
>>> len(axes)
3
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.colors import Normalize, TwoSlopeNorm
from matplotlib.figure import Figure

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[float]]

DPI: int = 90
"""Figure resolution for every course figure (small PNGs keep the notebooks' JSON small)."""

SEQUENTIAL_CMAP: str = "viridis"
"""Colour map for maps that are never negative (softmax maps)."""

DIVERGING_CMAP: str = "RdBu_r"
"""Colour map for maps that can be negative (differential maps): red positive, blue negative, white zero."""


def to_numpy(x: ArrayLike) -> np.ndarray:
    """A float NumPy copy of ``x`` (tensor on any device, with or without grad, or array-like)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def figure_grid(nrows: int = 1, ncols: int = 1, *, width: float = 3.2, height: float = 2.6,
                **subplots_kw) -> tuple[Figure, np.ndarray]:
    """``plt.subplots`` at the course's size: each panel ``width x height`` inches, at :data:`DPI`.

    Returns ``(fig, axes)`` with ``axes`` always a flat array of :class:`~matplotlib.axes.Axes`.
    """
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), dpi=DPI,
                             squeeze=False, **subplots_kw)
    return fig, axes.ravel()


def symmetric_limit(maps: Sequence[ArrayLike]) -> float:
    """The largest ``|value|`` over all ``maps`` (at least a tiny positive number): a shared diverging scale."""
    m = max(float(np.abs(to_numpy(a)).max()) for a in maps)
    return max(m, 1e-12)


def attention_heatmaps(
    maps: Sequence[ArrayLike],
    titles: Sequence[str],
    *,
    diverging: Optional[bool] = None,
    vmax: Optional[float] = None,
    outline: Optional[ArrayLike] = None,
    key_marks: Optional[Mapping[str, ArrayLike]] = None,
    xlabel: str = "key position",
    ylabel: str = "query",
    suptitle: Optional[str] = None,
    width: float = 3.4,
    height: float = 2.4,
    colorbar: bool = True,
    axes: Optional[Sequence[Axes]] = None,
) -> tuple[Figure, np.ndarray]:
    """Attention maps side by side on **one shared colour scale**, so equal colours mean equal weights.

    Args:
        maps: 2-D maps ``(Nq, Nk)`` (tensors or arrays), one panel each.
        titles: one title per map.
        diverging: use a diverging scale centred on zero, ``[-vmax, vmax]`` (white = 0, blue = negative).
            Default: diverging when any map has a negative entry (a differential map), else a sequential
            scale ``[0, vmax]``.
        vmax: top of the scale; default the largest ``|value|`` over all maps. A smaller value clips the
            largest weights so that small ones become visible (say so in the title).
        outline: optional bool ``(Nq, Nk)``: cells to outline (for instance each query's answer key).
        key_marks: optional ``{label: bool (Nk,)}``: key positions to mark with a coloured tick under
            every panel (for instance the distractors), with a legend.
        xlabel, ylabel, suptitle: labels.
        width, height: inches per panel.
        colorbar: draw one colour bar for the row.
        axes: draw into these axes instead of a new figure (one per map).

    Returns:
        ``(fig, axes)``.
    """
    if len(maps) != len(titles):
        raise ValueError(f"got {len(maps)} maps but {len(titles)} titles")
    arrays = [to_numpy(a) for a in maps]
    for a, t in zip(arrays, titles):
        if a.ndim != 2:
            raise ValueError(f"map {t!r} must be 2-D (Nq, Nk), got shape {a.shape}")
    if diverging is None:
        diverging = any(bool((a < 0).any()) for a in arrays)
    top = symmetric_limit(arrays) if vmax is None else float(vmax)
    if diverging:
        norm: Normalize = TwoSlopeNorm(vcenter=0.0, vmin=-top, vmax=top)
        cmap = DIVERGING_CMAP
    else:
        norm, cmap = Normalize(vmin=0.0, vmax=top), SEQUENTIAL_CMAP
    if axes is None:
        fig, ax_arr = figure_grid(1, len(arrays), width=width, height=height, constrained_layout=True)
    else:
        ax_arr = np.asarray(axes, dtype=object).ravel()
        fig = ax_arr[0].figure
    image = None
    for i, (ax, a, title) in enumerate(zip(ax_arr, arrays, titles)):
        image = ax.imshow(a, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=9)
        if i == 0:
            ax.set_ylabel(ylabel, fontsize=9)
        ax.tick_params(labelsize=8)
        if outline is not None:
            rows, cols = np.nonzero(to_numpy(outline) > 0)
            for r, c in zip(rows, cols):
                ax.add_patch(plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, edgecolor="black", lw=1.0))
        if key_marks:
            colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
            for j, (label, mask) in enumerate(key_marks.items()):
                cols = np.nonzero(to_numpy(mask) > 0)[0]
                ax.plot(cols, np.full(len(cols), a.shape[0] - 0.5 + 0.04 * a.shape[0]), linestyle="none",
                        marker="^", markersize=4, color=colours[(j + 1) % len(colours)], label=label,
                        clip_on=False)
            ax.set_ylim(a.shape[0] - 0.5, -0.5)
            if i == len(arrays) - 1:
                ax.legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, -0.2), ncol=len(key_marks),
                          frameon=False, handletextpad=0.2)
    if colorbar and image is not None:
        fig.colorbar(image, ax=list(ax_arr), shrink=0.9, pad=0.02)
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    return fig, ax_arr


def curves(
    x: ArrayLike,
    ys: Mapping[str, ArrayLike],
    *,
    ax: Optional[Axes] = None,
    xlabel: str = "",
    ylabel: str = "",
    title: Optional[str] = None,
    logx: bool = False,
    logy: bool = False,
    styles: Optional[Mapping[str, str]] = None,
    width: float = 4.8,
    height: float = 2.8,
) -> tuple[Figure, Axes]:
    """Several labelled curves over one ``x`` (signals over time, a share against a sweep, ...).

    ``ys`` maps a legend label to a 1-D series of ``len(x)`` values; ``styles`` optionally maps a label to a
    matplotlib format string (``"--"``, ``"o-"``). Returns ``(fig, ax)``.
    """
    if ax is None:
        fig, (ax,) = figure_grid(1, 1, width=width, height=height, constrained_layout=True)
    else:
        fig = ax.figure
    xs = to_numpy(x)
    for label, y in ys.items():
        ys_ = to_numpy(y)
        if ys_.shape != xs.shape:
            raise ValueError(f"curve {label!r} has shape {ys_.shape}, x has {xs.shape}")
        fmt = (styles or {}).get(label, "-")
        ax.plot(xs, ys_, fmt, label=label, lw=1.3, markersize=4)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    if len(ys) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return fig, ax


def share_bars(
    shares: Mapping[str, Mapping[str, float]],
    *,
    ax: Optional[Axes] = None,
    ylabel: str = "share of attention",
    title: Optional[str] = None,
    width: float = 4.2,
    height: float = 2.8,
    value_format: str = "{:.2f}",
) -> tuple[Figure, Axes]:
    """Grouped bars: ``{group: {part: value}}``, e.g. ``{"softmax": {"answer": .5, "noise": .5}, ...}``.

    Every group must name the same parts. Values are printed above (or below, when negative) their bar, formatted
    with ``value_format`` (use as many decimals as the numbers the notebook prints). Returns ``(fig, ax)``.
    """
    groups = list(shares)
    if not groups:
        raise ValueError("share_bars needs at least one group")
    parts = list(shares[groups[0]])
    for g in groups:
        if list(shares[g]) != parts:
            raise ValueError(f"group {g!r} has parts {list(shares[g])}, expected {parts}")
    if ax is None:
        fig, (ax,) = figure_grid(1, 1, width=width, height=height, constrained_layout=True)
    else:
        fig = ax.figure
    bar_w = 0.8 / len(parts)
    for j, part in enumerate(parts):
        xs = np.arange(len(groups)) + (j - (len(parts) - 1) / 2) * bar_w
        vals = [float(shares[g][part]) for g in groups]
        bars = ax.bar(xs, vals, bar_w, label=part)
        for b, v in zip(bars, vals):
            ax.annotate(value_format.format(v), (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom" if v >= 0 else "top", fontsize=8)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set_xticks(np.arange(len(groups)), groups, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.margins(y=0.15)
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return fig, ax


def _display(bundle: dict) -> None:
    """Display a raw MIME bundle in the running IPython kernel (a seam for the tests)."""
    from IPython.display import display

    display(bundle, raw=True)


def widget_bundle(widget: Any, text: str) -> dict:
    """The MIME bundle of an ipywidgets ``widget`` with ``text`` as its plain-text form.

    A live Jupyter front end renders the widget from ``application/vnd.jupyter.widget-view+json``; everything
    else (a notebook opened without a kernel, GitHub, the test run) shows ``text`` instead of the widget's
    ``repr``, which for an ``interactive`` is an unreadable ``interactive(children=(FloatSlider(...), ...))``.
    """
    bundle = dict(widget._repr_mimebundle_() or {})
    bundle["text/plain"] = text
    return bundle


def show_interactive(draw: Callable[..., None], text: str, **sliders: Any) -> None:
    """Show ``draw`` under ipywidgets sliders for live use; ``text`` is what readers without a kernel see.

    ``draw(**values)`` draws one figure (ending with ``plt.show()``); ``sliders`` maps each of its arguments to
    an ipywidgets control (``FloatSlider(...)``), as for ``ipywidgets.interact``. Unlike ``interact`` this leaves
    ``text`` (say, which sliders there are and where the static figure is), not the widget's ``repr``, as the
    cell's saved output. The figure the widget draws lives in the widget, so it is not saved with the notebook:
    draw a static version in an ordinary cell (a few slider settings side by side) for readers without a kernel.
    Returns nothing, so a cell may end with the call.
    """
    import ipywidgets

    _display(widget_bundle(ipywidgets.interactive(draw, **sliders), text))
