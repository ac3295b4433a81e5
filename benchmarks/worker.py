"""One engine configuration in a fresh process: ``python -m benchmarks.worker '<json spec>'``.

(A spec with ``configs`` instead runs a decode A/B in one process, :func:`run_pair`.)

Every configuration whose memory is reported runs here, alone, so that no other
configuration's heap, allocator pools or peak enter its numbers. The spec names the method, budget, prompt length
and generated tokens; the worker loads the model, warms up on a short prompt, runs
``Engine.generate`` once and prints one line ``BENCH_JSON {...}`` with the timings of
:class:`kvbench.engine.GenerationResult` and memory by phase:

* ``startup_peak_bytes``: peak resident memory of loading and warming up (on CPU the fused
  decode step's start-up copy briefly holds the weights twice, see :mod:`kvbench.fused_decode`);
* ``rss_after_load_bytes``: resident memory with the model loaded, before the sample;
* ``prefill_peak_bytes``: peak of the sample's prefill + compression (model included);
* ``decode_mem_bytes``: the largest resident memory seen after a decode step (the decode phase);
* ``peak_bytes``: peak of the whole sample (prefill + compression + decode, model included).

The peaks are ``VmHWM`` (:func:`kvbench.engine.peak_rss_bytes`), restarted after the warm-up
(:func:`kvbench.engine.reset_peak_rss`; ``peak_reset`` says whether that worked, else the
sample's peaks include the start-up). ``ru_maxrss`` is not used: a child process inherits its
parent's resident set size as its starting peak, so workers of a large benchmark process
reported the parent's 2.9 GB. On CUDA the same fields are CUDA allocator bytes (allocated now /
peak allocated, the peak restarted after the warm-up).

Resident memory counts heap pages that were freed but not yet returned to the system: glibc
keeps freed blocks below its mmap threshold in the heap (dynamic, up to 32 MiB, by default;
1 GiB under a CPU engine's heap policy, :mod:`kvbench.heap`), so a method
whose compression frees a few MB-sized temporaries could look as if it held them during
decode (LOOK-M's score blocks did: −29.6 MB "drop" at 512 tokens). The worker therefore
drops the warm-up's state and returns freed heap memory to the system (``malloc_trim``)
before taking the baseline, and once more just before the first decode step (inside the
decode timing: one call, milliseconds), so that both numbers are live memory.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import statistics
import sys
import time
from typing import Any

from .common import (Settings, apply_threads, build_method, build_prompt, last_level_cache_bytes, load, probe_bytes,
                     read_bandwidth, rss_now, step_read_pattern)

MARKER = "BENCH_JSON "


def _mem_now(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else rss_now()


def release_freed_memory() -> bool:
    """Collect garbage and return freed heap pages to the system (glibc ``malloc_trim(0)``).

    Returns:
        True when ``malloc_trim`` exists (glibc), False elsewhere (only ``gc.collect`` ran).
    """
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim(0)
    return True


def timed_generate(engine, ids: list[int], new_tokens: int, before_step=None, again: bool = False):
    """``engine.generate(ids, new_tokens)`` with stop tokens off, timing each decode step.

    ``before_step(step)`` (optional) runs before each step, outside its time. A callback, not
    forward hooks: a hooked model decodes through its modules, not the fused decode step that
    jobs use (:mod:`kvbench.fused_decode`). ``again``: decode the engine's last compressed
    cache once more instead (:meth:`kvbench.engine.Engine.decode_again`, no prefill).

    Returns:
        ``(result, step_seconds)``: the :class:`kvbench.engine.GenerationResult` and the time
        from each step's start to the next one's (argmax, token read, forward), the first step
        left out (it follows the prefill and, in :func:`run`, a ``malloc_trim``).
    """
    import torch

    dev = engine.loaded.device
    starts: list[float] = []

    def on_decode_step(step: int) -> None:
        if before_step is not None:
            before_step(step)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        starts.append(time.perf_counter())

    engine.on_decode_step = on_decode_step
    try:
        res = engine.decode_again(new_tokens) if again else engine.generate(ids, new_tokens, stop_ids=[])
    finally:
        engine.on_decode_step = None
    return res, [b - a for a, b in zip(starts[1:], starts[2:])]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Run the configuration ``spec`` (keys: settings, method, overrides, budget, n, new_tokens, bandwidth)."""
    import torch

    from kvbench.engine import Engine, peak_memory_bytes, reset_peak_rss

    settings = Settings.from_json(json.dumps(spec["settings"]))
    apply_threads(settings)
    loaded = load(settings)
    dev = loaded.device
    prompt = build_prompt(loaded.tokenizer, int(spec["n"]))
    method = build_method(spec["method"], loaded.layout, **spec.get("overrides", {}))
    engine = Engine(loaded, method, spec["budget"])
    engine.generate(prompt.ids[: min(256, len(prompt.ids))], 2, stop_ids=[])  # warm-up: lazy inits, kernels
    engine.last_state, engine.last_logits = None, []  # the warm-up's cache is not part of the baseline
    trimmed = release_freed_memory()
    startup_peak = peak_memory_bytes(dev)
    peak_reset = True
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        peak_reset = reset_peak_rss()
    after_load = _mem_now(dev)

    phases: dict[str, list[int]] = {"prefill_peak": [], "decode": []}

    def memory_by_phase(step: int) -> None:
        # Step 0: prefill and compression are over; record their peak and drop freed heap before decoding.
        if step == 0:
            phases["prefill_peak"].append(peak_memory_bytes(dev))
            release_freed_memory()
        else:
            phases["decode"].append(_mem_now(dev))

    res, step_times = timed_generate(engine, prompt.ids, int(spec["new_tokens"]), memory_by_phase)
    peak = peak_memory_bytes(dev)
    steps = max(1, res.generated_tokens - 1)  # decode forwards (the first token comes from prefill)
    out = {
        "method": spec["method"],
        "budget": spec["budget"],
        "n_requested": int(spec["n"]),
        **res.record(),
        "decode_step_ms": 1000 * res.decode_s / steps if res.generated_tokens > 1 else None,
        # Median of the per-step times (argmax, token read, forward; from one step's start to
        # the next): robust to a few steps slowed by other processes on a shared machine.
        "decode_step_median_ms": 1000 * statistics.median(step_times) if step_times else None,
        "startup_peak_bytes": startup_peak,
        "peak_reset": peak_reset,
        "mkl_fast_mm": os.environ.get("MKL_DISABLE_FAST_MM", "") in ("", "0"),
        "rss_after_load_bytes": after_load,
        "prefill_peak_bytes": max(phases["prefill_peak"] or [0]),
        "decode_mem_bytes": max(phases["decode"] or [0]),
        "peak_bytes": peak,
        "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "threads": torch.get_num_threads(),
        "malloc_trim": trimmed,
        "decode_path": engine.last_decode_path,
    }
    if spec.get("bandwidth"):
        out["last_level_cache_bytes"] = last_level_cache_bytes(str(dev))
        out["read_probe_bytes"] = probe_bytes(str(dev))
        out["read_bandwidth_Bps"] = read_bandwidth(str(dev), out["read_probe_bytes"])
        if engine.last_state is not None:
            pattern = step_read_pattern(loaded.model, engine.last_state.cache)
            out["step_read_pattern_s"], out["step_read_pattern_bytes"] = pattern["seconds"], pattern["bytes"]
    return out


def run_pair(spec: dict[str, Any]) -> dict[str, Any]:
    """Decode A/B in one process: the configurations ``spec["configs"]`` alternate for ``spec["rounds"]`` rounds.

    Separate worker processes measure each configuration at a different time and with its own
    memory placement; on a machine whose speed drifts by up to 25 % within an hour that moves a
    ratio of two steps more than the effect it measures. Here one process loads the model
    once, warms up every configuration, then runs them in turn (round 1: A, B; round 2: A, B;
    ...). Round 1 prefills and compresses each configuration's cache; later rounds decode the
    same compressed caches again (:meth:`kvbench.engine.Engine.decode_again`: the decode steps
    are what is compared, and an 8k prefill costs 30 s a round). After each decode it measures
    the read bandwidth (the floor's denominator) and the step's read pattern on that cache.

    Args:
        spec: ``settings``, ``configs`` (``[[label, method, budget], ...]``), ``n`` (prompt
            tokens), ``new_tokens``, ``rounds``.

    Returns:
        ``{"rounds": [{label: {...}}, ...], "weight_bytes", "read_probe_bytes",
        "last_level_cache_bytes", "threads"}``; each ``{...}`` has ``prompt_tokens``,
        ``decode_step_median_ms`` (median of that generation's per-step times, the first step
        left out), ``cache_bytes_after``, ``read_bandwidth_Bps`` and ``step_read_pattern_s``.
    """
    import torch

    from kvbench.engine import Engine

    settings = Settings.from_json(json.dumps(spec["settings"]))
    apply_threads(settings)
    loaded = load(settings)
    dev = loaded.device
    prompt = build_prompt(loaded.tokenizer, int(spec["n"]))
    engines = {label: Engine(loaded, build_method(method, loaded.layout), budget)
               for label, method, budget in spec["configs"]}
    for engine in engines.values():
        engine.generate(prompt.ids[: min(256, len(prompt.ids))], 2, stop_ids=[])  # warm-up: lazy inits, kernels
        engine.last_state, engine.last_logits = None, []
    nbytes = probe_bytes(str(dev))
    rounds = []
    for i in range(int(spec["rounds"])):
        this_round = {}
        for label, engine in engines.items():
            release_freed_memory()
            # round 1 prefills and compresses; later rounds decode the same compressed cache again
            res, steps = timed_generate(engine, prompt.ids, int(spec["new_tokens"]), again=i > 0)
            pattern = step_read_pattern(loaded.model, engine.last_state.cache)
            this_round[label] = {
                "prompt_tokens": res.prompt_tokens,
                "decode_step_median_ms": 1000 * statistics.median(steps) if steps else None,
                "cache_bytes_after": res.cache_bytes_after,
                "read_bandwidth_Bps": read_bandwidth(str(dev), nbytes),
                "step_read_pattern_s": pattern["seconds"],
            }
        rounds.append(this_round)
    for engine in engines.values():
        engine.last_state, engine.last_logits = None, []
    return {
        "rounds": rounds,
        "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "read_probe_bytes": nbytes,
        "last_level_cache_bytes": last_level_cache_bytes(str(dev)),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str]) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    spec = json.loads(argv[1])
    result = run_pair(spec) if "configs" in spec else run(spec)
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
