"""What compression costs: time (the ``cost`` table) and bytes (``accuracy_vs_bytes``).

``cost``: a method that scores by reconstructing the context (KVzip) runs about three prefills, one that scores inside
the prefill (SnapKV) one: the table shows both at their price. Per job, from its records on the samples it shares
with the full-cache job of the same task and model key (``method=full``; without one, its own records):

* ``prefill + compress ÷ plain``: Σ (prefill_s + compress_s) over those samples ÷ Σ the full-cache job's
  prefill_s on them (without a full-cache job, ÷ the job's own prefill_s: a prefill without compression);
* ``reconstruct ms``: the reconstruction forwards inside ``compress_s`` (``reconstruct_s``; 0 for other methods);
* ``cache MiB``: the bytes the cache holds after compression (all layers, ``cache_bytes_after``), and
  ``÷ full``: over the full-cache job's on the same samples.
Timings compare on one device only: jobs on other devices or dtypes have other model keys.

``accuracy_vs_bytes``: eviction (budgets), quantization (``cache.bits``) and both on one axis. A job's point is its
average score (the mean of its datasets' scores) at its stored cache: ``cache_bytes_after`` / ``cache_bytes_before``,
the bytes every layer holds after eviction and quantization (packed codes, scales, minima, full-precision residual)
relative to the whole prompt's cache in the model dtype, mean over samples (docs/RESULTS.md).
"""

import json

import pandas as pd
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from kvbench.report.data import FULL, budget_cell, method_sort_key, paper_order, samples
from kvbench.report.tables import Artifact, _figure, count, draw_lines

COLUMNS = ["prefill_s", "compress_s", "reconstruct_s", "cache_bytes_after"]
DTYPE_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}
STYLE = {32: ("o", "-"), 16: ("o", "-"), 8: ("D", "--"), 4: ("s", "--"), 2: ("^", ":")}  # bits -> marker, line


def ratio(part: pd.Series, whole: pd.Series) -> float | None:
    """Σ part ÷ Σ whole over the samples where both are recorded; None when nothing is."""
    both = part.notna() & whole.notna()
    return part[both].sum() / whole[both].sum() if both.any() and whole[both].sum() > 0 else None


def cost_table(df: pd.DataFrame, root) -> list[Artifact]:
    """One table over every task × model key: a row per job (method, variant, budget), full cache first."""
    rows, used, notes = [], [], []
    ordered = paper_order(df.drop_duplicates("job").assign(compressed=df["method_name"] != FULL),
                          ["task", "model_key", "compressed", "method", "variant", "budget"])
    for (task, mk), jobs in ordered.groupby(["task", "model_key"], sort=False):
        recs = samples(jobs, root, ["id", "error", *COLUMNS], latest=True, every=True)  # a job's latest records
        recs = recs[recs["error"].isna()].set_index("id")
        per = {j: recs.loc[recs["job"] == j, COLUMNS].apply(pd.to_numeric, errors="coerce").fillna(
            {"reconstruct_s": 0.0}) for j in jobs["job"]}
        ref = max([per[j] for j in jobs.loc[jobs["method_name"] == FULL, "job"] if len(per[j])], key=len, default=None)
        if ref is None:
            notes.append(f"no full-cache job: {task} {mk}: relative to each job's own prefill (compression excluded)")
        for r in jobs.itertuples():
            own, base = per[r.job], per[r.job] if ref is None else ref
            ids = own.index.intersection(base.index)
            if not len(ids):
                continue
            mine, plain = own.loc[ids], base.loc[ids]
            rows.append({
                "Task": task, "Model": mk, "Method": r.method + (f" ({r.variant})" if r.variant else ""),
                "Budget": budget_cell(r.method_name, r.budget), "n": str(len(ids)),
                "prefill ms": 1e3 * mine["prefill_s"].mean(), "compress ms": 1e3 * mine["compress_s"].mean(),
                "reconstruct ms": 1e3 * mine["reconstruct_s"].mean(),
                "prefill + compress ÷ plain": ratio(mine["prefill_s"] + mine["compress_s"], plain["prefill_s"]),
                "cache MiB": mine["cache_bytes_after"].mean() / 2**20,
                "÷ full": ratio(mine["cache_bytes_after"], plain["cache_bytes_after"]) if ref is not None else None,
            })
        used.append(df[df["job"].isin(jobs["job"])])
    if not rows:
        return []
    fast = [f"{r['Method']} {r['Budget']}" for r in rows if (r["prefill + compress ÷ plain"] or 1) < 1]
    notes += [f"below 1 ({', '.join(fast)}): jobs timed at other moments or loads compare poorly; python -m "
              "kvbench.tools.latency times methods side by side"] * bool(fast)
    caption = ("Cost of compression: mean prefill, compression and (inside it) reconstruction time per sample, "
               "prefill + compression over a plain prefill (the full-cache job's on the same samples), "
               "cache bytes after compression and their share of the full cache's; n: the samples compared")
    return [Artifact("cost", caption, pd.DataFrame(rows), notes=notes, used=pd.concat(used))]


def job_points(df: pd.DataFrame, column: str = "cache_bytes_after") -> pd.DataFrame:
    """A row per scored job and panel (``table_key``: its model key but ``cache.*``): task, method, variant,
    method_name, bits (``cache.bits``, else the model dtype's; NaN unknown), quantized, layout (``G<group_size>,
    R<residual>``), budget, score (mean over its datasets), size (``column``: the stored cache, or ``read_bytes``, % of
    the model-dtype cache), complete."""
    rows = df[df["score"].notna() & (df["cache_bytes_before"] > 0) & df[column].notna()]
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
    panels = pts.groupby(["task", "table_key"])
    fig, axes = _figure(1, panels.ngroups, w=5.2, h=3.8)
    methods = sorted(pts["method"].unique(), key=lambda m: method_sort_key(pts.loc[pts["method"] == m, "method_name"].iat[0], m))
    comp = [m for m in methods if (pts.loc[pts["method"] == m, "method_name"] != FULL).all()]
    colors = {m: f"C{comp.index(m) % 10}" if m in comp else "black" for m in methods}  # as score_vs_budget's lines
    for ax, ((task, model), mine) in zip(axes[0], panels):
        ax.set_xscale("log")
        curves = sorted(mine.groupby("curve"), key=lambda kv: (methods.index(kv[1]["method"].iat[0]), -kv[1]["bits"].iat[0]))
        draw_lines(ax, {k: c.set_index("size")["score"].sort_index() for k, c in curves},
                   hollow={k: c.loc[~c["complete"], "size"].tolist() for k, c in curves},
                   styles={k: dict(zip(("marker", "linestyle"), STYLE.get(c["bits"].iat[0], ("x", "-."))),
                                   color=colors[c["method"].iat[0]]) for k, c in curves})
        ax.xaxis.set(major_locator=LogLocator(subs=(1, 2, 5)), major_formatter=FuncFormatter(lambda x, _: f"{x:g}%"),
                     minor_formatter=NullFormatter())
        ax.set(title=f"{task} — {model}", ylabel="Average score (points)",
               xlabel=f"{'KV read per step' if read else 'Stored KV cache'} (% of the full cache, model dtype)")
    caption = (f"Score against the KV-cache bytes every layer's attention read per decode step ({count(len(pts), 'job')}; "
               "read_bytes / cache_bytes_before, mean over samples; log scale); " if read else
               f"Score against stored KV-cache bytes ({count(len(pts), 'job')}): all layers after eviction and "
               "quantization (packed codes, scales, minima, full-precision residual) relative to the whole prompt's "
               "cache in the model dtype (cache_bytes_after / cache_bytes_before, mean over samples; log scale); ") + (
               "score: the mean of a job's datasets; a curve per method and cache width (cache.bits, else the model "
               "dtype) through its budgets; hollow: an unfinished job; points at one x drawn side by side (exact: the "
               "_points table).")
    used = df[df["job"].isin(pts["job"])]
    table = pts.sort_values(["task", "table_key", "method", "bits", "layout", "size"]).assign(
        Budget=lambda p: [budget_cell(n, b, "–") for b, n in zip(p["budget"], p["method_name"])],
        Bits=lambda p: [f"{b:.0f}" + (f" ({g})" if q else " (dtype)") if b == b else "dtype"
                        for b, q, g in zip(p["bits"], p["quantized"], p["layout"])])
    data = table.rename(columns={"task": "Task", "table_key": "Model", "method": "Method", "size": "Cache %", "score": "Score"})[
        ["Task", "Model", "Method", "Bits", "Budget", "Cache %", "Score"]].reset_index(drop=True)
    return [Artifact(name, caption, fig=fig, used=used),
            Artifact(f"{name}_points", f"The points of {name}: " + caption[0].lower() + caption[1:], data, used=used)]
