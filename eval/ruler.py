"""RULER (Hsieh et al., 2024), the synthetic long-context suite of KV-compression papers and kvpress's
leaderboard: 13 subtasks at a context length, scored by substring match.

Data: RULER's own jsonl files (``index``, ``input``, ``outputs``, ``length``; ``input`` is the whole
prompt in RULER's base template, ending with the answer prefix) named ``<subtask>_<length>.jsonl``
in ``task.data_dir`` (e.g. ``../shared/data/ruler/niah_multikey_3_4096.jsonl``); or, online, the
Hub dataset kvpress uses (``simonjegou/ruler``, one config per length: ``context``, ``question``,
``answer_prefix``, ``answer``, ``task``), whose prompt is ``context + question + answer_prefix``.
Generation limits are RULER's ``tokens_to_generate`` per task family; scores are RULER's
``string_match_all`` (the share of references found in the prediction, case-insensitive) for the
niah / vt / cwe / fwe subtasks and ``string_match_part`` (any reference found) for qa.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

from .base import Sample, Task, TaskConfigError, looked_for, read_jsonl

SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
            "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
#: RULER's tokens_to_generate per task family (its synthetic.yaml)
MAX_NEW_TOKENS = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa": 32}


def max_new_tokens(subtask: str) -> int:
    return MAX_NEW_TOKENS[subtask.split("_")[0]]


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


class RulerTask(Task):
    """RULER subtasks × context lengths; sample ids ``<subtask>/<length>/<index>``."""

    name = "ruler"

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Raises: TaskConfigError for an unknown subtask, a bad length or sample count, a missing file."""
        subtasks, lengths, n = cfg.get("subtasks"), cfg.get("context_lengths"), cfg.get("n_samples")
        if not isinstance(subtasks, list) or not subtasks or any(s not in SUBTASKS for s in subtasks):
            raise TaskConfigError(f"task.subtasks={subtasks}: a non-empty list of {', '.join(SUBTASKS)}")
        if not isinstance(lengths, list) or not lengths or not all(isinstance(x, int) and x > 0 for x in lengths):
            raise TaskConfigError(f"task.context_lengths={lengths}: must be a non-empty list of positive integers (tokens)")
        if n is not None and (not isinstance(n, int) or n < 1):
            raise TaskConfigError(f"task.n_samples={n}: must be null or an integer >= 1")
        if not cfg.get("data_dir"):
            from .longbench_data import hub_reachable

            if not hub_reachable():
                raise TaskConfigError("task.data_dir is not set and the Hugging Face Hub is unreachable: pass "
                                      "task.data_dir=/path/to/ruler (RULER's <subtask>_<length>.jsonl files)")
        else:
            for s in subtasks:
                for length in lengths:
                    path = Path(cfg["data_dir"]).expanduser() / f"{s}_{length}.jsonl"
                    if not path.is_file():
                        raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: no {path.name}{looked_for(path)}")

    def rows(self, subtask: str, length: int) -> list[dict[str, Any]]:
        """The first ``n_samples`` rows as ``{index, prompt, answers}``, from ``data_dir`` or the Hub."""
        n = self.cfg.get("n_samples")
        if self.cfg.get("data_dir"):
            path = Path(self.cfg["data_dir"]).expanduser() / f"{subtask}_{length}.jsonl"
            rows = read_jsonl(path, limit=n)
            return [{"index": r["index"], "prompt": r["input"], "answers": list(r["outputs"])} for r in rows]
        from datasets import load_dataset

        ds = load_dataset(self.cfg["hub_dataset"], str(length), split="test").filter(lambda r: r["task"] == subtask)
        return [{"index": i, "prompt": r["context"] + r["question"] + r["answer_prefix"], "answers": list(r["answer"])}
                for i, r in enumerate(ds.select(range(min(n or len(ds), len(ds)))))]

    def samples(self) -> Iterator[Sample]:
        for subtask in self.cfg["subtasks"]:
            for length in self.cfg["context_lengths"]:
                for row in self.rows(subtask, length):
                    yield Sample(id=f"{subtask}/{length}/{row['index']}", dataset=subtask, prompt=row["prompt"],
                                 max_new_tokens=max_new_tokens(subtask), answers=row["answers"], chat=False,
                                 meta={"context_length": length})

    def score(self, sample: Sample, prediction: str) -> float:
        match = string_match_part if sample.dataset.startswith("qa") else string_match_all
        return match(prediction, sample.answers)

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per-subtask scores (×100) and their ``average``."""
        out = super().aggregate(records)
        scores = [v["score"] for v in out["datasets"].values()]
        out["averages"] = {"ruler": round(sum(scores) / len(scores), 2) if scores else None}
        return out
