"""Engine configurations in a fresh process: ``python -m benchmarks.worker '<json spec>'``.

Runs whose memory or decode speed is reported run here, so that no other configuration's heap
or allocator pools enter their numbers. The worker loads the model, builds and warms up one
engine per configuration, then runs them in turn for ``rounds`` rounds (an A/B in one process
sees the same machine state on both sides) and prints ``BENCH_JSON [{label: measurements}, ...]``.
Decode steps are seen through a forward pre-hook on the decoder (a one-token forward is a step).
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

from .common import MARKER, Settings, build_method, build_prompt, load


def release_freed_memory() -> bool:
    """``gc.collect()`` and glibc's ``malloc_trim(0)``; False where there is no glibc."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
        return True
    except (AttributeError, OSError):
        return False


def _mem_now(device) -> int:
    """Bytes in use now: CUDA allocated bytes, else the resident set size."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(engine, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """One ``engine.generate(ids, new_tokens, stop_ids=[])``: the :class:`kvbench.engine.GenerationResult`
    record plus ``decode_step_ms`` (median from one step's start to the next, the first left out),
    ``rss_after_load_bytes`` (before the sample), ``prefill_peak_bytes`` (prefill + compression),
    ``decode_mem_bytes`` (largest between decode steps), ``peak_bytes``, ``weight_bytes`` and
    ``kept_tokens_mean`` / ``stored_tokens_mean`` (logical kept vs stored slots per KV head). Peaks
    restart before the sample; freed heap is returned to the system before it and before decoding.
    """
    import torch

    from kvbench.engine import peak_memory_bytes, reset_peak_rss

    loaded = engine.loaded
    dev = loaded.device
    decoder = getattr(loaded.model, "model", loaded.model)
    starts: list[float] = []
    mem = {"prefill_peak": 0, "decode": 0}

    def on_forward(_module, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        if x is None or x.shape[1] != 1:
            return
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if not starts:  # prefill and compression are over
            mem["prefill_peak"] = peak_memory_bytes(dev)
            release_freed_memory()
        mem["decode"] = max(mem["decode"], _mem_now(dev))
        starts.append(time.perf_counter())

    release_freed_memory()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        reset_peak_rss()
    after_load = _mem_now(dev)
    handle = decoder.register_forward_pre_hook(on_forward, with_kwargs=True)
    try:
        res = engine.generate(ids, new_tokens, stop_ids=[])
    finally:
        handle.remove()
    steps = [b - a for a, b in itertools.pairwise(starts[1:])]
    mean = res.decode_s / max(1, res.generated_tokens - 1)
    return {
        **res.record(),
        "decode_step_ms": 1000 * (statistics.median(steps) if len(steps) >= 2 else mean),
        "rss_after_load_bytes": after_load,
        "prefill_peak_bytes": mem["prefill_peak"] or peak_memory_bytes(dev),
        "decode_mem_bytes": mem["decode"] or _mem_now(dev),
        "peak_bytes": peak_memory_bytes(dev),
        "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "kept_tokens_mean": res.kept_tokens.get("mean"),
        "stored_tokens_mean": res.stored_tokens.get("mean"),
    }


def run(spec: dict[str, Any]) -> list[dict[str, dict]]:
    """Run ``spec``: ``settings``, ``configs`` (``[[label, method, budget], ...]``), ``n`` (prompt
    tokens), ``new_tokens``, ``rounds``. Returns one ``{label: measure(...)}`` per round."""
    from kvbench.engine import Engine

    settings = Settings(**spec["settings"])
    loaded = load(settings)
    ids = build_prompt(loaded.tokenizer, int(spec["n"]))[1]
    engines = {label: Engine(loaded, build_method(method, loaded.layout), budget)
               for label, method, budget in spec["configs"]}
    for engine in engines.values():
        engine.generate(ids[:256], 2, stop_ids=[])  # warm-up: lazy inits
        if hasattr(engine, "last_state"):
            engine.last_state = None  # the warm-up's cache is not part of the baseline
    return [{label: measure(engine, ids, int(spec["new_tokens"])) for label, engine in engines.items()}
            for _ in range(int(spec["rounds"]))]


if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    print(MARKER + json.dumps(run(json.loads(sys.argv[1]))), flush=True)
