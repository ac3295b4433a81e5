"""LongBench-v2 (Bai et al., 2025): 503 four-choice questions over long contexts, THUDM/LongBench ``pred.py`` and
``result.py`` (commit 2e00731).

Per sample: the template ``prompts/<task.prompt>.txt`` (``suite_config/longbench_v2.json``, verbatim) with ``$DOC$``,
``$Q$``, ``$C_A$``..``$C_D$`` replaced in that order by the stripped fields; middle truncation to ``max_length``
tokens (:func:`eval.suite.truncate_middle`, the tail keeps ``ceil(max_length / 2)`` tokens as ``ids[-max_len//2:]``;
official ``max_len`` 120,000); one user turn of the chat template; up to 128 new tokens (the official temperature is
0.1, kvbench decodes greedily). The answer is the letter of ``The correct answer is (X)``, else of ``The correct
answer is X``, in the stripped response with ``*`` removed; a sample scores 1 if it equals ``answer``; an empty output
is left out of the scores as ``pred.py`` leaves it out (kvpress's copy: scored 0, as its ``calculate_metrics``). The query
(``task.compress=context``) is the text after the document: question, choices and the format instruction.

Data: the official ``data.json`` (a JSON array, or JSON lines) in ``task.data_dir``, or ``THUDM/LongBench-v2`` on
the Hub; fields ``_id``, ``difficulty`` (easy/hard), ``length`` (short/medium/long), ``question``, ``choice_A``..
``choice_D``, ``answer``, ``context``. kvpress's copy (``simonjegou/LongBench-v2``, formerly
``Xnhyacinth/LongBench-v2``, config ``0shot``) keeps those fields next to its prompt parts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .base import Sample, TaskConfigError, one_of
from .suite import SuiteConfig, SuiteTask, require

PROMPTS: dict[str, str] = json.loads(
    (Path(__file__).parent / "suite_config" / "longbench_v2.json").read_text(encoding="utf-8"))
MAX_NEW_TOKENS = 128
FIELDS = ("$DOC$", "$Q$", "$C_A$", "$C_B$", "$C_C$", "$C_D$")
KEYS = ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D")
BREAKDOWN = ("overall", "easy", "hard", "short", "medium", "long")


def fill(template: str, row: dict) -> str:
    """The official sequential ``str.replace`` of each placeholder by the stripped field."""
    for field, key in zip(FIELDS, KEYS):
        template = template.replace(field, row[key].strip())
    return template


def extract_answer(response: str) -> str | None:
    """``pred.py``'s choice extraction: ``*`` removed, ``The correct answer is (X)`` then ``... is X``, X in A-D."""
    response = response.replace("*", "")
    found = re.search(r"The correct answer is \(([A-D])\)", response) or re.search(r"The correct answer is ([A-D])", response)
    return found.group(1) if found else None


def breakdown(records: list[dict]) -> dict[str, float | None]:
    """``result.py``'s columns: accuracy (%, one decimal) overall, by difficulty (easy, else hard) and by length
    (short, medium, else long), from the successful records' ``meta``; None for an empty group."""
    groups: dict[str, list[float]] = {k: [] for k in BREAKDOWN}
    for r in records:
        if r.get("error") is None and r.get("score") is not None:
            meta = r.get("meta") or {}
            length = meta.get("length") if meta.get("length") in ("short", "medium") else "long"
            for g in ("overall", "easy" if meta.get("difficulty") == "easy" else "hard", length):
                groups[g].append(float(r["score"]))
    return {g: round(100 * sum(v) / len(v), 1) if v else None for g, v in groups.items()}


@dataclass
class LongBenchV2Config(SuiteConfig):
    """``conf/task/longbench_v2.yaml``: 503 four-choice questions, official pred.py/result.py protocol."""

    name: str = "longbench_v2"
    prompt: str = "0shot"  # official template: 0shot | 0shot_no_context (prompts/<name>.txt)

    def check(self) -> None:
        super().check()
        one_of(self.prompt, "prompt", tuple(PROMPTS))


class LongBenchV2Task(SuiteTask):
    """LongBench-v2, one dataset ``longbench_v2``; ``aggregate`` adds :func:`breakdown` as ``averages``."""

    name = "longbench_v2"
    Config = LongBenchV2Config
    subsets = ("longbench_v2",)
    official_hub = "THUDM/LongBench-v2"
    kvpress_hub = "simonjegou/LongBench-v2"
    what = "LongBench-v2's data.json (huggingface.co/datasets/THUDM/LongBench-v2)"
    ceil_tail = True

    @classmethod
    def file_name(cls, dataset: str) -> str:
        return "data.json"

    @classmethod
    def read_file(cls, path: Path, dataset: str, limit: int | None) -> list[dict]:
        """``data.json`` as the official JSON array (rows named ``<path> row <n>``), or as JSON lines."""
        head = b""
        if path.is_file():
            with path.open("rb") as f:  # closed at once (no ResourceWarning)
                head = f.read(64).lstrip()
        if not head.startswith(b"["):
            return super().read_file(path, dataset, limit)
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise TaskConfigError(f"{path}: not a valid JSON array ({e})") from None
        for i, row in enumerate(rows[:limit], start=1):
            if not isinstance(row, dict):
                raise TaskConfigError(f"{path} row {i}: not a JSON object")
            cls.check_row(dataset, row, f"{path} row {i}")
        return rows[:limit]

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        require(row, where, **{k: str for k in (*KEYS, "answer", "difficulty", "length")})

    def sample(self, index: int, row: dict, prompt: str, query: str, max_new_tokens: int) -> Sample:
        prompt, query, meta = self.truncated(prompt, query)
        return Sample(id=f"longbench_v2/{index}", dataset="longbench_v2", prompt=prompt, query=query,
                      max_new_tokens=max_new_tokens, answers=[row["answer"]], chat=True,
                      meta={"_id": row.get("_id"), "difficulty": row["difficulty"], "length": row["length"], **meta})

    def official_sample(self, dataset: str, index: int, row: dict) -> Sample:
        template = PROMPTS[self.cfg.get("prompt") or "0shot"]
        tail = template.split("$DOC$", 1)[1] if "$DOC$" in template else ""
        return self.sample(index, row, fill(template, row), fill(tail, row) if tail else "", MAX_NEW_TOKENS)

    def kvpress_sample(self, dataset: str, index: int, row: dict) -> Sample:
        query = row["question"]  # the answer prefix: SuiteTask.answer_turn
        return self.sample(index, row, row["context"] + query, query, int(row.get("max_new_tokens") or MAX_NEW_TOKENS))

    def kvpress_config(self, dataset: str) -> str:
        return "0shot"

    def scoring_sample(self, row: dict, where: str) -> Sample:
        """An official row (``answer``, ``difficulty``, ``length``), else :meth:`Task.scoring_sample`'s."""
        if "answer" not in row:
            return super().scoring_sample(row, where)
        require(row, where, answer=str, difficulty=str, length=str)
        return Sample(id=where, dataset=self.name, prompt="", max_new_tokens=0, answers=[row["answer"]],
                      meta={"difficulty": row["difficulty"], "length": row["length"]})

    def score(self, sample: Sample, prediction: str) -> float:
        """1.0 when the extracted choice equals the answer letter, else 0.0."""
        return float(extract_answer(prediction.strip()) == sample.answers[0])

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """:func:`breakdown` as ``averages``. With ``task.source=official`` a sample whose prediction is empty is left
        out, as ``pred.py`` skips an empty output (``if output == '': continue``: never written, never scored);
        kvpress's ``calculate_metrics`` scores it 0. ``empty_outputs``: how many there were."""
        empty = [r for r in records if r.get("error") is None and r.get("prediction") == ""]
        if self.cfg.get("source") != "kvpress":
            records = [r for r in records if not (r.get("error") is None and r.get("prediction") == "")]
        out = super().aggregate(records)
        out["averages"], out["empty_outputs"] = breakdown(records), len(empty)
        return out
