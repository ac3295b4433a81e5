"""The job runner: validate, load, iterate samples, generate, score, store, summarise.

One job = one model × method × task × budget (× shard). Every sample is isolated: an
exception (out of memory, non-finite logits, tokenizer failure) is stored as an error record
and the job goes on; the exit code is 1 when any sample failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Mapping

import eval as tasks
from eval.base import Sample, Task, TaskConfigError
from methods import artifacts as method_artifacts
from methods.base import ConfigError, is_ratio

from . import heap
from .config_keys import RUN_CONTROL_KEYS, SAMPLE_SELECTION_KEYS
from .config_keys import flatten as _flatten
from .config_keys import under as _under
from .engine import Engine
from .faults import crash_point, injected, sample_delay
from .full_share import FullCacheShare, copied_record
from .models import LoadedModel, load_model
from .signals import stops_by_exception
from .store import JobStore, job_relpath, keep_previous, normalized_budget
from .validate import check_output_root, validate

log = logging.getLogger("kvbench")

EXIT_OK, EXIT_SAMPLE_FAILED, EXIT_CONFIG, EXIT_LOCKED = 0, 1, 2, 3  # 130/143: kvbench.signals
ROOT = Path(__file__).resolve().parents[1]



#: 1-minute load average from which a job with threads=null warns (another busy thread shares the cores)
BUSY_LOAD = 1.0


def warn_busy_cpu(threads: int, load: float | None = None) -> bool:
    """Warn (once, one line) when other processes keep the CPU busy and the job uses all its threads.

    With ``threads: null`` torch runs one thread per core; when another busy process shares those
    cores, OpenMP's threads wait on each other at every operation and a decode step of hundreds
    of small operations can run many times slower (measured on 2 cores with one other busy
    process: 1 token/s instead of 27). ``threads=1`` (or fewer threads than idle cores) avoids it.

    Args:
        threads: torch's intra-op threads for this job.
        load: the 1-minute load average (default: the OS's).

    Returns:
        Whether it warned.
    """
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            return False
    if threads < 2 or load < BUSY_LOAD:
        return False
    log.warning("the CPU is busy (1-minute load average %.1f) and threads=null runs %d torch threads: sharing "
                "cores with other processes can make decoding many times slower; set threads=1, or fewer threads "
                "than the idle cores", load, threads)
    return True

def encode_prompt(loaded: LoadedModel, sample: Sample) -> list[int]:
    """Token ids of a sample's prompt: the chat template (one user turn) when the sample and the
    model use it, else the plain tokenizer with its special tokens (LongBench's ``pred.py``)."""
    tok = loaded.tokenizer
    if sample.chat and loaded.chat_template:
        out = tok.apply_chat_template([{"role": "user", "content": sample.prompt}], add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, Mapping) else out
        return [int(i) for i in ids]
    return [int(i) for i in tok(sample.prompt)["input_ids"]]


def stop_ids_for(loaded: LoadedModel, sample: Sample) -> list[int]:
    """The model's stop ids plus the last token id of each of the sample's stop strings
    (LongBench stops samsum on ``tokenizer.encode("\\n", add_special_tokens=False)[-1]``)."""
    ids = list(loaded.stop_ids)
    for s in sample.stop_strings:
        enc = loaded.tokenizer.encode(s, add_special_tokens=False)
        if enc:
            ids.append(enc[-1])
    return ids


def environment(loaded: LoadedModel | None, device: str) -> dict[str, Any]:
    """Package versions, git revision, device, dtype and attention implementation for ``env.json``."""
    import torch
    import transformers

    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip() or None
        # tracked files changed since HEAD (untracked files, e.g. notebooks or a data link, do not count)
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        rev, dirty = None, None
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "host": platform.node(),
        "git_revision": rev,
        "git_dirty": dirty,
        "device": device,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "attention_implementation": "kvbench (SDPA prefill, grouped SDPA decode with per-layer logit bias)",
        # the decode step's projections and attention: the compiled CPU kernels (kvbench.cpu_decode,
        # float32 on CPU) or PyTorch's operations, with the reason the kernels are not used
        "decode_kernels": decode_kernels(loaded),
        # the C-heap policy of a CPU engine (kvbench.heap, applied here as the engine would):
        # whether it is in effect for this run
        "keep_heap": (heap.keep_freed_heap() if loaded is not None and loaded.device.type == "cpu"
                      else heap.in_effect()),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
    }
    if loaded is not None:
        env.update(
            dtype=str(loaded.dtype).replace("torch.", ""),
            device=str(loaded.device),
            model_source=loaded.source,
            layers=loaded.layout.num_layers,
            query_heads=loaded.layout.num_q_heads,
            kv_heads=loaded.layout.num_kv_heads,
            compressible_layers=list(loaded.layout.compressible_layers),
        )
    return env


def decode_kernels(loaded: LoadedModel | None) -> str | None:
    """How the decode step computes its projections and attention, for ``env.json``: ``c`` (the
    compiled CPU kernels of :mod:`kvbench.cpu_decode`), ``torch`` (a GPU or a non-float32
    model) or ``torch (<why the kernels are unavailable>)``; None before a model is loaded."""
    import torch

    if loaded is None:
        return None
    if loaded.device.type != "cpu" or loaded.dtype != torch.float32:
        return "torch"
    from . import cpu_decode

    reason = cpu_decode.unavailable_reason()
    return "c" if reason is None else f"torch ({reason})"


def lookm_kernel(method_cfg: Mapping[str, Any], loaded: LoadedModel | None) -> str | None:
    """How LOOK-M's quadratic steps run in this job, for ``env.json``: ``c`` (the compiled CPU
    kernels of :mod:`methods.cpu_kernels`), ``torch`` (set so, or a CUDA model) or ``torch
    (<why the kernels are unavailable>)``; None for a method without a ``kernel`` setting."""
    kernel = method_cfg.get("kernel") if hasattr(method_cfg, "get") else None
    if kernel is None:
        return None
    if kernel == "torch" or (loaded is not None and loaded.device.type != "cpu"):
        return "torch"
    from methods import cpu_kernels

    reason = cpu_kernels.unavailable_reason()
    return "c" if reason is None else f"torch ({reason})"


def _mean(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None


def this_run(records: list[dict], expected_ids: list[str]) -> list[dict]:
    """The records of this run's samples (its grid / datasets), what ``summary.json`` counts."""
    wanted = set(expected_ids)
    return [r for r in records if r.get("id") in wanted]


def summarize(
    cfg: dict, task: Task, records: list[dict], expected_ids: list[str], relpath: str, skipped: list[dict] | None = None,
    subset: str = "",
) -> dict[str, Any]:
    """The ``summary.json`` of a job from all its stored records (every shard).

    ``failed`` lists the failed samples (id, error type and message; first 100), ``skipped``
    what the task left out by its own rule (e.g. NIAH lengths over the model's max input, each
    entry with its number of ``samples``), ``n_skipped`` the samples so left out, ``subset``
    the keys that limited the run to part of a dataset (``"task.n_samples=50"``; ``""``: whole
    datasets or the whole grid).
    """
    records = this_run(records, expected_ids)  # others stay stored
    ok = [r for r in records if r.get("error") is None]
    done = {r["id"] for r in ok}
    agg = task.aggregate(records)
    summary: dict[str, Any] = {
        "job": relpath,
        "task": cfg["task"]["name"],
        "model": cfg["model"]["name"],
        "method": cfg["method"]["name"],
        "method_label": cfg["method"].get("label", cfg["method"]["name"]),
        "budget": cfg["budget"],
        "n_samples": len(ok),
        "n_failed": sum(1 for r in records if r.get("error") is not None),
        "n_expected": len(expected_ids),
        "n_reused": sum(1 for r in ok if r.get("reused_from")),  # copied from a full-cache job of another budget
        "complete": set(expected_ids) <= done,
        "selection": run_selection(cfg),
        "subset": subset,
        "failed": [{"id": r["id"], **(r.get("error") or {})} for r in records if r.get("error") is not None][:100],
        "n_skipped": sum(int(s.get("samples", 1)) for s in skipped or []),
        "skipped": list(skipped or []),
        **agg,
        "timings": {k: _mean([r.get(k) for r in ok]) for k in ("prefill_s", "compress_s", "decode_s", "decode_tok_s")},
        "cache": {
            "prompt_tokens": _mean([r.get("prompt_tokens") for r in ok]),
            "kept_tokens": _mean([(r.get("kept_tokens") or {}).get("mean") for r in ok]),
            "stored_tokens": _mean([(r.get("stored_tokens") or {}).get("mean") for r in ok]),
            "cache_bytes_before": _mean([r.get("cache_bytes_before") for r in ok]),
            "cache_bytes_after": _mean([r.get("cache_bytes_after") for r in ok]),
            "compressed_fraction": _mean([1.0 if r.get("compressed") else 0.0 for r in ok]),
        },
    }
    return summary


def prompt_sha256(sample: Sample) -> str:
    """SHA-256 (hex) of the sample's prompt as the task built it (truncated, before the chat
    template): the record's ``prompt_sha256``, and what a resume or a copy is checked against."""
    return hashlib.sha256(sample.prompt.encode("utf-8")).hexdigest()


def run_sample(engine: Engine, loaded: LoadedModel, task: Task, sample: Sample) -> dict[str, Any]:
    """Generate and score one sample; never raises (errors become an error record)."""
    base = {
        "id": sample.id,
        "dataset": sample.dataset,
        "answers": sample.answers,
        "all_classes": sample.all_classes,
        "length": sample.length,
        "meta": sample.meta,
        # the prompt as the task built it (truncated, before the chat template): audit it against a
        # prompt rebuilt by the official script without storing long contexts in every record
        "prompt_sha256": prompt_sha256(sample),
    }
    try:
        with injected(sample.id, loaded.model):  # KVBENCH_FAIL_SAMPLES (tests); inert otherwise
            ids = encode_prompt(loaded, sample)
            result = engine.generate(ids, sample.max_new_tokens, stop_ids_for(loaded, sample), sample.min_new_tokens)
        score = float(task.score(sample, result.text))
        if not math.isfinite(score):
            raise FloatingPointError(f"non-finite score {score!r} for prediction {result.text[:60]!r}")
        extra = task.extra_scores(sample, result.text) if hasattr(task, "extra_scores") else {}
        record = {**base, "prediction": result.text, "score": score, "scores": extra, **result.record(), "error": None}
        check_record(record)
        return record
    except Exception as e:  # noqa: BLE001 - per-sample isolation is the point (KeyboardInterrupt is not an Exception)
        if type(e).__name__ == "UncompletedJobError":
            raise  # submitit's preemption/time-limit signal: the task must stop and be requeued, not record a failure
        log.error("sample %s failed: %s: %s", sample.id, type(e).__name__, e)
        _release_cuda_memory()
        return error_record(base, e)


def error_record(base: dict[str, Any], err: BaseException) -> dict[str, Any]:
    """The stored record of a failed sample: ``score`` null, ``error`` = type and message."""
    return {**base, "prediction": None, "score": None, "error": {"type": type(err).__name__, "message": str(err)[:2000]}}


def check_record(record: dict[str, Any]) -> None:
    """Raise unless the record is storable: JSON without NaN/inf anywhere (scores, timings, stats).

    Raises:
        FloatingPointError: a NaN or inf value (the field is named).
        TypeError: a value JSON cannot encode.
    """

    def walk(value: Any, path: str) -> None:
        if isinstance(value, float) and not math.isfinite(value):
            raise FloatingPointError(f"non-finite value {value!r} in {path}")
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}[{i}]")

    walk(record, "")
    json.dumps(record, ensure_ascii=False, allow_nan=False)


def _release_cuda_memory() -> None:
    """Free cached CUDA blocks after a failed sample (an out-of-memory error must not poison the next)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_job(cfg: dict, method_preset: str | None = None, method_overrides: list[str] | None = None,
            experiment: str | None = None) -> int:
    """Run one job from a resolved config (a plain dict). Returns the process exit code.

    ``experiment``: the selected experiment preset (``""``: none; None: unknown), for the
    top-level key check (:func:`kvbench.validate.top_level_keys`).

    Raises:
        ConfigError / TaskConfigError: bad configuration (checked before the model loads).
        JobLockedError: another process runs the same job shard.
    """
    import torch
    from omegaconf import OmegaConf

    if "budget" in cfg:  # range(0.1, 0.4, 0.1) yields 0.30000000000000004: the ratio 0.3 (folder b0.3)
        cfg = {**cfg, "budget": normalized_budget(cfg["budget"])}
    method, _ = validate(cfg, experiment=experiment)
    cfg = absolute_paths(cfg)  # stored and compared absolute (messages above name the paths as typed)
    root = check_output_root(cfg.get("output_root", "results"))
    relpath = job_relpath(cfg, method_preset, method_overrides)
    dropped = ([f"run_tag={cfg['run_tag']}"] if cfg.get("run_tag") else []) + \
        (["the hash of the method.* overrides"] if method_overrides else [])
    if cfg.get("run_name") and dropped:
        log.warning("run_name=%s names the whole job folder, so %s is not part of its name (config.yaml keeps "
                    "every key)", cfg["run_name"], " and ".join(dropped))
    if method.name == "full" and not (is_ratio(cfg["budget"]) and cfg["budget"] == 1.0):  # budget=1 is 1 token
        log.warning("method=full keeps every token: budget=%s does not change what this job computes "
                    "(its folder is %s; budget=1.0 names the usual full-cache job; samples a full-cache job of "
                    "another budget has stored are copied, not recomputed: reuse_full)", cfg["budget"], relpath)
    if not (root / relpath).resolve().is_relative_to(root):
        raise ConfigError(f"job folder {relpath}: resolves outside output_root={root}; check run_name and model.name")
    _check_not_nested(root, relpath, cfg.get("run_name"))
    shard = (int(cfg["shard"]["index"]), int(cfg["shard"]["count"]))
    folders = [root / relpath, *(root / relpath).parents]
    folders = folders[: folders.index(root)] if root in folders else folders[:1]  # below output_root
    created = next((p for p in reversed(folders) if not p.exists()), None)  # the highest this run makes
    store = JobStore(root / relpath, shard)
    with store.locked(float(cfg.get("lock_wait_s") or 0)):
        store.repair()  # a truncated last line (kill -9 mid-write) is moved aside and its sample redone
        store.clean_stale_temp()  # temp files of atomic writes interrupted by a kill
        config_text = OmegaConf.to_yaml(OmegaConf.create(cfg))
        done_summary = _complete_summary(store, cfg)
        if done_summary is not None:  # a resubmitted sweep: this job is finished, no model load
            n = done_summary["n_samples"]
            log.info("job %s: already complete (%d sample%s stored); nothing to do", relpath, n, "" if n == 1 else "s")
            if cfg["task"]["name"] == "niah" and _heatmap_stale(store):
                from .report_data import niah_grid_records

                _heatmap(store, niah_grid_records(store.path), cfg)  # redrawn from the summary's grid
                _date_heatmaps_as_summary(store)
            print_summary(done_summary, store.path)
            return EXIT_SAMPLE_FAILED if done_summary["n_failed"] else EXIT_OK
        _check_same_job(store, cfg, relpath)
        fresh = not (store.path / "config.yaml").exists()
        before = set(store.path.glob("config*.yaml"))
        written = store.write_config(config_text, same=lambda stored: _same_run(stored, cfg))
        new_snapshot = written if written not in before and written.name != "config.yaml" else None
        try:
            if cfg.get("threads"):
                torch.set_num_threads(int(cfg["threads"]))
            elif str(cfg.get("device", "auto")) in ("auto", "cpu") and not torch.cuda.is_available():
                warn_busy_cpu(torch.get_num_threads())
            random.seed(cfg.get("seed", 0))
            torch.manual_seed(int(cfg.get("seed", 0)))
            try:
                loaded = load_model(cfg["model"], cfg.get("device", "auto"))
            except OSError as e:  # a local folder or file transformers cannot read (missing or corrupt weights)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ConfigError(f"model.source={cfg['model'].get('source')}: cannot load the model ({first})") from None
            method.layout = loaded.layout
            method_artifacts.reset_files_read()
            method.check_layout(loaded.layout)
            artifact_files = method_artifacts.files_read()  # head / layer score files this method reads
            _check_artifacts(store, artifact_files, relpath, cfg)
            max_input = int(cfg["task"].get("max_length") or loaded.max_input_length)
            window = getattr(loaded.model.config, "max_position_embeddings", None)
            if isinstance(window, int) and max_input > window:
                log.warning("task.max_length / model.max_input_length = %d tokens is more than the model's context "
                            "window (max_position_embeddings = %d): longer prompts run past the positions it was "
                            "trained on", max_input, window)
            task = tasks.get_task_class(cfg["task"]["name"])(
                cfg["task"], loaded.tokenizer, max_input, encode=lambda s: encode_prompt(loaded, s)
            )
            samples = list(task.samples())  # a task whose rules leave nothing to run raises here
        except (ConfigError, TaskConfigError):
            # A setting refused before any sample was stored leaves no config.yaml behind, so the
            # corrected command (often the one the error suggests) can use this folder.
            if fresh and not store.predictions.exists():
                (store.path / "config.yaml").unlink(missing_ok=True)
                (store.path / ARTIFACTS_FILE).unlink(missing_ok=True)
                if created is not None:  # a folder this run made holds nothing: remove it
                    store.discard_if_empty(created)
            if new_snapshot is not None:  # nor the config snapshot of a refused run in a folder with samples
                new_snapshot.unlink(missing_ok=True)
            raise
        samples = _unique(samples)
        expected = [s.id for s in samples]
        mine = [s for i, s in enumerate(samples) if i % shard[1] == shard[0]]
        # what limited this run to part of each dataset (the report flags such scores)
        subset = [f"task.n_samples={cfg['task'].get('n_samples')}"] if task.cut_datasets else []
        if cfg.get("max_samples"):
            cap = int(cfg["max_samples"])
            if any(len(samples[k :: shard[1]]) > cap for k in range(shard[1])):
                subset.append(f"max_samples={cap}")
            mine = mine[:cap]
            # every shard runs its first max_samples samples: the job expects all of those
            expected = [s.id for k in range(shard[1]) for s in samples[k :: shard[1]][:cap]]
        env = environment(loaded, cfg.get("device", "auto"))
        env["haystack_source"] = getattr(task, "haystack_source", None)
        kernel = lookm_kernel(cfg.get("method") or {}, loaded)
        if kernel is not None:
            env["lookm_kernel"] = kernel
        if artifact_files:
            env["artifacts"] = artifact_files  # {file: sha256}, also in the folder's artifacts.json
        try:
            stored = store.records()
            if stored:  # a resume: the stored samples must have been computed as this run would
                _check_same_environment(store, env, relpath)
                _check_same_prompts(stored, cfg, mine, relpath)
        except ConfigError:
            if new_snapshot is not None:  # a refused run leaves no config of its own behind
                new_snapshot.unlink(missing_ok=True)
            raise
        # written with this run's first record: an attempt that stores no sample (a GPU run that
        # failed before its first one) must not make the folder's samples look computed there
        store.write_json_with_first_record("env.json" if shard[1] == 1 else f"env.shard{shard[0]}.json", env)
        done = store.done_ids()
        share = None
        if method.name == "full" and cfg.get("reuse_full", True) and not cfg.get("run_name"):
            done |= reuse_full_cache_samples(store, root, cfg, [s for s in mine if s.id not in done], env)
            share = FullCacheShare(store.path, root, {s.id: prompt_sha256(s) for s in mine if s.id not in done},
                                   lambda folder: full_cache_sibling(folder, cfg, env))
        todo = [s for s in mine if s.id not in done]
        log.info(
            "job %s: samples in this shard: %d, already stored: %d, to run: %d (compressible layers: %d of %d)",
            relpath, len(mine), len(mine) - len(todo), len(todo), len(loaded.layout.compressible_layers),
            loaded.layout.num_layers,
        )
        engine = Engine(loaded, method, cfg["budget"])
        failed = _loop(engine, loaded, task, todo, store, quiet=bool(cfg.get("quiet")), share=share,
                       resumed=len(todo) < len(mine))
        with store._append_lock():  # shards finishing together: the last summary written sees every record
            records = store.records()
            summary = summarize(cfg, task, records, expected, relpath, getattr(task, "skipped", None), " ".join(subset))
            if cfg["task"]["name"] == "niah":  # before the summary: a job stopped here is not finished
                _heatmap(store, this_run(records, expected), cfg)  # the summary's samples
            earlier = keep_other_selection_summary(store.path / "summary.json", summary)
            store.write_json("summary.json", summary)
        print_summary(summary, store.path)
        stored = len({r.get("id") for r in records if r.get("error") is None})
        if stored > summary["n_samples"] or earlier is not None:
            print(f"predictions.jsonl holds {stored} samples; this summary scores the {summary['n_samples']} of this "
                  "run's selection" + (f"; the previous summary.json (another selection) is kept as {earlier.name}"
                                       if earlier is not None else ""), flush=True)
    any_failed = failed or summary["n_failed"] > 0
    return EXIT_SAMPLE_FAILED if any_failed else EXIT_OK


def keep_other_selection_summary(path: Path, summary: Mapping[str, Any]) -> Path | None:
    """Keep a job's ``summary.json`` beside it (:func:`store.keep_previous`) before a summary of
    another sample selection replaces it (``selection`` or ``n_expected`` differ: a rerun with
    ``max_samples``, a narrower grid...), so the earlier scores stay readable; a summary of the
    same selection is simply updated. Returns the copy, or None."""
    try:
        previous = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(previous, dict):
        return None
    if same_selection(previous.get("selection"), summary.get("selection")) and \
            previous.get("n_expected") == summary.get("n_expected"):
        return None
    return keep_previous(path)


def run_selection(cfg: dict) -> dict[str, Any]:
    """The sample-selection keys of ``cfg`` (:data:`SAMPLE_SELECTION_KEYS`, ``model.gguf_cache``
    aside), flattened and JSON-normalised: what ``summary.json`` records as ``selection``.

    A summary scores the whole job whichever shard wrote it, so the shard is not part of its
    selection (:func:`_shard_keys_ignored`), except ``shard.count`` with ``max_samples``: that
    pair decides which samples the job expects (each shard's first ones)."""
    flat = _flatten(json.loads(json.dumps(cfg, default=str)))
    keys = [k for k in SAMPLE_SELECTION_KEYS if k != "model.gguf_cache"]
    ignored = _shard_keys_ignored(flat.get("max_samples"))
    return {k: v for k, v in sorted(flat.items()) if _under(k, keys) and k not in ignored}


def _shard_keys_ignored(max_samples: Any) -> tuple[str, ...]:
    """The shard keys that do not change which samples a job expects: the index always, the
    count unless ``max_samples`` caps each shard."""
    return ("shard.index",) if max_samples else ("shard.index", "shard.count")


def same_selection(a: Any, b: Any) -> bool:
    """Whether two summaries' ``selection`` fields name the same samples: equal but for the shard
    keys that do not change them (which summaries written before they were left out record)."""
    def whole_job(sel: Any) -> Any:
        if not isinstance(sel, dict):
            return sel
        ignored = _shard_keys_ignored(sel.get("max_samples"))
        return {k: v for k, v in sel.items() if k not in ignored}

    return whole_job(a) == whole_job(b)


#: Local paths a job reads its inputs from. They are stored absolute (:func:`absolute_paths`), so
#: that a rerun from another working directory that would read other files is seen as another
#: setting, and one that reads the same files is not.
PATH_KEYS = (("task", "data_dir"), ("task", "haystack_dir"), ("model", "source"))


def absolute_paths(cfg: dict) -> dict:
    """``cfg`` with its relative local input paths (:data:`PATH_KEYS`) made absolute, from the
    current working directory. ``model.source`` changes only when it names an existing path (a Hub
    id or ``pypi:`` source stays as written); ``null`` and absolute paths stay as they are."""
    out = json.loads(json.dumps(cfg, default=str))
    for section, key in PATH_KEYS:
        node = out.get(section)
        value = node.get(key) if isinstance(node, dict) else None
        if not isinstance(value, str) or not value or Path(value).is_absolute():
            continue
        if key == "source" and (value.startswith("pypi") or not Path(value).exists()):
            continue
        node[key] = str(Path(value).resolve())
    return out


def _config_changes(stored_text: str, cfg: dict, free: tuple[str, ...]) -> dict[str, tuple[Any, Any]] | None:
    """``{dotted key: (stored, ours)}`` for the keys that differ, keys under ``free`` aside.

    Returns None when the stored text is not a YAML mapping.
    """
    import yaml

    try:
        stored = yaml.safe_load(stored_text)
    except yaml.YAMLError:
        return None
    if not isinstance(stored, dict):
        return None
    # a config.yaml stored before paths were made absolute: read its paths from here, as its run did
    old, new = _flatten(absolute_paths(stored)), _flatten(absolute_paths(cfg))
    return {
        k: (old.get(k), new.get(k))
        for k in sorted(old.keys() | new.keys())
        if old.get(k) != new.get(k) and not _under(k, free)
    }


def _check_not_nested(root: Path, relpath: str, run_name: Any) -> None:
    """Refuse a job folder inside another job's folder, or one that would hold other jobs' folders
    (``run_name=niah`` over ``niah/<model>/...``): reports and resumes read a folder with a
    ``config.yaml`` as one job, so the two would mix (before the model loads; nothing written).

    Raises:
        ConfigError: names ``run_name`` (or the job folder) and the other job's folder.
    """
    folder = root / relpath
    what = f"run_name={run_name}" if run_name else f"job folder {relpath}"
    for parent in list(folder.parents)[: len(Path(relpath).parts) - 1]:  # between output_root and the folder
        if (parent / "config.yaml").is_file():
            raise ConfigError(f"{what}: inside the job folder {parent.relative_to(root).as_posix()}; choose a "
                              "run_name that is not below another job's folder")
    if folder.is_dir():
        for dirpath, dirnames, filenames in os.walk(folder):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if dirpath != str(folder) and "config.yaml" in filenames:
                inner = Path(dirpath).relative_to(root).as_posix()
                raise ConfigError(f"{what}: the folder holds the job folder {inner}; choose a run_name that is not "
                                  "above other jobs' folders (e.g. runs/NAME)")


ARTIFACTS_FILE = "artifacts.json"  # {artifact file: sha256} the job folder's samples were computed with


def _elsewhere(cfg: dict) -> str:
    """How to keep a job folder and run another setting beside it (for error messages)."""
    return ("pass another run_name" if cfg.get("run_name") else "pass run_tag=NAME (a separate job folder)") + \
        " or another output_root"


def _check_artifacts(store: JobStore, files: dict[str, str], relpath: str, cfg: dict) -> None:
    """Refuse to add samples computed with other artifact files (head / layer scores) to a job folder.

    ``config.yaml`` names an artifact only by its path (``method.head_idx_path: null`` is the
    default file of the model), so a recalibration (``python -m methods.calibrate`` rewrites
    ``methods/artifacts/<model>/``) would otherwise mix samples of two head rankings in one
    folder. The folder's ``artifacts.json`` records ``{file: sha256}`` of what its samples read;
    a resume reading other contents stops with one line. A folder of an earlier version without
    the file gets it on its next run.

    Args:
        files: :func:`methods.artifacts.files_read` after the method loaded its artifacts.

    Raises:
        ConfigError: the folder holds samples and its recorded files differ from ``files``.
    """
    path = store.path / ARTIFACTS_FILE
    try:
        stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    except (OSError, ValueError):
        stored = None
    if isinstance(stored, dict) and store.records():
        changed = [k for k in sorted(stored.keys() | files.keys()) if stored.get(k) != files.get(k)]
        if changed:
            name = changed[0]
            was, now = stored.get(name), files.get(name)
            what = "changed" if was and now else ("is not read any more" if was else "is read now")
            raise ConfigError(
                f"method artifacts: {name} {what} since the samples in job folder {relpath} were computed (sha256 "
                f"{(was or '-')[:12]} -> {(now or '-')[:12]}); restore that file (methods.calibrate keeps an "
                f"earlier one as <name>.<time>.json beside it), or {_elsewhere(cfg)} to keep both"
            )
    if files and stored != files:
        from .store import atomic_write

        atomic_write(path, json.dumps(files, indent=1) + "\n")


def _check_same_job(store: JobStore, cfg: dict, relpath: str) -> None:
    """Refuse to add samples of a different setting to a job folder (before the model loads).

    The folder name holds task, model, method preset, budget, ``run_tag`` and a hash of the
    ``method.*`` overrides; any other key that changes how a sample is computed (the model
    source, the haystack, the generation limit, the seed, the device...) would otherwise
    reuse the stored samples of the old setting under the new one.

    A stored ``config.yaml`` with no sample beside it (its run stopped before the first one)
    and no other shard running is kept as ``config.<time>.yaml`` and replaced.

    Raises:
        ConfigError: the stored ``config.yaml`` differs in such keys (up to three are named).
    """
    path = store.path / "config.yaml"
    elsewhere = _elsewhere(cfg)
    diff = (_config_changes(path.read_text(encoding="utf-8", errors="replace"), cfg, RUN_CONTROL_KEYS + SAMPLE_SELECTION_KEYS)
            if path.exists() else None)
    if diff is None:  # no readable config.yaml: the stored samples' setting is unknown
        n = len(store.records())
        if n:
            what = "an unreadable config.yaml" if path.exists() else "no config.yaml"
            raise ConfigError(
                f"config.yaml: job folder {relpath} holds {n} stored sample{'' if n == 1 else 's'} but {what}, so their "
                f"setting is unknown; restore its config.yaml (a config.<time>.yaml there may be a copy), or {elsewhere}"
            )
        return
    if diff and not store.records() and not store.other_shards_running():
        # a run that stopped (Ctrl-C, SIGTERM, a crash) before its first sample: nothing is stored
        # under the old setting, so the folder takes the new one (the old file is kept)
        kept = keep_previous(path)
        path.unlink()
        log.info("job %s: its config.yaml is of a run that stored no sample (kept as %s); this run's setting "
                 "replaces it", relpath, kept.name if kept else "-")
        return
    if diff:
        keys = sorted(diff, key=lambda k: k != "method.name")  # another method is named as such
        shown = ", ".join(f"{k}: {diff[k][0]!r} -> {diff[k][1]!r}" for k in keys[:3]) + (", ..." if len(diff) > 3 else "")
        key = keys[0]
        raise ConfigError(
            f"{key}={diff[key][1]}: job folder {relpath} already holds samples run with another setting ({shown}); "
            f"{elsewhere} to keep both"
        )


def reuse_full_cache_samples(store: JobStore, root: Path, cfg: dict, todo: list[Sample],
                             env: Mapping[str, Any] | None = None) -> set[str]:
    """Copy into ``store`` the finished samples of ``todo`` that a full-cache job of another budget holds.

    The full cache keeps every token, so a ``method=full`` job computes the same predictions at
    every budget; a paper preset's sweep (method × budget) would otherwise compute them once per
    budget. A sibling is another folder of this job's ``<task>/<model>/<method preset>/`` whose
    ``config.yaml`` is a full-cache job equal to ``cfg`` in every key but ``budget`` (and the
    sample-selection and run-control keys, :data:`SAMPLE_SELECTION_KEYS`,
    :data:`RUN_CONTROL_KEYS`) and whose ``env*.json`` resolved ``auto`` settings as this run
    did (:data:`ENV_KEYS`: device type, dtype, haystack source). A sample is copied only from a record stored without error
    whose ``prompt_sha256`` is the hash of this sample's prompt; the copy is the sibling's
    record (predictions, scores, timings of the run that computed it) plus ``reused_from``:
    the job folder, relative to ``output_root``, that computed it. Siblings are read as they
    are when this job starts; siblings running at the same time (SLURM array tasks) share the
    rest sample by sample (:mod:`kvbench.full_share`).

    Args:
        store: this job's folder (lock held).
        root: ``output_root`` (absolute).
        cfg: this job's resolved config (``method.name == "full"``).
        todo: this shard's samples not yet stored here.
        env: this run's ``env.json`` content (None: not compared).

    Returns:
        The ids copied (now stored here).
    """
    if not todo:
        return set()
    wanted = {s.id: prompt_sha256(s) for s in todo}
    copied: set[str] = set()
    own = store.path.relative_to(root).as_posix()
    for folder in sorted(p for p in store.path.parent.iterdir() if p.is_dir() and p != store.path):
        if not (folder / "predictions.jsonl").is_file() or not full_cache_sibling(folder, cfg, env):
            continue
        source = folder.relative_to(root).as_posix()
        found = []
        for rec in JobStore(folder).records():
            sid = rec.get("id")
            if sid in wanted and sid not in copied and rec.get("error") is None and rec.get("prompt_sha256") == wanted[sid]:
                found.append(copied_record(rec, source, own))
        for rec in found:
            store.append(rec)
            copied.add(rec["id"])
        if found:
            counts: dict[str, int] = {}
            for rec in found:
                counts[rec["reused_from"]] = counts.get(rec["reused_from"], 0) + 1
            computed = ("" if set(counts) == {source} else ", computed by " + ", ".join(
                f"{origin} ({n})" for origin, n in sorted(counts.items())))
            log.info("job %s: %d sample%s copied from the full-cache job %s%s (the same computation at another "
                     "budget; reuse_full=false recomputes them)", own, len(found),
                     "" if len(found) == 1 else "s", source, computed)
        if len(copied) == len(wanted):
            break
    return copied


def full_cache_sibling(folder: Path, cfg: dict, env: Mapping[str, Any] | None = None) -> bool:
    """Whether ``folder`` (in the preset folder of a full-cache job with config ``cfg``) is a
    full-cache job of the same setting: its ``config.yaml`` equals ``cfg`` in every key but
    ``budget``, :data:`SAMPLE_SELECTION_KEYS` and :data:`RUN_CONTROL_KEYS`, and its ``env*.json``
    resolved ``auto`` as ``env`` did (:data:`ENV_KEYS`; None: not compared). An unreadable config
    is not a sibling."""
    config = folder / "config.yaml"
    try:
        diff = _config_changes(config.read_text(encoding="utf-8"), cfg,
                               RUN_CONTROL_KEYS + SAMPLE_SELECTION_KEYS + ("budget",))
    except (OSError, ValueError):  # missing, unreadable or not UTF-8
        return False
    return diff == {} and not (env is not None and _env_differences(folder, env))


#: What ``auto`` settings resolve to at run time (``device=auto``: CUDA + bf16 or CPU float32;
#: ``task.haystack_source=auto``: the Hub or the embedded text), as ``env.json`` records it: the
#: stored samples of a folder, and samples copied from another folder, must share them.
ENV_KEYS = ("device_type", "dtype", "haystack_source")


def _resolved(env: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`ENV_KEYS` of an ``env.json`` (``device_type``: ``cuda`` of ``cuda:1``)."""
    device = env.get("device")
    return {"device_type": str(device).split(":")[0] if device else None, "dtype": env.get("dtype"),
            "haystack_source": env.get("haystack_source")}


def _env_differences(folder: Path, env: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{key: (stored, now)}`` for the :data:`ENV_KEYS` in which a stored ``env*.json`` of ``folder``
    differs from ``env`` (keys a stored file lacks are not compared)."""
    now = _resolved(env)
    for path in sorted(folder.glob("env*.json")):
        try:
            stored = _resolved(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, AttributeError):
            continue
        diff = {k: (stored[k], now[k]) for k in ENV_KEYS if stored[k] is not None and stored[k] != now[k]}
        if diff:
            return diff
    return {}


def _check_same_environment(store: JobStore, env: Mapping[str, Any], relpath: str) -> None:
    """Refuse to add samples computed on another device type, dtype or haystack to a folder.

    ``device=auto`` and ``task.haystack_source=auto`` are stored as ``auto`` in ``config.yaml``,
    so :func:`_check_same_job` cannot see that a resume on a GPU machine (bf16) or with the Hub
    reachable would compute differently; ``env.json`` records what they resolved to.

    Raises:
        ConfigError: a stored ``env*.json`` of the folder (called when it holds samples) differs
            in :data:`ENV_KEYS` (the model is loaded by then; nothing is written).
    """
    diff = _env_differences(store.path, env)
    if diff:
        shown = ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in diff.items())
        key = next(iter(diff))
        what = "task.haystack_source=auto" if key == "haystack_source" else "device=auto"
        raise ConfigError(
            f"{key}={diff[key][1]}: job folder {relpath} holds samples computed with {key}={diff[key][0]} "
            f"({shown}, as the stored env.json says; {what} resolves otherwise here); run it where it resolves as "
            "before, or pass run_tag=NAME for a separate job folder"
        )


def _check_same_prompts(records: list[dict], cfg: dict, samples: list[Sample], relpath: str) -> None:
    """Refuse a resume whose inputs changed under the same config: a stored sample's
    ``prompt_sha256`` differs from the prompt this run builds for it (the haystack or data
    files were edited, the embedded haystack of another Python version).

    Raises:
        ConfigError: names the input key, the first such sample and both hashes (nothing written).
    """
    wanted = {s.id: s for s in samples}
    for rec in records:
        sample = wanted.get(rec.get("id"))
        if sample is None or rec.get("error") is not None or not rec.get("prompt_sha256"):
            continue
        now = prompt_sha256(sample)
        if now != rec["prompt_sha256"]:
            task = cfg["task"]
            key = ("task.data_dir" if "data_dir" in task else "task.haystack_dir" if task.get("haystack_dir")
                   else "task.haystack_source")
            raise ConfigError(
                f"{key}={task.get(key.split('.', 1)[1])}: the stored sample {rec['id']} of job folder "
                f"{relpath} was run on another prompt (prompt_sha256 {rec['prompt_sha256'][:12]} -> "
                f"{now[:12]}): the task's input files changed; pass run_tag=NAME for a separate job folder"
            )


def _same_run(stored_text: str, cfg: dict) -> bool:
    """Whether a stored ``config.yaml`` describes the same job as ``cfg`` (run-control keys and
    the shard keys that do not change the job's samples aside: the shards of a job write one
    ``config.yaml``, not one snapshot each)."""
    return _config_changes(stored_text, cfg, RUN_CONTROL_KEYS + _shard_keys_ignored(cfg.get("max_samples"))) == {}


def _complete_summary(store: JobStore, cfg: dict) -> dict | None:
    """The stored summary when the job is complete with this very config (single shard), else None.

    "This very config": ``config.yaml`` equal to ``cfg`` but for :data:`RUN_CONTROL_KEYS` and
    :data:`SAMPLE_SELECTION_KEYS` (a rerun may have changed the grid), and the summary of this
    sample selection (its ``selection`` field).
    """
    summary_path, config_path = store.path / "summary.json", store.path / "config.yaml"
    if store.shard[1] != 1 or not summary_path.exists() or not config_path.exists():
        return None
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    # the grid may differ from config.yaml (the first run's): the summary's selection decides below
    stored = config_path.read_text(encoding="utf-8")
    if not summary.get("complete") or _config_changes(stored, cfg, RUN_CONTROL_KEYS + SAMPLE_SELECTION_KEYS) != {}:
        return None
    # config.yaml is the first run's config; the summary is the last run's. A grid changed in
    # between (other depths, datasets, sample count) makes the stored summary another run's.
    if not same_selection(summary.get("selection"), run_selection(cfg)):
        return None
    if len(store.done_ids()) < int(summary.get("n_expected", 0)):
        return None
    return summary


def _unique(samples: list[Sample]) -> list[Sample]:
    """The samples with duplicate ids dropped (first kept): a sample id is stored once."""
    seen: set[str] = set()
    out = []
    for sample in samples:
        if sample.id not in seen:
            seen.add(sample.id)
            out.append(sample)
    return out


def _claimed(todo: list[Sample], share: FullCacheShare | None) -> Iterator[tuple[Sample, int | None]]:
    """The samples in order, each with its claim when ``share`` is set (:mod:`kvbench.full_share`):
    a sample another full-cache job of this setting holds is put off to the end and then waited
    for. The caller releases each claim once the sample's record is stored."""
    if share is None:
        yield from ((s, None) for s in todo)
        return
    later = []
    for sample in todo:
        fd = share.claim(sample.id, wait=False)
        if fd is None:
            later.append(sample)
        else:
            yield sample, fd
    for sample in later:
        yield sample, share.claim(sample.id, wait=True)


def _loop(engine: Engine, loaded: LoadedModel, task: Task, todo: list[Sample], store: JobStore, quiet: bool,
          share: FullCacheShare | None = None, resumed: bool = False) -> int:
    """Run ``todo``, appending one record per sample; returns the number of failed samples.

    ``resumed``: the job already holds samples, so the logged running mean covers only this
    run's samples (said in the log line).
    """
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    failed = 0
    scores: list[float] = []
    # A terminal gets a progress bar; a log file (SLURM, nohup, a pipe) gets one plain line per
    # sample instead of the bar's carriage-return redraws.
    interactive = sys.stderr.isatty()
    bar = tqdm(total=len(todo), desc="samples", unit="sample", disable=quiet or not todo or not interactive,
               dynamic_ncols=True)
    # Log lines (warnings) are printed above the bar instead of into its line. Ctrl-C/SIGTERM
    # raise here, between whole records (kvbench.signals); outside the loop they exit at once.
    with logging_redirect_tqdm(), stops_by_exception():
        for i, (sample, claim) in enumerate(_claimed(todo, share), 1):
            try:
                # a full-cache job of this setting running at the same time may have stored it meanwhile
                rec = share.copy_of(sample.id) if share is not None else None
                if rec is None:
                    crash_point("sample")
                    sample_delay()
                    rec = run_sample(engine, loaded, task, sample)
                try:
                    store.append(rec)
                except (TypeError, ValueError) as e:  # not storable as JSON: store the failure instead
                    rec = error_record({k: rec.get(k) for k in ("id", "dataset", "answers", "all_classes", "length")}, e)
                    store.append(rec)
            finally:
                if claim is not None:
                    share.release(claim)
            bar.update(1)
            failed += rec["error"] is not None
            if rec["error"] is None:
                scores.append(float(rec["score"]))
                # the running mean of this run's samples, x100 like the summary table (not the last sample's)
                bar.set_postfix(mean_score=f"{100 * sum(scores) / len(scores):.2f}", tok_s=f"{rec['decode_tok_s']:.1f}",
                                refresh=False)  # shown with the count that includes this sample
            if not interactive and not quiet:
                outcome = (f"score {100 * rec['score']:.2f}, {rec['decode_tok_s']:.1f} tok/s" if rec["error"] is None
                           else f"failed ({rec['error']['type']})")
                if rec.get("reused_from") and share is not None:
                    outcome += f", copied from {rec['reused_from']} (computed there meanwhile)"
                mean = (f"; mean_score {100 * sum(scores) / len(scores):.2f}"
                        + (" (this run's samples)" if resumed else "")) if scores else ""
                log.info("sample %d/%d %s: %s%s", i, len(todo), rec["id"], outcome, mean)
    bar.close()
    return failed


def _heatmap_stale(store: JobStore) -> bool:
    """Whether a finished NIAH job's ``heatmap.png`` may not be its summary's: missing, or newer
    than ``summary.json`` (a run of another grid drew it and was killed before its summary: the
    heatmaps are written just before the summary)."""
    try:
        return (store.path / "heatmap.png").stat().st_mtime > (store.path / "summary.json").stat().st_mtime
    except FileNotFoundError:
        return True


def _date_heatmaps_as_summary(store: JobStore) -> None:
    """Give redrawn heatmaps the summary's modification time (they are its, see :func:`_heatmap_stale`)."""
    import os

    stat = (store.path / "summary.json").stat()
    for name in ("heatmap.png", "heatmap.pdf"):
        if (store.path / name).exists():
            os.utime(store.path / name, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def _heatmap(store: JobStore, records: list[dict], cfg: dict) -> None:
    """Draw the job's ``heatmap.png`` and ``heatmap.pdf``, each written whole (temp file, rename)."""
    import os

    tmp = store.path / f".heatmap.tmp-{os.getpid()}.png"  # a killed run's is removed by clean_stale_temp
    try:
        from .plots import plot_niah_heatmap

        title = f"NIAH — {cfg['model']['name']} — {cfg['method'].get('label', cfg['method']['name'])} — budget {cfg['budget']}"
        if plot_niah_heatmap([r for r in records if r.get("error") is None], tmp, title) is not None:
            for suffix in (".pdf", ".png"):
                os.replace(tmp.with_suffix(suffix), store.path / f"heatmap{suffix}")
    except Exception as e:  # noqa: BLE001 - a plot never fails a job
        log.warning("heatmap not written: %s", e)
    finally:
        for suffix in (".png", ".pdf"):
            tmp.with_suffix(suffix).unlink(missing_ok=True)


def _n_uncompressed(summary: dict) -> int:
    """How many of a compressing job's scored samples kept their whole prompt (n ≤ budget, or
    budget=1.0): from the summary's ``cache.compressed_fraction``; 0 for method=full."""
    frac = (summary.get("cache") or {}).get("compressed_fraction")
    if summary.get("method") == "full" or frac is None or not summary.get("n_samples"):
        return 0
    return round((1.0 - frac) * summary["n_samples"])


def print_summary(summary: dict, path: Path) -> None:
    """Print the per-dataset score table of a job."""
    rows = [(ds, v.get("score"), v.get("n")) for ds, v in (summary.get("datasets") or {}).items()]
    width = max([len("dataset")] + [len(r[0]) for r in rows])
    lines = [
        f"\njob {summary['job']}  ({'complete' if summary['complete'] else 'incomplete'}; "
        f"{summary['n_samples']}/{summary['n_expected']} samples, {summary['n_failed']} failed"
        + (f"; part of the grid or datasets only: {summary['subset']}" if summary.get("subset") else "") + ")",
        f"{'dataset':<{width}}  {'score':>7}  {'n':>4}",
        f"{'-' * width}  {'-' * 7}  {'-' * 4}",
    ]
    lines += [f"{ds:<{width}}  {('%.2f' % s) if s is not None else '-':>7}  {n:>4}" for ds, s, n in rows]
    for f in summary.get("failed", [])[:10]:
        lines.append(f"failed: {f['id']}: {f.get('type')}: {str(f.get('message', '')).splitlines()[0][:160] if f.get('message') else ''}")
    if summary.get("n_reused"):
        lines.append(f"copied from a full-cache job of another budget: {summary['n_reused']} (see reused_from in the records)")
    if summary.get("n_skipped"):
        lines.append(f"skipped by the task: {summary['n_skipped']} ({'; '.join(str(s.get('reason', s)) for s in summary['skipped'][:3])})")
    t, c = summary["timings"], summary["cache"]
    uncompressed = _n_uncompressed(summary)
    if uncompressed:
        lines.append(f"not compressed: {uncompressed}/{summary['n_samples']} samples (prompt within budget="
                     f"{summary['budget']}: every prompt token kept; record field compressed=false)")
    if t.get("prefill_s") is not None:
        lines.append(
            f"mean prefill {t['prefill_s']:.3f}s  compress {t['compress_s']:.4f}s  decode {t['decode_s']:.3f}s "
            f"({t['decode_tok_s']:.1f} tok/s)  kept {c['kept_tokens']:.0f}/{c['prompt_tokens']:.0f} tokens per "
            "compressible layer" + (f", cache {c['cache_bytes_before'] / 1e6:.1f} -> {c['cache_bytes_after'] / 1e6:.1f} MB"
                                    if c.get("cache_bytes_before") and c.get("cache_bytes_after") is not None else "")
        )
    lines.append(f"results: {path}")
    print("\n".join(lines), flush=True)
