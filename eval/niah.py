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
from typing import Any, Iterator

from .base import Sample, Task, TaskConfigError, looked_for
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


def _show(value: Any) -> str:
    """A config value as written on the command line (lists as ``[a, b]``)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


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
    from rouge_score import rouge_scorer

    logging.getLogger("absl").setLevel(logging.WARNING)  # its "Using default tokenizer." on every call
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=False)
    return 100.0 * scorer.score(answer, prediction)["rouge1"].recall


def check_answer_in_needle(needle: Any, answer: Any) -> None:
    """Refuse an expected answer that a perfect retrieval could not score 100 on.

    The score is ROUGE-1 recall of ``answer`` (``rouge-score``'s tokenizer: lower-cased
    a-z/0-9 words, others dropped), so every word of the answer must be a word of the needle:
    otherwise a model that repeats the needle word for word scores below 100 (a custom
    ``task.needle`` with the default ``task.answer`` scores ~0 whatever the cache keeps).

    Raises:
        TaskConfigError: the answer has no word ROUGE-1 can score, or words the needle lacks.
    """
    if not isinstance(needle, str) or not isinstance(answer, str) or not answer.strip():
        return  # the non-empty-string checks name these
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


class NIAHTask(Task):
    """Needle-in-a-Haystack over ``context_lengths`` × ``depth_percents``.

    Config keys (``conf/task/niah.yaml``): context_lengths (tokens), depth_percents,
    haystack_source, haystack_dir, needle, question, answer, prompt_style (kvcf | chat),
    max_new_tokens, final_context_buffer (tokens reserved for template and question).
    """

    name = "niah"

    @classmethod
    def validate(cls, cfg: dict) -> None:
        lengths = cfg.get("context_lengths")
        depths = cfg.get("depth_percents")

        def number(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        if not isinstance(lengths, (list, tuple)) or not lengths or any(isinstance(x, bool) or not isinstance(x, int) or x <= 0 for x in lengths):
            hint = f" (a list: task.context_lengths=[{lengths}])" if isinstance(lengths, int) and lengths > 0 else ""
            raise TaskConfigError(f"task.context_lengths={_show(lengths)}: must be a non-empty list of positive integers "
                                  f"(tokens){hint}")
        if not isinstance(depths, (list, tuple)) or not depths or any(not number(x) or not 0 <= x <= 100 for x in depths):
            hint = (f" (a list: task.depth_percents=[{depths:g}])" if number(depths) and 0 <= depths <= 100 else "")
            raise TaskConfigError(f"task.depth_percents={_show(depths)}: must be a non-empty list of numbers in "
                                  f"[0, 100]{hint}")
        for key, values in (("context_lengths", lengths), ("depth_percents", depths)):
            repeated = sorted({float(x) for x in values if sum(float(y) == float(x) for y in values) > 1})
            if repeated:
                raise TaskConfigError(f"task.{key}={_show(values)}: {', '.join(f'{x:g}' for x in repeated)} "
                                      "given more than once; list each value once")
        if cfg.get("prompt_style", "kvcf") not in ("kvcf", "chat"):
            raise TaskConfigError(f"task.prompt_style={cfg.get('prompt_style')!r}: accepted values are kvcf, chat")
        max_length = cfg.get("max_length")
        if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2):
            raise TaskConfigError(f"task.max_length={_show(max_length)}: must be null (the model's max_input_length) "
                                  "or an integer >= 2 (tokens)")
        for key, low in (("max_new_tokens", 1), ("final_context_buffer", 0)):
            value = cfg.get(key, low)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise TaskConfigError(f"task.{key}={_show(value)}: must be an integer >= {low}")
        for key in ("needle", "question", "answer"):
            if key in cfg and (not isinstance(cfg[key], str) or not cfg[key].strip()):
                raise TaskConfigError(f"task.{key}={cfg[key]!r}: must be a non-empty string")
        check_answer_in_needle(cfg.get("needle"), cfg.get("answer"))
        src = cfg.get("haystack_source", "auto")
        if src not in ("auto", "dir", "hub", "embedded"):
            raise TaskConfigError(f"task.haystack_source={src!r}: accepted values are auto, dir, hub, embedded")
        if cfg.get("haystack_dir") or src == "dir":
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
                f"task.context_lengths={_show(self.cfg['context_lengths'])}: every sample was skipped "
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
