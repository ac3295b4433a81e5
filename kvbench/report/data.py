"""One tidy frame from the store (:func:`load_results`: a row per job × dataset), identity from ``config.yaml``:
``method`` is ``method.label``; ``model_key`` the model, suffixed by a differing setting (``llama31 [ctx31500]``);
``variant`` the method fields that differ among a label's jobs or from its preset (``alpha=1.5``)."""

import functools
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from eval.longbench import DATASETS_EN, DATASETS_ZH
from eval.niah import strict_match

from kvbench.job.store import JobStore, is_job_folder, read_json

DATASET_ORDER = list(DATASETS_EN)
DATASET_ABBR = dict(zip(DATASET_ORDER + list(DATASETS_ZH), "NrtQA Qasp MF-en HpQA 2Wiki Musi GovR QMSm MNws TREC TrvQA "
                        "SAMs PCnt PRet LCC RB-P MF-zh DuRd VCSum LSHT PRet-zh".split()))
METHOD_ORDER = ["full", "streamingllm", "snapkv", "lookm", "pyramidkv", "cake", "headkv", "adakv", "selkv",
                "compresskv", "knorm"]
MODEL_ORDER = ["llama31", "gemma2", "longchat", "mistral", "qwen25_14b", "qwen25_32b"]
FULL = "full"
LONG_CONTEXT_TOKENS = 16000  # prompts truncated at >= this many tokens: SelKV Table 7's "long inputs"
CONF = Path(__file__).resolve().parents[2] / "conf"
TIMING_COLUMNS = ["prefill_s", "compress_s", "decode_s", "decode_tok_s"]
CACHE_COLUMNS = ["prompt_tokens", "kept_tokens", "cache_bytes_before", "cache_bytes_after", "read_bytes"]
#: config keys that are not a job's setting: table rows/columns, folder naming, run control, sample selection
NOT_SETTINGS = ("method", "budget", "run_tag", "run_name", "hydra", "quiet", "lock_wait_s", "output_root",
                "threads", "compile", "reuse_full", "max_samples", "shard", "batch_size", "task.context_lengths", "task.depth_percents",
                "task.datasets", "task.n_samples", "model.gguf_cache", "device", "task.max_length",
                "model.max_input_length", "cache.max_bytes")
RUN_CONTROL_FIELDS = ("kernel",)  # method fields that do not change a result


def niah_grid_records(job_dir: Path) -> tuple[list[dict], str]:
    """A NIAH job's records on the grid its ``summary.json`` scores (every record when it records none), and that grid
    as text (``lengths [512, 1024] × depths [10, 90.5]``, sorted; ``""`` when none)."""
    records, sel = JobStore(job_dir).records(), read_json(Path(job_dir) / "summary.json").get("selection") or {}
    lengths, depths = sel.get("task.context_lengths"), sel.get("task.depth_percents")
    if not isinstance(lengths, list) or not isinstance(depths, list):
        return records, ""
    lengths, depths = sorted({int(n) for n in lengths}), sorted({float(d) for d in depths})
    text = f"lengths {lengths} × depths {[int(d) if d.is_integer() else d for d in depths]}"
    meta = [r.get("meta") or {} for r in records]
    return [r for r, m in zip(records, meta) if "context_length" not in m or (
        int(m["context_length"]) in lengths and float(m["depth_percent"]) in depths)], text


@functools.cache
def presets() -> dict[str, dict]:
    """``conf/method/<preset>.yaml`` as Hydra composes them (the schema's defaults filled in): ``{preset: mapping}``."""
    from kvbench.job.config import preset

    return {p.stem: preset("method", p.stem) for p in sorted((CONF / "method").glob("*.yaml"))}


def display_name(method_name: str) -> str:
    """A method's paper name: the label of ``conf/method/<method_name>.yaml`` (``selkv`` -> ``SelKV``)."""
    return presets().get(method_name, {}).get("label") or method_name


def job_records(job: Path, summary: dict | None, columns: list[str], latest: bool = False) -> pd.DataFrame:
    """The one reader of a job's records: those its ``summary.json`` scores (its ``ids``: sample ids, or the problems of
    sampled candidates; every record without one; ``summary`` None: read it), ``latest``: a sample id's last record
    only; ``columns`` of them, None where a record lacks one."""
    store, summary = JobStore(job), read_json(job / "summary.json") if summary is None else summary
    recs = pd.DataFrame(list(store.latest().values()) if latest else store.records(),
                        columns=list(dict.fromkeys(["id", "problem", *columns])))
    ids = summary.get("ids", recs["id"])
    return recs[recs["id"].isin(ids) | recs["problem"].isin(ids)][columns].astype(object).where(lambda f: f.notna(), None)


def samples(jobs: pd.DataFrame, root, columns: list[str], latest: bool = False, every: bool = False) -> pd.DataFrame:
    """The per-sample frame of the jobs of ``jobs`` (rows of :func:`load_results`, in order): a row per record that
    :func:`job_records` reads (``every``: all of a job's records, not only those its summary scores), the job's columns
    beside the records' ``columns`` (the record's wins; None where it lacks one)."""
    jobs = jobs.drop_duplicates("job")
    recs = [job_records(Path(root) / j, {} if every else None, columns, latest).assign(job=j) for j in jobs["job"]]
    recs = pd.concat(recs, ignore_index=True) if recs else pd.DataFrame(columns=[*columns, "job"])
    return jobs.drop(columns=[c for c in columns if c in jobs]).merge(recs, on="job")


def _job_rows(root: Path, job: Path) -> list[dict]:
    cfg = yaml.safe_load((job / "config.yaml").read_text()) or {}
    if not (isinstance(cfg, dict) and all(isinstance(cfg.get(k), dict) and cfg[k].get("name") for k in ("task", "model", "method"))):
        raise ValueError("config.yaml is not a kvbench job's config (task.name, model.name and method.name)")
    summary = read_json(job / "summary.json")
    method, task, model = dict(cfg["method"]), cfg["task"], cfg["model"]
    ctx = next((v for v in (task.get("max_length"), model.get("max_input_length")) if isinstance(v, (int, float))),
               math.nan)
    flat = pd.json_normalize(json.loads(json.dumps(cfg, default=str))).iloc[0].to_dict()
    flat["task.compress"] = compress = str(task.get("compress") or "prompt")  # a setting: prompt/context never merge
    if flat.get("cache.bits") is None:  # the model dtype's cache, as before cache.* existed: no setting
        flat = {k: v for k, v in flat.items() if not k.startswith("cache.")}
    env = read_json(job / "env.json")
    if env.get("device"):
        flat |= {"env.device_type": str(env["device"]).split(":")[0], "env.dtype": env.get("dtype")}
    sel = summary.get("selection") or {}
    n_samples, max_samples = (sel.get("task.n_samples"), sel.get("max_samples")) if sel else (
        task.get("n_samples"), cfg.get("max_samples"))
    subset = summary.get("subset") if isinstance(summary.get("subset"), str) else " ".join(
        [f"task.n_samples={n_samples}"] * (n_samples is not None and task.get("name") != "niah")
        + [f"max_samples={max_samples}"] * (max_samples is not None))
    base = {"job": job.relative_to(root).as_posix(), "task": str(task["name"]), "model": str(model["name"]),
            "method": str(method.get("label") or method["name"]), "method_name": str(method["name"]),
            "budget": float(cfg.get("budget", math.nan)),
            "setting": str(cfg.get("run_tag") or ""), "compress": compress, "max_input_tokens": float(ctx),
            "params": json.dumps({k: v for k, v in method.items() if k not in ("name", "label", *RUN_CONTROL_FIELDS)},
                                 sort_keys=True, default=str),
            "settings": json.dumps({k: v for k, v in flat.items()  # the full cache compresses nothing while decoding
                                    if not any(k == n or k.startswith(n + ".") for n in NOT_SETTINGS)
                                    and not (k.startswith("decode.") and method.get("name") == FULL)},
                                   sort_keys=True, default=str),
            "complete": bool(summary.get("complete", False)), "subset": subset}
    numeric = ["score", *TIMING_COLUMNS, *CACHE_COLUMNS, "compressed"]
    recs = job_records(job, summary, ["id", "problem", "dataset", "error", "prediction", "answers", "scores", *numeric])
    recs["kept_tokens"] = [k.get("mean") if isinstance(k, dict) else k for k in recs["kept_tokens"]]
    recs = recs.assign(dataset=recs["dataset"].astype(str), failed=recs["error"].notna())
    ok = recs[~recs["failed"] & recs["score"].notna()].drop_duplicates(["dataset", "id"], keep="last")
    ok[numeric] = ok[numeric].apply(pd.to_numeric, errors="coerce").astype(float)  # float even when empty
    if task.get("name") == "niah":  # strict match (0/1): stored ``scores.strict`` (0/100), else recomputed
        ok["strict"] = [s["strict"] / 100 if isinstance(s, dict) and "strict" in s else max(
            strict_match(p, str(a)) for a in q) if isinstance(p, str) and isinstance(q, list) and q else math.nan
            for s, p, q in zip(ok["scores"], ok["prediction"], ok["answers"])]
    if ok["problem"].notna().any():  # sampled candidates: a problem is one sample, scored by their mean (pass@1)
        means = [c for c in (*numeric, "strict") if c in ok]
        ok = ok.assign(id=ok["problem"].fillna(ok["id"]))
        ok = ok.groupby(["dataset", "id"], as_index=False, sort=False)[means].mean()
    stored = {d: s for d, s in (summary.get("datasets") or {}).items() if (s or {}).get("score") is not None}
    datasets = sorted(set(recs["dataset"]) | set(summary.get("datasets") or {}))
    by = ok.groupby("dataset")
    per = by[numeric].mean().reindex(datasets)
    per["score"] = by["score"].agg(lambda s: round(100 * sum(s) / len(s), 2))
    per["n"], per["n_failed"], per["se"] = by.size(), recs.groupby("dataset")["failed"].sum(), 100 * by["score"].sem()
    by_id = lambda col: pd.Series({d: dict(zip(g["id"].astype(str), g[col])) for d, g in by}, dtype=object)
    per["samples"] = by_id("score")
    if "strict" in ok:
        per["strict"], per["strict_se"] = 100 * by["strict"].mean(), 100 * by["strict"].sem()
        per["strict_samples"] = by_id("strict")
    for d, s in stored.items():
        per.loc[d, ["score", "n"]] = float(s["score"]), s.get("n", per.at[d, "n"])
    job_means = {**(summary.get("timings") or {}), **(summary.get("cache") or {}), "n": 0, "n_failed": 0}
    bare = ~per.index.isin(ok["dataset"])  # datasets without records: the summary's job-level means
    fill = {c: v for c, v in job_means.items() if c in per and v is not None}
    per.loc[bare, list(fill)] = per.loc[bare, list(fill)].fillna(fill)
    frac = (summary.get("cache") or {}).get("compressed_fraction")
    per["compressed_fraction"] = per["compressed"] if frac is None else frac
    rows = [dict(base, dataset=d, **r) for d, r in per.drop(columns="compressed").iterrows()]
    return rows or [dict(base, dataset=None, score=math.nan, n=0, n_failed=0)]


def _model_keys(df: pd.DataFrame, skip: str = "\0") -> pd.Series:
    """Model name, suffixed where jobs of one (task, model) differ in a setting (but the keys starting with ``skip``):
    run tag, else the differing keys."""
    keys = df["model"].copy()
    for _, grp in df.groupby(["task", "model"]):
        sets = [json.loads(text) for text in grp["settings"].unique()]
        differ = sorted({k for s in sets for k in s if len({json.dumps(q[k]) for q in sets if k in q}) > 1
                         and not k.startswith(skip)})
        tags, ctxs = grp["setting"].nunique() > 1, grp["max_input_tokens"].nunique(dropna=False) > 1
        for idx, tag, ctx, text in zip(grp.index, grp["setting"], grp["max_input_tokens"], grp["settings"]):
            own = json.loads(text)
            parts = [tag] if tag and tags else [f"{ctx:.0f} tok" if ctx == ctx else "default"] if ctxs else []
            parts += [", ".join(f"{k}={own[k]}" for k in differ if k in own)] if any(k in own for k in differ) else []
            if parts:
                keys.at[idx] = f"{keys.at[idx]} [{'; '.join(parts)}]"
    return keys


def full_in_every_group(df: pd.DataFrame, keys=("model_key", "table_key"), settings: str = "settings") -> pd.DataFrame:
    """A full-cache job (it compresses nothing while decoding) joins, as their reference, the groups (``keys``) of its
    task and model whose ``settings`` (JSON) differ from its own in ``decode.*`` only: a row per such group."""
    both = df.assign(bare=df[settings].map(lambda text: json.dumps(
        {k: v for k, v in json.loads(text).items() if not k.startswith("decode.")}, sort_keys=True)))
    full, rest = both[both["method_name"] == FULL], both[both["method_name"] != FULL]
    if full.empty or rest.empty:
        return df
    same = ["task", "model", "setting", "max_input_tokens", "bare"]
    full = full.merge(rest[[*same, *keys]].drop_duplicates(), on=same, how="left", suffixes=("", "_of"))
    for key in keys:
        full[key] = full.pop(f"{key}_of").fillna(full[key])
    return pd.concat([rest, full], ignore_index=True).drop(columns="bare")


def _variants(df: pd.DataFrame) -> pd.DataFrame:
    """``variant`` (differing method fields, ``""`` when none) and ``default`` per row."""
    df["variant"], df["default"] = "", True
    for (_t, _m, label, name), grp in df.groupby(["task", "model_key", "method", "method_name"]):
        params = {p: json.loads(p) for p in grp["params"].unique()}
        ref = next(({k: v for k, v in d.items() if k not in ("name", "label")} for p, d in presets().items()
                    if d.get("name", p) == name and d.get("label", p) == label), None)
        varying = {k for p in params.values() for k in p if len({json.dumps(q.get(k)) for q in params.values()}) > 1
                   or ref and k in ref and json.dumps(p[k]) != json.dumps(ref[k])}
        for p, own in params.items():
            idx = grp.index[grp["params"] == p]
            df.loc[idx, "variant"] = ", ".join(f"{k}={own.get(k, '–')}" for k in sorted(varying))
            df.loc[idx, "default"] = all(json.dumps(own.get(k)) == json.dumps(ref.get(k)) for k in varying) if ref \
                else p == min(params)
    return df


def job_folders(root: Path) -> list[Path]:
    """The job folders under ``root`` (:func:`~kvbench.job.store.is_job_folder`), sorted; symbolic links to folders are
    followed, each real folder counted once; hidden folders (``.hydra``) are skipped."""
    seen, jobs = set(), []
    for folder, subfolders, _ in os.walk(root, followlinks=True):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        real = os.path.realpath(folder)
        if real in seen:  # a link back up the tree, or a second way to one folder
            subfolders.clear()
            continue
        seen.add(real)
        if is_job_folder(Path(folder)):
            jobs.append(Path(folder))
    return sorted(jobs)


def load_results(root: str | Path) -> pd.DataFrame:
    """Job folders under ``root`` (:func:`job_folders`), a row per job × dataset: score ``round(100·mean, 2)``
    (``summary.json``, else ``predictions.jsonl``), mean timings (s, tokens/s) and cache sizes (tokens, bytes);
    ``dataset=None`` when nothing is scored; ``df.attrs["unreadable"]``: job folders left out (unreadable, or a
    ``config.yaml`` that is not a job's). FileNotFoundError if ``root`` is no directory."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"results root {str(root)!r} is not a directory")
    rows, bad = [], []
    for job in job_folders(root):
        try:
            rows += _job_rows(root, job)
        except (OSError, ValueError, yaml.YAMLError) as e:
            bad.append(f"{job.relative_to(root).as_posix()}: {type(e).__name__}: {' '.join(str(e).split())}")
    cols = ["job", "task", "model", "method", "method_name", "budget", "setting", "compress", "max_input_tokens", "params",
            "settings", "complete", "subset", "dataset", "score", "n", "n_failed", "se", "samples", "strict",
            "strict_se", "strict_samples", *TIMING_COLUMNS, *CACHE_COLUMNS, "compressed_fraction"]
    df = pd.DataFrame(rows, columns=cols)
    df["model_key"] = _model_keys(df) if len(df) else pd.Series(dtype=object)
    df["table_key"] = _model_keys(df, "cache.") if len(df) else pd.Series(dtype=object)  # score tables: a Bits column
    df["bits"] = df["settings"].map(lambda s: json.loads(s).get("cache.bits"), na_action="ignore").astype(float)
    df = full_in_every_group(df)
    df = _variants(df) if len(df) else df.assign(variant=pd.Series(dtype=object), default=pd.Series(dtype=bool))
    for col in ["budget", "score", "n", "se", "strict", "strict_se", "max_input_tokens", *TIMING_COLUMNS,
                *CACHE_COLUMNS]:
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df.attrs["unreadable"] = bad
    return df


def method_sort_key(name: str, label: str) -> tuple:
    """Row order: :data:`METHOD_ORDER`, then shorter (main) labels first."""
    return METHOD_ORDER.index(name) if name in METHOD_ORDER else len(METHOD_ORDER), len(label), label


def model_sort_key(key: str) -> tuple:
    """Paper model order, then the key (``[ctx3500]`` before ``[ctx31500]`` by length)."""
    base = key.split(" ")[0]
    return MODEL_ORDER.index(base) if base in MODEL_ORDER else len(MODEL_ORDER), len(key), key


def paper_order(frame: pd.DataFrame, by: list[str], ranks: dict | None = None) -> pd.DataFrame:
    """``frame`` sorted (stably) by the columns ``by``, the one row order of every report: ``model`` and ``model_key``
    by :func:`model_sort_key`, ``method`` by :func:`method_sort_key` (with ``method_name``), a column whose values
    ``ranks`` all ranks by those ranks, any other by value; index reset."""
    order = {}
    for c in by:
        vals = pd.Series(list(zip(frame["method_name"], frame[c])) if c == "method" else list(frame[c]), frame.index,
                         dtype=object)
        key = {"model": model_sort_key, "model_key": model_sort_key, "method": lambda p: method_sort_key(*p)}.get(
            c, (ranks or {}).get if set(vals) <= set(ranks or {}) else None)
        order[f"_{c}"] = vals.map({v: i for i, v in enumerate(sorted(set(vals), key=key))})
    return frame.assign(**order).sort_values(list(order), kind="stable").drop(columns=list(order)).reset_index(drop=True)


def order_datasets(datasets: Iterable) -> list[str]:
    """LongBench order, then other datasets alphabetically."""
    ds = {d for d in datasets if isinstance(d, str)}
    return [d for d in DATASET_ORDER if d in ds] + sorted(ds - set(DATASET_ORDER))


def budget_text(budget: float) -> str:
    """``25%`` for a retention ratio (budget <= 1; 6 significant digits, never an exponent), ``256`` for tokens."""
    return np.format_float_positional(100 * budget, 6, fractional=False, trim="-") + "%" if budget <= 1 \
        else f"{budget:g}"


def budget_cell(method_name: str, budget: float, missing: str | None = None) -> str | None:
    """A table's Budget cell: :func:`budget_text`, ``missing`` for the full cache (its budget is not a setting)."""
    return missing if method_name == FULL else budget_text(budget)


def budget_semantics(budgets: Iterable[float]) -> str:
    """The caption phrase saying what a budget counts (``prompt tokens``: :class:`Artifact` names the protocol)."""
    bs = [b for b in budgets if not math.isnan(b)]
    return "budget = retention ratio ρ of prompt tokens" if bs and max(bs) <= 1 else \
        "budget = tokens kept per layer per KV head (average, recent window included)" if bs and min(bs) > 1 else \
        "budget ≤ 1: retention ratio ρ of prompt tokens; budget > 1: tokens per layer per KV head"
