"""NIAH heatmaps, for a job's ``heatmap.png`` and the reports' panels. Matplotlib runs headless (Agg)."""

from collections.abc import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.patches import Patch

# One style for every figure: sizes relative to a 10 pt base (figures are drawn at about their printed width, a
# 3.2-4.2 in panel), so no text falls below "small" (8.3 pt); nothing sets an absolute font size.
plt.rcParams.update({"figure.max_open_warning": 0, "font.size": 10, "axes.titlesize": "medium",
                     "axes.labelsize": "medium", "xtick.labelsize": "small", "ytick.labelsize": "small",
                     "legend.fontsize": "small", "legend.title_fontsize": "small", "figure.titlesize": "large"})
NO_SCORE = "lightgrey"  # a NIAH cell without a scored sample


def niah_grid(records: Iterable[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """``(lengths, depths, grid)``: mean score (0-100) per cell, ``grid`` of shape ``(len(depths), len(lengths))``,
    NaN where no record (with ``meta.context_length``, ``meta.depth_percent``) succeeded."""
    cells = pd.DataFrame([(int(r["meta"]["context_length"]), float(r["meta"]["depth_percent"]),
                           100.0 * r["score"] if r.get("error") is None and r.get("score") is not None else np.nan)
                          for r in records if {"context_length", "depth_percent"} <= set(r.get("meta") or {})],
                         columns=["n", "d", "s"])
    grid = cells.pivot_table(index="d", columns="n", values="s", aggfunc="mean", dropna=False)  # sorted
    return list(grid.columns), list(grid.index), grid.to_numpy(dtype=float)


def draw_niah_heatmap(ax, records: Iterable[dict], title: str = ""):
    """Draw the depth × length heatmap on ``ax`` (cell values up to 12 × 12 cells; grey: no scored sample); returns
    the image (for :func:`niah_colorbar`), None without NIAH records."""
    lengths, depths, grid = niah_grid(records)
    ax.set_title(title)
    if not lengths:
        ax.text(0.5, 0.5, "no NIAH records", ha="center", va="center", transform=ax.transAxes)
        ax.set(xticks=[], yticks=[])
        return None
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=matplotlib.colormaps["RdYlGn"].with_extremes(bad=NO_SCORE),
                   vmin=0, vmax=100, aspect="auto")
    ticks = [f"{n // 1024}k" if n % 1024 == 0 else f"{n / 1000:g}k" if n >= 1000 else str(n) for n in lengths]
    ax.set_xticks(range(len(lengths)), ticks, rotation=45 * (len(lengths) > 6))
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set(xlabel="Context length (tokens)", ylabel="Needle depth (%)")
    for (i, j), v in np.ndenumerate(grid if len(lengths) <= 12 and len(depths) <= 12 else []):
        if not np.isnan(v):  # white on the colormap's dark ends
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize="small",
                    color="white" if v < 20 or v > 80 else "black")
    return im


def niah_colorbar(fig, images: list, ax) -> None:
    """The score colorbar beside ``ax`` (an axes or array of them) and, when a heatmap has a grey cell, its legend."""
    images = [im for im in images if im is not None]
    if images:
        fig.colorbar(images[0], ax=ax, label="Score (ROUGE-1 recall × 100)", shrink=0.8)
    if any(np.ma.count_masked(im.get_array()) for im in images):
        fig.legend(handles=[Patch(color=NO_SCORE, label="no scored sample")], loc="outside upper right")
