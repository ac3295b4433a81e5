"""Needle-in-a-Haystack: a length × depth grid of retrieval prompts.

The haystack (essays) is cut to each context length, in tokens of the model's tokenizer;
the needle is inserted at the requested depth percent, moved back to the previous sentence
boundary (as the reference NIAH harness does); the retrieval question follows (the query part,
``task.compress=context``: the template's text after the haystack).

Haystack sources (``task.haystack_source``):
* ``dir``: a folder of ``.txt`` files (``task.haystack_dir``, e.g. the 49 Paul Graham essays);
* ``hub``: the Hub dataset kvpress uses (``alessiodevoto/paul_graham_essays``, split ``test``);
* ``embedded``: real prose that ships with Python itself, so that it needs no network — the
  reference-manual text in the standard library module ``pydoc_data.topics``;
* ``auto`` (default): ``dir`` when ``haystack_dir`` is set, else ``hub`` when the Hub answers
  within a few seconds, else ``embedded`` (logged).

Scores: ROUGE-1 recall × 100 of the expected answer (CompressKV's protocol, ``rouge-score``
package, the sample score stored as a fraction), the word-overlap score (share of the
answer's words found in the prediction, × 100) and the strict score (100 when the answer
phrase occurs in the prediction, case and punctuation ignored, else 0).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional

from .base import Sample, Task, TaskConfig, TaskConfigError, count, looked_for, one_of, require
from .metrics import rouge_scorer
from .longbench_data import hub_reachable

log = logging.getLogger(__name__)

HUB_DATASET = "alessiodevoto/paul_graham_essays"

# KVCache-Factory's NIAH prompt (no chat template); ``chat`` style sends the same text as one user turn.
KVCF_TEMPLATE = (
    "<|im_start|> This is a very long story book: <book> {context} </book>.\n"
    " Based on the content of the book, Question: {question}\nAnswer:"
)
CHAT_TEMPLATE = (
    "This is a very long story book: <book> {context} </book>.\n"
    "Based on the content of the book, answer the question: {question}"
)


def embedded_haystack() -> str:
    """Real English prose shipped with CPython: the reference-manual topics of ``pydoc_data``."""
    from pydoc_data import topics

    texts = [re.sub(r"[ \t]+", " ", t) for _, t in sorted(topics.topics.items())]
    return "\n\n".join(texts)


def load_haystack(cfg: dict) -> tuple[str, str]:
    """The haystack text and a description of its source.

    Raises:
        TaskConfigError: ``haystack_dir`` missing or without ``.txt`` files; unknown source;
            ``hub`` requested while the Hub is unreachable.
    """
    source = cfg.get("haystack_source", "auto")
    hdir = cfg.get("haystack_dir")
    if source == "auto":
        source = "dir" if hdir else ("hub" if hub_reachable(3.0) else "embedded")
        if source == "embedded":
            log.info("task.haystack_source=auto: Hub offline or unreachable and no haystack_dir; using the embedded haystack")
    if source == "dir":
        files = _haystack_files(hdir)
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files), f"dir:{hdir}"
    if source == "hub":
        if not hub_reachable(3.0):
            raise TaskConfigError(
                "task.haystack_source=hub: the Hugging Face Hub is unreachable; "
                "pass task.haystack_dir=/path/to/essays or task.haystack_source=embedded"
            )
        from datasets import load_dataset

        ds = load_dataset(HUB_DATASET, split="test")
        col = "text" if "text" in ds.column_names else ds.column_names[0]
        return "\n\n".join(ds[col]), f"hub:{HUB_DATASET}"
    if source == "embedded":
        return embedded_haystack(), "embedded:pydoc_data.topics"
    raise TaskConfigError(f"task.haystack_source={source!r}: accepted values are auto, dir, hub, embedded")


def _haystack_files(hdir: Any) -> list[Path]:
    if not hdir:
        raise TaskConfigError("task.haystack_source=dir needs task.haystack_dir=/path/to/folder/of/txt")
    path = Path(str(hdir)).expanduser()
    if not path.is_dir():
        raise TaskConfigError(f"task.haystack_dir={hdir}: no such folder{looked_for(path)}")
    files = sorted(p for p in path.glob("*.txt") if p.stat().st_size > 0)
    if not files:
        raise TaskConfigError(f"task.haystack_dir={hdir}: holds no non-empty .txt files")
    return files


def word_overlap(prediction: str, answer: str) -> float:
    """Share (× 100) of the answer's lower-cased words that occur in the prediction."""
    words = re.findall(r"\w+", answer.lower())
    pred = set(re.findall(r"\w+", prediction.lower()))
    return 100.0 * sum(w in pred for w in words) / len(words) if words else 0.0


def strict_match(prediction: str, answer: str) -> float:
    """1.0 when ``answer``'s words occur in ``prediction`` as one phrase (lower case, punctuation dropped), else 0."""
    norm = lambda text: " " + " ".join(re.findall(r"[^\W_]+", text.lower())) + " "
    return float(norm(answer).strip() != "" and norm(answer) in norm(prediction))


def rouge1_recall(prediction: str, answer: str) -> float:
    """ROUGE-1 recall × 100 of ``answer`` in ``prediction`` (``rouge-score``, no stemming)."""
    return 100.0 * rouge_scorer("rouge1").score(answer, prediction)["rouge1"].recall


def check_answer_in_needle(needle: str, answer: str) -> None:
    """Refuse an expected answer that a perfect retrieval could not score 100 on.

    The score is ROUGE-1 recall of ``answer`` (``rouge-score``'s tokenizer: lower-cased
    a-z/0-9 words, others dropped), so every word of the answer must be a word of the needle:
    otherwise a model that repeats the needle word for word scores below 100 (a custom
    ``task.needle`` with the default ``task.answer`` scores ~0 whatever the cache keeps).

    Raises:
        TaskConfigError: the answer has no word ROUGE-1 can score, or words the needle lacks.
    """
    from rouge_score import tokenize

    answer_words = tokenize.tokenize(answer, None)
    if not answer_words:
        raise TaskConfigError(f"task.answer={answer!r}: has no word ROUGE-1 can score (rouge-score keeps the "
                              "letters a-z and digits 0-9 only); use an answer in those characters")
    needle_words = set(tokenize.tokenize(needle, None))
    missing = list(dict.fromkeys(w for w in answer_words if w not in needle_words))
    if missing:
        raise TaskConfigError(f"task.answer={answer!r}: {', '.join(missing)} not in task.needle, so repeating the "
                              "needle word for word scores below 100; set task.answer to the needle's fact "
                              "(both keys change together)")


@dataclass
class NIAHConfig(TaskConfig):
    """``conf/task/niah.yaml``: the grid and the needle (the default grid is a quick CPU grid; paper grids are in
    ``conf/experiment/``)."""

    name: str = "niah"
    context_lengths: List[int] = field(default_factory=lambda: [512, 1024, 2048])  # prompt lengths in tokens (template and question included)
    depth_percents: List[Any] = field(default_factory=lambda: [10, 50, 90])  # needle depth as % of the context (moved back to a sentence end)
    haystack_source: str = "auto"  # auto | dir | hub | embedded (auto: dir if haystack_dir, else Hub if reachable, else embedded)
    haystack_dir: Optional[str] = None  # folder of .txt essays, e.g. ../shared/data/paul_graham_essays
    needle: str = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
    question: str = "What is the best thing to do in San Francisco?"  # retrieval question
    answer: str = "eat a sandwich and sit in Dolores Park on a sunny day"  # scored by ROUGE-1 recall; its words must all occur in needle
    prompt_style: str = "chat"  # chat: one user turn in the chat template (instruct models) | kvcf: KVCache-Factory raw prompt
    max_new_tokens: int = 32  # generation limit (tokens)
    max_length: Optional[int] = None  # prompt budget in tokens (longer lengths are skipped); null = the model's max_input_length
    final_context_buffer: int = 0  # tokens reserved besides template/question/needle (0: prompt length = context length)

    def check(self) -> None:
        require(bool(self.context_lengths) and min(self.context_lengths) > 0, "context_lengths", self.context_lengths,
                "must be a non-empty list of positive integers (tokens)")
        require(bool(self.depth_percents) and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 100
                                                  for x in self.depth_percents), "depth_percents", self.depth_percents,
                "must be a non-empty list of numbers in [0, 100]")
        for key in ("context_lengths", "depth_percents"):
            values = [float(x) for x in getattr(self, key)]
            require(len(set(values)) == len(values), key, getattr(self, key), "list each value once")
        one_of(self.prompt_style, "prompt_style", ("kvcf", "chat"))
        one_of(self.haystack_source, "haystack_source", ("auto", "dir", "hub", "embedded"))
        count(self.max_length, "max_length", 2)
        count(self.max_new_tokens, "max_new_tokens", 1)
        count(self.final_context_buffer, "final_context_buffer", 0)
        for key in ("needle", "question", "answer"):
            require(bool(getattr(self, key).strip()), key, getattr(self, key), "must be a non-empty string")
        check_answer_in_needle(self.needle, self.answer)


class NIAHTask(Task):
    """Needle-in-a-Haystack over ``context_lengths`` × ``depth_percents``.

    Config keys: :class:`NIAHConfig`.
    """

    name = "niah"
    Config = NIAHConfig

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Raises: TaskConfigError for a missing or empty ``haystack_dir``."""
        if cfg.get("haystack_dir") or cfg.get("haystack_source") == "dir":
            _haystack_files(cfg.get("haystack_dir"))

    def samples(self) -> Iterator[Sample]:
        tok = self.tokenizer
        haystack, self.haystack_source = self.resolved.get("haystack") or load_haystack(self.cfg)
        hay_ids = tok.encode(haystack, add_special_tokens=False)
        needle_ids = tok.encode(self.cfg["needle"], add_special_tokens=False)
        chat = self.cfg.get("prompt_style", "kvcf") == "chat"
        template = CHAT_TEMPLATE if chat else KVCF_TEMPLATE
        frame = template.format(context="", question=self.cfg["question"])
        if self.encode is not None:  # what the engine prefills: chat template / BOS included
            overhead = len(self.encode(Sample(id="", dataset="niah", prompt=frame, max_new_tokens=0, answers=[], chat=chat)))
        else:
            overhead = len(tok.encode(frame, add_special_tokens=False))
        buffer = int(self.cfg.get("final_context_buffer", 0))
        limit = self.max_input_tokens or max(self.cfg["context_lengths"])
        fixed = overhead + buffer + len(needle_ids)  # template, question, needle (and buffer): no haystack
        self.skipped: list[dict[str, Any]] = []
        for length in self.cfg["context_lengths"]:
            if length > limit:
                reason = (f"context length {length} tokens exceeds the prompt budget of {limit} tokens "
                          "(task.max_length, else model.max_input_length)")
            elif length <= fixed:
                reason = (f"context length {length} tokens leaves no room for the haystack: the template, question "
                          f"and needle{' and final_context_buffer' if buffer else ''} take {fixed} tokens")
            else:
                reason = None
            if reason is not None:
                log.warning("task.context_lengths: %s; skipped (reported in summary.json)", reason)
                self.skipped.append({"context_length": length, "samples": len(self.cfg["depth_percents"]), "reason": reason})
                continue
            budget = length - fixed
            context_ids = (hay_ids * (budget // max(1, len(hay_ids)) + 1))[:budget]  # repeated when too short
            for depth in self.cfg["depth_percents"]:
                ids = self._insert(context_ids, needle_ids, depth)
                context = tok.decode(ids, skip_special_tokens=True)
                prompt = template.format(context=context, question=self.cfg["question"])
                yield Sample(
                    id=f"niah/{length}/{depth:g}",
                    dataset="niah",
                    prompt=prompt,
                    max_new_tokens=int(self.cfg.get("max_new_tokens", 32)),
                    answers=[self.cfg["answer"]],
                    chat=chat,
                    query=template.split("{context}", 1)[1].format(question=self.cfg["question"]),
                    length=length,
                    meta={"context_length": length, "depth_percent": depth},
                )
        if len(self.skipped) == len(self.cfg["context_lengths"]):  # nothing left: a config error, not "0/0 done"
            more = len(self.skipped) - 1
            raise TaskConfigError(
                f"task.context_lengths={self.cfg['context_lengths']}: every sample was skipped "
                f"({self.skipped[0]['reason']}{f'; {more} more skipped' if more else ''}); nothing to run"
            )

    def _insert(self, context_ids: list[int], needle_ids: list[int], depth: float) -> list[int]:
        """Insert the needle at ``depth`` % of the context, moved back to a sentence end (a token
        of at most 3 characters ending in '.')."""
        if depth >= 100:
            return context_ids + needle_ids
        pos = int(len(context_ids) * depth / 100)
        if not hasattr(self, "_periods"):
            vocab = self.tokenizer.get_vocab()
            self._periods = {i for t, i in vocab.items() if t.rstrip().endswith(".") and len(t.strip()) <= 3}
        while pos > 0 and context_ids[pos - 1] not in self._periods:
            pos -= 1
        return context_ids[:pos] + needle_ids + context_ids[pos:]

    def score(self, sample: Sample, prediction: str) -> float:
        return max(rouge1_recall(prediction, a) for a in sample.answers) / 100.0

    def extra_scores(self, sample: Sample, prediction: str) -> dict[str, float]:
        """The NIAH scores of a prediction (× 100): ROUGE-1 recall, word overlap, strict match (0 or 100)."""
        return {
            "rouge1_recall": round(max(rouge1_recall(prediction, a) for a in sample.answers), 4),
            "word_overlap": round(max(word_overlap(prediction, a) for a in sample.answers), 4),
            "strict": 100.0 * max(strict_match(prediction, a) for a in sample.answers),
        }
