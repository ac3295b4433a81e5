"""Long generation (issue #46.8): a 2,048-token generation on a short prompt, full cache vs decode-time
compression (SnapKV, budget 256 tokens, interval 128): decode tokens/s over the whole generation and from
token 1,024 on, the share of decode time spent compressing, and the peak stored cache bytes at half and at the
whole length (flat when compressed). Both run alternately in one process."""

from __future__ import annotations

import itertools
import time

from .common import MB, BenchResult, Context, Target, build_method, build_prompt

NAME = "thinking"
TITLE = "Long generation: full cache vs decode-time compression (budget 256, interval 128)"
BUDGET, INTERVAL, PROMPT = 256, 128, 64


def generation(engine, ids: list[int], new_tokens: int) -> dict:
    """One generation of ``new_tokens`` (stop tokens off): decode tok/s over it and over its second half, the
    compression share of decode time, the peak stored bytes over its first half and over all of it."""
    starts: list[float] = []
    engine.on_decode_step = lambda step: starts.append(time.perf_counter())
    try:
        res = engine.generate(ids, new_tokens, stop_ids=[])
    finally:
        engine.on_decode_step = None
    steps = [b - a for a, b in itertools.pairwise(starts)]
    late = steps[len(steps) // 2:]
    half = [p[2] for p in res.cache_trace if p[0] <= new_tokens // 2]
    return {"tok_s": res.decode_tok_s, "late_tok_s": len(late) / sum(late),
            "compress_share": res.decode_compress_s / res.decode_s, "decode_compressions": res.decode_compressions,
            "peak_half_bytes": max(half) if res.decode_compressions else None,  # full: no point mid-way
            "peak_bytes": max(p[2] for p in res.cache_trace)}


def run(ctx: Context) -> BenchResult:
    from kvbench.job.config import Decode
    from kvbench.engine.generate import Engine

    new = 512 if ctx.settings.quick else 2048
    loaded = ctx.loaded
    ids = build_prompt(loaded.tokenizer, PROMPT)[1]
    engines = {"full": Engine(loaded, build_method("full", loaded.layout), 1.0),
               "decode-time": Engine(loaded, build_method("snapkv", loaded.layout), BUDGET, Decode(interval=INTERVAL))}
    for engine in engines.values():
        engine.generate(ids, 8, stop_ids=[])  # warm-up
    rounds = [{label: generation(e, ids, new) for label, e in engines.items()} for _ in range(1 if ctx.settings.quick else 2)]
    best = {label: max((r[label] for r in rounds), key=lambda x: x["late_tok_s"]) for label in engines}
    res = BenchResult(NAME, TITLE, headers=["cache", "decode tok/s", f"tok/s after {new // 2}", "compression share",
                                            "compressions", f"peak stored MB ({new // 2})", f"peak stored MB ({new})"])
    for label, m in best.items():
        res.rows.append([label, m["tok_s"], m["late_tok_s"], m["compress_share"], m["decode_compressions"],
                         m["peak_half_bytes"] and m["peak_half_bytes"] / MB, m["peak_bytes"] / MB])
    full, comp = best["full"], best["decode-time"]
    res.targets += [
        Target("share of decode time spent compressing", f"{comp['compress_share']:.3f}", "≤ 0.10",
               comp["compress_share"] <= 0.10),
        Target(f"compressed decode speed after {new // 2} generated tokens, over full", f"{comp['late_tok_s'] / full['late_tok_s']:.2f}×",
               "≥ 1.00×", comp["late_tok_s"] >= full["late_tok_s"]),
        Target("peak stored bytes, whole generation over its first half (compressed)",
               f"{comp['peak_bytes'] / comp['peak_half_bytes']:.2f}×", "≤ 1.00×", comp["peak_bytes"] <= comp["peak_half_bytes"]),
    ]
    res.data = {"rounds": rounds, "new_tokens": new, "prompt_tokens": len(ids)}
    res.notes.append(f"{len(ids)}-token prompt, {new} generated tokens (stop tokens off), the better of "
                     f"{len(rounds)} alternating round(s); stored bytes = the whole cache (cache_trace).")
    return res
