"""LooGLE (Li et al., 2024): short- and long-dependency QA, cloze and summarization over 24k+ token documents, with
bigai-nlco/LooGLE's protocol for open models (commit 6734382: ``config/task2prompt.json``, ``config/task2maxlen.json``,
``Prediction/pred_opensource_models.py``, ``Evaluation/automatic_eval.py``, ``Evaluation/automatic_metrics.py``).

Per question: the task's template (``suite_config/loogle.json``, verbatim) formatted with ``input`` (the document) and
``Q``; middle truncation to ``max_length`` tokens as ``get_pred`` does it (:func:`eval.longbench.middle_truncate`:
``decode(ids[:half]) + decode(ids[-half:])``, ``half = int(max_length / 2)``); no chat template; up to
``task2maxlen`` new tokens, greedy (the official ``repetition_penalty=2`` is not applied: kvbench decodes plainly,
as kvpress does). The query (``task.compress=context``) is the template's text after ``{input}``.

Scores (``automatic_metrics.py``): QA and summarization record ``rouge_l`` (the ``rouge`` package's ROUGE-L with
the official default stat ``r``, recall) as the score, and ``rouge_1``, ``rouge_2``, ``bleu1``, ``bleu4`` (nltk's
``sentence_bleu`` on whitespace words) beside it; an empty prediction is scored as ``"None"`` (``automatic_eval``);
where the ``rouge`` package raises (a prediction of dots only, a too deep LCS recursion) the official script stops
and kvpress's copy scores 0, as kvbench does; a BLEU of NLTK's floor (``sys.float_info.min``, no matching n-gram) is
0. ``meteor``: nltk's ``single_meteor_score`` on the distinct words in their order (the official call passes Python
sets, whose order, and so the score, changes with ``PYTHONHASHSEED``; docs/BENCHMARKS.md), WordNet from NLTK's data
path (:mod:`eval.wordnet`). ``bert_score`` with ``task.bert_score_model`` (a local folder or Hub id; official:
``lang="EN"``, roberta-large at layer 17): ``bert-score``'s ``score([reference], [prediction])[1]``, the reference
passed as the candidate and the recall kept, as ``get_bertscore`` does. The cloze task records ``exact_match`` (masks whose predicted entity equals the reference) and
``partial_match`` (masks sharing a word), the prediction read as a Python dict literal (``ast.literal_eval``, where
the official code calls ``eval``); a dataset scores ``sum(matches) / sum(masks)`` (``get_match_score``), the others
the mean over questions.

Data: the official ``<task>.jsonl`` files (``LooGLE-testdata/`` of the repository: a document per line with
``input``, ``title``, ``qa_pairs`` (a Python list literal of ``{"Q", "A", "S"}``, ``"none"`` for summarization) and
``output`` (the summary)) in ``task.data_dir``, or ``data/<config>.jsonl`` of ``bigainlco/LooGLE`` (a question per
line: ``context``, ``question``, ``answer``; cloze answers as a list of entities, mask ``i`` the ``i``-th); kvpress's
copy ``simonjegou/loogle`` (a config per task; cloze answers as a JSON object).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

from .base import Sample, TaskConfigError, count
from .longbench import middle_truncate
from .longbench_data import hub_reachable
from .suite import SuiteConfig, SuiteTask, require, split
from .wordnet import require as wordnet

_CONFIG = json.loads((Path(__file__).parent / "suite_config" / "loogle.json").read_text(encoding="utf-8"))
PROMPTS: dict[str, str] = _CONFIG["prompts"]
MAX_NEW_TOKENS: dict[str, int] = _CONFIG["max_new_tokens"]
TASKS = ("shortdep_qa", "longdep_qa", "shortdep_cloze", "longdep_summarization")
HUB_FILES = {"shortdep_qa": "data/shortdep_qa.jsonl", "longdep_qa": "data/longdep_qa.jsonl",
             "shortdep_cloze": "data/shortdep_cloze.jsonl", "longdep_summarization": "data/summarization.jsonl"}
CLOZE_METRICS = ("exact_match", "partial_match")
TEXT_METRICS = ("rouge_l", "rouge_1", "rouge_2", "bleu1", "bleu4", "meteor", "bert_score")


@dataclass
class LoogleConfig(SuiteConfig):
    """``conf/task/loogle.yaml``: the suite's keys and BERTScore's model."""

    name: str = "loogle"
    bert_score_model: Optional[str] = None  # BERTScore's model, a local folder or Hub id (official: roberta-large); null = none
    bert_score_layers: int = 17  # its layer (bert-score's num_layers; 17: roberta-large, lang="EN")

    def check(self) -> None:
        super().check()
        count(self.bert_score_layers, "bert_score_layers")


def primary(dataset: str) -> str:
    """The metric recorded as a sample's ``score``: ``exact_match`` for the cloze task, else ``rouge_l``."""
    return "exact_match" if dataset == "shortdep_cloze" else "rouge_l"


def questions(dataset: str, row: dict) -> list[dict]:
    """The questions of a checked row, each ``{"document", "question", "answer"}`` (a summary's question is "")."""
    if "qa_pairs" not in row:
        answer = row["answer"]
        if dataset == "shortdep_cloze" and isinstance(answer, list):
            answer = {f"<mask-{i}>": a for i, a in enumerate(answer)}
        return [{"document": row["context"], "question": row["question"], "answer": answer}]
    if dataset == "longdep_summarization":
        return [{"document": row["input"], "question": "", "answer": row["output"]}]
    return [{"document": row["input"], "question": p["Q"], "answer": p["A"]} for p in row["qa_pairs"]]


# --------------------------------------------------------------------------- automatic_metrics.py


def _as_dict(prediction: Any) -> dict | None:
    try:
        value = ast.literal_eval(prediction) if isinstance(prediction, str) else prediction
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def cloze_scores(prediction: str, reference: dict) -> dict[str, float]:
    """``get_exact_match`` / ``get_partial_match`` as matched masks / masks (0 when the prediction is no dict)."""
    hyp = _as_dict(prediction)
    if hyp is None or not reference:
        return {"exact_match": 0.0, "partial_match": 0.0}
    exact = sum(k in hyp and hyp[k] == v for k, v in reference.items())
    if any(k in hyp and not isinstance(hyp[k], str) for k in reference):  # .split() raises: the sample scores 0
        return {"exact_match": exact / len(reference), "partial_match": 0.0}
    partial = sum(k in hyp and bool(set(v.split()) & set(hyp[k].split())) for k, v in reference.items())
    return {"exact_match": exact / len(reference), "partial_match": partial / len(reference)}


def text_scores(prediction: str, reference: str) -> dict[str, float]:
    """``get_rouge_score`` (recall) and ``get_bleu_score`` of one prediction (``"None"`` when empty)."""
    from nltk.translate.bleu_score import sentence_bleu
    from rouge import Rouge

    hyp = prediction or "None"
    try:
        got = Rouge().get_scores(hyps=[hyp], refs=[reference])[0]
        out = {"rouge_l": got["rouge-l"]["r"], "rouge_1": got["rouge-1"]["r"], "rouge_2": got["rouge-2"]["r"]}
    except (ValueError, RecursionError):
        out = {"rouge_l": 0.0, "rouge_1": 0.0, "rouge_2": 0.0}
    ref_words, hyp_words = reference.replace("\n", " ").split(), hyp.replace("\n", " ").split()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk warns of zero n-gram overlaps (the score is then its floor)
        for name, weights in (("bleu1", (1, 0, 0, 0)), ("bleu4", (0, 0, 0, 1))):
            bleu = float(sentence_bleu([ref_words], hyp_words, weights=weights))
            out[name] = bleu if bleu > sys.float_info.min else 0.0  # the floor (times the brevity penalty) is 0
    return out


def meteor(reference: list[str], hypothesis: list[str]) -> float:
    """``get_meteor_score``: nltk's ``single_meteor_score(set(reference), set(hypothesis))``, the sets' words taken in
    their first order (``dict.fromkeys``) so that the score does not depend on ``PYTHONHASHSEED``.
    TaskConfigError: no WordNet (:func:`eval.wordnet.require`)."""
    from nltk.translate.meteor_score import single_meteor_score

    return float(single_meteor_score(list(dict.fromkeys(reference)), list(dict.fromkeys(hypothesis)), wordnet=wordnet()))


@lru_cache(maxsize=1)
def bert_scorer(model: str, layers: int) -> Any:
    from bert_score import BERTScorer

    return BERTScorer(model_type=model, num_layers=layers)


def bert_score(model: str, layers: int, reference: str, prediction: str) -> float:
    """``get_bertscore``'s ``float(score([reference], [prediction], lang="EN")[1])``: BERTScore (Zhang et al., 2020)
    with the reference as the candidate, recall: the mean over the prediction's tokens of their best cosine
    similarity to the reference's, at hidden layer ``layers`` of ``model`` (bert-score's ``BERTScorer``, loaded once)."""
    return float(bert_scorer(model, layers).score([reference], [prediction])[1][0])


class LoogleTask(SuiteTask):
    """LooGLE's four tasks (``task.datasets``), a sample per question; ``averages`` holds every metric per task."""

    name = "loogle"
    subsets = TASKS
    official_hub = "bigainlco/LooGLE"
    kvpress_hub = "simonjegou/loogle"
    what = "LooGLE's <task>.jsonl files (github.com/bigai-nlco/LooGLE, LooGLE-testdata/)"
    Config = LoogleConfig

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """The suite's checks, then what the metrics need. TaskConfigError: no WordNet for METEOR (the cloze task
        alone needs none), no ``bert-score`` package, or a ``bert_score_model`` neither a folder nor reachable."""
        super().validate(cfg)
        if set(cfg.get("datasets") or TASKS) - {"shortdep_cloze"}:
            wordnet()
        model = cfg.get("bert_score_model")
        if model:
            if not Path(model).expanduser().is_dir() and not hub_reachable():
                raise TaskConfigError(f"task.bert_score_model={model}: no such folder and the Hugging Face Hub is "
                                      "unreachable; download the model (official: roberta-large) and pass its folder")
            try:
                import bert_score  # noqa: F401
            except ImportError:
                raise TaskConfigError(f"task.bert_score_model={model}: needs the bert-score package "
                                      "(pip install -e '.[loogle]')") from None

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        """A document row (``input``, ``qa_pairs`` parsed in place; ``output`` for summarization) or a Hub question
        row (``context``, ``question``, ``answer``)."""
        if "qa_pairs" not in row:
            require(row, where, context=str, question=str, answer=(list, dict) if dataset == "shortdep_cloze" else str)
            return
        require(row, where, input=str, qa_pairs=(str, list))
        if dataset == "longdep_summarization":
            require(row, where, output=str)
            return
        pairs = row["qa_pairs"]
        if isinstance(pairs, str):
            try:
                pairs = ast.literal_eval(pairs)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                raise TaskConfigError(f"{where}: field 'qa_pairs' is not a list literal") from None
        if not isinstance(pairs, list) or not pairs or not all(isinstance(p, dict) for p in pairs):
            raise TaskConfigError(f"{where}: field 'qa_pairs' must be a non-empty list of {{'Q', 'A'}} objects")
        for i, p in enumerate(pairs):
            require(p, f"{where} qa_pairs[{i}]", Q=str, A=dict if dataset == "shortdep_cloze" else str)
        row["qa_pairs"] = pairs

    @classmethod
    def read_file(cls, path: Path, dataset: str, limit: int | None) -> list[dict]:
        """The first ``limit`` questions of the file (documents read up to ``limit``: each holds one at least)."""
        return [q for row in super().read_file(path, dataset, limit) for q in questions(dataset, row)][:limit]

    def official_hub_file(self, dataset: str) -> Path:
        from huggingface_hub import hf_hub_download

        repo = self.cfg.get("hub_dataset") or self.official_hub
        return Path(self._hub(lambda: hf_hub_download(repo, HUB_FILES[dataset], repo_type="dataset")))

    def truncated(self, prompt: str, query: str) -> tuple[str, str, dict]:
        text, n = middle_truncate(prompt, self.tokenizer, self.max_length)
        return (*split(text, query), {"prompt_tokens_full": n, "truncated": n > self.max_length})

    def sample(self, dataset: str, index: int, prompt: str, query: str, answer: Any, max_new_tokens: int,
               chat: bool) -> Sample:
        prompt, query, meta = self.truncated(prompt, query)
        if dataset == "shortdep_cloze":
            meta["masks"] = len(answer)
        return Sample(id=f"{dataset}/{index}", dataset=dataset, prompt=prompt, query=query, chat=chat,
                      max_new_tokens=max_new_tokens, meta=meta,
                      answers=[answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)])

    def official_sample(self, dataset: str, index: int, row: dict) -> Sample:
        template, values = PROMPTS[dataset], {"input": row["document"], "Q": row["question"]}
        return self.sample(dataset, index, template.format(**values), template.split("{input}", 1)[1].format(**values),
                           row["answer"], MAX_NEW_TOKENS[dataset], False)

    def kvpress_sample(self, dataset: str, index: int, row: dict) -> Sample:
        answer = json.loads(row["answer"]) if dataset == "shortdep_cloze" else row["answer"]
        query = row["question"]  # the answer prefix: SuiteTask.answer_turn
        return self.sample(dataset, index, row["context"] + query, query, answer,
                           int(row.get("max_new_tokens") or MAX_NEW_TOKENS[dataset]), True)

    def scores(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Every automatic metric of one prediction (:data:`CLOZE_METRICS` or :data:`TEXT_METRICS`, ``bert_score``
        with a model), in [0, 1]."""
        if sample.dataset == "shortdep_cloze":
            return cloze_scores(prediction, json.loads(sample.answers[0]))
        out = text_scores(prediction, sample.answers[0])
        out["meteor"] = meteor(*(text.replace("\n", " ").split() for text in (sample.answers[0], prediction or "None")))
        if self.cfg.get("bert_score_model"):
            out["bert_score"] = bert_score(os.path.expanduser(self.cfg["bert_score_model"]),
                                           self.cfg.get("bert_score_layers") or 17, sample.answers[0], prediction or "None")
        return out

    def score(self, sample: Sample, prediction: str) -> float:
        """``exact_match`` for the cloze task, else ``rouge_l`` (recall)."""
        return self.scores(sample, prediction)[primary(sample.dataset)]

    def extra_scores(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {k: v for k, v in self.scores(sample, prediction).items() if k != primary(sample.dataset)}

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per task: the score (cloze: matched / all masks) and ``averages["<task> <metric>"]`` (×100, 2 decimals)."""
        out = super().aggregate(records)
        ok = [r for r in records if r.get("error") is None and r.get("score") is not None]
        for ds in out["datasets"]:
            cloze, part = ds == "shortdep_cloze", [r for r in ok if r["dataset"] == ds]
            weights = [(r.get("meta") or {}).get("masks", 1) if cloze else 1 for r in part]
            for m in CLOZE_METRICS if cloze else [m for m in TEXT_METRICS if any(m in (r.get("scores") or {}) or
                                                                                 m == primary(ds) for r in part)]:
                got = [r["score"] if m == primary(ds) else (r.get("scores") or {}).get(m, 0.0) for r in part]
                total = sum(g * w for g, w in zip(got, weights))
                out["averages"][f"{ds} {m}"] = round(100 * total / max(sum(weights), 1), 2)
        if "shortdep_cloze" in out["datasets"]:
            out["datasets"]["shortdep_cloze"]["score"] = out["averages"]["shortdep_cloze exact_match"]
            scores = [v["score"] for v in out["datasets"].values()]
            out["averages"][self.name] = round(sum(scores) / len(scores), 2)
        return out
