"""Decode step time vs prompt length, full vs 25 % cache (SnapKV at a retention ratio of 0.25). The per-length table
reuses the engine benchmark's runs; the target (benchmarks/README.md) is judged on full and 25 % alternating."""

from __future__ import annotations

import statistics

from .common import MB, RATIO_25, BenchResult, Context, Target

NAME = "decode"
TITLE = "Decode: step time vs prompt length, full vs 25 % cache"
CONFIGS = [("full", "full", 1.0), ("25%", "snapkv", RATIO_25)]  # (label, method, budget)


def step_bytes(r: dict) -> int:
    """Bytes a decode step must read at least: the weights and the whole (compressed) cache."""
    return r["weight_bytes"] + r["cache_bytes_after"]


def judge(rounds: list[dict[str, dict]]) -> tuple[float, float, list[float], Target]:
    """Speed-up of the 25 % cache over full (median of the rounds' ratios of ``decode_step_ms``)
    against the bytes ratio of the first round; returns ``(speedup, bytes_ratio, ratios, target)``."""
    ratios = [r["full"]["decode_step_ms"] / r["25%"]["decode_step_ms"] for r in rounds]
    speedup = statistics.median(ratios)
    bytes_ratio = step_bytes(rounds[0]["full"]) / step_bytes(rounds[0]["25%"])
    n = rounds[0]["full"]["prompt_tokens"]
    return speedup, bytes_ratio, ratios, Target(
        f"25% cache decode speed-up over full at {n} tokens", f"{speedup:.2f}× (rounds: "
        f"{', '.join(f'{x:.2f}' for x in ratios)})", f"≥ {bytes_ratio:.2f}× (bytes read per step, full / 25 %)",
        speedup >= bytes_ratio)


def run(ctx: Context) -> BenchResult:
    s = ctx.settings
    res = BenchResult(NAME, TITLE, headers=["prompt tokens", "full ms/step", "25% ms/step", "speed-up",
                                            "bytes ratio", "full decode MB", "25% decode MB"])
    for n in s.lengths:  # the engine benchmark's runs
        full, comp = (ctx.worker([(m, m, b)], n)[0][m] for _, m, b in CONFIGS)
        res.rows.append([full["prompt_tokens"], full["decode_step_ms"], comp["decode_step_ms"],
                         full["decode_step_ms"] / comp["decode_step_ms"], step_bytes(full) / step_bytes(comp),
                         full["decode_mem_bytes"] / MB, comp["decode_mem_bytes"] / MB])
    rounds = ctx.worker(CONFIGS, s.long, rounds=2 if s.quick else 3)
    speedup, bytes_ratio, ratios, target = judge(rounds)
    res.targets.append(target)
    res.tables.append({
        "title": f"Full and 25 % cache alternating in one process at {s.long} tokens (the target is judged on these)",
        "headers": ["round", "full ms/step", "25% ms/step", "speed-up (full / 25 %)"],
        "rows": [[i + 1, r["full"]["decode_step_ms"], r["25%"]["decode_step_ms"], ratios[i]]
                 for i, r in enumerate(rounds)],
    })
    res.data = {"rounds": rounds, "speedup": speedup, "bytes_ratio": bytes_ratio, "speedup_rounds": ratios}
    res.notes.append(f"ms/step = median time of a decode step (the first left out); {s.new_tokens} generated tokens; "
                     f"bytes ratio = (weights + full cache) / (weights + 25 % cache), weights "
                     f"{rounds[0]['full']['weight_bytes'] / MB:.0f} MB; decode MB = the largest resident memory "
                     "between decode steps.")
    return res
