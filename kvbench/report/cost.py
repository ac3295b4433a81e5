"""The ``cost`` artifact: what each job's compression cost, beside the plain prefill it replaces.

A method that scores by reconstructing the context (KVzip) runs about three prefills, one that scores inside the
prefill (SnapKV) one: the table shows both at their price. Per job, from its records on the samples it shares
with the full-cache job of the same task and model key (``method=full``; without one, its own records):

* ``prefill + compress ÷ plain``: Σ (prefill_s + compress_s) over those samples ÷ Σ the full-cache job's
  prefill_s on them (without a full-cache job, ÷ the job's own prefill_s: a prefill without compression);
* ``reconstruct ms``: the reconstruction forwards inside ``compress_s`` (``reconstruct_s``; 0 for other methods);
* ``cache MiB``: the bytes the cache holds after compression (all layers, ``cache_bytes_after``), and
  ``÷ full``: over the full-cache job's on the same samples.
Timings compare on one device only: jobs on other devices or dtypes have other model keys.
"""

import pandas as pd

from kvbench.report.data import FULL, budget_cell, paper_order, samples
from kvbench.report.tables import Artifact

COLUMNS = ["prefill_s", "compress_s", "reconstruct_s", "cache_bytes_after"]


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
        fulls = [j for j, name in zip(jobs["job"], jobs["method_name"]) if name == FULL and len(per[j])]
        ref = per[max(fulls, key=lambda j: len(per[j]))] if fulls else None
        if ref is None:
            notes.append(f"no full-cache job: {task} {mk}: relative to each job's own prefill (compression excluded)")
        for r in jobs.itertuples():
            own = per[r.job]
            base = own if ref is None else ref
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
    caption = ("Cost of compression: mean prefill, compression and (inside it) reconstruction time per sample, "
               "prefill + compression over a plain prefill (the full-cache job's on the same samples), "
               "cache bytes after compression and their share of the full cache's; n: the samples compared")
    return [Artifact("cost", caption, pd.DataFrame(rows), notes=notes, used=pd.concat(used))]
