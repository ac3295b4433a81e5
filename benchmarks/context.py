"""The run context shared by the benchmarks of one ``python -m benchmarks`` invocation.

It loads the model in this process once (for in-process timings) and runs engine
configurations in worker processes, memoised: the ``engine``, ``decode`` and ``memory``
benchmarks share the runs they have in common (e.g. SnapKV at 25 % and 8k tokens).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import ROOT, Settings, load, local_model_config, log
from .worker import MARKER


class WorkerError(RuntimeError):
    """A worker process failed; the message names the configuration and its log file."""


def worker_env(mkl_pool: bool = True) -> dict[str, str]:
    """Environment for child processes: offline, quiet, same thread settings.

    ``mkl_pool=False`` adds ``MKL_DISABLE_FAST_MM=1`` (Intel MKL's buffer pool off).
    """
    env = dict(os.environ)
    if not mkl_pool:
        env["MKL_DISABLE_FAST_MM"] = "1"
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class Context:
    """Settings, the in-process model, and memoised worker runs."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.out = Path(settings.out)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self._loaded = None
        self._runs: dict[str, dict[str, Any]] = {}
        self.runs_started = 0  # worker processes run (counters for the summary's per-benchmark line)
        self.runs_reused = 0  # requests served from memoised runs
        local_model_config(settings)  # convert a GGUF model once, before any worker starts

    @property
    def loaded(self):
        """The benchmark model loaded in this process (:class:`kvbench.models.LoadedModel`)."""
        if self._loaded is None:
            self._loaded = load(self.settings)
        return self._loaded

    def engine_run(self, method: str, budget: float, n: int, new_tokens: int | None = None, bandwidth: bool = True,
                   mkl_pool: bool = True, **overrides) -> dict[str, Any]:
        """One configuration in a fresh worker process (memoised); see :mod:`benchmarks.worker`.

        ``bandwidth``: also measure the read bandwidth (about 3 s; the decode floor needs it).
        A memoised run that has it serves requests with or without it.
        ``mkl_pool=False``: run the worker with ``MKL_DISABLE_FAST_MM=1`` (MKL's memory manager
        off: its retained buffers then do not count as resident memory; see :mod:`benchmarks.memory`).

        Raises:
            WorkerError: the worker failed (its log file is named).
        """
        spec = {
            "settings": json.loads(self.settings.to_json()),
            "method": method,
            "overrides": overrides,
            "budget": budget,
            "n": n,
            "new_tokens": new_tokens or self.settings.new_tokens,
        }
        if not mkl_pool:
            spec["mkl_pool"] = False  # only then: memo keys of default runs stay as they were
        key = json.dumps(spec, sort_keys=True)
        if key in self._runs and (not bandwidth or "read_bandwidth_Bps" in self._runs[key]):
            self.runs_reused += 1
            return self._runs[key]
        self.runs_started += 1
        spec["bandwidth"] = bandwidth
        tag = f"{method}-{budget}-{n}" + ("" if mkl_pool else "-nomklpool")
        log(f"worker: {method} budget={budget} n={n} ...")
        result = self._spawn(spec, tag, mkl_pool)
        self._runs[key] = result
        return result

    def paired_run(self, configs: list[tuple[str, str, float]], n: int, rounds: int,
                   new_tokens: int | None = None) -> dict[str, Any]:
        """A decode A/B in one worker process (memoised): ``configs`` alternate for ``rounds`` rounds.

        Args:
            configs: ``(label, method, budget)`` per configuration, run in this order each round.
            n: prompt tokens.
            rounds: rounds (each runs every configuration once).

        Returns:
            The worker's result (:func:`benchmarks.worker.run_pair`).

        Raises:
            WorkerError: the worker failed (its log file is named).
        """
        spec = {
            "settings": json.loads(self.settings.to_json()),
            "configs": [list(c) for c in configs],
            "n": n,
            "rounds": rounds,
            "new_tokens": new_tokens or self.settings.new_tokens,
        }
        key = json.dumps(spec, sort_keys=True)
        if key in self._runs:
            self.runs_reused += 1
            return self._runs[key]
        self.runs_started += 1
        tag = "pair-" + "-".join(label.rstrip("%") for label, _m, _b in configs) + f"-{n}"
        log(f"worker: {' / '.join(label for label, _m, _b in configs)} alternating, {rounds} rounds, n={n} ...")
        result = self._spawn(spec, tag)
        self._runs[key] = result
        return result

    def _spawn(self, spec: dict[str, Any], tag: str, mkl_pool: bool = True) -> dict[str, Any]:
        """Run ``python -m benchmarks.worker <spec>``; its result with ``worker_s`` (seconds) added.

        Raises:
            WorkerError: the worker failed (its log file is named).
        """
        log_path = self.logs / f"worker-{tag}.log"
        t0 = time.perf_counter()
        with open(log_path, "w") as err:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.worker", json.dumps(spec, sort_keys=True)],
                cwd=ROOT, env=worker_env(mkl_pool), stdout=subprocess.PIPE, stderr=err, text=True,
            )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
        if proc.returncode != 0 or not lines:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            raise WorkerError(f"{tag}: worker exited with {proc.returncode}: {tail[0]} (log: {log_path})")
        result = json.loads(lines[-1][len(MARKER):])
        result["worker_s"] = time.perf_counter() - t0
        log(f"worker: {tag} done in {result['worker_s']:.0f} s")
        return result
