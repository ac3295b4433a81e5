"""LongBench and LongBench-E (v1), with the official protocol of THUDM/LongBench ``pred.py``/``eval.py``.

Per sample (Bai et al., 2024, LongBench v1 code):

1. prompt = the dataset's official template (``longbench_config/dataset2prompt.json``)
   filled with the row's ``context`` and ``input``;
2. middle truncation in tokens: tokenized with the model's tokenizer (special tokens added,
   as the official script does), a prompt longer than ``max_length`` tokens becomes
   ``decode(ids[:max_length//2]) + decode(ids[-max_length//2:])``, special tokens skipped;
3. ``Sample.chat`` is False for trec, triviaqa, samsum, lsht, lcc and repobench-p (no chat
   template), True elsewhere: the engine wraps the truncated prompt as one user turn;
4. greedy decoding up to ``longbench_config/dataset2maxlen.json`` new tokens; samsum stops on
   ``[tokenizer.eos_token_id, newline]`` exactly (``Sample.stop_strings == ["\\n"]``);
5. ``task.compress=context`` leaves the template's text after ``{context}`` (question, instruction,
   answer cue) uncompressed (``Sample.query``);
6. scoring by :mod:`eval.metrics` (first-line cut for trec, triviaqa, samsum, lsht; max over
   answers; ``round(100·mean, 2)`` per dataset; LongBench-E buckets by ``length``).

``max_length`` is ``task.max_length`` when set, else the model's ``model.max_input_length``
(official: 3,500 for the 4k-context chat models, 31,500 for longchat-v1.5-7b-32k).
The two JSON files hold the official ``config/dataset2prompt.json`` and
``config/dataset2maxlen.json`` of THUDM/LongBench (LongBench/config at commit 2e00731)
verbatim in content, typo "asconcisely" included.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional

from . import longbench_data as data
from .base import Sample, Task, TaskConfig, TaskConfigError, count
from .metrics import BUCKETS, bucket_scores, dataset_score, score_sample
from .suite import split

_CONFIG_DIR = Path(__file__).with_name("longbench_config")
PROMPTS: dict[str, str] = json.loads((_CONFIG_DIR / "dataset2prompt.json").read_text(encoding="utf-8"))
"""Official prompt template of each dataset (``{context}``, ``{input}`` placeholders)."""
MAX_NEW_TOKENS: dict[str, int] = json.loads((_CONFIG_DIR / "dataset2maxlen.json").read_text(encoding="utf-8"))
"""Official generation limit (tokens) of each dataset."""

DATASETS_ALL = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)  # fmt: skip
"""The 21 LongBench datasets, in the official order."""
DATASETS_ZH = ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
DATASETS_EN = tuple(d for d in DATASETS_ALL if d not in DATASETS_ZH)
"""The 16 English (and code) datasets the papers average over."""
DATASETS_E = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news", "trec",
    "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)  # fmt: skip
"""The 13 LongBench-E datasets (files ``<dataset>_e.jsonl``)."""
GROUPS: dict[str, tuple[str, ...]] = {"en16": DATASETS_EN, "zh5": DATASETS_ZH, "all21": DATASETS_ALL, "e13": DATASETS_E}
"""Names usable in ``task.datasets`` for a whole group."""

NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
NEWLINE_STOP = frozenset({"samsum"})

CATEGORIES: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("narrativeqa", "qasper", "multifieldqa_en"),
    "Multi-Doc QA": ("hotpotqa", "2wikimqa", "musique"),
    "Summarization": ("gov_report", "qmsum", "multi_news"),
    "Few-shot Learning": ("trec", "triviaqa", "samsum"),
    "Synthetic": ("passage_count", "passage_retrieval_en"),
    "Code": ("lcc", "repobench-p"),
}
"""LongBench's task categories over the 16 English datasets (the papers' category columns)."""
CATEGORIES_ZH: dict[str, tuple[str, ...]] = {
    "Single-Doc QA": ("multifieldqa_zh",),
    "Multi-Doc QA": ("dureader",),
    "Summarization": ("vcsum",),
    "Few-shot Learning": ("lsht",),
    "Synthetic": ("passage_retrieval_zh",),
}
"""The same categories over the 5 Chinese datasets."""

def build_prompt(dataset: str, row: dict) -> str:
    """The official prompt of one row (template filled with ``context`` and ``input``)."""
    return PROMPTS[dataset].format(context=row["context"], input=row["input"])


def middle_truncate(prompt: str, tokenizer: Any, max_length: int) -> tuple[str, int]:
    """Official middle truncation of a prompt to ``max_length`` tokens.

    The prompt is tokenized as the official script does (``tokenizer(prompt)``, so the
    tokenizer's special tokens such as BOS count); if it has more than ``max_length`` tokens,
    the first and the last ``int(max_length / 2)`` tokens are decoded with special tokens
    skipped and concatenated. Re-tokenizing the result may give a few tokens more or less.

    Returns:
        (prompt, number of tokens of the untruncated prompt).
    """
    ids = list(tokenizer(prompt, truncation=False).input_ids)
    if len(ids) > max_length:
        half = int(max_length / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[-half:], skip_special_tokens=True
        )
    return prompt, len(ids)


def _mean2(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 2) if values else None


def averages(scores: dict[str, float]) -> dict[str, Any]:
    """Averages the papers print, from per-dataset scores (0-100, already rounded).

    Returns:
        ``{"en16": mean of the 16 English datasets or None unless all are present,
        "zh5": same for the 5 Chinese ones, "categories": {category: mean over the present
        English datasets of it, or None}}`` plus ``"categories_zh"`` when a Chinese dataset is
        present; means are rounded to 2 decimals.
    """
    out: dict[str, Any] = {
        "en16": _mean2([scores[d] for d in DATASETS_EN]) if all(d in scores for d in DATASETS_EN) else None,
        "zh5": _mean2([scores[d] for d in DATASETS_ZH]) if all(d in scores for d in DATASETS_ZH) else None,
        "categories": {c: _mean2([scores[d] for d in ds if d in scores]) for c, ds in CATEGORIES.items()},
    }
    if any(d in scores for d in DATASETS_ZH):
        out["categories_zh"] = {c: _mean2([scores[d] for d in ds if d in scores]) for c, ds in CATEGORIES_ZH.items()}
    return out


@dataclass
class LongBenchConfig(TaskConfig):
    """``conf/task/longbench.yaml``: LongBench v1 (THUDM), official protocol."""

    name: str = "longbench"
    datasets: Any = field(default_factory=lambda: ["en16"])  # dataset names and/or groups: en16 (the papers' 16 English), zh5, all21, e13
    n_samples: Optional[int] = None  # first n rows of each dataset (deterministic); null = all rows
    data_dir: Optional[str] = None  # folder of the official jsonl files (the data/ folder of data.zip); null = the Hub
    max_length: Optional[int] = None  # max input tokens before middle truncation; null = the model's max_input_tokens
    hub_dataset: str = "THUDM/LongBench"  # Hub dataset read when data_dir is null (the official one)
    hub_revision: str = "refs/convert/parquet"  # its parquet export branch (current `datasets` cannot run the loading script)
    hub_data_files: str = "{config}/test/*.parquet"  # files of one config there; {config} = dataset name (+ _e for LongBench-E)

    def check(self) -> None:
        count(self.n_samples, "n_samples")
        count(self.max_length, "max_length", 2)


@dataclass
class LongBenchEConfig(LongBenchConfig):
    """``conf/task/longbench_e.yaml``: the 13 LongBench-E datasets, scored per length bucket (0-4k, 4-8k, 8k+)."""

    name: str = "longbench_e"
    datasets: Any = field(default_factory=lambda: ["e13"])  # dataset names and/or the group e13 (files <dataset>_e.jsonl)


class LongBenchTask(Task):
    """LongBench v1: 21 datasets (16 English, 5 Chinese), official prompts, truncation and metrics.

    Task keys: :class:`LongBenchConfig` (the Hub parquet copy: :mod:`eval.longbench_data`).

    Sample ids are ``<dataset>/<row index>``; ``meta`` holds the row's ``_id``, the untruncated
    prompt length in tokens (``prompt_tokens_full``) and whether it was truncated.
    """

    name = "longbench"
    Config = LongBenchConfig
    file_suffix = ""
    valid_datasets: tuple[str, ...] = DATASETS_ALL
    default_datasets: tuple[str, ...] = ("en16",)

    def __init__(self, cfg: dict, tokenizer: Any = None, max_input_tokens: int | None = None, encode: Any = None,
                 resolved: dict | None = None):
        super().__init__(cfg, tokenizer, max_input_tokens, encode, resolved)
        self.datasets = self.resolve_datasets(self.cfg.get("datasets"))
        self.n_samples = self.cfg.get("n_samples")
        self.max_length = self.cfg.get("max_length") or max_input_tokens
        self.hub = {k: self.cfg.get(k) or getattr(LongBenchConfig, k) for k in ("hub_dataset", "hub_revision", "hub_data_files")}

    # ---------------------------------------------------------------- configuration

    @classmethod
    def resolve_datasets(cls, value: Any) -> list[str]:
        """Dataset names from ``task.datasets`` (names and groups, duplicates dropped, order kept).

        Raises:
            TaskConfigError: empty, not a string/list, or an unknown name (lists the accepted ones).
        """
        if value is None:
            value = list(cls.default_datasets)
        items = [value] if isinstance(value, str) else value
        try:
            items = list(items)
        except TypeError:
            raise TaskConfigError(f"task.datasets={value!r}: expected a name or a list of names") from None
        groups = {g: ds for g, ds in GROUPS.items() if set(ds) <= set(cls.valid_datasets)}
        names: list[str] = []
        for item in items:
            if item in groups:
                names.extend(groups[item])
            elif item in cls.valid_datasets:
                names.append(item)
            else:
                close = difflib.get_close_matches(str(item).lower(), [*groups, *cls.valid_datasets], n=1, cutoff=0.6)
                shown = "[" + ", ".join(map(str, items)) + "]" if not isinstance(value, str) else value
                raise TaskConfigError(
                    f"task.datasets={shown}: unknown {cls.name} dataset {item!r}"
                    f"{f' (did you mean {close[0]}?)' if close else ''}; accepted: groups "
                    f"{', '.join(groups)} or datasets {', '.join(cls.valid_datasets)}"
                )
        if not names:
            raise TaskConfigError(f"task.datasets is empty; accepted: groups {', '.join(groups)} or dataset names")
        return list(dict.fromkeys(names))

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Check the task node and the data source before any model loads.

        Reads the rows that will be used (first ``n_samples`` of each dataset) of a
        ``data_dir`` and checks their fields; without ``data_dir``, checks the Hub answers.

        Raises:
            TaskConfigError: unknown dataset, ``data_dir`` missing/empty/incomplete, a jsonl line missing a
                required field (file and line), or the Hub unreachable without ``data_dir``.
        """
        datasets = cls.resolve_datasets(cfg.get("datasets"))
        if cfg.get("data_dir"):
            for path in data.check_data_dir(cfg["data_dir"], [d + cls.file_suffix for d in datasets]):
                if not data.read_jsonl(path, cfg.get("n_samples")):
                    raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: {path.name} holds no samples")
        else:
            data.check_hub()

    # ---------------------------------------------------------------- samples

    def rows(self, dataset: str) -> list[dict]:
        """The first ``n_samples`` official rows of ``dataset`` (from ``data_dir`` or the Hub).

        A dataset that has more rows than ``n_samples`` is added to ``cut_datasets`` (one row
        more is read to tell), so that the job's summary says its score covers part of it.
        """
        config = dataset + self.file_suffix
        limit = None if self.n_samples is None else self.n_samples + 1
        if self.cfg.get("data_dir"):
            (path,) = data.check_data_dir(self.cfg["data_dir"], [config])
            rows = data.read_jsonl(path, limit)
        else:
            rows = data.read_hub(
                self.hub["hub_dataset"], self.hub["hub_revision"], self.hub["hub_data_files"], config, limit
            )
        if self.n_samples is not None and len(rows) > self.n_samples:
            if dataset not in self.cut_datasets:
                self.cut_datasets.append(dataset)
            rows = rows[: self.n_samples]
        return rows

    def make_sample(self, dataset: str, index: int, row: dict, max_length: int) -> Sample:
        """One official sample: prompt built and middle-truncated to ``max_length`` tokens; the query part is the
        template's text after ``{context}`` (none when truncation cut into it)."""
        prompt, n_tokens = middle_truncate(build_prompt(dataset, row), self.tokenizer, max_length)
        prompt, query = split(prompt, PROMPTS[dataset].split("{context}", 1)[1].format(input=row["input"]))
        return Sample(
            id=f"{dataset}/{index}",
            dataset=dataset,
            prompt=prompt,
            max_new_tokens=MAX_NEW_TOKENS[dataset],
            answers=list(row["answers"]),
            chat=dataset not in NO_CHAT_TEMPLATE,
            stop_strings=["\n"] if dataset in NEWLINE_STOP else [],
            min_new_tokens=1 if dataset in NEWLINE_STOP else 0,  # pred.py: min_length = prompt + 1
            all_classes=list(row["all_classes"]) if row["all_classes"] is not None else None,
            length=int(row["length"]),
            meta={"_id": row.get("_id"), "prompt_tokens_full": n_tokens, "truncated": n_tokens > max_length},
            query=query,
        )

    def samples(self) -> Iterator[Sample]:
        """Samples of every selected dataset in order, rows in file order (TaskConfigError: no max
        input length, neither ``task.max_length`` nor the model's)."""
        if self.max_length is None:
            raise TaskConfigError("task.max_length is not set and the model gives no max_input_length: set task.max_length")
        for dataset in self.datasets:
            for index, row in enumerate(self.rows(dataset)):
                yield self.make_sample(dataset, index, row, self.max_length)

    # ---------------------------------------------------------------- scoring

    def score(self, sample: Sample, prediction: str) -> float:
        """Official sample score in [0, 1] (see :func:`eval.metrics.score_sample`)."""
        return score_sample(sample.dataset, prediction, sample.answers, sample.all_classes)

    def _scores_by_dataset(self, records: list[dict]) -> dict[str, list[tuple[float, int | None]]]:
        """(score, length) of the successful records of each dataset, in row order."""
        by_ds: dict[str, list[tuple[int, float, int | None]]] = {}
        for pos, r in enumerate(records):
            if r.get("error") is None and r.get("score") is not None:
                tail = str(r.get("id", "")).rsplit("/", 1)[-1]
                order = int(tail) if tail.isdigit() else pos
                by_ds.setdefault(r["dataset"], []).append((order, float(r["score"]), r.get("length")))
        return {ds: [(s, n) for _, s, n in sorted(v, key=lambda t: t[0])] for ds, v in by_ds.items()}

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """``{"datasets": {ds: {"score", "n"}}, "averages": ...}`` from stored records.

        Scores are the official ``round(100 · sum / n, 2)`` over successful records (failed
        ones, ``error`` set, are left out) summed in row order; ``averages`` as :func:`averages`.
        """
        by_ds = self._scores_by_dataset(records)
        datasets = {
            ds: {"score": dataset_score([s for s, _ in by_ds[ds]]), "n": len(by_ds[ds])}
            for ds in self.datasets + sorted(set(by_ds) - set(self.datasets))
            if ds in by_ds
        }
        return {"datasets": datasets, "averages": averages({ds: v["score"] for ds, v in datasets.items()})}


class LongBenchETask(LongBenchTask):
    """LongBench-E: the 13 datasets with uniform length spread (files ``<dataset>_e.jsonl``).

    Same prompts, truncation and metrics as LongBench; :meth:`aggregate` adds the length
    buckets ``0-4k``, ``4-8k``, ``8k+`` (by the ``length`` field) per dataset, an empty bucket
    being None.
    """

    name = "longbench_e"
    Config = LongBenchEConfig
    file_suffix = "_e"
    valid_datasets = DATASETS_E
    default_datasets = ("e13",)

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """As :meth:`LongBenchTask.aggregate` plus ``"buckets": {ds: {bucket: score or None}}``
        and ``averages["buckets"]`` (mean over the datasets that have the bucket).

        Raises:
            ValueError: a successful record has no ``length``.
        """
        out = super().aggregate(records)
        by_ds = self._scores_by_dataset(records)
        buckets: dict[str, dict[str, float | None]] = {}
        for ds in out["datasets"]:
            lengths = [n for _, n in by_ds[ds]]
            if any(n is None for n in lengths):
                raise ValueError(f"{ds}: a LongBench-E record has no 'length'")
            buckets[ds] = bucket_scores([s for s, _ in by_ds[ds]], lengths)
        out["buckets"] = buckets
        out["averages"]["buckets"] = {
            b: _mean2([v[b] for v in buckets.values() if v[b] is not None]) for b in BUCKETS
        }
        return out
