"""Shared pieces of the benchmark suite: settings, model and method loading, prompts, measured
engine runs, results and tables.

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``), tokens (``n``); MB = 10^6 bytes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FULL_LENGTHS = [1024, 2048, 4096, 8000]  # engine table; 8000 leaves decode room in an 8192-token context
QUICK_LENGTHS = [256, 512]
LONG = 4096  # compression, decode A/B and memory targets are measured here (the longest --lengths otherwise)
RATIO_25 = 0.25  # the "25 % cache": retention ratio of prompt tokens
MB = 1e6

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer in one sentence."


@dataclass
class Settings:
    """The command line's settings (``python -m benchmarks --help``)."""

    quick: bool = False
    model: str = "smollm2"
    device: str = "cpu"
    out: str = str(ROOT / "benchmarks" / "out")
    threads: int | None = None
    methods: list[str] | None = None
    prompt_lengths: list[int] | None = None

    def __post_init__(self):
        #: prompt lengths in tokens: ``--lengths``, else 256/512 (``--quick``), else 1k, 2k, 4k, 8k
        self.lengths = sorted(set(self.prompt_lengths or (QUICK_LENGTHS if self.quick else FULL_LENGTHS)))
        #: prompt tokens of the length-specific targets: 4096, or the longest given/quick length
        self.long = self.lengths[-1] if self.quick or self.prompt_lengths else LONG
        #: tokens generated per sample (all: stop tokens are off) and repetitions of alternating timings
        self.new_tokens, self.reps = (8, 2) if self.quick else (32, 5)

    def selected(self, methods: list[str]) -> list[str]:
        """``methods`` restricted to ``--methods``."""
        return [m for m in methods if not self.methods or m in self.methods]


def build_method(name: str, layout=None, **overrides):
    """A method from ``conf/method/<name>.yaml`` (+ overrides), as a job builds it (ConfigError: a bad key)."""
    from kvbench.job.config import preset
    from methods import build_method as build

    node = preset("method", name) if (ROOT / "conf" / "method" / f"{name}.yaml").is_file() else {"name": name}
    return build({**node, **overrides}, layout)


# --- prompts -----------------------------------------------------------------------------
def wrap(tokenizer, context: str) -> str:
    """``context`` as the user turn of the chat template (or ``context + "\\nAnswer:"``)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": context}],
                                             add_generation_prompt=True, tokenize=False)
    return context + "\nAnswer:"


def build_prompt(tokenizer, n_tokens: int) -> tuple[str, list[int]]:
    """``(context, ids)``: a needle-in-a-haystack prompt of ``n_tokens`` tokens (± a few) from the NIAH
    task's embedded haystack (no data files), needle at 50 %, question last, chat template applied."""
    from eval.niah import embedded_haystack

    hay = tokenizer.encode(embedded_haystack(), add_special_tokens=False)
    frame = len(tokenizer.encode(wrap(tokenizer, f"{NEEDLE}\n\n{QUESTION}"), add_special_tokens=False))
    budget = max(2, n_tokens - frame)
    for _ in range(3):  # re-tokenising decoded text shifts a few tokens: correct twice
        half = budget // 2
        context = f"{tokenizer.decode(hay[:half])} {NEEDLE} {tokenizer.decode(hay[half:budget])}\n\n{QUESTION}"
        ids = tokenizer.encode(wrap(tokenizer, context), add_special_tokens=False)
        if len(ids) == n_tokens:
            break
        budget = max(2, budget + n_tokens - len(ids))
    return context, ids


# --- results -----------------------------------------------------------------------------
@dataclass
class Target:
    """One acceptance target: ``measured`` against ``target`` (a readable bound such as ``≤ 1.05×``);
    ``passed`` None: not measured (SKIP)."""

    name: str
    measured: str
    target: str
    passed: bool | None
    note: str = ""

    @property
    def verdict(self) -> str:
        return "SKIP" if self.passed is None else "PASS" if self.passed else "FAIL"


@dataclass
class BenchResult:
    """What one benchmark returns: its table, further tables, targets, notes and the raw data for JSON."""

    name: str
    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    tables: list[dict[str, Any]] = field(default_factory=list)  # {"title", "headers", "rows"}
    skipped: str | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = [dict(dataclasses.asdict(t), verdict=t.verdict) for t in self.targets]
        return d


def fmt(value: Any) -> str:
    """A table cell: floats to 3 significant digits (integers from 100 on), None as ``-``."""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return "-" if value is None else str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in cells])


def log(msg: str) -> None:
    """A progress line on stderr (stdout carries the tables)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def machine_info(settings: Settings) -> dict[str, Any]:
    """CPU, cores, library versions, device, model and date, for the summary page."""
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if settings.device != "cpu" and torch.cuda.is_available() else None
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), platform.machine())
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpu": cpu,
            "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "torch_threads": settings.threads or torch.get_num_threads(), "device": settings.device,
            "model": settings.model, "quick": settings.quick}


# --- measured engine runs ----------------------------------------------------------------
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
    """One ``engine.generate(ids, new_tokens, stop_ids=[])``: the :class:`kvbench.engine.generate.GenerationResult`
    record plus ``decode_step_ms`` (median from one step's start to the next, the first left out),
    ``rss_after_load_bytes`` (before the sample), ``prefill_peak_bytes`` (prefill + compression),
    ``decode_mem_bytes`` (largest between decode steps), ``peak_bytes``, ``weight_bytes`` and
    ``kept_tokens_mean`` / ``stored_tokens_mean`` (logical kept vs stored slots per KV head). Peaks
    restart before the sample; freed heap is returned to the system before it and before decoding.
    A forward pre-hook on the decoder sees each decode step (a one-token forward).
    """
    import torch

    from kvbench.engine.generate import peak_memory_bytes, reset_peak_memory

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
            mem["prefill_peak"] = peak_memory_bytes([dev])
            release_freed_memory()
        mem["decode"] = max(mem["decode"], _mem_now(dev))
        starts.append(time.perf_counter())

    release_freed_memory()
    reset_peak_memory([dev])
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
        "prefill_peak_bytes": mem["prefill_peak"] or peak_memory_bytes([dev]),
        "decode_mem_bytes": mem["decode"] or _mem_now(dev),
        "peak_bytes": peak_memory_bytes([dev]),
        "weight_bytes": sum(p.numel() * p.element_size() for p in loaded.model.parameters()),
        "kept_tokens_mean": res.kept_tokens.get("mean"),
        "stored_tokens_mean": res.stored_tokens.get("mean"),
    }


class Context:
    """Settings, the model (loaded on first use) and memoised measured runs."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._runs: dict[str, Any] = {}

    @functools.cached_property
    def loaded(self):
        """The benchmark model (:class:`kvbench.engine.models.LoadedModel`) on ``settings.device``."""
        import torch

        from kvbench.job.config import conf_model
        from kvbench.engine.models import load_model

        if self.settings.threads:
            torch.set_num_threads(self.settings.threads)
        return load_model(conf_model(self.settings.model), self.settings.device)

    def worker(self, configs: list[tuple[str, str, float]], n: int, rounds: int = 1,
               live_memory: bool = False) -> list[dict[str, dict]]:
        """Run ``configs`` (``(label, method, budget)``) in turn for ``rounds`` rounds on an ``n``-token
        prompt, each engine warmed up first and freed after (memoised): one ``{label: measure(...)}`` per
        round. ``live_memory``: a run of its own even when an equal one was memoised."""
        key = json.dumps([configs, n, rounds, live_memory])
        if key not in self._runs:
            from kvbench.engine.generate import Engine

            log(f"run: {', '.join(f'{m} {b}' for _, m, b in configs)} at {n} tokens")
            loaded, ids = self.loaded, build_prompt(self.loaded.tokenizer, n)[1]
            engines = {label: Engine(loaded, build_method(method, loaded.layout), budget)
                       for label, method, budget in configs}
            for engine in engines.values():
                engine.generate(ids[:256], 2, stop_ids=[])  # warm-up: lazy inits
                engine.last_state = None  # the warm-up's cache is not part of the baseline
            self._runs[key] = [{label: measure(engine, ids, self.settings.new_tokens) for label, engine in engines.items()}
                               for _ in range(rounds)]
            del engines
            release_freed_memory()
        return self._runs[key]
