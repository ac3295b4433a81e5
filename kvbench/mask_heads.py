"""``kvbench mask-heads``: the head-masking ablation of CompressKV Table 2a (Sec. 4.3).

Following the causal test of Wu et al. (2025), the k heads with the highest score across all
layers (k = 10, 20, 30 by default) are masked (:class:`kvbench.head_mask.HeadMask`) and the
model runs the harness's Needle-in-a-Haystack task with its full cache; the table gives the
NIAH score without mask and its drop, in points, for each k and each head ranking:

* ``srh``: Semantic Retrieval Heads, CompressKV Eq. 1 scores (``semantic_retrieval_heads.json``);
* ``trh``: traditional retrieval heads, top-1 copy scores (``retrieval_heads.json``, or the
  published ``<model>.json`` for ``llama31``/``mistral``);
* ``random``: a control, k heads drawn with ``--seed`` among the heads outside the SRH and TRH
  top-k (Wu et al. draw their random heads outside their retrieval heads).

A head's score is the mean of its list in the score file (``{"<layer>-<head>": [...]}``, query
heads, as :func:`methods.artifacts.load_head_scores` reads it). The ranking files
``*_head_idx.json`` hold per-layer orders only, no scores, so they cannot rank heads across
layers; when one exists beside the score file the report says whether it agrees with the scores.
The published CompressKV files for Llama-3.1-8B / Mistral-7B carry no SRH scores: give
``--srh-scores`` or leave ``srh`` out of ``--kinds``.

Writes ``<out>/mask_heads_<model>_<mode>-<phase>.{json,csv,md}`` and never overwrites: when a
file of that name exists, the next free ``…-2``, ``…-3`` is used. While it runs, the conditions
finished so far are kept in ``<stem>.partial.json`` (rewritten atomically after each one); an
interrupted run (Ctrl-C, SIGTERM, a crash) is resumed by the same command, which skips the
finished conditions, and the progress file is removed once the three files are written. A
progress file of other settings (model, grid, k, kinds, seed, score files, mode, phase, device)
is never touched: that run writes to the next free stem. User errors (unknown model, missing
score files, k larger than the number of heads, bad grid) stop it with one line before any
model is loaded.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import resource
import sys
import time
from pathlib import Path

import yaml

from eval.base import TaskConfigError
from eval.niah import NIAHTask
from methods.artifacts import (
    ARTIFACTS_ROOT, PUBLISHED, artifact_path, keyed_errors, load_head_ranking, load_head_scores, ranking_from_scores,
    top_heads,
)
from methods.base import ConfigError

from .cli_parser import OneLineParser, split_list
from .head_mask import MODES, PHASES, HeadMask
from .signals import one_line_stop, quiet_broken_pipe
from .store import atomic_write, store_write_refusal, try_lock_file

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("srh", "trh", "random")
PARTIAL = ".partial.json"  # progress file beside the outputs (see run)
_SCORE_KIND = {"srh": ("semantic_retrieval_heads", "srh_head_idx"), "trh": ("retrieval_heads", "trh_head_idx")}


# --------------------------------------------------------------------------- inputs (no model)
def model_config(name: str, source: str | None = None) -> dict:
    """``conf/model/<name>.yaml`` as a dict (``source`` overrides ``model.source``; a ``.gguf``
    file or a model folder, so ``gguf_file`` is reset).

    Raises:
        ConfigError: no such model config (lists the accepted names).
    """
    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in path.parent.glob("*.yaml"))
        raise ConfigError(f"--model={name!r}: no conf/model/{name}.yaml; accepted values are {', '.join(names)}")
    cfg = yaml.safe_load(path.read_text(encoding="utf-8"))
    if source:
        cfg["source"], cfg["gguf_file"] = source, None
    return cfg


def score_file(kind: str, model: str, explicit: str | None) -> Path:
    """The head-score file of ``kind`` (``srh`` or ``trh``) for ``model``.

    Raises:
        ConfigError: not found (names the calibration command), or SRH asked for a model whose
            published files hold only a per-layer SRH ranking.
    """
    key = f"--{kind}-scores"
    if kind == "srh" and not explicit and model in PUBLISHED:
        local = ARTIFACTS_ROOT / model / "semantic_retrieval_heads.json"
        if not local.is_file():
            raise ConfigError(
                f"{key}: model {model} has only the published per-layer SRH ranking ({PUBLISHED[model]}_head_idx.json), "
                f"no scores to rank heads across layers; give {key}=PATH ({{'<layer>-<head>': [scores]}}) or --kinds trh,random"
            )
    return artifact_path(_SCORE_KIND[kind][0], model, explicit, key)


def ranking_agrees(kind: str, model: str, scores) -> tuple[str | None, bool | None]:
    """Whether the per-layer ranking file of ``kind`` (if any) orders each layer as ``scores`` do.

    Returns:
        ``(ranking file or None, agrees or None)``.
    """
    try:
        path = artifact_path(_SCORE_KIND[kind][1], model, None, "ranking")
        return str(path), load_head_ranking(path) == ranking_from_scores(scores)
    except ConfigError:
        return None, None


def random_heads(num_layers: int, num_heads: int, k: int, seed: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """k distinct ``(layer, head)`` pairs drawn uniformly, reproducibly (``seed``), outside ``exclude``.

    One seeded permutation of all ``L·H_q`` heads is filtered, so a larger k extends a smaller
    one when ``exclude`` is the same.

    Raises:
        ConfigError: fewer than k heads outside ``exclude``.
    """
    import torch

    order = torch.randperm(num_layers * num_heads, generator=torch.Generator().manual_seed(seed)).tolist()
    pool = [(i // num_heads, i % num_heads) for i in order if (i // num_heads, i % num_heads) not in exclude]
    if len(pool) < k:
        raise ConfigError(f"--k={k}: only {len(pool)} heads are left outside the SRH/TRH top-{k} for the random control")
    return pool[:k]


def parse_ks(text: str) -> list[int]:
    """``"10,20,30"`` → ``[10, 20, 30]``.

    Raises:
        ConfigError: not a comma-separated list of distinct positive integers.
    """
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ks = []
    if not ks or any(k <= 0 for k in ks) or len(set(ks)) != len(ks):
        raise ConfigError(f"--k={text!r}: must be distinct positive integers, comma-separated (e.g. 10,20,30)")
    return ks


def conditions(scores: dict, ks: list[int], kinds: list[str], seed: int) -> list[dict]:
    """The masked runs: for each k, the top-k heads of each score kind, then the random control.

    Args:
        scores: ``{kind: (L, H_q) mean scores}`` for the score kinds in ``kinds``.

    Returns:
        ``[{"kind", "k", "heads": [[layer, head], ...]}]``, the no-mask run excluded.

    Raises:
        ConfigError: a k larger than the number of heads.
    """
    grid = tuple(next(iter(scores.values())).shape)
    out = []
    for k in ks:
        chosen = {kind: top_heads(scores[kind], k, "--k", lowest=1) for kind in ("srh", "trh") if kind in kinds}
        out += [{"kind": kind, "k": k, "heads": [list(h) for h in heads]} for kind, heads in chosen.items()]
        if "random" in kinds:
            exclude = {h for heads in chosen.values() for h in heads}
            out.append({"kind": "random", "k": k, "heads": [list(h) for h in random_heads(*grid, k, seed, exclude)]})
    return out


def niah_config(args) -> dict:
    """``conf/task/niah.yaml`` with the command's grid overrides, validated.

    Raises:
        ConfigError: a bad grid or haystack folder (the task's own one-line message).
    """
    cfg = yaml.safe_load((ROOT / "conf" / "task" / "niah.yaml").read_text(encoding="utf-8"))
    for flag, key, kind in (("lengths", "context_lengths", int), ("depths", "depth_percents", float)):
        text = getattr(args, flag)
        if text:
            try:
                cfg[key] = [kind(x) for x in text.split(",")]
            except ValueError:
                raise ConfigError(f"--{flag}={text!r}: comma-separated {'integers' if kind is int else 'numbers'}") \
                    from None
    if args.haystack_dir:
        cfg["haystack_dir"], cfg["haystack_source"] = args.haystack_dir, "dir"
    if args.max_new_tokens is not None:
        cfg["max_new_tokens"] = args.max_new_tokens
    try:
        NIAHTask.validate(cfg)
    except TaskConfigError as e:  # name this command's flags, not the task keys they set
        text = str(e)
        for flag, key in (("lengths", "context_lengths"), ("depths", "depth_percents"),
                          ("haystack-dir", "haystack_dir"), ("max-new-tokens", "max_new_tokens")):
            if text.startswith(f"task.{key}=") and getattr(args, flag.replace("-", "_")) is not None:
                text = f"--{flag}={getattr(args, flag.replace('-', '_'))!r}" + text[text.find(": ", len(key) + 6):]
        raise ConfigError(text) from None
    return cfg


def _with(stem: Path, suffix: str) -> Path:
    return stem.parent / (stem.name + suffix)  # not with_suffix: a model name may hold a dot


def partial_path(stem: Path) -> Path:
    """``stem.partial.json``: the conditions finished so far, rewritten after each one."""
    return _with(stem, PARTIAL)


def read_partial(stem: Path) -> dict | None:
    """The progress file of ``stem`` (None when there is none or it cannot be read as one)."""
    try:
        data = json.loads(partial_path(stem).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("settings"), dict) else None


def output_stem(out_dir: Path, name: str, settings: dict | None = None) -> Path:
    """``out_dir/name``, or ``name-2``, ``name-3``… : the first stem with no ``.json/.csv/.md`` file
    and no progress file (``.partial.json``) of other ``settings`` (one of the same settings is
    resumed: see :func:`run`)."""
    n = 1
    while True:
        stem = out_dir / (name if n == 1 else f"{name}-{n}")
        if not any(_with(stem, s).exists() for s in (".json", ".csv", ".md")):
            if not partial_path(stem).exists():
                return stem
            partial = read_partial(stem)
            if settings is not None and partial is not None and partial["settings"] == settings:
                return stem
        n += 1


def out_stem(out: str, name: str, settings: dict | None = None) -> Path:
    """Where ``--out`` puts the ``.json/.csv/.md`` files: a folder (``name`` inside it), or a file
    name ending in one of those suffixes (``--out drop.json``: ``drop.json``, ``drop.csv``,
    ``drop.md``); either way the first stem with no file yet, or with the progress file of an
    interrupted run of the same ``settings`` (:func:`output_stem`).

    Raises:
        ConfigError: ``out`` is an existing file that is not one of those outputs' names, lies
            under one, or lies in a job folder (:func:`kvbench.store.store_write_refusal`).
    """
    path = Path(out)
    folder = path if path.suffix not in (".json", ".csv", ".md") else path.parent
    why = store_write_refusal(folder)
    if why:
        raise ConfigError(f"--out={out!r}: {why}; pass a folder outside the job folders")
    from .validate import check_not_in_code, check_not_in_store

    check_not_in_code(f"--out={out!r}", folder, "the ablation's files (default: results/mask_heads)")
    check_not_in_store(f"--out={out!r}", folder)  # a results root's task, model or method folder
    if path.suffix in (".json", ".csv", ".md"):
        if path.parent.exists() and not path.parent.is_dir():
            raise ConfigError(f"--out={out!r}: {path.parent} is a file, not a folder")
        return output_stem(path.parent, path.stem, settings)
    blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ConfigError(f"--out={out!r}: {blocker} is a file; give a folder or a name ending in .json, .csv or .md")
    return output_stem(path, name, settings)


# --------------------------------------------------------------------------- running
def run_condition(engine, loaded, task, samples, heads, mode: str, phase: str) -> dict:
    """Generate every sample with ``heads`` masked; NIAH score = 100 × mean ROUGE-1 recall.

    Returns:
        ``{"score", "n", "failed", "samples": [{"id", "prediction", "score"}]}`` (failed samples
        are listed with their error and left out of the mean).
    """
    from .job import run_sample

    records = []
    with HeadMask(loaded.model, loaded.layout, [tuple(h) for h in heads], mode, phase):
        for sample in samples:
            rec = run_sample(engine, loaded, task, sample)
            records.append({"id": rec["id"], "prediction": rec["prediction"], "score": rec["score"],
                            **({"error": rec["error"]} if rec["error"] else {})})
    ok = [r["score"] for r in records if r["score"] is not None]
    return {"score": round(100 * sum(ok) / len(ok), 2) if ok else None, "n": len(ok),
            "failed": len(records) - len(ok), "samples": records}


def table_rows(report: dict) -> list[dict]:
    """One row per (kind, k): masked score and drop (no-mask score − masked score, points)."""
    base = report["no_mask"]["score"]
    rows = []
    for c in report["conditions"]:
        drop = round(base - c["score"], 2) if base is not None and c["score"] is not None else None
        rows.append({"kind": c["kind"], "k": c["k"], "score": c["score"], "drop": drop, "n": c["n"], "failed": c["failed"]})
    return rows


def render_markdown(report: dict) -> str:
    """Table 2a's layout: a row per head kind, a column per top-k; cells ``drop (masked score)``."""
    rows = table_rows(report)
    ks = sorted({r["k"] for r in rows})
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    cell = {(r["kind"], r["k"]): r for r in rows}
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [
        f"NIAH score without mask: {fmt(report['no_mask']['score'])} ({report['no_mask']['n']} samples); "
        f"model {report['model']}, mask mode {report['mode']}, phase {report['phase']}",
        "",
        "| heads | " + " | ".join(f"top-{k}" for k in ks) + " |",
        "|---|" + "---:|" * len(ks),
    ]
    for kind in kinds:
        cells = [f"{fmt(cell[kind, k]['drop'])} ({fmt(cell[kind, k]['score'])})" if (kind, k) in cell else "-" for k in ks]
        lines.append(f"| {kind.upper() if kind != 'random' else 'random'} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cells: drop of the NIAH score in points (score with the heads masked).")
    heads = {(c["kind"], c["k"]): {tuple(h) for h in c.get("heads", [])} for c in report["conditions"]}
    shared = [f"{len(heads['srh', k] & heads['trh', k])}/{k}" for k in ks if ("srh", k) in heads and ("trh", k) in heads]
    if shared:
        lines.append(f"SRH and TRH top-k share {', '.join(shared)} heads.")
    return "\n".join(lines) + "\n"


def render_csv(report: dict) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["kind", "k", "score", "drop", "n", "failed"], lineterminator="\n")
    writer.writeheader()
    writer.writerow({"kind": "none", "k": 0, "score": report["no_mask"]["score"], "drop": 0.0,
                     "n": report["no_mask"]["n"], "failed": report["no_mask"]["failed"]})
    writer.writerows(table_rows(report))
    return buf.getvalue()


def write_report(stem: Path, report: dict) -> list[Path]:
    """Write ``stem.json/.csv/.md`` with exclusive creation (an existing file is never replaced).

    Raises:
        ConfigError: a file of that name appeared meanwhile.
    """
    stem.parent.mkdir(parents=True, exist_ok=True)
    texts = {".json": json.dumps(report, indent=2, ensure_ascii=False) + "\n", ".csv": render_csv(report),
             ".md": render_markdown(report)}
    written = []
    for suffix, text in texts.items():
        path = _with(stem, suffix)
        try:
            with open(path, "x", encoding="utf-8") as f:
                f.write(text)
        except FileExistsError:
            raise ConfigError(f"--out: {path} already exists; not overwritten (results so far are in {written or 'no file'})") from None
        written.append(path)
    return written


def _lock_path(stem: Path) -> Path:
    return stem.parent / f".{stem.name}.lock"


def _lock_stem(stem: Path, out: str):
    """Hold an exclusive lock on ``stem`` (``.<name>.lock`` beside it) for this process's life.

    Two runs of the same settings pick the same stem and progress file; the second would redo
    every condition and then fail to write. It stops at once instead.

    Returns:
        The lock file, open (keep a reference: closing it, or the process ending, releases the lock).

    Raises:
        ConfigError: another live process holds the lock.
    """
    fd = try_lock_file(_lock_path(stem))
    if fd is None:
        raise ConfigError(f"--out={out!r}: {stem.name} is being written by another kvbench mask-heads run of the "
                          "same settings; wait for it (its results resume here) or pass another --out")
    return os.fdopen(fd, "r+")


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(args) -> int:
    """Validate everything, then load the model and run the no-mask and masked NIAH grids."""
    from .validate import check_device_flag

    check_device_flag("--device", args.device, args.threads)
    model_cfg = model_config(args.model, args.model_source)
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds) or kinds == ["random"]:
        raise ConfigError(f"--kinds={args.kinds!r}: comma-separated values among {', '.join(KINDS)}, at least one of srh, trh")
    ks = parse_ks(args.k)
    files = {kind: score_file(kind, args.model, getattr(args, f"{kind}_scores")) for kind in ("srh", "trh") if kind in kinds}
    scores = {}
    for kind, path in files.items():
        with keyed_errors(f"--{kind}-scores", path):  # the error names the flag to change
            scores[kind] = load_head_scores(path)
    grids = {tuple(s.shape) for s in scores.values()}
    if len(grids) > 1:
        raise ConfigError(f"--srh-scores/--trh-scores: the files cover different layer x head grids {sorted(grids)}")
    plan = conditions(scores, ks, kinds, args.seed)
    task_cfg = niah_config(args)
    lengths = [int(x) for x in task_cfg["context_lengths"]]
    from .models import max_input_length

    limit = max_input_length(model_cfg)
    if min(lengths) > limit:  # the task would skip every length once the model is loaded
        raise ConfigError(f"--lengths={','.join(map(str, lengths))}: every length exceeds the prompt budget of {limit} "
                          f"tokens of model {args.model} (model.max_input_length); use lengths <= {limit}")
    # What the results depend on: a progress file of exactly these settings is resumed.
    settings = {"model": args.model, "model_source": args.model_source, "device": args.device, "mode": args.mode,
                "phase": args.phase, "k": ks, "kinds": kinds, "seed": args.seed,
                "score_files": {k: str(p) for k, p in files.items()},
                "plan": [[c["kind"], c["k"], [list(h) for h in c["heads"]]] for c in plan],
                "grid": {k: task_cfg.get(k) for k in ("context_lengths", "depth_percents", "haystack_source",
                                                      "haystack_dir", "max_new_tokens")}}
    settings = json.loads(json.dumps(settings, default=str))  # as a progress file holds them (lists, strings)
    stem = out_stem(args.out, f"mask_heads_{args.model}_{args.mode}-{args.phase}", settings)
    progress = partial_path(stem)
    earlier = read_partial(stem) if progress.exists() else None
    from .validate import check_creatable

    check_creatable(f"--out={args.out!r}", stem.parent)  # before the model loads, not after the first condition
    lock = _lock_stem(stem, args.out)  # held to the end: one run per stem (the same command twice at once)

    import torch

    from methods.full import FullCache

    from .engine import Engine
    from .job import encode_prompt, environment
    from .models import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    t0, c0 = time.time(), _cpu_seconds()
    loaded = load_model(model_cfg, args.device)
    print(f"writing {stem}.{{json,csv,md}} when every condition has run (progress: {progress})", file=sys.stderr)
    for kind, path in files.items():
        load_head_scores(path, loaded.layout)  # the score grid must be the model's layers x query heads
    task = NIAHTask(task_cfg, loaded.tokenizer, loaded.max_input_length, encode=lambda s: encode_prompt(loaded, s))
    try:
        samples = list(task.samples())
    except TaskConfigError as e:  # e.g. every length too short for the needle and question: one line, exit 2
        raise ConfigError(str(e).replace("task.context_lengths=", "--lengths=")) from None
    engine = Engine(loaded, FullCache(None, loaded.layout), budget=1.0)
    report = {
        "model": args.model, "mode": args.mode, "phase": args.phase, "k": ks, "kinds": kinds, "seed": args.seed,
        "score_files": {k: str(p) for k, p in files.items()},
        "rankings": {k: dict(zip(("file", "agrees_with_scores"), ranking_agrees(k, args.model, scores[k])))
                     for k in files if not getattr(args, f"{k}_scores")},  # only beside the default score files
        "grid": {"context_lengths": task_cfg["context_lengths"], "depth_percents": task_cfg["depth_percents"],
                 "haystack_source": getattr(task, "haystack_source", None), "samples": len(samples),
                 "skipped": getattr(task, "skipped", [])},
        "env": environment(loaded, args.device),
    }
    before_s = before_cpu = 0.0
    done: list[dict] = []
    if earlier is not None:  # an interrupted run of the same settings: keep what it finished
        report["no_mask"] = earlier.get("no_mask")
        done = [c for c in earlier.get("conditions", []) if isinstance(c, dict)][: len(plan)]
        before_s, before_cpu = float(earlier.get("seconds", 0.0)), float(earlier.get("cpu_seconds", 0.0))
        print(f"resuming from {progress}: {'no mask and ' if report['no_mask'] else ''}{len(done)} of {len(plan)} "
              "masked conditions already run", file=sys.stderr, flush=True)

    def save_progress() -> None:
        elapsed = {"seconds": round(before_s + time.time() - t0, 1),
                   "cpu_seconds": round(before_cpu + _cpu_seconds() - c0, 1)}
        progress.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(progress, json.dumps({**report, **elapsed, "settings": settings}, indent=2, ensure_ascii=False))

    if not report.get("no_mask"):
        report["no_mask"] = run_condition(engine, loaded, task, samples, [], args.mode, args.phase)
        report["conditions"] = []
        save_progress()
    print(f"[{time.time() - t0:6.0f}s] no mask: {report['no_mask']['score']}", file=sys.stderr, flush=True)
    report["conditions"] = done
    for cond in plan[len(done):]:
        result = run_condition(engine, loaded, task, samples, cond["heads"], args.mode, args.phase)
        report["conditions"].append({**cond, **result})
        save_progress()
        print(f"[{time.time() - t0:6.0f}s] {cond['kind']} top-{cond['k']}: {result['score']}", file=sys.stderr, flush=True)
    report["seconds"] = round(before_s + time.time() - t0, 1)
    report["cpu_seconds"] = round(before_cpu + _cpu_seconds() - c0, 1)
    written = write_report(stem, report)
    progress.unlink(missing_ok=True)  # the outputs hold all of it now
    print(render_markdown(report))
    print(f"wrote {', '.join(str(p) for p in written)} in {report['seconds']} s ({report['cpu_seconds']} CPU s)", file=sys.stderr)
    _lock_path(stem).unlink(missing_ok=True)  # the outputs exist: a later run takes the next stem
    lock.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="kvbench mask-heads", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="conf/model/<name>.yaml; also names methods/artifacts/<name>/")
    p.add_argument("--model-source", default=None, help="override model.source (a local folder or file)")
    p.add_argument("--k", nargs="+", action="extend", default=None,
                   help="numbers of top heads to mask, comma- or space-separated (default 10,20,30)")
    p.add_argument("--kinds", nargs="+", action="extend", default=None,
                   help=f"head rankings: {', '.join(KINDS)} (random: seeded control), comma- or space-separated "
                        "(default srh,trh,random)")
    p.add_argument("--srh-scores", default=None, help="SRH head-score file (default methods/artifacts/<model>/semantic_retrieval_heads.json)")
    p.add_argument("--trh-scores", default=None, help="TRH head-score file (default methods/artifacts/<model>/retrieval_heads.json or the published one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-heads control")
    p.add_argument("--mode", choices=MODES, default="uniform", help="uniform (default): query set to 0, uniform attention (Wu et al.'s code, which CompressKV Sec. 4.3 follows); zero: head output before W_O set to 0")
    p.add_argument("--phase", choices=PHASES, default="decode", help="decode (default): the last prompt position and decoded tokens (Wu et al.'s code); all: every position")
    p.add_argument("--lengths", nargs="+", action="extend", default=None,
                   help="NIAH context lengths in tokens, comma- or space-separated (default conf/task/niah.yaml)")
    p.add_argument("--depths", nargs="+", action="extend", default=None,
                   help="NIAH needle depths in percent, comma- or space-separated (default conf/task/niah.yaml)")
    p.add_argument("--haystack-dir", default=None, help="folder of .txt haystack files (default: the task's haystack_source)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="generation limit (default conf/task/niah.yaml)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default="results/mask_heads",
                   help="output folder, or a file name ending in .json/.csv/.md for the three files (existing files "
                        "are never overwritten: -2, -3... is added)")
    return p


@quiet_broken_pipe
@one_line_stop("the conditions that finished are kept in <out>/<name>.partial.json; the same command resumes from "
               "them (the .json/.csv/.md files are written when every condition has run)")
def main(argv: list[str] | None = None) -> int:
    """Run the ablation. Returns 0, or 2 on a user error (one line on stderr)."""
    args = build_parser().parse_args(argv)
    # list flags: "--k 10 20", "--k 10,20" and repeated flags are one comma-separated value
    for flag, default in (("k", "10,20,30"), ("kinds", "srh,trh,random"), ("lengths", None), ("depths", None)):
        values = getattr(args, flag)
        pieces = split_list(values)  # "1, 2", "1 2", "1,2"
        if values is not None and not pieces:  # an empty shell variable must not mean "the default"
            print(f"kvbench mask-heads: --{flag.replace('_', '-')}={' '.join(values)!r}: empty; name at least one "
                  "value (or leave the flag out)", file=sys.stderr)
            return 2
        setattr(args, flag, ",".join(pieces) if pieces else default)
    try:
        return run(args)
    except ConfigError as e:
        print(f"kvbench mask-heads: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
