"""Shared pieces of the benchmark suite: settings, model loading, prompts, measurements, tables.

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``), tokens (``n``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

FULL_LENGTHS = [1024, 2048, 4096, 8000]  # "1k, 2k, 4k, 8k": 8000 leaves decode room in an 8192-token context
QUICK_LENGTHS = [256, 512]
RATIO_25 = 0.25  # the "25 % cache": retention ratio of prompt tokens

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer in one sentence."


@dataclass
class Settings:
    """Command-line settings shared by the main process and its workers.

    Attributes:
        quick: short lengths and few repetitions (development runs, about a minute or two).
        model: a ``conf/model/<name>.yaml`` name or a path to such a YAML file.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:1``.
        out: output folder (JSON per benchmark, worker logs, the converted-model cache).
        threads: torch intra-op threads (None: torch's default).
        kvpress_python: interpreter with kvpress installed for the ``kvpress`` benchmark (None: this one).
        methods: restrict the per-method benchmarks (compression, memory) to these methods (None: all).
        prompt_lengths: prompt lengths (tokens) for compression, engine, decode and memory (the
            longest), instead of the defaults (None).
    """

    quick: bool = False
    model: str = "smollm2"
    device: str = "cpu"
    out: str = str(ROOT / "benchmarks" / "out")
    threads: int | None = None
    kvpress_python: str | None = None
    methods: list[str] | None = None
    prompt_lengths: list[int] | None = None

    @property
    def lengths(self) -> list[int]:
        if self.prompt_lengths:
            return sorted(set(self.prompt_lengths))
        return QUICK_LENGTHS if self.quick else FULL_LENGTHS

    def selected(self, methods: list[str]) -> list[str]:
        """``methods`` restricted to ``--methods`` (in their given order)."""
        return [m for m in methods if not self.methods or m in self.methods]

    @property
    def new_tokens(self) -> int:
        """Tokens generated per sample (all of them: stop tokens are disabled in benchmarks)."""
        return 8 if self.quick else 32

    @property
    def pair_rounds(self) -> int:
        """Rounds of the decode benchmark's in-process A/B (full and 25 % cache alternating)."""
        return 2 if self.quick else 3

    @property
    def reps(self) -> int:
        """Repetitions of in-process timings (median reported)."""
        return 2 if self.quick else 5

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        return cls(**json.loads(text))


def apply_threads(settings: Settings) -> None:
    """Set torch's intra-op threads when the user asked for a number."""
    import torch

    if settings.threads:
        torch.set_num_threads(int(settings.threads))


# --- model -------------------------------------------------------------------------------


def model_config(name_or_path: str) -> dict[str, Any]:
    """The model node: ``conf/model/<name>.yaml`` or a YAML file path.

    Raises:
        SystemExit: no such config (one line naming the accepted names).
    """
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = ROOT / "conf" / "model" / f"{name_or_path}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
        raise SystemExit(f"error: --model={name_or_path}: no such model config; accepted values are {', '.join(names)}")
    return dict(yaml.safe_load(path.read_text()))


def local_model_config(settings: Settings) -> dict[str, Any]:
    """The model node, with a GGUF model's conversion cache warmed first.

    transformers dequantizes a GGUF file and converts its tokenizer on every load (about half
    a minute on 2 CPU cores for SmolLM2-135M); :func:`kvbench.models.load_model` caches the
    converted model (``~/.cache/kvbench/gguf``, identical weights and tokenizer). The suite
    loads the model in many worker processes, so the cache is filled once here, before any
    worker starts.
    """
    from kvbench.models import gguf_cache_dir, load_model, resolve_source

    cfg = model_config(settings.model)
    folder, gguf_file = resolve_source(cfg)
    cache = gguf_cache_dir(folder, gguf_file, cfg.get("gguf_cache", "auto")) if gguf_file else None
    if cache is not None and not (cache / "COMPLETE").is_file():
        log(f"converting {cfg.get('source')} ({gguf_file}) once into {cache} ...")
        load_model(cfg, "cpu")
    return cfg


def load(settings: Settings):
    """Load the benchmark model (:class:`kvbench.models.LoadedModel`) on ``settings.device``."""
    from kvbench.models import load_model

    return load_model(local_model_config(settings), settings.device)


def build_method(name: str, layout, **overrides):
    """A method from its Hydra node ``conf/method/<name>.yaml`` (+ overrides), as a job builds it.

    Raises:
        ConfigError / KeyError / ImportError / FileNotFoundError: the method is not available.
    """
    import yaml

    from kvbench.validate import build_method as _build

    path = ROOT / "conf" / "method" / f"{name}.yaml"
    node = dict(yaml.safe_load(path.read_text())) if path.is_file() else {"name": name}
    node.update(overrides)
    return _build(node, layout)


def method_available(name: str) -> str | None:
    """None when ``name`` is in the methods registry, else the reason it is not."""
    import methods

    return None if name in methods.available() else "not available (not in the methods registry)"


# --- prompts -----------------------------------------------------------------------------

_HAYSTACK_IDS: dict[int, list[int]] = {}


@dataclass
class Prompt:
    """A needle-in-a-haystack prompt of about ``n`` tokens, the question inside.

    Attributes:
        context: the user message text (haystack with the needle, then the question).
        ids: the prompt token ids (chat template applied when the tokenizer has one).
    """

    context: str
    ids: list[int]


def _wrap(tokenizer, context: str) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": context}], add_generation_prompt=True, tokenize=False
        )
    return context + "\nAnswer:"


def build_prompt(tokenizer, n_tokens: int) -> Prompt:
    """A prompt of ``n_tokens`` tokens (± a few at the joins): embedded haystack, needle at 50 %, question.

    The haystack is the embedded one of the NIAH task (``eval.niah.embedded_haystack``: real
    prose shipped with Python), so the suite needs no data files or network.
    """
    from eval.niah import embedded_haystack

    key = id(tokenizer)
    if key not in _HAYSTACK_IDS:
        _HAYSTACK_IDS[key] = tokenizer.encode(embedded_haystack(), add_special_tokens=False)
    hay = _HAYSTACK_IDS[key]
    frame = len(tokenizer.encode(_wrap(tokenizer, f"{NEEDLE}\n\n{QUESTION}"), add_special_tokens=False))
    budget = max(2, n_tokens - frame)
    ids: list[int] = []
    context = ""
    for _ in range(3):  # re-tokenising decoded text shifts a few tokens: correct twice
        half = budget // 2
        context = (
            tokenizer.decode(hay[:half]) + f" {NEEDLE} " + tokenizer.decode(hay[half:budget]) + f"\n\n{QUESTION}"
        )
        ids = tokenizer.encode(_wrap(tokenizer, context), add_special_tokens=False)
        if len(ids) == n_tokens:
            break
        budget = max(2, budget + n_tokens - len(ids))
    return Prompt(context=context, ids=ids)


# --- measurements ------------------------------------------------------------------------


def rss_now() -> int:
    """Current resident set size of this process (bytes)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def median_time(fn: Callable[[], Any], reps: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``reps`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


PROBE_MIN_BYTES = 256 << 20  # smallest read-bandwidth probe (bytes)
PROBE_CACHE_MULTIPLE = 4  # the probe is at least this many times the last-level cache (STREAM's rule)


CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache_bytes(device: str = "cpu", cache_dir: Path = CPU_CACHE_DIR) -> int:
    """Size of the device's last-level cache in bytes (0 when unknown).

    CPU: the largest ``cache_dir/index*/size`` (Linux sysfs; e.g. ``491520K``).
    CUDA: the GPU's L2 (``torch.cuda.get_device_properties(...).L2_cache_size``).
    """
    if device.startswith("cuda"):
        import torch

        return int(getattr(torch.cuda.get_device_properties(torch.device(device)), "L2_cache_size", 0) or 0)
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = 0
    for path in Path(cache_dir).glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        scale = units.get(text[-1:].upper(), 1)
        digits = text[:-1] if text[-1:].upper() in units else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def _available_bytes(device: str) -> int | None:
    """Free memory of the device in bytes (None when unknown)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def probe_bytes(device: str = "cpu") -> int:
    """Size of the read-bandwidth probe (bytes): ``max(256 MiB, 4 × last-level cache)``.

    STREAM's rule: a bandwidth probe must be several times the last-level cache, or it
    measures the cache. Some servers have a last-level cache of hundreds of MiB (the 2-core
    VM of docs/PERFORMANCE.md reports 480 MiB), beyond a fixed 256 MiB probe. Capped at a quarter
    of the device's free memory; a multiple of 4 KiB.
    """
    size = max(PROBE_MIN_BYTES, PROBE_CACHE_MULTIPLE * last_level_cache_bytes(device))
    free = _available_bytes(device)
    if free:
        size = min(size, max(PROBE_MIN_BYTES, free // 4))
    return size // 4096 * 4096


def read_bandwidth(device: str = "cpu", nbytes: int | None = None, reps: int = 5) -> float:
    """Sustained read bandwidth (bytes/s) of this machine, with torch's intra-op threads.

    A float32 tensor of ``nbytes`` (default :func:`probe_bytes`: at least 256 MiB and four
    times the last-level cache, so that the reads come from memory) is read by two kernels,
    ``x.sum()`` and a matrix-vector product ``x.view(-1, 1024) @ v`` (the decode step's own
    access pattern); each is timed by its median over ``reps`` calls and the faster one
    counts (torch's float32 sum uses cascaded accumulators and can be compute-bound on
    one core, which would understate the bandwidth and flatter the floor).
    """
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    nbytes = probe_bytes(str(dev)) if nbytes is None else nbytes
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    v = torch.ones(1024, dtype=torch.float32, device=dev)
    mat = x[: x.numel() // 1024 * 1024].view(-1, 1024)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def run_sum():
        x.sum()
        sync()

    def run_mv():
        torch.mv(mat, v)
        sync()

    with torch.inference_mode():
        t = min(median_time(run_sum, reps, warmup=2), median_time(run_mv, reps, warmup=2))
    del x, mat
    return nbytes / t


def step_read_pattern(model, cache, reps: int = 5) -> dict[str, float]:
    """Seconds to read what a decode step reads, the way the step reads it (the attainable floor).

    The floor of :func:`read_bandwidth` assumes one long stream. A decode step instead reads
    each weight matrix (a few MB on a small model) and each layer's keys and values as separate,
    dependent reads, each split over the threads. This times exactly that pattern with no
    arithmetic but a sum: layer by layer, every parameter storage of the layer (fused buffers
    once) and the layer's cached keys and values (the filled part), then the remaining
    parameters (embeddings / LM head, final norm); median over ``reps`` passes after one warm-up.

    Args:
        model: the loaded ``*ForCausalLM`` (after the decode, so fused buffers exist).
        cache: the sample's cache (``cache.layers[i].keys/values``: the filled ``(B, H_kv, T, d)``).

    Returns:
        ``{"seconds": s, "bytes": n}`` (bytes read per pass).
    """
    import torch

    seen: set[int] = set()

    def flat(t):
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            return None
        seen.add(storage.data_ptr())
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage)

    tensors = []
    layers = getattr(getattr(model, "model", None), "layers", [])
    cache_layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        tensors += [f for p in layer.parameters() if (f := flat(p)) is not None]
        if i < len(cache_layers):
            tensors += [cache_layers[i].keys, cache_layers[i].values]  # the filled views
    tensors += [f for p in model.parameters() if (f := flat(p)) is not None]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    sync = torch.cuda.synchronize if tensors and tensors[0].is_cuda else (lambda: None)

    def run():
        for t in tensors:
            t.sum()
        sync()

    with torch.inference_mode():
        seconds = median_time(run, reps, warmup=1)
    return {"seconds": seconds, "bytes": nbytes}


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied embeddings counted once: each is read once per step)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def machine_info(settings: Settings) -> dict[str, Any]:
    """CPU model, cores, RAM, load, library versions and date, for the report header."""
    import torch
    import transformers

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    info = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_bytes": mem,
        "load_average": list(os.getloadavg()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "(default)"),
        "device": settings.device,
        "model": settings.model,
        "quick": settings.quick,
    }
    if settings.device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# --- results -----------------------------------------------------------------------------


@dataclass
class Target:
    """One acceptance target: ``measured`` against ``target`` (a readable bound such as ``≤ 1.05×``)."""

    name: str
    measured: str
    target: str
    passed: bool | None  # None: not measured (skipped)
    note: str = ""
    #: Why the measurement is not at the target's own setting (e.g. ``--quick`` lengths): the
    #: target is then not judged (verdict ``INFO``; the would-be verdict goes into the note).
    off_target: str = ""

    @property
    def verdict(self) -> str:
        if self.passed is None:
            return "SKIP"
        if self.off_target:
            return "INFO"
        return "PASS" if self.passed else "FAIL"

    def __post_init__(self) -> None:
        if self.off_target and self.passed is not None:
            judged = "within" if self.passed else "outside"
            self.note = "; ".join(x for x in (f"not judged: {self.off_target} ({judged} the bound here)", self.note) if x)


def off_target_lengths(measured: list[int], defined: list[int]) -> str:
    """``Target.off_target`` for a fit over prompt lengths (the scaling exponent) made over other
    lengths than the target's ('' when the same): two short, noisy lengths say little about scaling."""
    if list(measured) == list(defined):
        return ""
    return (f"the target is defined over {', '.join(map(str, defined))} prompt tokens, this run fitted "
            f"{', '.join(map(str, measured))} (--quick or --lengths)")


def off_target_length(measured: int, defined: int) -> str:
    """``Target.off_target`` for a length-specific target measured at another prompt length ('' when equal)."""
    if measured == defined:
        return ""
    return f"the target is defined at {defined} prompt tokens, this run measured {measured} (--quick or --lengths)"


@dataclass
class BenchResult:
    """What one benchmark returns: a printed table, its targets and the raw data for JSON."""

    name: str
    title: str
    headers: list[str] = field(default_factory=list)
    rows: list[list[Any]] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    #: further tables after the main one: ``{"title": str, "headers": [...], "rows": [[...]]}``
    tables: list[dict[str, Any]] = field(default_factory=list)
    skipped: str | None = None
    seconds: float = 0.0
    runs_started: int = 0  # worker runs this benchmark started
    runs_reused: int = 0  # worker runs it took from an earlier benchmark of the same invocation (memoised)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = [dict(dataclasses.asdict(t), verdict=t.verdict) for t in self.targets]
        return d


def fmt(value: Any, digits: int = 3) -> str:
    """Compact table cell: floats to ``digits`` significant decimals, None as ``-``."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 100:
            return f"{value:.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return str(value)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table (also valid Markdown)."""
    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in cells]
    return "\n".join(out)


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries tables and worker JSON)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


MB = 1e6


def save(path: Path, text: str) -> None:
    """Write one output of the suite atomically; an earlier, different file of that name is kept
    beside it as ``<stem>.<time><suffix>`` first (:func:`kvbench.store.replace_keeping`): a new run
    never loses an earlier run's measurements."""
    from kvbench.store import replace_keeping

    kept = replace_keeping(path, text)
    if kept is not None:
        log(f"kept the earlier {path.name} as {kept.name}")
