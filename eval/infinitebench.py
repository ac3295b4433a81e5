"""InfiniteBench (Zhang et al., 2024): 12 tasks over 100k+ token inputs, with OpenBMB/InfiniteBench's protocol for
open models (commit 88b3daa: ``src/eval_yarn_mistral.py``, ``src/eval_utils.py``, ``src/compute_scores.py``).

Per sample: the task's ``yarn_mistral_templates`` prompt (``suite_config/infinitebench.json``, verbatim, as
``create_prompt`` fills it: ``code_run`` names the ``func_N(x)`` call found in ``input``, ``math_find`` asks for the
number named by ``The ... of`` in ``input``, the choice tasks list ``options`` as A-D); middle truncation to
``max_length`` tokens (:func:`eval.suite.truncate_middle`; official 128k); no chat template; up to the task's
``DATA_NAME_TO_MAX_NEW_TOKENS`` new tokens. The label is ``get_answer``'s (``[answer text, letter]`` for the choice
tasks, else ``answer``), kept in ``meta["label"]``; scores are ``compute_scores.py``'s per-task functions. The query
(``task.compress=context``) is the template's text after ``{context}``.

Prompt + generation fit the model's context window W (the official code and kvpress let them run past it): a
generation limit over W/2 (``math_calc``'s 30,000 on an 8k model) is cut to W/2, and where the prompt (as the engine
tokenizes it: chat template, answer prefix) plus the generation would exceed W, the middle truncation is redone to
that many tokens fewer (:meth:`InfiniteBenchTask.build`); ``meta`` records ``prompt_budget`` and the official
``max_new_tokens`` then. A sample that fits is built exactly as before.

Data: the official ``<task>.jsonl`` files (``id``, ``context``, ``input``, ``answer``, ``options``) in
``task.data_dir`` or from ``xinrongzhang2022/InfiniteBench``; kvpress's copy ``MaxJeblick/InfiniteBench`` (a config
per task; its answers are strings: ``code_run``, ``math_find`` and ``math_calc`` labels are turned back into numbers,
the choice tasks' letter serves as both label parts).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from .base import Sample, TaskConfigError
from .metrics import normalize_answer, normalize_zh_answer, rouge_scorer
from .suite import SuiteTask, require

_CONFIG = json.loads((Path(__file__).parent / "suite_config" / "infinitebench.json").read_text(encoding="utf-8"))
PROMPTS: dict[str, str] = _CONFIG["prompts"]
MAX_NEW_TOKENS: dict[str, int] = _CONFIG["max_new_tokens"]
TASKS = ("passkey", "number_string", "kv_retrieval", "longdialogue_qa_eng", "longbook_sum_eng", "longbook_choice_eng",
         "longbook_qa_eng", "longbook_qa_chn", "math_find", "math_calc", "code_run", "code_debug")
CHOICE = ("longbook_choice_eng", "code_debug")


def fields(task: str, row: dict) -> dict[str, str]:
    """The template fields ``create_prompt`` fills for ``task`` from an official row."""
    out = {"context": row["context"], "input": row["input"], "question": row["input"]}
    if task in CHOICE:
        out.update({f"OPTION_{c}": o for c, o in zip("ABCD", row["options"])})
    if task == "code_run":
        call = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", row["input"])[0]
        out.update(func_call=call, func=call.split("(")[0])
    if task == "math_find":
        out["prefix"] = f"What is {re.findall(r'The .+ of', row['input'])[0].lower()[:-3]} in the following list?"
    return out


def label_of(task: str, answer: Any, options: list[str]) -> Any:
    """``get_answer``: ``[text, letter]`` for the choice tasks, else the row's ``answer``."""
    if task not in CHOICE:
        return answer
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in list("ABCD"):
        return answer
    text = answer if isinstance(answer, str) else answer[0]
    return [text, "ABCD"[options.index(text)]]


def _number(x: Any) -> Any:
    """A numeric string as int (else float); anything else unchanged (undoes the Hub's string cast)."""
    if isinstance(x, str) and re.fullmatch(r"-?\d+", x.strip()):
        return int(x)
    if isinstance(x, str) and re.fullmatch(r"-?\d+\.\d*", x.strip()):
        return float(x)
    return x


# --------------------------------------------------------------------------- compute_scores.py


def _f1(pred: list, gold: list) -> float:
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    p, r = common / len(pred), common / len(gold)
    return 2 * p * r / (p + r)


def qa_f1(pred: str, labels: list[str]) -> float:
    """Max over labels of the token F1 of LongBench's English normalisation."""
    return max((_f1(normalize_answer(pred).split(), normalize_answer(g).split()) for g in labels), default=0.0)


def qa_f1_zh(pred: str, labels: list[str]) -> float:
    """Max over labels of the character F1 after LongBench's Chinese normalisation (one character, one token)."""
    return max((_f1(list(normalize_zh_answer(pred)), list(normalize_zh_answer(g))) for g in labels), default=0.0)


def first_int(pred: str) -> str:
    """The first run of ASCII digits, ``""`` if none."""
    found = re.search(r"[0-9]+", pred)
    return found.group(0) if found else ""


def _words(pred: str, chars: str) -> list[str]:
    for c in chars:
        pred = pred.replace(c, " ")
    return pred.split()


def _squeeze(pred: str, chars) -> str:
    for c in chars:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    return pred


def _after_prefix(pred: str, prefixes: tuple[str, ...], targets) -> bool | None:
    """At the first prefix found: whether the text after it and one character starts with a target; None: none found."""
    for prefix in prefixes:
        idx = pred.find(prefix)
        if idx != -1:
            rest = pred[idx + len(prefix) + 1:] if len(pred) >= idx + len(prefix) + 1 else None
            return rest is not None and any(rest.startswith(t) for t in targets)
    return None


def _first(label: Any) -> Any:
    return label[0] if isinstance(label, list) else label


def score_kv_retrieval(pred: str, label: Any) -> float:
    """The label among the words of the prediction split at ``\\n:"'.,?!{}`` (a one-item list label is unwrapped:
    the official function compares the list itself, which never matches the Hub files' list answers)."""
    return float(_first(label) in _words(pred, "\n:\"'.,?!{}"))


def score_first_int(pred: str, label: Any) -> float:
    return float(_first(label) == first_int(pred))


def score_code_run(pred: str, label: Any) -> float:
    words = _words(pred.strip(), "\n.`'\":")
    try:
        return float(bool(words) and _first(label) == int(words[-1]))
    except ValueError:
        return 0.0


def score_code_debug(pred: str, label: list) -> float:
    fn_name, letter = label[0], label[1]
    pred = pred.strip()
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    pred = _squeeze(pred.strip(), ["\n", "`", "'", '"', "-", "*", "Option", "option"])
    return float(bool(_after_prefix(pred, ("answer is:", "is:", "answer:", "correct option is:"), (letter, fn_name))))


def score_math_find(pred: str, label: Any) -> float:
    label = _first(label)
    if isinstance(label, bool) or not isinstance(label, (int, float)):
        raise TypeError(f"Expected int or float, got {type(label)}")
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None or (isinstance(label, int) and "." in found.group(0)):
        return 0.0  # a decimal for an integer label: the official int() raises, failing the whole run
    return float((int if isinstance(label, int) else float)(found.group(0)) == label)


def score_longdialogue(pred: str, label: list) -> float:
    return float(label[0] in [w.upper() for w in _words(pred.strip(), "\n:\"'.,?!{}")])


def score_choice(pred: str, label: list) -> float:
    pred = pred.strip()
    if pred == "":
        return 0.0
    if pred[0] in "ABCD":
        return float(pred[0] in label)
    if pred in label:
        return 1.0
    pred = _squeeze(pred, "\n\"'.,?!{}")
    found = _after_prefix(pred, ("answer is:", "answer:", "answer is", "option is"), label)
    if found is not None:
        return float(found)
    return next((float(w in label) for w in pred.split() if w in "ABCD"), 0.0)


def score_math_calc(pred: str, label: list) -> float:
    label = label[0] if isinstance(label[0], list) else label
    nums = [int(x) for x in re.split("[^0-9]", pred) if x != ""]
    count = 0
    for want, got in zip(label, nums):
        if want != got:
            break
        count += 1
    return count / len(label)


def score_sum(pred: str, label: Any) -> float:
    """``evaluate``'s ``rouge`` ``rougeLsum`` F (``rouge_score``, no stemmer), best over the references."""
    scorer = rouge_scorer("rougeLsum")
    return max(scorer.score(ref, pred)["rougeLsum"].fmeasure for ref in (label if isinstance(label, list) else [label]))


SCORERS = {
    "passkey": score_first_int, "number_string": score_first_int, "kv_retrieval": score_kv_retrieval,
    "code_run": score_code_run, "code_debug": score_code_debug, "math_find": score_math_find,
    "math_calc": score_math_calc, "longdialogue_qa_eng": score_longdialogue, "longbook_choice_eng": score_choice,
    "longbook_qa_eng": qa_f1, "longbook_qa_chn": qa_f1_zh, "longbook_sum_eng": score_sum,
}
"""``compute_scores.py``'s ``get_score_one`` per task: ``(prediction, label) -> score in [0, 1]``."""


class InfiniteBenchTask(SuiteTask):
    """InfiniteBench's 12 tasks (``task.datasets``), scored per task ×100 and averaged."""

    name = "infinitebench"
    subsets = TASKS
    official_hub = "xinrongzhang2022/InfiniteBench"
    kvpress_hub = "MaxJeblick/InfiniteBench"
    what = "InfiniteBench's <task>.jsonl files (huggingface.co/datasets/xinrongzhang2022/InfiniteBench)"

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        require(row, where, context=str, input=str, answer=(list, str, int, float))
        if dataset in CHOICE:
            require(row, where, options=list)
            if len(row["options"]) != 4 or not all(isinstance(o, str) for o in row["options"]):
                raise TaskConfigError(f"{where}: field 'options' must be 4 strings")
            text = row["answer"] if isinstance(row["answer"], str) else (row["answer"] or [None])[0]
            if text not in row["options"] and not (isinstance(row["answer"], list) and len(row["answer"]) == 2):
                raise TaskConfigError(f"{where}: field 'answer' is not one of 'options'")
        if dataset == "code_run" and not re.search(r"func_[0-9]+\(\-?[0-9]+\)", row["input"]):
            raise TaskConfigError(f"{where}: field 'input' names no func_N(x) call")
        if dataset == "math_find" and not re.search(r"The .+ of", row["input"]):
            raise TaskConfigError(f"{where}: field 'input' names no 'The ... of' target")

    def sample(self, task: str, index: int, prompt: str, query: str, label: Any, max_new_tokens: int,
               chat: bool) -> Sample:
        if task in ("code_run", "math_find"):
            label = [_number(x) for x in label] if isinstance(label, list) else _number(label)
        if task == "math_calc":
            label = [[_number(x) for x in y] if isinstance(y, list) else _number(y) for y in label]
        prompt, query, meta = self.truncated(prompt, query)
        answers = [a if isinstance(a, str) else json.dumps(a) for a in (label if isinstance(label, list) else [label])]
        return Sample(id=f"{task}/{index}", dataset=task, prompt=prompt, query=query, max_new_tokens=max_new_tokens,
                      answers=answers, chat=chat, meta={"label": label, **meta})

    def official_sample(self, dataset: str, index: int, row: dict) -> Sample:
        values = fields(dataset, row)
        template = PROMPTS[dataset]
        return self.sample(dataset, index, template.format(**values), template.split("{context}", 1)[1].format(**values),
                           label_of(dataset, row["answer"], row.get("options") or []), MAX_NEW_TOKENS[dataset], False)

    def kvpress_sample(self, dataset: str, index: int, row: dict) -> Sample:
        label = list(row["answer"]) if isinstance(row["answer"], list) else [row["answer"]]
        if dataset in CHOICE:
            label = [label[0], label[0]]
        query = row["question"]  # the answer prefix: SuiteTask.answer_turn
        return self.sample(dataset, index, row["context"] + query, query, label,
                           int(row.get("max_new_tokens") or MAX_NEW_TOKENS[dataset]), True)

    def build(self, dataset: str, index: int, row: dict) -> Sample:
        """The row's sample, fitted to the context window W (``resolved["context_window"]``, the job's check reads it;
        module docstring): generation ``min(max_new_tokens, W // 2)``, the prompt truncated again, the excess fewer
        tokens, until ``len(encode(sample)) + generation <= W``.

        Raises:
            TaskConfigError: the text around the truncated prompt (template, question) and the generation alone
                exceed W; the message names the sample and the numbers.
        """
        sample, window = super().build(dataset, index, row), self.resolved.get("context_window")
        if not window or self.encode is None:
            return sample
        new, full = min(sample.max_new_tokens, window // 2), self.max_length
        try:
            while (over := (need := len(self.encode(sample)) + new) - window) > 0:
                if self.max_length - over < 2:
                    raise TaskConfigError(f"task=infinitebench {sample.id}: {need - new} prompt tokens at a truncation "
                                          f"budget of {self.max_length} plus {new} new tokens exceed the model's "
                                          f"context window of {window} tokens (the text around the context leaves no room)")
                self.max_length -= over
                sample = super().build(dataset, index, row)
        finally:
            budget, self.max_length = self.max_length, full
        if budget == full and new == sample.max_new_tokens:
            return sample
        return replace(sample, max_new_tokens=new, meta={**sample.meta, "prompt_budget": budget,
                                                         "max_new_tokens": sample.max_new_tokens})

    def tokens_needed(self, sample: Sample) -> int:
        """The context window when :meth:`build` fitted the samples to it, else the base bound."""
        fitted = self.resolved.get("context_window") and self.encode is not None
        return self.resolved["context_window"] if fitted else super().tokens_needed(sample)

    def score(self, sample: Sample, prediction: str) -> float:
        return float(SCORERS[sample.dataset](prediction, sample.meta["label"]))
