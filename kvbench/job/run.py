"""The job, as the steps of docs/ARCHITECTURE.md; its folder, reruns and resumes: docs/RESULTS.md."""

import dataclasses
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import time
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

import eval as tasks
import methods
from eval.base import Sample, Task, TaskConfigError
from methods.base import ConfigError

from kvbench.job.config import SELECTION_KEYS, JobSpec, check, compose
from kvbench.job.prompts import encode_prompt, prompt_format, split_prompt, stop_ids_for  # noqa: F401 - public helpers
from kvbench.job.runner import conversations, free_cuda, record_ids, run_sample, run_samples  # noqa: F401
from kvbench.job.store import JobLockedError, JobStore, atomic_write, read_json

log = logging.getLogger("kvbench")
EXIT_OK, EXIT_SAMPLE_FAILED, EXIT_CONFIG, EXIT_LOCKED = 0, 1, 2, 3
ROOT = Path(__file__).resolve().parents[2]
LOG_FORMAT = "[%(asctime)s] %(levelname)s %(name)s: %(message)s"


def environment(loaded: Any) -> dict[str, Any]:
    """Package versions, git revision, device, dtype and head layout of ``loaded``, for ``env.json``."""
    import torch
    import transformers

    def git(*args: str) -> str:
        with suppress(OSError, subprocess.SubprocessError):
            return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=5).stdout.strip()
        return ""

    return {
        "python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
        "platform": platform.platform(), "host": platform.node(),
        "git_revision": git("rev-parse", "HEAD") or None, "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "device": str(loaded.device), "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "attention_implementation": "kvbench (SDPA prefill, grouped SDPA decode with per-layer logit bias)",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv,
        "packages": {d.name: d.version for d in importlib.metadata.distributions() if d.name.lower().replace("_", "-") in (
            "kvbench", "kvpress", "accelerate", "numpy", "gguf", "datasets", "hydra-core", "flash-attn", "safetensors")},
        "dtype": str(loaded.dtype).replace("torch.", ""), "model_source": loaded.source, "load_s": round(loaded.load_s, 2),
        "layers": loaded.layout.num_layers, "query_heads": loaded.layout.num_q_heads, "kv_heads": loaded.layout.num_kv_heads,
        "compressible_layers": list(loaded.layout.compressible_layers),
        "logits_processors": [type(p).__name__ for p in loaded.processors],
    }


def build_task(cfg: dict, loaded: Any, resolved: dict | None = None) -> tuple[Task, list[Sample]]:
    """A job's task (``loaded``'s tokenizer and chat format, the check's resolved inputs) and its unique samples."""
    max_input = int(cfg["task"].get("max_length") or loaded.max_input_length)
    task = tasks.get_task_class(cfg["task"]["name"])(cfg["task"], loaded.tokenizer, max_input,
                                                     encode=lambda s: encode_prompt(loaded, s), resolved=resolved)
    return task, list({s.id: s for s in task.samples()}.values())


def _mean(values: list) -> float | None:
    return round(sum(vals) / len(vals), 6) if (vals := [v for v in values if v is not None]) else None


def selection(cfg: dict) -> dict[str, Any]:
    """The keys that chose this run's samples (they may change between runs of one folder)."""
    return {"max_samples": cfg.get("max_samples"), "shard.count": cfg["shard"]["count"],
            **({"sampling.n": cfg["sampling"]["n"]} if (cfg.get("sampling") or {}).get("temperature") else {}),
            **{f"task.{k}": cfg["task"].get(k) for k in SELECTION_KEYS if k in cfg["task"]}}


def summarize(cfg: dict, task: Task, records: list[dict], expected: list[str], relpath: str,
              skipped: list[dict] | None = None) -> dict[str, Any]:
    """``summary.json``: scores of this run's selection (``expected`` ids) from the latest record of each."""
    ids = set(expected)
    records = [r for r in records if r["id"] in ids]
    ok = [r for r in records if r.get("error") is None]
    means = lambda *keys: {k: _mean([r.get(k) for r in ok]) for k in keys}  # noqa: E731
    cache = means("prompt_tokens", "compressed_tokens", "cache_bytes_before", "cache_bytes_after", "read_bytes")
    cache.update({k: _mean([(r.get(k) or {}).get("mean") for r in ok]) for k in ("kept_tokens", "stored_tokens", "read_tokens")})
    cache["compressed_fraction"] = _mean([float(bool(r.get("compressed"))) for r in ok])
    decoded = ("decode_compressions", "decode_compress_s", "peak_stored_tokens")  # only when on (docs/DECODING.md)
    cache.update(means(*decoded) if any(r.get(decoded[0]) for r in ok) else {})
    return {
        "job": relpath, "task": cfg["task"]["name"], "model": cfg["model"]["name"], "method": cfg["method"]["name"],
        "method_label": cfg["method"].get("label") or cfg["method"]["name"], "budget": cfg["budget"],
        "n_samples": len(ok), "n_failed": len(records) - len(ok), "n_expected": len(expected),
        "complete": ids <= {r["id"] for r in ok}, "selection": selection(cfg), "ids": list(expected),
        "failed": [{"id": r["id"], **{k: v for k, v in r["error"].items() if k != "traceback"}}
                   for r in records if r.get("error")][:100],
        "n_skipped": sum(int(s.get("samples", 1)) for s in skipped or []), "skipped": list(skipped or []),
        **task.aggregate(records),
        "timings": means("prefill_s", "compress_s", "reconstruct_s", "decode_s", "decode_tok_s", "compile_s"),
        "cache": cache,
    }


def print_summary(summary: dict, path: Path) -> int:
    """Print the per-dataset score table of a job; returns its exit code (0, 1: failed samples)."""
    rows = [(ds, v.get("score"), v.get("n")) for ds, v in (summary.get("datasets") or {}).items()]
    w = max([7] + [len(r[0]) for r in rows])
    lines = [f"\njob {summary['job']}  ({'complete' if summary['complete'] else 'incomplete'}; {summary['n_samples']}/"
             f"{summary['n_expected']} {'candidates' if summary.get('pass_at_k') else 'samples'}, {summary['n_failed']} failed)",
             f"{'dataset':<{w}}  {'score':>7}  {'n':>4}", f"{'-' * w}  {'-' * 7}  {'-' * 4}"]
    lines += [f"{ds:<{w}}  {'-' if s is None else f'{s:.2f}':>7}  {n:>4}" for ds, s, n in rows]
    lines += [f"failed: {f['id']}: {f.get('type')}: {str(f.get('message', ''))[:160]}" for f in summary.get("failed", [])[:10]]
    if summary.get("n_skipped"):
        lines.append(f"skipped by the task: {summary['n_skipped']} ({summary['skipped'][0].get('reason', '')})")
    t, c = summary["timings"], summary["cache"]
    if summary["method"] != "full" and (c.get("compressed_fraction") or 1) < 1:
        lines.append(f"not compressed: {round((1 - c['compressed_fraction']) * summary['n_samples'])}/"
                     f"{summary['n_samples']} samples (prompt within budget={summary['budget']}: every prompt token kept)")
    if t.get("prefill_s") is not None:
        lines.append(f"mean prefill {t['prefill_s']:.3f}s  compress {t['compress_s']:.4f}s  decode {t['decode_s']:.3f}s "
                     f"({t['decode_tok_s']:.1f} tok/s)  kept {c['kept_tokens']:.0f}/{c.get('compressed_tokens') or c['prompt_tokens']:.0f} tokens per "
                     "compressible layer" + (f"; while decoding {c['decode_compressions']:.1f} compressions "
                                             f"({c['decode_compress_s']:.4f}s), at most {c['peak_stored_tokens']:.0f} "
                                             "tokens per KV head" if c.get("decode_compressions") else ""))
    lines.append(f"results: {path}")
    print("\n".join(lines), flush=True)
    return EXIT_SAMPLE_FAILED if summary["n_failed"] else EXIT_OK


def heatmap(store: JobStore, records: list[dict], cfg: dict) -> None:
    """Draw the NIAH job's depth × length ``heatmap.png`` and ``.pdf`` (a plot never fails a job)."""
    try:
        from kvbench.job.plots import draw_niah_heatmap, niah_colorbar, niah_grid, plt

        lengths, depths, _ = niah_grid(records)  # a failed sample's cell is grey
        fig, ax = plt.subplots(figsize=(max(4.8, 1.6 + 0.8 * len(lengths)), max(3.4, 1.6 + 0.4 * len(depths))),
                               layout="constrained")
        title = f"NIAH — {cfg['model']['name']} — {cfg['method'].get('label') or cfg['method']['name']} — budget {cfg['budget']}"
        if im := draw_niah_heatmap(ax, records, title):
            niah_colorbar(fig, [im], ax)
            for ext in ("png", "pdf"):
                fig.savefig(store.path / f"heatmap.{ext}", dpi=150)
        plt.close(fig)
    except Exception as e:  # noqa: BLE001
        log.warning("heatmap not written: %s", e)


def set_threads(threads: Any) -> None:
    """Set torch's CPU threads; ``auto``: the cores minus the 1-minute load (busy cores stall OpenMP threads)."""
    import torch

    if threads == "auto":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores - round(os.getloadavg()[0]))  # (POSIX, as the store's fcntl locks)
    if threads:
        torch.set_num_threads(threads)


def run_jobs(jobs: list[JobSpec], wait_s: float | None = None) -> list[int]:
    """Run checked jobs that differ only in method and budget on one model load and one prefill per sample
    (docs/SWEEPS.md); twins run once. ``wait_s``: for a held lock (default ``lock_wait_s``). Returns an exit code
    per job (0, 1 failed samples, 3 locked). ConfigError: the model cannot be loaded or the prompts do not fit."""
    from kvbench.engine.generate import Engine

    codes: dict[str, int] = {}
    with ExitStack() as stack:
        unique = [job for i, job in enumerate(jobs) if job.relpath not in {j.relpath for j in jobs[:i]}]
        if runs := open_stores(unique, stack, wait_s, codes):
            loaded, task, mine, expected, compiled = load(runs[0][0])
            envs = [write_env(job, store, loaded, compiled, mine) for job, store in runs]
            top, fmt = runs[0][0].top, prompt_format(loaded)
            engines = [Engine(loaded, job.method, job.top.budget, job.top.decode) for job, _ in runs]
            for engine, (job, _) in zip(engines, runs):
                engine.compile_decode, engine.prompt_format = compiled, fmt
                engine.quant = job.top.cache if job.top.cache.bits else None
            run_samples(engines, loaded, task, mine, [store for _, store in runs], top.quiet, top.sampling, top.seed,
                        top.batch_size, top.cache.max_bytes)
            for engine, (_, store), (name, env) in zip(engines, runs, envs):
                if engine.compile_error:  # this run's env.json says what ran: eager from the failure on
                    store.write_json(name, {**env, "decode_compiled": False, "compile_error": engine.compile_error})
            codes.update({job.relpath: summarise(job, store, task, expected) for job, store in runs})
            del engines, loaded, task
            free_cuda()
    return [codes[j.relpath] for j in jobs]


def open_stores(jobs: list[JobSpec], stack: ExitStack, wait_s: float | None, codes: dict[str, int]) -> list[tuple]:
    """Open each job's store in ``stack`` (docs/ARCHITECTURE.md, step 3): the ``(job, store)`` pairs to run."""
    runs = []
    for job in jobs:
        top, shard = job.top, (job.top.shard.index, job.top.shard.count)
        try:
            store = JobStore(Path(top.output_root).resolve() / job.relpath, shard)
        except OSError as e:
            raise OSError(f"output_root={top.output_root}: cannot make the job folder there ({e.strerror})") from None
        stack.push(lambda kind, *_, store=store: bool(kind and store.discard_if_empty()))
        try:
            stack.enter_context(store.locked(top.lock_wait_s if wait_s is None else wait_s))
        except JobLockedError as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            codes[job.relpath] = EXIT_LOCKED
            continue
        repaired = store.repair()
        if not (store.path / "config.yaml").exists():
            atomic_write(store.path / "config.yaml", OmegaConf.to_yaml({k: v for k, v in job.cfg.items() if k != "sweep"}))
            store.write_json("identity.json", job.identity)
            for rel, text in job.resolved.get("files", {}).items():  # generated data (task.generate): its hash is in the identity
                (store.path / "data" / rel).parent.mkdir(parents=True, exist_ok=True)
                atomic_write(store.path / "data" / rel, text)
        done = read_json(store.path / "summary.json")
        if (done and done.get("complete") and done.get("selection") == selection(job.cfg) and shard[1] == 1
                and not repaired and len(store.done_ids()) >= done["n_samples"]):  # the records still back it
            log.info("job %s: already complete; nothing to do", job.relpath)
            codes[job.relpath] = print_summary(done, store.path)
        else:
            runs.append((job, store))
    return runs


def load(job: JobSpec) -> tuple[Any, Task, list[Sample], list[str], bool]:
    """Seed, load the model, build the task: the model, the task, this shard's samples, the ids every shard expects,
    whether decode is compiled. ConfigError: the prompts + generation exceed the context window."""
    from transformers import set_seed

    from kvbench.engine.models import load_model

    top, (index, count) = job.top, (job.top.shard.index, job.top.shard.count)
    set_threads(top.threads)
    set_seed(top.seed)  # random, numpy, torch
    loaded = load_model(job.cfg["model"], top.device, job.source, job.method.layout)
    task, samples = build_task(job.cfg, loaded, job.resolved)
    if not samples:  # e.g. a Hub or parquet subset with no row of the chosen datasets
        raise TaskConfigError(f"task={job.cfg['task']['name']}: no samples to run (task.data_dir, its datasets or "
                              "subtasks, task.n_samples)")
    blocks = conversations(samples)  # a multi-turn conversation is never split
    cap = top.max_samples or len(blocks)
    mine = [s for block in blocks[index::count][:cap] for s in block]
    expected = [i for k in range(count) for block in blocks[k::count][:cap] for s in block for i in record_ids(s, top.sampling)]
    window = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)  # Gemma 3: text part
    need = max(map(task.tokens_needed, mine), default=0)
    if isinstance(window, int) and need > window:
        raise ConfigError(f"task.max_length / model.max_input_length: {need} tokens of prompt + generation exceed "
                          f"the model's context window of {window} tokens")
    compiled = not (top.decode.interval or job.method.reads) and (top.compile is True or (
        top.compile == "auto" and loaded.device.type == "cuda" and not top.model.device_map))
    return loaded, task, mine, expected, compiled


def write_env(job: JobSpec, store: JobStore, loaded: Any, compiled: bool, mine: list[Sample]) -> tuple[str, dict]:
    """Write ``env.json`` (``env.shard<k>.json``; a rerun's timestamped); returns its name and content."""
    name = "env.json" if job.top.shard.count == 1 else f"env.shard{job.top.shard.index}.json"
    if (store.path / name).exists():  # every run that stores samples keeps its provenance
        name = name.replace(".json", f".{time.strftime('%Y%m%d-%H%M%S')}.json")
    env = {**environment(loaded), "inputs": job.identity["inputs"], "artifacts": job.artifacts,
           "decode_compiled": compiled}
    store.write_json(name, env)
    stored, ids = store.done_ids(), [i for s in mine for i in record_ids(s, job.top.sampling)]  # a record per candidate
    done = sum(i in stored for i in ids)
    log.info("job %s: %d samples in this shard, %d of their %d records stored, %d to run", job.relpath, len(mine),
             done, len(ids), len(ids) - done)
    return name, env


def summarise(job: JobSpec, store: JobStore, task: Task, expected: list[str]) -> int:
    """Write ``summary.json`` (and the NIAH heatmap) under the append lock, print it; returns the job's exit code."""
    with store.append_lock():
        records = list(store.latest().values())
        summary = summarize(job.cfg, task, records, expected, job.relpath, getattr(task, "skipped", None))
        if job.cfg["task"]["name"] == "niah":
            heatmap(store, [r for r in records if r["id"] in set(summary["ids"])], job.cfg)
        before = read_json(store.path / "summary.json")
        if set(before.get("ids", ())) - set(summary["ids"]):  # a smaller selection: earlier records left unscored
            log.warning("job %s: summary.json now scores %d samples (%s), not the %d of %s; predictions.jsonl keeps "
                        "every record (run that selection again to score it)", job.relpath, summary["n_samples"],
                        summary["selection"], before.get("n_samples", 0), before["selection"])
        store.write_json("summary.json", summary)
    return print_summary(summary, store.path)


class Summary(dict):
    """A job's ``summary.json`` (:func:`api`); ``path``: its folder; :meth:`records`: its records, a pandas frame."""

    def records(self) -> Any:
        import pandas

        return pandas.DataFrame(list(JobStore(self.path).latest().values()))


def api(overrides: list[str], method: Any = None) -> Summary:
    """``kvbench.run`` (docs/METHODS.md): the job of ``overrides`` in this process; ``method``: a Method class or
    instance, run as ``method=plugin``. ConfigError / TaskConfigError before a model loads; JobLockedError."""
    if method is not None:
        cls = method if isinstance(method, type) else type(method)
        methods.CLASSES[target := f"{cls.__module__}:{cls.__qualname__}"] = cls
        fields = {} if cls is method else dataclasses.asdict(method.config)
        overrides = ["method=plugin", f"method.target={target}", *overrides, *(f"method.{k}={json.dumps(v)}"
                                                                                for k, v in fields.items())]
    cfg = compose(list(overrides), return_hydra_config=True)
    preset = cfg.hydra.runtime.choices.get("method")
    with open_dict(cfg):
        del cfg["hydra"]
    job = check(cfg, preset)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if run_jobs([job])[0] == EXIT_LOCKED:
        raise JobLockedError(f"job folder {job.relpath} is in use by another process")
    summary = Summary(read_json(path := Path(job.top.output_root).resolve() / job.relpath / "summary.json"))
    summary.path = path.parent
    return summary


def main(cfg: Any) -> Any:
    """Hydra's task function: check and run the job (a local sweep: return it, or its error, to the launcher)."""
    for noisy in ("transformers", "datasets", "httpx", "urllib3", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    local = multirun and str(OmegaConf.select(hc, "launcher._target_", default="")).endswith(".LocalLauncher")
    try:
        if not multirun and OmegaConf.select(hc, "sweeper.params"):
            raise ConfigError(f"experiment={hc.runtime.choices.get('experiment')} sweeps {', '.join(hc.sweeper.params)}:"
                              " add --multirun (-m) to run its jobs")
        job = check(cfg, hc.runtime.choices.get("method"))
        if local:
            return job
        logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
        # in a sweep a job may meet its twin (method=full at several budgets is one folder): wait for it
        code = run_jobs([job], max(job.top.lock_wait_s, 86400) if multirun else None)[0]
    except (ConfigError, TaskConfigError, OSError) as e:  # one line, before any model loads where it can
        if local:
            return e  # the launcher stops the sweep with it, once every job is checked
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.exit(EXIT_SAMPLE_FAILED if isinstance(e, OSError) else EXIT_CONFIG)
    if not multirun:
        sys.exit(code)
    if code:  # another launcher's job
        raise RuntimeError(f"kvbench job {job.relpath} exited {code}")
    return code


class SweepCheck(Callback):
    """``sweep.share_prefill=true`` with another launcher than the local one: one line, exit 2."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        if config.sweep.share_prefill and not str(config.hydra.launcher._target_).endswith(".LocalLauncher"):
            print(f"error: sweep.share_prefill=true: runs with the local launcher only (hydra/launcher=local), not "
                  f"{config.hydra.runtime.choices['hydra/launcher']}", file=sys.stderr, flush=True)
            sys.exit(EXIT_CONFIG)  # (an exception would be a warning: Hydra's callbacks catch them)


def run_sweep(jobs: list[JobSpec]) -> int:
    """Run a local sweep's checked jobs in order (``sweep.share_prefill``: grouped); the largest exit code."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=True)  # not Hydra's launcher format ([HYDRA])
    groups: dict[str, list[JobSpec]] = {}
    for i, job in enumerate(jobs):
        key = json.dumps({k: v for k, v in job.cfg.items() if k not in ("method", "budget")}, sort_keys=True,
                         default=str) if job.top.sweep.share_prefill else i
        groups.setdefault(key, []).append(job)
    codes = [0]
    for group in groups.values():  # in a shared group twins are one job: a held lock waits lock_wait_s, then exit 3
        codes += run_jobs(group, None if len(group) > 1 else max(group[0].top.lock_wait_s, 86400))
    return max(codes)
