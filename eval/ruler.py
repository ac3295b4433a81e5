"""RULER (Hsieh et al., 2024), the synthetic long-context suite of KV-compression papers and kvpress's
leaderboard: 13 subtasks at a context length, scored by substring match.

Data, in ``task.data_dir`` (:func:`data_files`), one file per subtask and length: RULER's own output
(``<length>/data/<subtask>/validation.jsonl``, rows ``input``, ``answer_prefix``, ``outputs``), the older
``<subtask>_<length>.jsonl`` files (the answer prefix inside ``input``), or a local copy of kvpress's
distribution (``<length>/test-*.parquet``: ``context``, ``question``, ``answer_prefix``, ``answer``, ``task``);
with no ``data_dir``, that distribution from the Hub (``task.hub_dataset``). Every row is one sample, its id
``<subtask>/<length>/<row>`` (RULER's ``index`` repeats). The prompt is ``input + answer_prefix`` as RULER's
``pred/call_api.py`` sends it; with ``task.chat_template`` the tokenizer's chat template wraps ``input`` as one
user turn and the answer prefix follows the assistant header, where RULER's ``prepare.py`` puts it after its
model template (kvpress does the same). ``Sample.query`` is the question (from RULER's question line, split as
kvpress's ``create_huggingface_dataset.py`` does), the template's tail and the answer prefix.
Generation limits are RULER's ``tokens_to_generate`` per task family; scores are RULER's
``string_match_all`` (the share of references found in the prediction, case-insensitive) for the
niah / vt / cwe / fwe subtasks and ``string_match_part`` (any reference found) for qa.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Optional

from .base import Sample, Task, TaskConfig, TaskConfigError, count, looked_for, read_jsonl, require

SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
            "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
#: RULER's tokens_to_generate per task family (its synthetic.yaml)
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}
#: where each family's question starts in RULER's templates (its last match); kvpress splits there too
QUESTION = {"niah": r"What (?:is|are all) the special magic", "vt": r"Question: Find all variables",
            "cwe": r"Question: What are the 10 most common words", "fwe": r"Question: Do not provide any explanation",
            "qa": r"Answer the question based on the given documents"}
#: the first characters of each family's answer prefix: RULER's generator cuts ``input`` at their last
#: occurrence (``input_text.rfind(answer_prefix[:10])``); files without ``answer_prefix`` are cut the same way
PREFIX_START = {"niah": " The speci", "vt": " Answer: A", "cwe": " Answer: T", "fwe": " Answer: A", "qa": " Answer:"}


def family(subtask: str) -> str:
    return subtask.split("_")[0]


def max_new_tokens(subtask: str) -> int:
    return MAX_NEW_TOKENS[family(subtask)]


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: control characters become newlines, outer whitespace is stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of ``references`` contained in ``prediction`` (case-insensitive), in [0, 1]."""
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 when any reference is contained in ``prediction`` (case-insensitive), else 0.0."""
    pred = postprocess(prediction).lower()
    return float(any(r.lower() in pred for r in references))


def data_files(data_dir: str, subtask: str, length: int) -> list[Path]:
    """The file(s) holding ``subtask`` at ``length`` in ``data_dir``, first layout found: RULER's
    ``<length>/data/<subtask>/validation.jsonl`` (or without ``data/``, as kvpress's generate.sh writes it),
    ``<subtask>_<length>.jsonl``, kvpress's ``<length>/test-*.parquet``; [] when none is there."""
    d = Path(data_dir).expanduser()
    for path in (d / str(length) / "data" / subtask / "validation.jsonl", d / str(length) / subtask / "validation.jsonl",
                 d / f"{subtask}_{length}.jsonl"):
        if path.is_file():
            return [path]
    return sorted((d / str(length)).glob("test-*.parquet"))


def split(subtask: str, text: str, answer_prefix: str | None) -> tuple[str, str, str]:
    """``(context, question, answer_prefix)`` of a RULER input; ``answer_prefix`` None: cut from ``text``'s
    end as RULER's generator does (:data:`PREFIX_START`). The question starts at the last match of
    :data:`QUESTION` ("" when none: the whole text is context)."""
    if answer_prefix is None:
        cut = text.rfind(PREFIX_START[family(subtask)])
        text, answer_prefix = (text[:cut], text[cut:]) if cut >= 0 else (text, "")
    starts = [m.start() for m in re.finditer(QUESTION[family(subtask)], text)]
    at = starts[-1] if starts else len(text)
    return text[:at], text[at:], answer_prefix


@dataclass
class RulerConfig(TaskConfig):
    """``conf/task/ruler.yaml``: RULER's 13 synthetic subtasks as KV-compression papers and kvpress's leaderboard use it."""

    name: str = "ruler"
    subtasks: List[str] = field(default_factory=lambda: list(SUBTASKS))  # any of SUBTASKS
    context_lengths: List[int] = field(default_factory=lambda: [4096])  # tokens: RULER's data per length
    n_samples: Optional[int] = None  # first n rows of each subtask and length; null = all
    # RULER's output folder (<length>/data/<subtask>/validation.jsonl), <subtask>_<length>.jsonl files or kvpress's
    # copy (<length>/test-*.parquet); null = the Hub
    data_dir: Optional[str] = None
    hub_dataset: str = "simonjegou/ruler"  # the Hub dataset kvpress's leaderboard reads when data_dir is null
    # wrap the input in the tokenizer's chat template, answer prefix after it (RULER's placement); false: RULER's
    # base template (files already templated)
    chat_template: bool = True

    def check(self) -> None:
        require(bool(self.subtasks) and set(self.subtasks) <= set(SUBTASKS), "subtasks", self.subtasks,
                f"a non-empty list of {', '.join(SUBTASKS)}")
        require(bool(self.context_lengths) and min(self.context_lengths) > 0, "context_lengths", self.context_lengths,
                "must be a non-empty list of positive integers (tokens)")
        count(self.n_samples, "n_samples")


class RulerTask(Task):
    """RULER subtasks × context lengths; sample ids ``<subtask>/<length>/<row>``."""

    name = "ruler"
    Config = RulerConfig

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Raises: TaskConfigError for a missing file, or no ``data_dir`` while the Hub is unreachable."""
        subtasks, lengths = cfg["subtasks"], cfg["context_lengths"]
        if not cfg.get("data_dir"):
            from .longbench_data import hub_reachable

            if not hub_reachable():
                raise TaskConfigError("task.data_dir is not set and the Hugging Face Hub is unreachable: pass "
                                      "task.data_dir=/path/to/ruler (RULER's output folder or its jsonl files)")
            return
        for s in subtasks:
            for length in lengths:
                if not data_files(cfg["data_dir"], s, length):
                    d = Path(cfg["data_dir"]).expanduser()
                    raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: no {length}/data/{s}/validation.jsonl, "
                                          f"{s}_{length}.jsonl or {length}/test-*.parquet{looked_for(d)}")

    @classmethod
    def data_files(cls, cfg: dict) -> list[Path]:
        """Every file the job reads (their SHA-256 are part of its identity)."""
        return sorted({p for s in cfg["subtasks"] for n in cfg["context_lengths"] for p in data_files(cfg["data_dir"], s, n)})

    def rows(self, subtask: str, length: int) -> list[dict[str, Any]]:
        """The first ``n_samples`` rows as ``{input, answer_prefix, outputs}`` (``answer_prefix`` None: inside
        ``input``), from ``data_dir`` or the Hub."""
        n = self.cfg.get("n_samples")
        files = data_files(self.cfg["data_dir"], subtask, length) if self.cfg.get("data_dir") else []
        if files and files[0].suffix == ".jsonl":
            return [{"input": r["input"], "answer_prefix": r.get("answer_prefix"), "outputs": r["outputs"]}
                    for r in read_jsonl(files[0], limit=n)]
        if files:
            import pandas as pd

            rows = pd.concat([pd.read_parquet(f) for f in files]).to_dict("records")
        else:
            from datasets import load_dataset

            rows = load_dataset(self.cfg["hub_dataset"], str(length), split="test")
        rows = [r for r in rows if r["task"] == subtask][:n]
        return [{"input": r["context"] + r["question"], "answer_prefix": r["answer_prefix"], "outputs": r["answer"]}
                for r in rows]

    def chat(self, text: str) -> str:
        """``text`` as one user turn of the tokenizer's chat template with the assistant header (RULER's
        ``prepare.py``: ``model_template.format(task_template=...)``), without the BOS the engine's tokenizer adds
        itself; ``text`` unchanged with ``task.chat_template`` false or a tokenizer without a template."""
        tok = self.tokenizer
        if not self.cfg.get("chat_template", True) or tok is None or not getattr(tok, "chat_template", None):
            return text
        out = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        bos = tok.bos_token
        return out[len(bos):] if bos and out.startswith(bos) and tok("x")["input_ids"][:1] == [tok.bos_token_id] else out

    def samples(self) -> Iterator[Sample]:
        for subtask in self.cfg["subtasks"]:
            for length in self.cfg["context_lengths"]:
                for i, row in enumerate(self.rows(subtask, length)):
                    context, question, prefix = split(subtask, row["input"], row["answer_prefix"])
                    head = self.chat(context + question)
                    at = head.rfind(question) if question else -1
                    yield Sample(id=f"{subtask}/{length}/{i}", dataset=subtask, prompt=head + prefix,
                                 max_new_tokens=max_new_tokens(subtask), answers=list(row["outputs"]), chat=False,
                                 meta={"context_length": length}, query=(head[at:] if at >= 0 else "") + prefix)

    def score(self, sample: Sample, prediction: str) -> float:
        match = string_match_part if sample.dataset.startswith("qa") else string_match_all
        return match(prediction, sample.answers)

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per-subtask scores (×100) and their ``average``."""
        out = super().aggregate(records)
        scores = [v["score"] for v in out["datasets"].values()]
        out["averages"] = {"ruler": round(sum(scores) / len(scores), 2) if scores else None}
        return out
