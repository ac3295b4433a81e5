"""Memory per method at 4096 prompt tokens (the longest with --quick/--lengths), budget 25 %, each configuration on
its own (``Context.worker``'s ``live_memory``); targets: benchmarks/README.md. Decode-phase memory is counted above
the process's memory with the model loaded; the free decode slots (the same for every method) are not."""

from __future__ import annotations

from .common import MB, RATIO_25, BenchResult, Context, Target

NAME = "memory"
TITLE = "Memory per method: full vs each method, budget 25 %"
METHODS = ["snapkv", "pyramidkv", "streamingllm", "adakv", "headkv", "lookm", "selkv", "compresskv"]
TOLERANCE, TOLERANCE_BYTES = 0.02, 1e6
TOLERANCE_TEXT = "drop ≥ saved (−max(2 %, 1 MB))"


def drop_suffices(drop: float, saved: float) -> bool:
    """Whether a decode-memory drop covers the saved cache bytes within the tolerance."""
    return drop >= saved - max(TOLERANCE * saved, TOLERANCE_BYTES)


def decode_phase_bytes(r: dict) -> int:
    """Decode-phase memory above the process's baseline (model loaded, before the sample)."""
    return r["decode_mem_bytes"] - r["rss_after_load_bytes"]


def run(ctx: Context) -> BenchResult:
    s = ctx.settings
    res = BenchResult(NAME, TITLE, headers=["method", "prompt tokens", "kept/head", "stored/head", "stored/kept bytes", "cache MB after",
                                            "saved MB", "prefill+compress peak MB", "decode MB above load",
                                            "drop vs full MB", "peak MB"])
    runs: dict[str, dict] = {}
    for name in ["full"] + s.selected(METHODS):
        budget = 1.0 if name == "full" else RATIO_25
        r = runs[name] = ctx.worker([(name, name, budget)], s.long, live_memory=True)[0][name]
        full = runs["full"]
        saved = r["cache_bytes_before"] - r["cache_bytes_after"]
        drop = decode_phase_bytes(full) - decode_phase_bytes(r)
        ratio = r["stored_bytes"] / r["kept_bytes"] if r["kept_bytes"] else None
        res.rows.append([name, r["prompt_tokens"], r["kept_tokens_mean"], r["stored_tokens_mean"], ratio,
                         r["cache_bytes_after"] / MB, saved / MB, r["prefill_peak_bytes"] / MB,
                         decode_phase_bytes(r) / MB, drop / MB, r["peak_bytes"] / MB])
        if name != "full":
            res.targets.append(Target(
                f"{name}: decode memory drop vs full at {r['prompt_tokens']} tokens ≥ cache bytes saved",
                f"{drop / MB:.1f} MB dropped, {saved / MB:.1f} MB saved" + (f" ({drop / saved:.3f}×)" if saved else ""),
                TOLERANCE_TEXT, drop_suffices(drop, saved)))
        if name in ("adakv", "headkv"):
            res.targets.append(Target(f"{name}: stored / kept bytes", f"{ratio or 0:.3f}", "≤ 1.05", (ratio or 9) <= 1.05))
    res.data = {"runs": runs, "budget": RATIO_25}
    res.notes.append("MB = 10^6 bytes; each row its own engine, freed before the next; kept/stored = tokens per KV head, mean over the "
                     "compressible layers; peaks are the sample's, model included.")
    return res
