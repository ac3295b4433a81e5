"""Throughput at a memory cap (issue #58, the shape of R-KV's 6.6× claim): at a cache cap where the full cache fits
B rows of a long generation, how many rows fit with decode-time compression (R-KV and SnapKV, budget 10 % of the
generated length) and their generated tokens/s, each batch decoded together (``Engine.decode_rows``), one run.

Rows of one batch are sampled candidates of one short prompt (temperature 0.6, stop tokens off), as a reasoning
preset decodes them; a row's peak cache is its prompt and generation (full) or ``budget + interval`` tokens per KV
head (compressed; the budget at least the method's floor, SnapKV's window; the prompt is shorter than the budget), so
the rows that fit the cap are analytic, and the measured peak stored bytes of the rows (``cache_trace``) are checked
against it.

Also the full cache's generated tokens/s at batch 1, 2, 4 and 8 (no cap), stored in ``benchmarks/rates.json`` under
``<model> on <device>`` with the machine and date: the decode rates ``kvbench plan`` turns a sweep's tokens into hours.
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks.common import MB, ROOT, BenchResult, Context, Target, build_method, build_prompt, machine_info

NAME = "throughput"
TITLE = "Throughput at a cache cap: full cache vs decode-time compression (budget 10 % of the generation)"
PROMPT, FULL_ROWS = 64, 2
RATES, BATCHES = ROOT / "benchmarks" / "rates.json", (1, 2, 4, 8)


def run_batch(engine, ids: list[int], rows: int, new: int) -> dict:
    """``rows`` candidates of ``new`` tokens decoded as one batch: generated tokens/s (wall) and the rows' summed
    peak stored bytes."""
    from kvbench.engine.generate import Row
    from kvbench.job.config import Sampling

    ctx, out = engine.open(ids, new), []
    batch = [Row(engine.fork(ctx), new, [], 0, torch.Generator().manual_seed(k)) for k in range(rows)]
    t0 = time.perf_counter()
    engine.decode_rows(batch, rows, Sampling(n=rows, temperature=0.6), lambda row, result: out.append(result))
    wall = time.perf_counter() - t0
    return {"rows": rows, "tok_s": sum(r.generated_tokens for r in out) / wall, "wall_s": wall,
            "peak_bytes": sum(max(p[2] for p in r.cache_trace) for r in out)}


def measure(loaded, ids: list[int], new: int, full_rows: int = FULL_ROWS) -> dict:
    """At the cap that holds the full cache of ``full_rows`` rows of ``ids`` + ``new`` tokens: per cache (full, R-KV,
    SnapKV at 10 % of ``new``, interval ``new`` / 32) the rows that fit and :func:`run_batch`'s measurements."""
    from kvbench.engine.generate import Engine
    from kvbench.job.config import Decode

    lay, budget, interval = loaded.layout, new // 10, new // 32
    token = 2 * lay.num_kv_heads * lay.head_dim * loaded.model.dtype.itemsize * lay.num_layers  # K and V, all layers
    cap = full_rows * token * (len(ids) + new)
    engines = {"full": Engine(loaded, build_method("full", lay), 1.0)}
    for name in ("rkv", "snapkv"):
        engines[name] = Engine(loaded, build_method(name, lay), budget, Decode(interval=interval, schedule="length"))
    for engine in engines.values():
        run_batch(engine, ids, 2, 8)  # warm-up
    held = {label: max(budget, engine.method.min_budget()) + interval for label, engine in engines.items()}
    measured = {label: run_batch(engine, ids, full_rows if label == "full" else cap // (token * held[label]), new)
                for label, engine in engines.items()}  # a budget under the method's floor (window) keeps the floor
    return {"measured": measured, "cap_bytes": cap, "new_tokens": new, "prompt_tokens": len(ids), "budget": budget,
            "interval": interval}


def run(ctx: Context) -> BenchResult:
    from kvbench.engine.generate import Engine

    loaded, new = ctx.loaded, 256 if ctx.settings.quick else 1024
    ids = build_prompt(loaded.tokenizer, PROMPT)[1]
    res = BenchResult(NAME, TITLE, headers=["cache", "rows at the cap", "generated tok/s", "over full",
                                            "peak stored MB (rows)", "cap MB"])
    data = measure(loaded, ids, new)
    measured, cap = data["measured"], data["cap_bytes"]
    for label, m in measured.items():
        res.rows.append([label, m["rows"], m["tok_s"], m["tok_s"] / measured["full"]["tok_s"], m["peak_bytes"] / MB,
                         cap / MB])
    cuda = loaded.device.type == "cuda"
    for label in ("rkv", "snapkv"):
        ratio = measured[label]["tok_s"] / measured["full"]["tok_s"]
        res.targets += [
            Target(f"{label} tokens/s over full at the cap", f"{ratio:.2f}×", "≥ 5.00×" if cuda else "> 1.00×",
                   ratio >= 5 if cuda else ratio > 1),
            Target(f"{label}: the rows' peak stored bytes within the cap", f"{measured[label]['peak_bytes'] / MB:.1f} MB",
                   f"≤ {cap / MB:.1f} MB", measured[label]["peak_bytes"] <= cap)]
    full = Engine(loaded, build_method("full", loaded.layout), 1.0)
    rates = {str(b): round(run_batch(full, ids, b, new)["tok_s"], 2) for b in BATCHES}
    res.rows += [[f"full, batch {b}", int(b), tok_s, "", "", ""] for b, tok_s in rates.items()]
    machine = machine_info(ctx.settings)
    table = json.loads(RATES.read_text()) if RATES.is_file() else {}
    table[f"{ctx.settings.model} on {ctx.settings.device}"] = {
        "tok_s": rates, "device": machine["gpu"] or f"{machine['cpu']}, torch threads {machine['torch_threads']}",
        "date": machine["date"], "prompt_tokens": len(ids), "new_tokens": new, "command": "python -m benchmarks --only "
        f"throughput --model {ctx.settings.model} --device {ctx.settings.device}" + " --quick" * ctx.settings.quick}
    RATES.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    res.data = data | {"rates": rates}
    res.notes.append(f"{len(ids)}-token prompt, {new} generated tokens per row (stop tokens off, temperature 0.6); "
                     f"budget {data['budget']}, interval {data['interval']} (decode.schedule=length); the cap holds the "
                     f"full cache of {FULL_ROWS} rows; tok/s = all rows' tokens over the batch's wall time.")
    return res
