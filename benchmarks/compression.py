"""Compression cost per method as a fraction of prefill time, and its scaling with prompt length (targets:
benchmarks/README.md; what the cost counts: the table's note)."""

from __future__ import annotations

from typing import Any

from .common import QUICK_LENGTHS, RATIO_25, BenchResult, Context, Target, build_method, build_prompt, log

NAME = "compression"
TITLE = "Compression cost per method (fraction of prefill time) and scaling with prompt length"
METHODS = ["snapkv", "pyramidkv", "adakv", "headkv", "lookm", "selkv", "compresskv"]
FULL_LENGTHS = [1024, 2048, 4096]
TARGET_FRACTION = 0.05
MAX_EXPONENT = 1.2


def fit_exponent(lengths: list[int], seconds: list[float]) -> float | None:
    """Least-squares slope of log(seconds) on log(length): t ∝ n^slope (None with < 2 positive times)."""
    import numpy as np

    pts = [(n, t) for n, t in zip(lengths, seconds) if t and t > 0]
    if len(pts) < 2:
        return None
    return float(np.polyfit(*np.log(np.array(pts, dtype=float)).T, 1)[0])


def targets(name: str, lengths: list[int], cost: dict[int, float], prefill: dict[int, float]) -> list[Target]:
    """The fraction target at the longest length and the exponent target of one method."""
    n = lengths[-1]
    frac, expo = cost[n] / prefill[n], fit_exponent(lengths, [cost[k] for k in lengths])
    out = [Target(f"{name}: compression / prefill at {n} tokens", f"{100 * frac:.2f} %", f"≤ {TARGET_FRACTION:.0%}",
                  frac <= TARGET_FRACTION)]
    if expo is not None:
        out.append(Target(f"{name}: exponent of compression time vs prompt length", f"{expo:.2f}",
                          f"≈ 1 (≤ {MAX_EXPONENT})", expo <= MAX_EXPONENT))
    return out


def run(ctx: Context) -> BenchResult:
    from kvbench.engine.generate import Engine

    s, loaded = ctx.settings, ctx.loaded
    lengths = s.lengths if s.quick or s.prompt_lengths else FULL_LENGTHS
    engines: dict[str, Any] = {"full": Engine(loaded, build_method("full", loaded.layout), 1.0)}
    failed: dict[str, str] = {}
    for name in s.selected(METHODS):
        try:
            engines[name] = Engine(loaded, build_method(name, loaded.layout), RATIO_25)
        except Exception as e:  # noqa: BLE001 - a method that cannot be built is reported, not timed
            failed[name] = f"not available ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
    for engine in engines.values():  # warm-up
        engine.generate(build_prompt(loaded.tokenizer, QUICK_LENGTHS[0])[1], 1, stop_ids=[])
    prefill: dict[int, float] = {}
    cost: dict[str, dict[int, float]] = {name: {} for name in engines if name != "full"}
    for n in lengths:
        ids = build_prompt(loaded.tokenizer, n)[1]
        for name, engine in engines.items():
            r = engine.generate(ids, 1, stop_ids=[])
            prefill.setdefault(n, r.prefill_s)  # the full cache runs first
            in_prefill = name != "full" and engine.method.wants_prompt_attention(loaded.device)
            if name != "full":
                cost[name][n] = r.compress_s + (max(0.0, r.prefill_s - prefill[n]) if in_prefill else 0.0)
        log(f"compression: n={n}: prefill {prefill[n]:.2f} s; " + ", ".join(f"{k} {v[n] * 1e3:.0f} ms" for k, v in cost.items()))
    res = BenchResult(NAME, TITLE, headers=["method"] + [f"{n} tok: ms (% prefill)" for n in lengths] + ["exponent"],
                      data={"prefill_s": prefill, "compress_s": cost, "failed": failed, "budget": RATIO_25})
    for name, per in cost.items():
        res.rows.append([name] + [f"{per[n] * 1000:.1f} ({100 * per[n] / prefill[n]:.2f} %)" for n in lengths]
                        + [fit_exponent(lengths, [per[n] for n in lengths])])
        res.targets += targets(name, lengths, per, prefill)
    for name, why in failed.items():
        res.rows.append([name, why] + [""] * len(lengths))
        res.targets.append(Target(f"{name}: compression / prefill", "-", f"≤ {TARGET_FRACTION:.0%}", None, why))
    res.rows.append(["(prefill s)"] + [f"{prefill[n]:.2f}" for n in lengths]
                    + [fit_exponent(lengths, [prefill[n] for n in lengths])])
    res.notes.append("compression = the engine's compress_s (plan, per-layer compress, cache write, finalize) plus, "
                     "for a score computed inside the prefill attention (LOOK-M on CPU), the extra prefill time over "
                     "the full cache's; one sample per method and length after a warm-up; budget 25 %.")
    return res
