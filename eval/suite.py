"""What LongBench-v2, InfiniteBench, LooGLE and ZeroSCROLLS share: subsets, the two data sources, truncation.

Rows come from one of two sources (``task.source``):

* ``official``: the benchmark's own files, from ``task.data_dir`` (a folder in the official layout) or downloaded
  from the official Hub dataset (``task.hub_dataset``, default :attr:`SuiteTask.official_hub`); the task builds the
  official prompt from the raw fields.
* ``kvpress``: kvpress's Hub copy (``task.hub_dataset``, default :attr:`SuiteTask.kvpress_hub`; a local snapshot
  folder works too), read with ``datasets.load_dataset``; its rows hold kvpress's ready prompt parts ``context``,
  ``question``, ``answer_prefix``: prompt = ``context + question`` in the chat template's user turn, then
  ``answer_prefix`` after its generation prompt (kvpress's pipeline, for parity with its leaderboard; see
  :meth:`SuiteTask.answer_turn`), query = from ``question`` on; scored by the same official metric.
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, List, Optional

from .base import Sample, Task, TaskConfig, TaskConfigError, count, is_data_file, looked_for, one_of, read_jsonl
from .longbench_data import _is_network_error, hub_reachable
from .ruler import chat

SOURCES = ("official", "kvpress")


@dataclass
class SuiteConfig(TaskConfig):
    """The keys every :class:`SuiteTask` has; ``conf/task/<name>.yaml`` sets ``name`` and says what the defaults mean."""

    datasets: Optional[List[str]] = None  # the task's subsets (SuiteTask.subsets); null = all
    n_samples: Optional[int] = None  # first n rows (of each dataset); null = all
    data_dir: Optional[str] = None  # folder of the official files; null = the Hub
    source: str = "official"  # official (its files and prompts) | kvpress (kvpress's Hub copy and its prompts)
    hub_dataset: Optional[str] = None  # null = the task's official or kvpress Hub dataset (by source)
    max_length: Optional[int] = None  # max input tokens before middle truncation; null = the model's max_input_tokens

    def check(self) -> None:
        count(self.n_samples, "n_samples")
        count(self.max_length, "max_length")
        one_of(self.source, "source", SOURCES)


def require(row: dict, where: str, **types: type | tuple[type, ...]) -> None:
    """Check that ``row`` has each field with the given type(s). TaskConfigError: ``<where>: field '<name>' ...``
    for the first missing or mistyped field."""
    for key, kind in types.items():
        if key not in row:
            raise TaskConfigError(f"{where}: missing field {key!r}")
        if not isinstance(row[key], kind) or isinstance(row[key], bool):
            names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
            raise TaskConfigError(f"{where}: field {key!r} must be {names}, got {type(row[key]).__name__}")


def truncate_middle(prompt: str, tokenizer: Any, max_length: int, ceil_tail: bool = False) -> tuple[str, int]:
    """Middle truncation in tokens as InfiniteBench's ``truncate_by_tokens`` and LongBench-v2's ``pred.py`` do it:
    ``ids = tokenizer.encode(prompt)`` (special tokens added); when longer than ``max_length``, keep the first
    ``max_length // 2`` and the last ``max_length // 2`` ids (``ceil(max_length / 2)`` with ``ceil_tail``, as
    ``pred.py``'s ``ids[-max_len//2:]``) and decode them at once with special tokens skipped.

    Returns:
        (prompt, number of tokens of the untruncated prompt).
    """
    ids = list(tokenizer(prompt, truncation=False).input_ids)
    if len(ids) > max_length:
        half = max_length // 2
        prompt = tokenizer.decode(ids[:half] + ids[-(max_length - half if ceil_tail else half):], skip_special_tokens=True)
    return prompt, len(ids)


def split(prompt: str, query: str) -> tuple[str, str]:
    """``(prompt, query)`` with ``query`` kept only when ``prompt`` still ends with it (truncation can cut it)."""
    return prompt, query if query and prompt.endswith(query) else ""


class SuiteTask(Task):
    """A benchmark of named subsets (``task.datasets``), rows from ``task.source`` (module docstring).

    Subclasses set the class attributes and implement the classmethod ``check_row(dataset, row, where)`` (raising
    :class:`TaskConfigError`), ``official_sample`` and ``kvpress_sample(dataset, index, row) -> Sample`` and
    :meth:`score`. Sample ids are ``<dataset>/<row index>``.
    """

    subsets: tuple[str, ...] = ()
    official_hub = ""
    kvpress_hub = ""
    what = ""  # what to download, for the offline error
    Config = SuiteConfig
    ceil_tail = False  # truncate_middle's tail rounding

    def __init__(self, cfg: dict, tokenizer: Any = None, max_input_tokens: int | None = None, encode: Any = None,
                 resolved: dict | None = None):
        super().__init__(cfg, tokenizer, max_input_tokens, encode, resolved)
        self.datasets = list(self.cfg.get("datasets") or self.subsets)
        self.max_length = self.cfg.get("max_length") or max_input_tokens

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Check the keys, then the first ``n_samples`` rows of each dataset in ``data_dir``, or that the Hub answers.
        TaskConfigError: an unknown dataset, a missing folder or file, a malformed row (file, line, field), or no
        ``data_dir`` while the Hub is unreachable."""
        datasets = cfg.get("datasets")
        if datasets is not None and (not datasets or any(d not in cls.subsets for d in datasets)):
            raise TaskConfigError(f"task.datasets={datasets}: a non-empty list of {', '.join(cls.subsets)} (null: all)")
        if cfg.get("data_dir") and cfg.get("source") == "official":
            for d in cfg.get("datasets") or cls.subsets:
                cls.read_file(cls.file_path(cfg["data_dir"], d), d, cfg.get("n_samples"))
        elif not (cfg.get("hub_dataset") and Path(os.path.expanduser(cfg["hub_dataset"])).is_dir()) and not hub_reachable():
            raise TaskConfigError(cls.offline_error())

    @classmethod
    def offline_error(cls) -> str:
        return (f"task.data_dir is not set and the Hugging Face Hub is unreachable: download {cls.what} "
                f"and pass task.data_dir=/path/to/it")

    @classmethod
    def file_path(cls, data_dir: str, dataset: str) -> Path:
        """The official file of ``dataset`` in ``data_dir`` (TaskConfigError: folder or file missing)."""
        root = Path(os.path.expanduser(str(data_dir)))
        if not root.is_dir():
            raise TaskConfigError(f"task.data_dir={data_dir}: no such directory{looked_for(root)}")
        path = root / cls.file_name(dataset)
        if not is_data_file(path):
            raise TaskConfigError(f"task.data_dir={data_dir}: no {cls.file_name(dataset)} ({cls.what})")
        return path

    @classmethod
    def file_name(cls, dataset: str) -> str:
        return f"{dataset}.jsonl"

    @classmethod
    def read_file(cls, path: Path, dataset: str, limit: int | None) -> list[dict]:
        return read_jsonl(path, lambda row, where: cls.check_row(dataset, row, where), limit)

    def _hub(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one line for the user
            if _is_network_error(e):
                raise TaskConfigError(self.offline_error()) from None
            raise TaskConfigError(f"task.hub_dataset={self.cfg.get('hub_dataset')}: {type(e).__name__}: "
                                  f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None

    def official_hub_file(self, dataset: str) -> Path:
        """The official file of ``dataset`` downloaded from ``hub_dataset`` (``huggingface_hub``'s cache)."""
        from huggingface_hub import hf_hub_download

        repo = self.cfg.get("hub_dataset") or self.official_hub
        return Path(self._hub(lambda: hf_hub_download(repo, self.file_name(dataset), repo_type="dataset")))

    def kvpress_rows(self, dataset: str) -> list[dict]:
        """kvpress's Hub copy of ``dataset`` (config ``kvpress_config(dataset)``, split ``test``), each row checked."""
        import datasets

        repo = self.cfg.get("hub_dataset") or self.kvpress_hub
        table = self._hub(lambda: datasets.load_dataset(repo, self.kvpress_config(dataset), split="test"))
        rows = [dict(r) for r in table if r.get("task", dataset) == dataset]
        for i, r in enumerate(rows):
            require(r, f"{repo} {dataset} row {i}", context=str, question=str, answer_prefix=str)
        return rows

    def kvpress_config(self, dataset: str) -> str | None:
        return dataset

    def rows(self, dataset: str) -> list[dict]:
        """The first ``n_samples`` rows of ``dataset`` (+1 read to tell whether the dataset was cut)."""
        n = self.cfg.get("n_samples")
        if self.cfg["source"] == "kvpress":
            rows = self.kvpress_rows(dataset)
        else:
            path = (self.file_path(self.cfg["data_dir"], dataset) if self.cfg.get("data_dir")
                    else self.official_hub_file(dataset))
            rows = self.read_file(path, dataset, None if n is None else n + 1)
        if n is not None and len(rows) > n:
            self.cut_datasets.append(dataset)
        return rows[:n]

    def samples(self) -> Iterator[Sample]:
        """Samples of each dataset in order (TaskConfigError: no max input length)."""
        if self.max_length is None:
            raise TaskConfigError("task.max_length is not set and the model gives no max_input_length: set task.max_length")
        for dataset in self.datasets:
            for index, row in enumerate(self.rows(dataset)):
                yield self.build(dataset, index, row)

    def build(self, dataset: str, index: int, row: dict) -> Sample:
        """The sample of one row, from ``task.source``'s prompt (kvpress's: its answer prefix placed)."""
        if self.cfg["source"] != "kvpress":
            return self.official_sample(dataset, index, row)
        sample = self.kvpress_sample(dataset, index, row)
        return self.answer_turn(sample, row["answer_prefix"]) if row["answer_prefix"] else sample

    def answer_turn(self, sample: Sample, prefix: str) -> Sample:
        """``sample`` (kvpress's ``context + question``, truncated) with ``prefix`` where kvpress's pipeline puts the
        answer prefix: after the chat template's generation prompt (:func:`eval.ruler.chat`, RULER's placement;
        appended to the prompt without a template), so ``chat`` is off; the query part runs from the question on."""
        head = chat(self.tokenizer, sample.prompt)
        at = head.rfind(sample.query) if sample.query else -1
        return replace(sample, prompt=head + prefix, query=(head[at:] if at >= 0 else "") + prefix, chat=False)

    def truncated(self, prompt: str, query: str) -> tuple[str, str, dict]:
        """``(prompt, query, meta)`` after :func:`truncate_middle` to ``max_length``."""
        text, n = truncate_middle(prompt, self.tokenizer, self.max_length, self.ceil_tail)
        return (*split(text, query), {"prompt_tokens_full": n, "truncated": n > self.max_length})

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per-dataset ``round(100·mean, 2)`` and their plain mean ``averages[<task name>]``."""
        out = super().aggregate(records)
        scores = [v["score"] for v in out["datasets"].values()]
        out["averages"] = {self.name: round(sum(scores) / len(scores), 2) if scores else None}
        return out
