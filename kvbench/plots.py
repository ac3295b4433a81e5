"""NIAH heatmaps, shared by a job (its ``heatmap.png``) and the reports. Matplotlib runs headless (Agg)."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

plt.rcParams["figure.max_open_warning"] = 0  # a report holds one figure per NIAH job before writing
SCORE_LABEL = "Score (ROUGE-1 recall × 100)"


def niah_grid(records: Iterable[dict]) -> tuple[list[int], list[float], np.ndarray]:
    """Mean score per cell of NIAH records: ``(lengths, depths, grid)``, ``grid`` of shape
    ``(len(depths), len(lengths))`` in points (0-100), NaN where a cell has no successful record.
    Records need ``meta.context_length`` (tokens) and ``meta.depth_percent``; failed ones are skipped."""
    rows = [(int(r["meta"]["context_length"]), float(r["meta"]["depth_percent"]),
             None if r.get("error") is not None or r.get("score") is None else 100.0 * float(r["score"]))
            for r in records if {"context_length", "depth_percent"} <= set(r.get("meta") or {})]
    if not rows:
        return [], [], np.empty((0, 0))
    cells = pd.DataFrame(rows, columns=["length", "depth", "score"]).astype(float).pivot_table(
        index="depth", columns="length", values="score", aggfunc="mean", dropna=False)
    lengths, depths = sorted({r[0] for r in rows}), sorted({r[1] for r in rows})
    return lengths, depths, cells.reindex(index=depths, columns=lengths).to_numpy(dtype=float)


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else (f"{n / 1000:g}k" if n >= 1000 else str(n))


def draw_niah_heatmap(ax, records: Iterable[dict], title: str = "", labels: bool = True):
    """Draw a depth × length heatmap (0-100, grey = no score, values printed up to 12 × 12 cells) on
    ``ax``; returns the image for a colorbar, or None when no record carries NIAH metadata."""
    lengths, depths, grid = niah_grid(records)
    ax.set_title(title, fontsize=9)
    if not lengths:
        ax.text(0.5, 0.5, "no NIAH records", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return None
    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")
    im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto")
    ax.set_xticks(range(len(lengths)), [_tokens(n) for n in lengths], fontsize=7, rotation=45)
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
    if labels:
        ax.set_xlabel("Context length (tokens)")
        ax.set_ylabel("Needle depth (%)")
    if len(lengths) <= 12 and len(depths) <= 12:
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=6)
    return im


def plot_niah_heatmap(records: Iterable[dict], path: str | Path, title: str) -> Path | None:
    """Write one job's NIAH heatmap to ``path`` (a ``.png`` also gets a ``.pdf`` beside it); None
    (nothing written) when no record carries NIAH metadata."""
    records = list(records)
    lengths, depths, _ = niah_grid(records)
    if not lengths:
        return None
    fig, ax = plt.subplots(figsize=(max(4.8, 1.6 + 0.8 * len(lengths)), max(3.2, 1.4 + 0.4 * len(depths))),
                           layout="constrained")
    fig.colorbar(draw_niah_heatmap(ax, records, title), ax=ax, label=SCORE_LABEL)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    if path.suffix == ".png":
        fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)
    return path
