"""The task contract: a task turns benchmark data into :class:`Sample` objects (text only: ``eval`` never sees
tensors) and scores predictions with the benchmark's official metric (a job's steps: docs/ARCHITECTURE.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from . import sampling


class TaskConfigError(ValueError):
    """A user-caused task configuration problem (one line: key, bad value, accepted values or fix), raised before
    any model loads (from a :class:`TaskConfig` or :meth:`Task.validate`) wherever possible."""


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Raise ``TaskConfigError("task.<key>=<value>: <rule>")`` unless ``ok``."""
    if not ok:
        raise TaskConfigError(f"task.{key}={value!r}: {rule}")


def count(value: Optional[int], key: str, low: int = 1) -> None:
    """Check that ``value`` is null or an integer >= ``low`` (OmegaConf has checked the type)."""
    require(value is None or value >= low, key, value, f"must be an integer >= {low}")


def one_of(value: Any, key: str, choices: tuple) -> None:
    require(value in choices, key, value, f"accepted values are {', '.join(map(str, choices))}")


@dataclass
class TaskConfig:
    """Base of a task's config dataclass: the node ``conf/task/<name>.yaml`` extends (``kvbench.job.config.register``
    stores it in Hydra's ConfigStore as ``schema/task/<name>``). OmegaConf checks keys and types while Hydra
    composes; ``__post_init__`` checks values, so that the :class:`TaskConfigError` comes before any model loads.
    """

    name: str = ""
    compress: str = "prompt"  # prompt: the whole prompt is compressed | context: Sample.query stays uncompressed

    def __post_init__(self) -> None:
        one_of(self.compress, "compress", ("prompt", "context"))
        self.check()

    def check(self) -> None:
        """Range and choice checks of the task's own fields (override; raise with :func:`require`)."""


def looked_for(path: Path) -> str:
    """`` (looked for <absolute path>)`` for a relative path (resolved against the working
    directory, which may not be the one the user thinks of), ``""`` for an absolute one: the
    tail of a "no such folder" error."""
    return "" if path.is_absolute() else f" (looked for {os.path.abspath(path)})"


def is_data_file(path: Path) -> bool:
    """Whether the data file ``path`` is there (the one test of every task's file lookup). TaskConfigError: ``path``
    exists but is not a file (a folder), naming it under ``task.data_dir``."""
    if path.exists() and not path.is_file():
        raise TaskConfigError(f"task.data_dir: {path} is not a file (a directory?)")
    return path.exists()


def read_jsonl(path: Path, check: Callable[[dict, str], None] | None = None, limit: int | None = None) -> list[dict]:
    """The JSON-object rows of a ``.jsonl`` data file (blank lines skipped; the first ``limit`` if given), each
    passed to ``check(row, where)``, ``where`` = ``"<path> line <n>"`` (1-based). TaskConfigError: the file cannot
    be read, or a line is not UTF-8, not a JSON object or fails ``check``; the message names the file and the line."""
    rows: list[dict] = []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                if limit is not None and len(rows) >= limit:
                    break
                where = f"{path} line {lineno}"
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise TaskConfigError(f"{where}: not valid UTF-8 (byte {e.start + 1} of the line)") from None
                except json.JSONDecodeError as e:
                    raise TaskConfigError(f"{where}: not valid JSON ({e})") from None
                if not isinstance(row, dict):
                    raise TaskConfigError(f"{where}: not a JSON object")
                if check:
                    check(row, where)
                rows.append(row)
    except OSError as e:
        raise TaskConfigError(f"{path}: cannot read ({e.strerror})") from None
    return rows


@dataclass
class Sample:
    """One prompt of a task.

    Attributes:
        id: unique within the job (used to resume), e.g. ``multi_news/17``.
        dataset: dataset name (``multi_news``, ``niah``...).
        prompt: the full prompt text, already truncated by the task's rule.
        chat: whether the engine wraps ``prompt`` in the model's chat template (as one user turn).
        max_new_tokens: generation limit (tokens).
        answers: reference answers; the sample score is the max over them.
        stop_strings: strings that end generation; with them generation stops on the tokenizer's eos and these
            only, not the model's other eos ids (LongBench's samsum: ``"\\n"``, pred.py's stop list).
        min_new_tokens: tokens generated before any stop id may end generation (LongBench's
            samsum: ``min_length = prompt + 1``).
        all_classes: class names for classification datasets, else None.
        length: the dataset's ``length`` field (words/characters), for LongBench-E buckets.
        meta: anything else worth storing (NIAH: context_length, depth_percent).
        query: the tail of ``prompt`` that is the query part (question, answer prefix: ``prompt.endswith(query)``),
            left uncompressed under ``task.compress=context``; "" = no split.
        group: the id of the context this sample shares with others (a SCBench row, a LooGLE document); "" = the job
            names it from the context's tokens. Under ``task.compress=context`` samples whose context tokens are equal
            are prefilled and compressed once.
        turn: the sample's index in its group (multi-turn order).
        follow_up: a multi-turn turn after the first: ``prompt`` is the segment appended (already in the model's
            format, ``chat`` off) to its group's cache after turn ``turn - 1`` was answered.
        keep_answer: multi-turn: the answer generated for this turn stays in the cache for the next turn (SCBench's
            ``--disable_golden_context``); else it is dropped and the next segment carries the golden answer.
        ids: the token ids to prefill instead of tokenizing ``prompt`` (special tokens included; the query part is
            their tail), when the official code feeds ids it cut by tokens (SCBench); ``prompt`` is then their text.
    """

    id: str
    dataset: str
    prompt: str
    max_new_tokens: int
    answers: list[str]
    chat: bool = True
    stop_strings: list[str] = field(default_factory=list)
    min_new_tokens: int = 0
    all_classes: list[str] | None = None
    length: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    query: str = ""
    group: str = ""
    turn: int = 0
    follow_up: bool = False
    keep_answer: bool = False
    ids: list[int] | None = None


class Task:
    """Base class of a task: subclasses implement :meth:`samples`, :meth:`score` and may override :meth:`aggregate`."""

    name: str = "task"
    Config: type[TaskConfig] = TaskConfig

    def __init__(self, cfg: dict, tokenizer: Any = None, max_input_tokens: int | None = None,
                 encode: Callable[[Sample], list[int]] | None = None, resolved: dict | None = None):
        """Args:
            cfg: the task's Hydra node as a plain dict (``conf/task/<name>.yaml``).
            tokenizer: the model's Hugging Face tokenizer (text in, token ids out), used for
                truncation and lengths in tokens; may be None for :meth:`validate`-only use.
            max_input_tokens: the model's max input length (tokens) unless the task overrides it.
            encode: the token ids the engine will prefill for a sample (chat template and special
                tokens included; the job passes ``kvbench.job.run.encode_prompt``). None: the plain
                tokenizer without special tokens.
            resolved: inputs the job's check already read (``kvbench.job.config.resolved_inputs``: the NIAH
                haystack), so that the task does not read them again.
        """
        self.cfg = dict(cfg)
        self.tokenizer = tokenizer
        self.max_input_tokens = max_input_tokens
        self.encode = encode
        self.resolved = resolved or {}
        #: datasets of which :meth:`samples` yielded only the first rows (a sample limit such as
        #: LongBench's ``task.n_samples`` left rows out); filled while :meth:`samples` runs
        self.cut_datasets: list[str] = []

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Check what the task node names (folders, files, the Hub) before any model loads; its keys, types and
        ranges are its :attr:`Config`'s. Raises :class:`TaskConfigError`."""

    @classmethod
    def data_files(cls, cfg: dict) -> list[Path]:
        """The files of ``task.data_dir`` the task reads (their SHA-256 are part of the job's identity):
        its ``.json``/``.jsonl`` files; a task reading a folder tree overrides it."""
        return sorted(p for p in Path(cfg["data_dir"]).expanduser().glob("*.json*") if p.suffix in (".json", ".jsonl") and is_data_file(p))

    @classmethod
    def documented(cls, cfg: dict) -> list[int] | None:
        """Without the data: each sample's ``max_new_tokens`` from the dataset's documented size and limits (an upper
        bound, for ``kvbench plan``); None when the task documents none."""
        return None

    def samples(self) -> Iterator[Sample]:  # pragma: no cover - abstract
        raise NotImplementedError

    def tokens_needed(self, sample: Sample) -> int:
        """Upper bound of ``sample``'s prompt + generation tokens, checked against the model's context window: the
        prompt budget ``max_input_tokens`` plus ``max_new_tokens`` (a task whose protocol cuts the prompt to leave
        room for the generation returns its budget)."""
        return (self.max_input_tokens or 0) + sample.max_new_tokens

    def scoring_sample(self, row: dict, where: str) -> Sample:
        """The sample a predictions row is scored against (``kvbench score --task``): by default its kvbench record
        fields ``answers`` (a list), ``dataset`` (default: the task's name), ``all_classes``, ``length``, ``meta``;
        tasks whose official rows carry their reference otherwise override it. TaskConfigError: ``<where>: ...``
        when ``answers`` is missing or not a list."""
        if not isinstance(row.get("answers"), list):
            raise TaskConfigError(f"{where}: field 'answers' must be a list (the references; task {self.name})")
        return Sample(id=where, dataset=str(row.get("dataset") or self.name), prompt="", max_new_tokens=0,
                      answers=row["answers"], all_classes=row.get("all_classes"), length=row.get("length"),
                      meta=row.get("meta") or {})

    def score(self, sample: Sample, prediction: str) -> float:  # pragma: no cover - abstract
        """Score of one prediction in [0, 1] (max over ``sample.answers``)."""
        raise NotImplementedError

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per-dataset scores from stored records (``{"datasets": {name: {"score", "n"}}}``); the default is
        round(100·mean, 2) over the successful samples of each dataset, a sample being a record or, with sampled
        candidates (records with ``problem``), a problem scored by the mean of its candidates (pass@1), ``n`` counting
        problems; then also ``pass_at_k`` (:func:`eval.sampling.summary`)."""
        by_ds = {ds: [sum(float(r["score"]) for r in rs) / len(rs) for rs in problems.values()]
                 for ds, problems in sampling.by_problem(records).items()}
        out = {"datasets": {ds: {"score": round(100 * sum(v) / len(v), 2), "n": len(v)}
                            for ds, v in sorted(by_ds.items())}}
        sampled = any(r.get("problem") is not None for r in records)
        return out | ({"pass_at_k": sampling.summary(records)} if sampled else {})
