"""Shared pieces of the benchmark suite: settings, model and method loading, prompts, worker
runs, results and tables.

Units: seconds (``*_s``), milliseconds (``*_ms``), bytes (``*_bytes``), tokens (``n``); MB = 10^6 bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import platform
import subprocess
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
MARKER = "BENCH_JSON "  # a worker's result line on stdout

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco? Answer in one sentence."


@dataclass
class Settings:
    """The command line's settings (``python -m benchmarks --help``), shared with the workers."""

    quick: bool = False
    model: str = "smollm2"
    device: str = "cpu"
    out: str = str(ROOT / "benchmarks" / "out")
    threads: int | None = None
    methods: list[str] | None = None
    prompt_lengths: list[int] | None = None

    @property
    def lengths(self) -> list[int]:
        """Prompt lengths in tokens: ``--lengths``, else 256/512 (``--quick``), else 1k, 2k, 4k, 8k."""
        return sorted(set(self.prompt_lengths or (QUICK_LENGTHS if self.quick else FULL_LENGTHS)))

    @property
    def long(self) -> int:
        """Prompt tokens of the length-specific targets: 4096, or the longest given/quick length."""
        return self.lengths[-1] if self.quick or self.prompt_lengths else LONG

    @property
    def new_tokens(self) -> int:
        """Tokens generated per sample (all of them: stop tokens are disabled in benchmarks)."""
        return 8 if self.quick else 32

    @property
    def reps(self) -> int:
        """Repetitions of alternating timings (medians reported)."""
        return 2 if self.quick else 5

    def selected(self, methods: list[str]) -> list[str]:
        """``methods`` restricted to ``--methods``."""
        return [m for m in methods if not self.methods or m in self.methods]


def model_config(name_or_path: str) -> dict[str, Any]:
    """The model node, ``conf/model/<name>.yaml`` or a YAML path; FileNotFoundError naming the accepted names."""
    import yaml

    path = Path(name_or_path) if name_or_path.endswith((".yaml", ".yml")) else ROOT / "conf" / "model" / f"{name_or_path}.yaml"
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml")))
        raise FileNotFoundError(f"--model {name_or_path}: no such model config; accepted values are {names}")
    return dict(yaml.safe_load(path.read_text()))


def load(settings: Settings):
    """The benchmark model (:class:`kvbench.models.LoadedModel`) on ``settings.device``."""
    import torch

    from kvbench.models import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    return load_model(model_config(settings.model), settings.device)


def build_method(name: str, layout=None, **overrides):
    """A method from ``conf/method/<name>.yaml`` (+ overrides), as a job builds it (ConfigError: a bad key)."""
    import yaml

    from methods import build_method as build

    path = ROOT / "conf" / "method" / f"{name}.yaml"
    node = dict(yaml.safe_load(path.read_text())) if path.is_file() else {"name": name}
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


# --- the run context ---------------------------------------------------------------------


class Context:
    """Settings, the model loaded in this process (on first use), and memoised worker runs."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.logs = Path(settings.out) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._runs: dict[str, Any] = {}

    @functools.cached_property
    def loaded(self):
        return load(self.settings)

    def worker(self, configs: list[tuple[str, str, float]], n: int, rounds: int = 1,
               live_memory: bool = False) -> list[dict[str, dict]]:
        """Run ``configs`` (``(label, method, budget)``) in turn for ``rounds`` rounds on an ``n``-token
        prompt in one fresh process (memoised; :mod:`benchmarks.worker`): one ``{label: measurements}``
        per round. ``live_memory``: with ``MKL_DISABLE_FAST_MM=1`` (MKL's buffer pool, outside PyTorch and
        ``malloc_trim``, not counted as resident memory).

        Raises:
            RuntimeError: the worker failed (its log's last line and path are named).
        """
        spec = {"settings": dataclasses.asdict(self.settings), "configs": [list(c) for c in configs], "n": n,
                "rounds": rounds, "new_tokens": self.settings.new_tokens, "live_memory": live_memory}
        key = json.dumps(spec, sort_keys=True)
        if key in self._runs:
            return self._runs[key]
        tag = "-".join(f"{m}{b}" for _, m, b in configs) + f"-{n}" + ("-live" if live_memory else "")
        log(f"worker: {tag} ...")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        if live_memory:
            env["MKL_DISABLE_FAST_MM"] = "1"
        path = self.logs / f"worker-{tag}.log"
        with open(path, "w") as err:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", key], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=err, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
        if proc.returncode or not lines:
            tail = (path.read_text(errors="replace").strip().splitlines() or ["(no output)"])[-1]
            raise RuntimeError(f"worker {tag} exited with {proc.returncode}: {tail} (log: {path})")
        self._runs[key] = json.loads(lines[-1][len(MARKER):])
        return self._runs[key]
