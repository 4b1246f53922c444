"""Small matplotlib helpers shared by the bench CLIs (non-interactive Agg backend, log2 x-axes,
failed points marked at the top of an axis)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, never a window; must run before pyplot is imported

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402


def subplots(nrows: int, ncols: int, *, panel_w: float = 5.0, panel_h: float = 3.6, **kw):
    """`plt.subplots` with a figure size proportional to the grid; always returns a 2-D axes array."""
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_w * ncols, panel_h * nrows), squeeze=False, **kw)
    return fig, axes


def log2_xaxis(ax, xs: Sequence[float]) -> None:
    """Log base-2 x-axis with one tick per value in `xs` (e.g. sequence lengths), labelled plainly,
    and limits padded around them (so that markers placed in axes coordinates keep a sane range)."""
    ax.set_xscale("log", base=2)
    ticks = sorted({x for x in xs if x and x > 0})
    if ticks:
        ax.set_xlim(ticks[0] / 1.3, ticks[-1] * 1.3)
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(int(t)) if float(t).is_integer() else f"{t:g}" for t in ticks])
        ax.minorticks_off()


def mark_failed(
    ax, xs: Sequence[float], label: str, color=None, *, level: int = 0, text: str | None = None
) -> None:
    """Mark x positions where a run/provider failed with an 'x' at the top of the axis.

    The y position is in axes coordinates (0.95 minus 0.05 per `level`, so several series failing at
    the same x stay apart) and so stays at the top whatever the data range. `label` goes to the
    legend; `text` (e.g. "OOM"), when given, is also written next to each marker.
    """
    if not xs:
        return
    y = 0.95 - 0.05 * level
    trans = blended_transform_factory(ax.transData, ax.transAxes)
    ax.scatter(
        list(xs),
        [y] * len(xs),
        marker="x",
        s=60,
        color=color,
        transform=trans,
        label=label,
        clip_on=False,
        zorder=5,
    )
    if text:
        for x in xs:
            ax.annotate(
                text,
                (x, y),
                xycoords=trans,
                xytext=(5, -3),
                textcoords="offset points",
                fontsize=7,
                color=color,
            )


def headroom(ax, frac: float = 0.2) -> None:
    """Raise the top y-limit by `frac` of the range (by a factor on a log axis) so that markers from
    `mark_failed` sit above the data rather than on it. Call after plotting, before `mark_failed`."""
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log":
        ax.set_ylim(lo, hi * (1.0 + 4 * frac))
    else:
        ax.set_ylim(lo, hi + (hi - lo) * frac)


def save(fig, path: str | Path, title: str | None = None) -> Path:
    """Save `fig` as PNG at `path` (parents created), close it, and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
