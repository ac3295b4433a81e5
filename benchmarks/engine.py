"""Engine: prefill, compression and decode time and peak memory vs context length, ``full`` and ``snapkv``.

Each (method, length) runs in a fresh worker process (:mod:`benchmarks.worker`): one warm-up
on a short prompt, then one sample of ``n`` prompt tokens and ``new_tokens`` generated tokens
(stop tokens disabled). SnapKV runs with its Hydra node (``conf/method/snapkv.yaml``) at a
retention ratio of 25 %. No targets (issue 2's benchmark): the table is the result.
"""

from __future__ import annotations

from .common import MB, RATIO_25, BenchResult
from .context import Context

NAME = "engine"
TITLE = "Engine: prefill / compression / decode time and peak memory vs context length"
METHODS = [("full", 1.0), ("snapkv", RATIO_25)]


def run(ctx: Context) -> BenchResult:
    res = BenchResult(
        NAME, TITLE,
        headers=["method", "budget", "prompt tokens", "prefill s", "compress s", "decode s",
                 "mean ms/step (with probes)", "median ms/step", "cache MB before", "cache MB after", "peak RSS MB"],
    )
    runs = []
    for method, budget in METHODS:
        for n in ctx.settings.lengths:
            r = ctx.engine_run(method, budget, n)
            runs.append(r)
            res.rows.append([
                method, budget, r["prompt_tokens"], r["prefill_s"], r["compress_s"], r["decode_s"],
                r["decode_step_ms"], r.get("decode_step_median_ms"),
                r["cache_bytes_before"] / MB, r["cache_bytes_after"] / MB, r["peak_bytes"] / MB,
            ])
    res.data["runs"] = runs
    res.notes.append(
        f"{ctx.settings.new_tokens} generated tokens per sample; mean ms/step (with probes) = decode s / (tokens - 1) "
        "(the first token comes from prefill; the worker's memory probes, a gc.collect and malloc_trim before "
        "the first step, are inside decode s, so short runs show it well above the median); median ms/step = median of the per-step times without the first "
        "(what the decode benchmark uses); peak RSS is the sample's peak resident memory (model included; "
        "restarted after the worker's load and warm-up, whose own peak is startup_peak_bytes in the JSON)."
    )
    return res
