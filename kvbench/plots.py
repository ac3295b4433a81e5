"""Plot helpers shared by the engine (per-job NIAH heatmap) and the reports.

Matplotlib runs with the non-interactive Agg backend (no display needed, safe in jobs).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# A report builds one figure per NIAH job before writing them (and closes each once written):
# more than 20 open at a time is expected here, not a leak.
plt.rcParams["figure.max_open_warning"] = 0
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

NIAH_CMAP = "RdYlGn"  # red (missed) → green (found), the usual NIAH palette


def niah_grid(records: Iterable[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """Mean score per (needle depth, context length) cell of NIAH records.

    Args:
        records: prediction records (docs/RESULTS.md) with ``meta.context_length`` (tokens),
            ``meta.depth_percent`` (0-100) and ``score`` in [0, 1]; failed records
            (``error`` set or ``score`` None) are left out.

    Returns:
        ``(lengths, depths, grid)`` with ``grid`` of shape ``(len(depths), len(lengths))`` in
        points (0-100), NaN where a cell has no successful record.
    """
    cells: dict[tuple[float, int], list[float]] = {}
    lengths: set[int] = set()
    depths: set[float] = set()
    for r in records:
        meta = r.get("meta") or {}
        if "context_length" not in meta or "depth_percent" not in meta:
            continue
        length, depth = int(meta["context_length"]), float(meta["depth_percent"])
        lengths.add(length)
        depths.add(depth)
        if r.get("error") is None and r.get("score") is not None:
            cells.setdefault((depth, length), []).append(100.0 * float(r["score"]))
    ls, ds = sorted(lengths), sorted(depths)
    grid = np.full((len(ds), len(ls)), np.nan)
    for (depth, length), vals in cells.items():
        grid[ds.index(depth), ls.index(length)] = sum(vals) / len(vals)
    return ls, ds, grid


def _tokens_text(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else (f"{n / 1000:g}k" if n >= 1000 else str(n))


def draw_niah_heatmap(ax: Axes, records: Iterable[dict], title: str = "", annotate: bool | None = None,
                      labels: bool = True):
    """Draw a length × depth heatmap on ``ax``; returns the image (for a shared colorbar) or None.

    Cells are mean scores in points (0-100, colour range fixed); grey cells have no score.
    ``annotate`` prints each cell's value (default: when the grid has at most 12 × 12 cells).
    """
    lengths, depths, grid = niah_grid(records)
    ax.set_title(title, fontsize=9)
    if not lengths:
        ax.text(0.5, 0.5, "no NIAH records", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return None
    cmap = matplotlib.colormaps[NIAH_CMAP].with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [_tokens_text(n) for n in lengths], fontsize=7, rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    if labels:
        ax.set_xlabel("Context length (tokens)")
        ax.set_ylabel("Needle depth (%)")
    if annotate is None:
        annotate = len(lengths) <= 12 and len(depths) <= 12
    if annotate:
        for i in range(len(depths)):
            for j in range(len(lengths)):
                if not math.isnan(grid[i, j]):
                    ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=6)
    return im


def add_caption(fig: Figure, caption: str) -> None:
    """Write a caption line (model, task, budget semantics) under the figure."""
    fig.text(0.5, 0.005, caption, ha="center", va="bottom", fontsize=7, wrap=True)


SCORE_LABEL = "Score (ROUGE-1 recall × 100)"


def niah_heatmap_figure(records: Iterable[dict], title: str, caption: str = "") -> Figure:
    """A one-panel NIAH heatmap figure with a colorbar and an optional caption line."""
    records = list(records)
    lengths, depths, _grid = niah_grid(records)
    size = (max(4.8, 1.6 + 0.8 * len(lengths)), max(3.2, 1.4 + 0.4 * len(depths) + (0.3 if caption else 0)))
    fig, ax = plt.subplots(figsize=size, layout="constrained")
    im = draw_niah_heatmap(ax, records, title)
    if im is not None:
        fig.colorbar(im, ax=ax, label=SCORE_LABEL)
    if caption:
        fig.get_layout_engine().set(rect=(0, 0.35 / size[1], 1, 1 - 0.35 / size[1]))
        add_caption(fig, caption)
    return fig


def plot_niah_heatmap(records: Iterable[dict], path: str | Path, title: str, ax: Axes | None = None,
                      caption: str = "") -> Path | None:
    """NIAH score heatmap (needle depth × context length) of one job.

    Args:
        records: the job's prediction records (see :func:`niah_grid`; failed records are skipped).
        path: output file; its suffix picks the format. A ``.png`` also gets a ``.pdf`` beside it.
        title: figure title, e.g. ``"NIAH — smollm2 — SnapKV — budget 0.25"``.
        ax: draw into this axes instead (nothing is written, returns None).
        caption: optional line under the figure (task, budget semantics).

    Returns:
        The written path (parent folders created), or None when drawing into ``ax`` or when
        no record carries NIAH metadata.
    """
    records = list(records)
    if ax is not None:
        draw_niah_heatmap(ax, records, title)
        return None
    if not niah_grid(records)[0]:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = niah_heatmap_figure(records, title, caption)
    fig.savefig(path, dpi=150)
    if path.suffix == ".png":
        fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path
