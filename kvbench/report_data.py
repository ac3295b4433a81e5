"""The report's data layer: read a results store into one pandas frame and select cells from it.

A results root holds one folder per job (``docs/RESULTS.md``): ``config.yaml`` (the resolved
Hydra config), ``summary.json`` (per-dataset scores, written at the end of each run) and
``predictions.jsonl`` (one record per sample). :func:`load_results` turns every job into one
row per dataset; the selection helpers below pick, for a table cell, which job a score comes
from, so that tables and figures never mix two variants of a method silently.

Identity of a job in the reports:

* ``method`` is the method *label*: ``method.label`` from the config (``SelKV``,
  ``SelKV (evict only)``), else the preset name (``selkv_evict``); ``method_name`` is the
  registry name.
* ``preset`` is the ``conf/method`` file the job ran (the job folder's method component).
* ``setting`` is ``run_tag`` (empty when unset); ``max_input_tokens`` is the prompt
  truncation length (``task.max_length``, else ``model.max_input_length``, else parsed from a
  ``ctx<N>`` run tag). ``model_key`` is the model name, suffixed only when one model
  appears in one task under several settings (e.g. ``llama31 [ctx3500]``), so that a full-cache
  reference is always paired with compressed runs of the same setting.
* ``params`` is the method's fields (without name and label) as sorted JSON: two jobs with one
  label and different params (a W × K sweep) are *variants*.
"""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import yaml

from .cli_guard import CONF
from .config_keys import METHOD_RUN_CONTROL_FIELDS, RUN_CONTROL_KEYS, SAMPLE_SELECTION_KEYS, flatten, under
from .store import is_job_folder

# LongBench v1 English datasets by category (SelKV Table 1 / Table 4 layout).
LONGBENCH_CATEGORIES: dict[str, list[str]] = {
    "Single-Doc QA": ["narrativeqa", "qasper", "multifieldqa_en"],
    "Multi-Doc QA": ["hotpotqa", "2wikimqa", "musique"],
    "Summarization": ["gov_report", "qmsum", "multi_news"],
    "Few-shot Learning": ["trec", "triviaqa", "samsum"],
    "Synthetic": ["passage_count", "passage_retrieval_en"],
    "Code": ["lcc", "repobench-p"],
}
DATASET_ORDER: list[str] = [d for ds in LONGBENCH_CATEGORIES.values() for d in ds]
DATASET_CATEGORY: dict[str, str] = {d: c for c, ds in LONGBENCH_CATEGORIES.items() for d in ds}
DATASET_ABBR: dict[str, str] = dict(zip(DATASET_ORDER, [
    "NrtQA", "Qasp", "MF-en", "HpQA", "2Wiki", "Musi", "GovR", "QMSm", "MNws",
    "TREC", "TrvQA", "SAMs", "PCnt", "PRet", "LCC", "RB-P",
])) | {  # the Chinese datasets, so that a table mixing both has abbreviated headers only
    "multifieldqa_zh": "MF-zh", "dureader": "DuRd", "vcsum": "VCSum", "lsht": "LSHT", "passage_retrieval_zh": "PRet-zh",
}
# Row order of methods in every table and legend (registry names; unknown names go last).
METHOD_ORDER: list[str] = [
    "full", "streamingllm", "snapkv", "lookm", "pyramidkv", "cake", "headkv", "adakv", "selkv", "compresskv",
]
FULL = "full"
LONG_CONTEXT_TOKENS = 16000  # a setting truncating prompts at >= this many tokens is "long context"

TIMING_COLUMNS = ["prefill_s", "compress_s", "decode_s", "decode_tok_s"]
CACHE_COLUMNS = ["prompt_tokens", "kept_tokens", "cache_bytes_before", "cache_bytes_after"]
COLUMNS = [
    "job", "task", "model", "model_key", "method", "method_name", "preset", "budget", "setting", "max_input_tokens",
    "params", "settings", "tagged", "dataset", "score", "n", "n_failed", "n_expected", "complete", "subset",
    *TIMING_COLUMNS, *CACHE_COLUMNS, "compressed_fraction",
]


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_predictions(path: Path) -> list[dict]:
    """Records of a ``predictions.jsonl`` file; a torn last line (a job killed mid-write) is skipped."""
    records = []
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def niah_grid(job_dir: Path) -> tuple[list, list] | None:
    """A NIAH job's grid as its ``summary.json`` records it (the last run's
    ``(task.context_lengths, task.depth_percents)``), as sorted distinct numbers (tokens as int,
    percents as int when whole), so that ``[512, 256]`` and ``[256, 512]``, ``[50.0]`` and ``[50]``
    are one grid; None when it records none (older jobs) or a value is not a number."""
    summary = _read_json(job_dir / "summary.json")
    selection = (summary.get("selection") if isinstance(summary, dict) else None) or {}
    lengths, depths = selection.get("task.context_lengths"), selection.get("task.depth_percents")
    if not isinstance(lengths, list) or not isinstance(depths, list):
        return None
    try:
        return (sorted({int(n) for n in lengths}),
                [int(d) if float(d).is_integer() else float(d) for d in sorted({float(d) for d in depths})])
    except (TypeError, ValueError):
        return None


def niah_grid_records(job_dir: Path) -> list[dict]:
    """A NIAH job's records on the grid its ``summary.json`` counts (:func:`niah_grid`), so that
    a heatmap and the job's score describe the same samples. Every record when the summary
    records no grid (older jobs).
    """
    records = read_predictions(job_dir / "predictions.jsonl")
    grid_lists = niah_grid(job_dir)
    if grid_lists is None:
        return records
    lengths, depths = grid_lists
    grid = {(int(n), float(d)) for n in lengths for d in depths}

    def on_grid(r: dict) -> bool:
        meta = r.get("meta") or {}
        try:
            return (int(meta["context_length"]), float(meta["depth_percent"])) in grid
        except (KeyError, TypeError, ValueError):
            return True  # a record without grid coordinates is not filtered out

    return [r for r in records if on_grid(r)]


def _mean(values: Iterable[Any]) -> float:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else math.nan


def _kept(record: dict) -> Any:
    kept = record.get("kept_tokens")
    return kept.get("mean") if isinstance(kept, dict) else kept


def _job_dirs(root: Path) -> list[Path]:
    """Job folders under ``root`` (:func:`kvbench.store.is_job_folder`; hidden folders skipped)."""
    dirs = []
    for cfg in sorted(root.rglob("config.yaml")):
        d = cfg.parent
        if any(part.startswith(".") for part in d.relative_to(root).parts):
            continue  # Hydra's own .hydra/config.yaml copies
        if is_job_folder(d):
            dirs.append(d)
    return dirs


def _max_input_tokens(cfg: dict, setting: str) -> float:
    """Prompt truncation length: ``task.max_length`` overrides ``model.max_input_length``."""
    for node, key in [("task", "max_length"), ("task", "max_input_tokens"), ("model", "max_input_length"),
                      ("model", "max_input_tokens")]:
        value = (cfg.get(node) or {}).get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    m = re.fullmatch(r"ctx(\d+)", setting or "")
    return float(m.group(1)) if m else math.nan


def incomplete_note(job: str, n: int) -> str:
    """The note on a job whose summary is not complete (samples not run yet, or failed)."""
    return (f"incomplete: {job} ({n} sample{'' if n == 1 else 's'} scored; the job has not finished or some samples "
            "failed: rerun it)")


def subset_notes(rows: pd.DataFrame, jobs: Iterable[str]) -> list[str]:
    """One note per job of ``jobs`` that scored only part of each dataset (its ``subset`` column)."""
    notes = []
    for job in jobs:
        subset = rows.loc[rows["job"] == job, "subset"].iloc[0]
        if subset:
            notes.append(f"subset: {job} scored part of each dataset only ({subset}); not comparable to "
                         "whole-dataset scores")
    return notes


def _subset(cfg: dict, summary: dict) -> str:
    """The keys that limited a job's scored run to part of each dataset (``task.n_samples=1``,
    ``max_samples=5``); ``""`` for a run over whole datasets (or a NIAH grid).

    The summary's ``subset`` (written by the job, which knows whether a limit left rows out:
    ``task.n_samples=200`` on a 200-row dataset scores all of it); for a summary written before
    that field, the limits of the summary's ``selection`` (the run it scores: a rerun may change
    the sample count), else of ``config.yaml`` (the first run's)."""
    if isinstance(summary.get("subset"), str):
        return summary["subset"]
    selection = summary.get("selection") if isinstance(summary.get("selection"), dict) else None
    task = cfg.get("task") or {}
    if selection is not None:
        n_samples, max_samples = selection.get("task.n_samples"), selection.get("max_samples")
    else:
        n_samples, max_samples = task.get("n_samples"), cfg.get("max_samples")
    parts = []
    if task.get("name") != "niah" and n_samples is not None:
        parts.append(f"task.n_samples={n_samples}")
    if max_samples is not None:
        parts.append(f"max_samples={max_samples}")
    return " ".join(parts)


#: Config keys that are not a job's *setting* in the report: the method and budget (table rows
#: and columns), the folder naming, run control and sample selection, and the truncation keys
#: (``max_input_tokens`` covers them). ``device`` is replaced by what ``env.json`` says it resolved to.
_NOT_SETTINGS = ("method", "budget", "run_tag", "run_name", "device", "task.max_length", "task.max_input_tokens",
                 "model.max_input_length", "model.max_input_tokens", "hydra") + RUN_CONTROL_KEYS + SAMPLE_SELECTION_KEYS


def _settings(cfg: dict, job_dir: Path) -> str:
    """The job's other settings as sorted JSON ``{dotted key: value}``: every config key that can
    change what a sample computes besides the method, the budget and the truncation length (e.g.
    ``task.max_new_tokens``, ``model.chat_template``, ``task.data_dir``), plus ``env.device_type``
    and ``env.dtype`` from the job's ``env.json`` (``device=auto`` may be CUDA bf16 or CPU float32).
    :func:`_model_keys` splits a model's rows by it, so that a table never pairs jobs of different
    settings in one cell or against one full-cache reference."""
    flat = {k: v for k, v in flatten(json.loads(json.dumps(cfg, default=str))).items() if not under(k, _NOT_SETTINGS)}
    for path in sorted(job_dir.glob("env*.json")):
        env = _read_json(path)
        if isinstance(env, dict) and env.get("device"):
            flat["env.device_type"] = str(env["device"]).split(":")[0]
            flat["env.dtype"] = env.get("dtype")
            break
    return json.dumps(flat, sort_keys=True)


class UnreadableJob(ValueError):
    """A job folder whose ``config.yaml`` cannot be read as a mapping (hand-edited, damaged)."""


def _job_rows(root: Path, job_dir: Path) -> list[dict]:
    try:
        cfg = yaml.safe_load((job_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UnreadableJob(f"config.yaml cannot be read ({type(e).__name__})") from None
    if not isinstance(cfg, dict):
        raise UnreadableJob(f"config.yaml holds a {type(cfg).__name__}, not a mapping")
    summary = _read_json(job_dir / "summary.json") or {}
    records = read_predictions(job_dir / "predictions.jsonl")
    method = dict(cfg.get("method") or {})
    name = str(method.get("name", summary.get("method", "?")))
    parts = job_dir.relative_to(root).parts
    preset = parts[-2] if len(parts) >= 4 and not cfg.get("run_name") else name
    label = str(method.get("label") or preset)  # an unlabelled preset is named by its file
    params = {k: v for k, v in method.items() if k not in ("name", "label") + METHOD_RUN_CONTROL_FIELDS}
    setting = str(cfg.get("run_tag") or "")
    budget = float(cfg.get("budget", summary.get("budget", math.nan)))
    folder = job_dir.name
    tag = folder.split("-", 1)[1] if folder.startswith("b") and "-" in folder else ""
    base = {
        "job": job_dir.relative_to(root).as_posix(),
        "task": str((cfg.get("task") or {}).get("name", summary.get("task", "?"))),
        "model": str((cfg.get("model") or {}).get("name", summary.get("model", "?"))),
        "method": label,
        "method_name": name,
        "preset": preset,
        "budget": budget,
        "setting": setting,
        "max_input_tokens": _max_input_tokens(cfg, setting),
        "params": json.dumps(params, sort_keys=True, default=str),
        "settings": _settings(cfg, job_dir),
        "tagged": (bool(tag) and tag != setting) or bool(cfg.get("run_name")),  # not the standard folder
        "n_expected": summary.get("n_expected"),
        "complete": bool(summary.get("complete", False)),
        "subset": _subset(cfg, summary),
    }
    by_ds: dict[str, list[dict]] = {}
    for r in records:
        by_ds.setdefault(str(r.get("dataset")), []).append(r)
    summary_ds = summary.get("datasets") or {}
    rows = []
    for ds in sorted(set(by_ds) | set(summary_ds)):
        recs = by_ds.get(ds, [])
        ok = [r for r in recs if r.get("error") is None and r.get("score") is not None]
        row = dict(base, dataset=ds, n_failed=sum(1 for r in recs if r.get("error") is not None))
        if ds in summary_ds and summary_ds[ds].get("score") is not None:
            row["score"] = float(summary_ds[ds]["score"])
            row["n"] = int(summary_ds[ds].get("n", len(ok)))
        else:
            row["score"] = round(100 * _mean(r["score"] for r in ok), 2) if ok else math.nan
            row["n"] = len(ok)
        for col in TIMING_COLUMNS + CACHE_COLUMNS:
            if ok:
                row[col] = _mean((_kept(r) if col == "kept_tokens" else r.get(col)) for r in ok)
            else:
                section = summary.get("timings" if col in TIMING_COLUMNS else "cache") or {}
                row[col] = float(section[col]) if section.get(col) is not None else math.nan
        # share of the samples whose cache was compressed (0: the budget kept every prompt whole): the
        # summary's (its run's samples) when there is one, else the records'
        frac = (summary.get("cache") or {}).get("compressed_fraction")
        if frac is not None:
            row["compressed_fraction"] = float(frac)
        elif any("compressed" in r for r in ok):
            row["compressed_fraction"] = _mean(1.0 if r["compressed"] else 0.0 for r in ok if "compressed" in r)
        else:
            row["compressed_fraction"] = math.nan
        rows.append(row)
    if not rows:  # a job folder with nothing scored yet: keep it visible as absent data
        rows.append(dict(base, dataset=None, score=math.nan, n=0, n_failed=0))
    return rows


def _first_suffix(row) -> str:
    """The run tag, else the truncation length (``3500 tok``), else ``default``."""
    if row["setting"]:
        return row["setting"]
    if not math.isnan(row["max_input_tokens"]):
        return f"{int(row['max_input_tokens'])} tok"
    return "default"


def _differing(settings: Iterable[str]) -> list[str]:
    """Keys whose values differ among the ``settings`` (JSON texts) that have them (a key that older
    jobs lack is compared among the jobs that have it only)."""
    values: dict[str, set[str]] = {}
    for text in settings:
        for k, v in json.loads(text).items():
            values.setdefault(k, set()).add(json.dumps(v, sort_keys=True))
    return sorted(k for k, vs in values.items() if len(vs) > 1)


def _model_keys(df: pd.DataFrame) -> pd.Series:
    """Model name, suffixed where one (task, model) has several settings: the run tag, else the
    truncation length (``llama31 [ctx31500]``, ``llama31 [3500 tok]``), and where jobs still differ
    in other settings (:func:`_settings`), the keys that differ (``smollm2 [task.max_new_tokens=64]``).
    Untagged jobs keep the plain name when every job of the model has their truncation length
    (only the tagged jobs differ, so only they are suffixed)."""
    keys = df["model"].copy()
    for (_task, _model), grp in df.groupby(["task", "model"]):
        first = grp.apply(_first_suffix, axis=1)
        split_by_first = first.nunique() > 1
        untagged = first[grp["setting"] == ""].unique()
        # untagged jobs of the one truncation length all jobs share keep the plain name: "[7500 tok]"
        # would tell them from nothing (a tagged job joining must not rename their tables)
        plain = untagged[0] if len(untagged) == 1 and grp["max_input_tokens"].nunique(dropna=False) == 1 else None
        for suffix, sub in grp.groupby(first):
            differ = _differing(sub["settings"].unique())
            for idx, row in sub.iterrows():
                parts = [suffix] if split_by_first and suffix != plain else []
                values = json.loads(row["settings"])
                if any(k in values for k in differ):
                    parts.append(", ".join(f"{k}={values[k]}" for k in differ if k in values))
                if parts:
                    keys.at[idx] = f"{row['model']} [{'; '.join(parts)}]"
    return keys


def load_results(root: str | Path) -> pd.DataFrame:
    """Read every job folder under ``root`` into one frame, one row per job × dataset.

    Scores come from ``summary.json`` (``round(100·mean, 2)`` per dataset, LongBench's rule)
    and, for a job still running or killed, from ``predictions.jsonl``. Timings (seconds,
    tokens/s) and cache statistics (tokens, bytes) are per-dataset means over successful
    samples (the summary's job-level means when predictions are absent). A job with no
    scored sample yet has one row with ``dataset=None``.

    Args:
        root: the results root (``output_root``, default ``results/``).

    Returns:
        A DataFrame with columns :data:`COLUMNS`; empty (with those columns) when no job exists.
        ``df.attrs["unreadable"]`` lists the job folders left out because their ``config.yaml``
        cannot be read (``"<job>: <why>"``).

    Raises:
        FileNotFoundError: ``root`` is not a directory.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root {str(root)!r} is not a directory")
    rows, unreadable = [], []
    for d in _job_dirs(root):
        try:
            rows += _job_rows(root, d)
        except UnreadableJob as e:
            unreadable.append(f"{d.relative_to(root).as_posix()}: {e}")
    df = pd.DataFrame(rows, columns=[c for c in COLUMNS if c != "model_key"])
    df.attrs["unreadable"] = unreadable
    df["model_key"] = _model_keys(df) if len(df) else pd.Series(dtype=object)
    for col in ["budget", "score", "max_input_tokens", *TIMING_COLUMNS, *CACHE_COLUMNS]:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    return df[COLUMNS]


# ----------------------------------------------------------------------------- selection


def method_sort_key(name: str, label: str) -> tuple[int, int, str]:
    """Row order of a method: :data:`METHOD_ORDER`, then shorter (main) labels first."""
    rank = METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER)
    return rank, len(label), label


def order_datasets(datasets: Iterable[str]) -> list[str]:
    """LongBench order (:data:`DATASET_ORDER`), unknown datasets after it, alphabetically."""
    ds = {d for d in datasets if d is not None and not (isinstance(d, float) and math.isnan(d))}
    return [d for d in DATASET_ORDER if d in ds] + sorted(ds - set(DATASET_ORDER))


def main_labels(rows: pd.DataFrame) -> set[str]:
    """Per method name, its main label: that of the preset named like the method (``conf/method/
    selkv.yaml``, the job folder ``.../selkv/...``) when such jobs exist, else the shortest label
    (``SelKV`` over ``SelKV (evict only)``). Ablation presets thus stay out of the main tables
    whenever the main preset was run; :func:`main_label_fallbacks` names the stand-ins."""
    return {label for label, _preset in _main_label_presets(rows).values()}


@functools.lru_cache(maxsize=None)
def _preset_file(preset: str) -> dict | None:
    """``conf/method/<preset>.yaml`` as a mapping, None when absent or unreadable."""
    if not re.fullmatch(r"[\w.-]+", preset or ""):
        return None
    try:
        data = yaml.safe_load((CONF / "method" / f"{preset}.yaml").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    return data if isinstance(data, dict) else None


def method_display_name(method_name: str) -> str:
    """The paper's name of a method for captions: the ``label`` of ``conf/method/<method_name>.yaml``
    (``selkv`` -> ``SelKV``), else ``method_name`` itself (a preset file that is not there, or
    a label that is not a string)."""
    label = (_preset_file(method_name) or {}).get("label")
    return label if isinstance(label, str) and label.strip() else method_name


def preset_params(preset: str) -> dict | None:
    """The method fields of ``conf/method/<preset>.yaml`` as this checkout has them (``name`` and
    ``label`` left out), the reference a job's ``params`` are compared with to tell a variant
    (``method.*`` overrides) from the preset itself; None when the preset file is not here."""
    data = _preset_file(preset)
    return None if data is None else {k: v for k, v in data.items() if k not in ("name", "label")}


def preset_overrides(params: dict, reference: dict) -> list[str]:
    """The method fields of a job's ``params`` that its preset (:func:`preset_params`) has with
    another value, sorted: what a ``method.<field>=...`` override changed (run-control fields
    such as ``kernel`` aside)."""
    return sorted(k for k in params if k in reference and k not in METHOD_RUN_CONTROL_FIELDS
                  and json.dumps(params[k]) != json.dumps(reference[k]))


def main_label_fallbacks(rows: pd.DataFrame) -> dict[str, tuple[str, str]]:
    """Main labels that stand in for a method whose own preset has no job among ``rows``.

    Returns:
        ``{label: (method_name, presets)}``, e.g. ``{"SelKV (+gate)": ("selkv", "selkv_gate")}``
        when only SelKV's Table 2 presets ran, or ``{"SnapKV (W8 K5)": ("snapkv",
        "snapkv_compresskv")}`` for CompressKV's baseline preset; ``presets`` joins the presets
        that carry the label with ", ". Tables note these so that a stand-in does not pass as
        the method's main preset.
    """
    out = {}
    for name, (label, own) in _main_label_presets(rows).items():
        if not own:
            presets = sorted(rows.loc[(rows["method_name"] == name) & (rows["method"] == label), "preset"].unique())
            out[label] = (name, ", ".join(presets))
    return out


def _main_label_presets(rows: pd.DataFrame) -> dict[str, tuple[str, bool]]:
    """``{method_name: (main label, whether it is the preset named like the method)}``."""
    out = {}
    for name, grp in rows.groupby("method_name"):
        own = grp[grp["preset"] == name]
        out[name] = (min((own if len(own) else grp)["method"].unique(), key=lambda s: (len(s), s)), bool(len(own)))
    return out


def _job_preference(rows: pd.DataFrame) -> list[str]:
    """Jobs best first: untagged folders (the method's defaults), complete, most datasets, most
    scored samples (a larger NIAH grid, more LongBench samples), a full cache's usual ``b1.0``
    folder before one named by another budget (its samples are often copies), then path."""
    stats: dict[str, list] = {}
    usual = [not (m == FULL and b != 1.0) for m, b in zip(rows["method_name"], rows["budget"])]
    for job, tagged, complete, score, n, ok in zip(rows["job"], rows["tagged"], rows["complete"], rows["score"],
                                                   rows["n"].fillna(0), usual):
        st = stats.setdefault(job, [bool(tagged), not complete, 0, 0, not ok, job])
        scored = not math.isnan(score)
        st[2] -= int(scored)
        st[3] -= int(n) if scored else 0
    return [st[5] for st in sorted(stats.values())]


def left_out_note(what: str, rows: pd.DataFrame, used: list[str]) -> str | None:
    """The note naming the jobs of one table cell or row that gave no score to it (another job of
    the same setting was preferred, :func:`_job_preference`), or None when every job was used."""
    left = [j for j in dict.fromkeys(rows["job"]) if j not in used]
    if not left:
        return None
    done = dict(zip(rows["job"], rows["complete"]))
    n = rows.groupby("job")["n"].sum(min_count=1)
    counts = {j: int(n[j]) if not math.isnan(n[j]) else 0 for j in left}
    shown = [f"{j} ({counts[j]} sample{'' if counts[j] == 1 else 's'}{'' if done[j] else ', unfinished'})"
             for j in left]
    return (f"left out: {what}: " + ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "")
            + f"; the scores are {'those' if len(used) > 1 else 'the job'} of " + ", ".join(used)
            + " (preferred: untagged, complete, most datasets, most samples, a full cache's b1.0 folder)")


def pick_variant(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows of the preferred variant (params) among jobs of one model × label × budget.

    The variant of the best job (see :func:`_job_preference`) wins; its jobs are kept. Use
    :func:`variants` to see all of them (sensitivity tables).
    """
    if rows.empty:
        return rows
    best = _job_preference(rows)[0]
    params = rows.loc[rows["job"] == best, "params"].iloc[0]
    return rows[rows["params"] == params]


def cell_scores(rows: pd.DataFrame) -> tuple[dict[str, float], list[str]]:
    """Per-dataset score from the given jobs (best job first) and the jobs actually used."""
    scores: dict[str, float] = {}
    used: list[str] = []
    order = _job_preference(rows)
    for job in order:
        jr = rows[(rows["job"] == job) & rows["score"].notna()]
        fresh = {d: s for d, s in zip(jr["dataset"], jr["score"]) if d not in scores}
        scores.update(fresh)
        if fresh:
            used.append(job)
    if not used and order:  # no job has a score yet: the cell is the best job's (unfinished, absent)
        used.append(order[0])
    return scores, used


def variants(rows: pd.DataFrame) -> list[tuple[dict, pd.DataFrame]]:
    """All variants of one model × label × budget: ``[(params dict, rows)]``, best variant first."""
    order = {p: i for i, p in enumerate(dict.fromkeys(rows.set_index("job").loc[_job_preference(rows), "params"]))}
    return [(json.loads(p), rows[rows["params"] == p]) for p in sorted(order, key=order.get)]


def full_rows(df: pd.DataFrame, task: str, model_key: str) -> pd.DataFrame:
    """The full-cache jobs of one model key in one task (any budget: the full cache ignores it)."""
    return df[(df["task"] == task) & (df["model_key"] == model_key) & (df["method_name"] == FULL)]


def is_ratio_budget(budget: float) -> bool:
    """Whether a stored budget is a retention ratio: ``budget <= 1``. The report sees budgets as
    floats, so ``1.0`` (keep everything) and a 1-token budget would look alike; validation rejects
    the integer budget 1 (:func:`kvbench.validate.validate`), so 1 is the ratio 100 %."""
    return budget <= 1


def budget_text(budget: float) -> str:
    """``25%`` (``100%`` for 1.0, ``0.0001%`` for 1e-6: never an exponent) for a retention ratio,
    ``256`` for a token budget."""
    if not is_ratio_budget(budget):
        return f"{budget:g}"
    text = f"{budget * 100:g}"
    return (np.format_float_positional(float(text), trim="-") if "e" in text else text) + "%"


def n_datasets(n: int) -> str:
    """``1 dataset`` / ``16 datasets``: the caption phrase for a count of datasets."""
    return f"{n} dataset" + ("" if n == 1 else "s")


def budget_semantics(budgets: Iterable[float]) -> str:
    """The caption phrase that says what a budget counts (ARCHITECTURE.md, "Budgets")."""
    bs = [b for b in budgets if not math.isnan(b)]
    if bs and all(is_ratio_budget(b) for b in bs):
        return "budget = retention ratio ρ of prompt tokens"
    if bs and not any(is_ratio_budget(b) for b in bs):
        return "budget = tokens kept per layer per KV head (average, recent window included)"
    return "budget ≤ 1: retention ratio ρ of prompt tokens; budget > 1: tokens per layer per KV head"
