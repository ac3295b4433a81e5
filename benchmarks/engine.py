"""Engine: prefill, compression and decode time and peak memory vs prompt length, ``full`` and
``snapkv`` (``conf/method/snapkv.yaml`` at 25 %). No target.
"""

from __future__ import annotations

from .common import MB, RATIO_25, BenchResult, Context

NAME = "engine"
TITLE = "Engine: prefill / compression / decode time and peak memory vs prompt length"
METHODS = [("full", 1.0), ("snapkv", RATIO_25)]


def run(ctx: Context) -> BenchResult:
    res = BenchResult(NAME, TITLE, headers=["method", "budget", "prompt tokens", "prefill s", "compress s", "decode s",
                                            "ms/step", "cache MB before", "cache MB after", "peak MB"])
    for method, budget in METHODS:
        for n in ctx.settings.lengths:
            r = ctx.worker([(method, method, budget)], n)[0][method]
            res.data.setdefault("runs", []).append(dict(r, method=method, budget=budget))
            res.rows.append([method, budget, r["prompt_tokens"], r["prefill_s"], r["compress_s"], r["decode_s"],
                             r["decode_step_ms"], r["cache_bytes_before"] / MB, r["cache_bytes_after"] / MB,
                             r["peak_bytes"] / MB])
    res.notes.append(f"{ctx.settings.new_tokens} generated tokens per sample; ms/step = median time of a decode step; "
                     "peak = the sample's peak resident memory (CUDA: allocated), model included.")
    return res
