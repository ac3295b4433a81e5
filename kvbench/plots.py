"""Small plotting helpers shared by the job runner and the reports (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def niah_grid(records: list[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """Mean score (× 100) per (depth, context length) cell from NIAH records.

    Returns:
        ``(lengths, depths, grid)`` with ``grid`` of shape ``(len(depths), len(lengths))``; NaN
        where a cell has no record.
    """
    lengths = sorted({int(r["meta"]["context_length"]) for r in records})
    depths = sorted({float(r["meta"]["depth_percent"]) for r in records})
    grid = np.full((len(depths), len(lengths)), np.nan)
    sums: dict[tuple[int, int], list[float]] = {}
    for r in records:
        key = (depths.index(float(r["meta"]["depth_percent"])), lengths.index(int(r["meta"]["context_length"])))
        sums.setdefault(key, []).append(100.0 * float(r["score"]))
    for (i, j), v in sums.items():
        grid[i, j] = sum(v) / len(v)
    return lengths, depths, grid


def plot_niah_heatmap(records: list[dict], path: Path | str, title: str, ax=None) -> Path | None:
    """Length × depth heatmap of NIAH scores (ROUGE-1 recall × 100), saved as PNG.

    Args:
        records: NIAH records with ``meta.context_length``, ``meta.depth_percent`` and ``score``.
        path: output PNG path (a PDF is written beside it with the same stem).
        title: figure title (model, method, budget).
        ax: draw into this axes instead of a new figure (no file written).

    Returns:
        The PNG path, or None when drawing into ``ax`` or when there are no records.
    """
    if not records:
        return None
    lengths, depths, grid = niah_grid(records)
    own = ax is None
    if own:
        fig, ax = plt.subplots(figsize=(1.2 + 0.9 * len(lengths), 1.0 + 0.45 * len(depths)), constrained_layout=True)
    im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=100, aspect="auto", origin="upper")
    ax.set_xticks(range(len(lengths)), [str(x) for x in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    ax.set_title(title, fontsize=9)
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(grid[i, j]):
                ax.text(j, i, f"{grid[i, j]:.0f}", ha="center", va="center", fontsize=7)
    if not own:
        return None
    fig.colorbar(im, ax=ax, label="score (ROUGE-1 recall × 100)")
    path = Path(path)
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path
