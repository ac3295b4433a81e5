"""Accuracy against stored KV-cache bytes: eviction (budgets), quantization (``cache.bits``) and both on one axis.

A job's point is its average score (the mean of its datasets' scores) at its stored cache: ``cache_bytes_after`` /
``cache_bytes_before``, the bytes every layer holds after eviction and quantization (packed codes, scales, minima,
full-precision residual) relative to the whole prompt's cache in the model dtype, mean over samples (docs/RESULTS.md).
"""

import json

import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvbench.report.data import budget_cell, method_sort_key
from kvbench.report.tables import Artifact, _figure, count, draw_lines

DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
STYLE = {32: ("o", "-"), 16: ("o", "-"), 8: ("D", "--"), 4: ("s", "--"), 2: ("^", ":")}  # bits -> marker, line


def job_points(df: pd.DataFrame, column: str = "cache_bytes_after") -> pd.DataFrame:
    """A row per scored job and panel (``table_key``: its model key but ``cache.*``): task, method, variant,
    method_name, bits (``cache.bits``, else the model dtype's; NaN unknown), quantized, layout (``G<group_size>,
    R<residual>``), budget, score (mean over its datasets), size (``column``: the stored cache, or ``read_bytes``, % of
    the model-dtype cache), complete."""
    rows = df[df["score"].notna() & (df["cache_bytes_before"] > 0) & df[column].notna()]
    if rows.empty:
        return pd.DataFrame()
    settings = rows["settings"].map(json.loads)
    rows = rows.assign(
        quantized=rows["bits"].notna(),
        bits=rows["bits"].fillna(settings.map(lambda s: DTYPE_BITS.get(s.get("env.dtype"))).astype(float)),
        layout=settings.map(lambda s: f"G{s['cache.group_size']}, R{s['cache.residual']}" if "cache.bits" in s else ""))
    keys = ["job", "task", "table_key", "method", "variant", "method_name", "bits", "quantized", "layout", "budget"]
    pts = rows.groupby(keys, dropna=False).agg(score=("score", "mean"), before=("cache_bytes_before", "mean"),
                                               after=(column, "mean"), complete=("complete", "all"))
    return pts.reset_index().assign(size=lambda p: 100 * p["after"] / p["before"]).drop(columns=["before", "after"])


def accuracy_vs_bytes(df: pd.DataFrame, read: bool = False) -> list[Artifact]:
    """The figure ``accuracy_vs_bytes`` (a panel per task × model; a curve per method and cache width through its
    budgets; hollow: an unfinished job) and the table ``accuracy_vs_bytes_points`` of its points; [] without jobs.
    ``read``: ``accuracy_vs_read_bytes`` (``_points``), at the bytes read per decode step."""
    pts = job_points(df, "read_bytes" if read else "cache_bytes_after")
    name = "accuracy_vs_read_bytes" if read else "accuracy_vs_bytes"
    if pts.empty:
        return []
    layouts = pts[pts["quantized"]].groupby(["task", "table_key"])["layout"].nunique()
    pts["curve"] = [f"{r.method}{f' ({r.variant})' if r.variant else ''} · " + (
        f"{r.bits:.0f}-bit" if r.bits == r.bits else "model dtype") + f" ({r.layout})" * bool(
        layouts.get((r.task, r.table_key), 0) > 1 and r.quantized) for r in pts.itertuples()]
    panels = pts[["task", "table_key"]].drop_duplicates().sort_values(["task", "table_key"]).to_numpy()
    fig, axes = _figure(1, len(panels), w=5.2, h=3.8)
    methods = sorted(pts["method"].unique(), key=lambda m: method_sort_key(pts.loc[pts["method"] == m, "method_name"].iat[0], m))
    colors = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for ax, (task, model) in zip(axes[0], panels):
        mine = pts[(pts["task"] == task) & (pts["table_key"] == model)]
        ax.set_xscale("log")
        curves = sorted(mine.groupby("curve"), key=lambda kv: (methods.index(kv[1]["method"].iat[0]), -kv[1]["bits"].iat[0]))
        draw_lines(ax, {k: c.set_index("size")["score"].sort_index() for k, c in curves},
                   hollow={k: c.loc[~c["complete"], "size"].tolist() for k, c in curves},
                   styles={k: dict(zip(("marker", "linestyle"), STYLE.get(c["bits"].iat[0], ("x", "-."))),
                                   color=colors[c["method"].iat[0]]) for k, c in curves})
        ax.xaxis.set(major_locator=LogLocator(subs=(1, 2, 5)), major_formatter=FuncFormatter(lambda x, _: f"{x:g}%"),
                     minor_formatter=NullFormatter())
        ax.set(title=f"{task} — {model}", ylabel="Average score (points)",
               xlabel=f"{'Read per step' if read else 'Stored'} KV cache (% of the full cache in the model dtype)")
    caption = (f"Score against the KV-cache bytes every layer's attention read per decode step ({count(len(pts), 'job')}; "
               "read_bytes / cache_bytes_before, mean over samples; log scale); " if read else
               f"Score against stored KV-cache bytes ({count(len(pts), 'job')}): all layers after eviction and "
               "quantization (packed codes, scales, minima, full-precision residual) relative to the whole prompt's "
               "cache in the model dtype (cache_bytes_after / cache_bytes_before, mean over samples; log scale); "
               "score: the mean of a job's datasets; a curve per method and cache width (cache.bits, else the model "
               "dtype) through its budgets; hollow: an unfinished job.")
    used = df[df["job"].isin(pts["job"])]
    table = pts.sort_values(["task", "table_key", "method", "bits", "layout", "size"]).assign(
        Budget=lambda p: [budget_cell(n, b, "–") for b, n in zip(p["budget"], p["method_name"])],
        Bits=lambda p: [f"{b:.0f}" + (f" ({g})" if q else " (dtype)") if b == b else "dtype"
                        for b, q, g in zip(p["bits"], p["quantized"], p["layout"])])
    data = table.rename(columns={"task": "Task", "table_key": "Model", "method": "Method", "size": "Cache %", "score": "Score"})[
        ["Task", "Model", "Method", "Bits", "Budget", "Cache %", "Score"]].reset_index(drop=True)
    return [Artifact(name, caption, fig=fig, used=used),
            Artifact(f"{name}_points", f"The points of {name}: " + caption[0].lower() + caption[1:], data, used=used)]
