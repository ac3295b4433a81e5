"""NIAH heatmaps, for a job's ``heatmap.png`` and the reports' panels. Matplotlib runs headless (Agg)."""

from collections.abc import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

plt.rcParams.update({"figure.max_open_warning": 0, "axes.titlesize": 9, "figure.titlesize": 10, "legend.fontsize": 7})
SCORE_LABEL = "Score (ROUGE-1 recall × 100)"


def niah_grid(records: Iterable[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """``(lengths, depths, grid)``: mean score (0-100) per cell, ``grid`` of shape ``(len(depths), len(lengths))``,
    NaN where no record (with ``meta.context_length``, ``meta.depth_percent``) succeeded."""
    cells = pd.DataFrame([(int(r["meta"]["context_length"]), float(r["meta"]["depth_percent"]),
                           100.0 * r["score"] if r.get("error") is None and r.get("score") is not None else np.nan)
                          for r in records if {"context_length", "depth_percent"} <= set(r.get("meta") or {})],
                         columns=["n", "d", "s"])
    grid = cells.pivot_table(index="d", columns="n", values="s", aggfunc="mean", dropna=False)
    lengths, depths = sorted(set(cells["n"])), sorted(set(cells["d"]))
    return lengths, depths, grid.reindex(index=depths, columns=lengths).to_numpy(dtype=float)


def draw_niah_heatmap(ax, records: Iterable[dict], title: str = "", labels: bool = True):
    """Draw the depth × length heatmap on ``ax``; returns the image (for a colorbar), None without NIAH records."""
    lengths, depths, grid = niah_grid(records)
    ax.set_title(title)
    if not lengths:
        ax.text(0.5, 0.5, "no NIAH records", ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
        return None
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey"),
                   vmin=0, vmax=100, aspect="auto")
    ticks = [f"{n // 1024}k" if n % 1024 == 0 else f"{n / 1000:g}k" if n >= 1000 else str(n) for n in lengths]
    ax.set_xticks(range(len(lengths)), ticks, fontsize=7, rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    if labels:
        ax.set(xlabel="Context length (tokens)", ylabel="Needle depth (%)")
    for (i, j), v in np.ndenumerate(grid if len(lengths) <= 12 and len(depths) <= 12 else []):
        if not np.isnan(v):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6)
    return im
