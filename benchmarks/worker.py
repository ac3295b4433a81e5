"""One engine configuration in a fresh process: ``python -m benchmarks.worker '<json spec>'``.

Peak resident memory (``ru_maxrss``) only grows within a process, so every configuration
whose memory is reported runs here, alone. The spec names the method, budget, prompt length
and generated tokens; the worker loads the model, warms up on a short prompt, runs
``Engine.generate`` once and prints one line ``BENCH_JSON {...}`` with the timings of
:class:`kvbench.engine.GenerationResult` and memory by phase:

* ``rss_after_load_bytes``: resident memory with the model loaded, before the sample;
* ``prefill_peak_bytes``: process peak right after prefill + compression;
* ``decode_mem_bytes``: the largest resident memory seen after a decode step (the decode phase);
* ``peak_bytes``: process peak at the end (prefill + compression + decode, model included).

On CUDA the same fields are CUDA allocator bytes (allocated now / peak allocated).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from .common import Settings, apply_threads, build_method, build_prompt, load, read_bandwidth, rss_now, rss_peak

MARKER = "BENCH_JSON "


def _mem_now(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else rss_now()


def _mem_peak(device) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else rss_peak()


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the configuration ``spec`` (keys: settings, method, overrides, budget, n, new_tokens, bandwidth)."""
    import torch

    from kvbench.engine import Engine

    settings = Settings.from_json(json.dumps(spec["settings"]))
    apply_threads(settings)
    loaded = load(settings)
    dev = loaded.device
    prompt = build_prompt(loaded.tokenizer, int(spec["n"]))
    method = build_method(spec["method"], loaded.layout, **spec.get("overrides", {}))
    engine = Engine(loaded, method, spec["budget"])
    engine.generate(prompt.ids[: min(256, len(prompt.ids))], 2, stop_ids=[])  # warm-up: lazy inits, kernels
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    after_load = _mem_now(dev)

    phases: dict[str, list[int]] = {"prefill_peak": [], "decode": []}

    def hook(module, args, kwargs, output):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[-1] > 1:
            phases["prefill_peak"].append(_mem_peak(dev))
        else:
            phases["decode"].append(_mem_now(dev))

    handle = loaded.model.register_forward_hook(hook, with_kwargs=True)
    try:
        res = engine.generate(prompt.ids, int(spec["new_tokens"]), stop_ids=[])
    finally:
        handle.remove()
    peak = _mem_peak(dev)
    steps = max(1, res.generated_tokens - 1)  # decode forwards (the first token comes from prefill)
    out = {
        "method": spec["method"],
        "budget": spec["budget"],
        "n_requested": int(spec["n"]),
        **res.record(),
        "decode_step_ms": 1000 * res.decode_s / steps if res.generated_tokens > 1 else None,
        "rss_after_load_bytes": after_load,
        "prefill_peak_bytes": max(phases["prefill_peak"] or [0]),
        "decode_mem_bytes": max(phases["decode"] or [0]),
        "peak_bytes": peak,
        "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "threads": torch.get_num_threads(),
    }
    if spec.get("bandwidth"):
        out["read_bandwidth_Bps"] = read_bandwidth(settings.device)
    return out


def main(argv: list[str]) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    spec = json.loads(argv[1])
    result = run(spec)
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
