"""ZeroSCROLLS (Shaham et al., 2023): ten zero-shot long-text tasks, with tau-nlp/zero_scrolls's protocol (commit
c994676: ``experiments/hf/run_hf_model.py``, ``experiments/api/api.py``) and the metrics of the ``tau/zero_scrolls``
Hub repository (``metrics/``: ``rouge.py``, ``f1.py``, ``accuracy.py``, ``exp_similarity.py``,
``concordance_index.py``).

Per example: the prompt is the row's ``input`` (instruction, document, query and answer prefix, as distributed), no
chat template, and up to ``api.py``'s ``dataset_to_leave_tokens_for_generations`` new tokens (the per-task table kvpress
uses too). As ``api.py`` does for decoder-only models, ``max_length`` bounds prompt + generation
(``max_input_output_tokens``): a prompt longer than ``budget = max_length - max_new_tokens`` tokens is cut as
``process_model_input`` cuts it to its ``max_tokens`` (the HF script's encoder-decoder models need no room), in text:
the first ``budget - len(tokenizer(truncation_seperator + query))`` tokens of ``input[:query_start_index]`` (decoded
with special tokens skipped), then ``truncation_seperator`` and the query ``input[query_start_index:]``. The query
(``task.compress=context``) is the text after the document, ``input[document_end_index:]`` (the separator and the
query once truncated).

Scores: gov_report, summ_screen_fd, qmsum, squality: ``rouge_score``'s ROUGE-1/2/L F (no stemmer; ×100), each the
max over the references, averaged over examples; the task scores their geometric mean (a sample's ``score`` is the
geometric mean of its own three, ``scores`` holds them). qasper, narrative_qa, musique: SQuAD token F1 after lower
case, punctuation and article removal, whitespace collapsing and ``unidecode``. quality: accuracy of the first
standalone letter A-D. space_digest: ``0.5 ** (|gold % - predicted %| / 10)`` of the first percentage. book_sum_sort:
the concordance index of the predicted order of summary ids (0 unless the prediction holds the same ids),
lifelines' ``concordance_index`` computed directly (no ties are possible between two orders of distinct ids). A
task scores the mean of its examples' max over references ×100; ``averages["zero_scrolls"]`` is the mean over tasks.
The ROUGE settings assumed (the Hub files are unreadable offline) and why: docs/BENCHMARKS.md. ``rouge.py``'s
``postprocess_text`` (nltk sentences joined by newlines) is left out: it moves no ROUGE-1/2/L token
(``rouge_score`` splits on non-alphanumerics), only ROUGE-Lsum, which no score uses. A reference without its task's
answer form (a letter, a percentage, an order of ids 1..n, n > 1), on which ``accuracy.py``, ``exp_similarity.py``
and ``concordance_index.py`` raise, is refused when the file is read.

Data: the validation split (the test split's references are private; its scores come from the leaderboard), the
official ZIPs unpacked in ``task.data_dir`` (``<task>/validation.jsonl``: ``id``, ``pid``, ``input``, ``output``,
``document_start_index``, ``document_end_index``, ``query_start_index``, ``query_end_index``,
``truncation_seperator``; an example with several references spans several rows of one ``id``), or ``<task>.zip``
from ``tau/zero_scrolls``. kvpress's copy ``simonjegou/zero_scrolls`` (``task.source=kvpress``) holds the test split
without references: it is refused once read.
"""

from __future__ import annotations

import re
import string
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from .base import Sample, TaskConfigError, is_data_file, read_jsonl
from .metrics import rouge_scorer
from .suite import SuiteTask, require, split

MAX_NEW_TOKENS = {"gov_report": 1024, "summ_screen_fd": 512, "qmsum": 512, "qasper": 128, "narrative_qa": 64,
                  "quality": 10, "musique": 32, "squality": 512, "space_digest": 36, "book_sum_sort": 256}
TASKS = tuple(MAX_NEW_TOKENS)
METRIC = {**dict.fromkeys(("gov_report", "summ_screen_fd", "qmsum", "squality"), "rouge"),
          **dict.fromkeys(("qasper", "narrative_qa", "musique"), "f1"), "quality": "accuracy",
          "space_digest": "exp_similarity", "book_sum_sort": "concordance_index"}
ROUGE = ("rouge1", "rouge2", "rougeL")


# --------------------------------------------------------------------------- metrics/


def normalize_f1(text: str) -> str:
    """``f1.py``'s normalisation: lower, drop ASCII punctuation, drop articles, collapse whitespace, ``unidecode``."""
    from unidecode import unidecode

    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return unidecode(" ".join(re.sub(r"\b(a|an|the)\b", " ", text).split()))


def f1(prediction: str, reference: str) -> float:
    """``f1.py``'s ``f1_score``, its float operations in its order (2PR / (P + R))."""
    pred, gold = normalize_f1(prediction).split(), normalize_f1(reference).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def letter(text: str) -> str | None:
    """``accuracy.py``'s ``find_answer``: the first standalone A-D."""
    found = re.search(r"\b[A-D]\b", text)
    return found.group() if found else None


def accuracy(prediction: str, reference: str) -> float:
    return float(letter(prediction) == letter(reference))


def percentage(text: str) -> float | None:
    """``exp_similarity.py``'s ``to_int``: the first ``12%`` / ``12.5%`` as a number."""
    found = re.search(r"\d+\.?\d*%", text)
    return float(found.group(0)[:-1]) if found else None


def exp_similarity(prediction: str, reference: str) -> float:
    pred = percentage(prediction)
    return 0.0 if pred is None else 0.5 ** (abs(percentage(reference) - pred) / 10)


def summary_ids(text: str) -> list[int]:
    """``concordance_index.py``'s ``normalize_answer``: the integers of the text ([] when a token is no integer)."""
    words = re.sub(r"[^0-9\s,]", "", text).replace(",", " ").strip(string.punctuation).split()
    try:
        return [int("".join(c for c in w if c not in string.punctuation).strip()) for w in words]
    except ValueError:
        return []


def concordance(prediction: str, reference: str) -> float:
    """Share of summary pairs that the prediction orders as the reference (0 unless both hold the same ids)."""
    pred, gold = summary_ids(prediction), summary_ids(reference)
    if sorted(pred) != sorted(gold):
        return 0.0
    pos_pred, pos_gold = ({i: p for p, i in enumerate(order)} for order in (pred, gold))
    pairs = [(a, b) for k, a in enumerate(gold) for b in gold[k + 1:]]
    return sum((pos_gold[a] - pos_gold[b]) * (pos_pred[a] - pos_pred[b]) > 0 for a, b in pairs) / len(pairs)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """``rouge.py``: ``rouge_score``'s ROUGE-1/2/L F-measure, no stemmer."""
    got = rouge_scorer(*ROUGE).score(reference, prediction)
    return {k: got[k].fmeasure for k in ROUGE}


SCORERS = {"f1": f1, "accuracy": accuracy, "exp_similarity": exp_similarity, "concordance_index": concordance}
"""The per-reference metric of each non-ROUGE task metric: ``(prediction, reference) -> [0, 1]``."""


def geometric_mean(values: list[float]) -> float:
    return (values[0] * values[1] * values[2]) ** (1 / 3)


class ZeroScrollsTask(SuiteTask):
    """ZeroSCROLLS's ten tasks (``task.datasets``), a sample per example id; ``averages`` adds ROUGE components."""

    name = "zero_scrolls"
    subsets = TASKS
    official_hub = "tau/zero_scrolls"
    kvpress_hub = "simonjegou/zero_scrolls"
    what = "ZeroSCROLLS's <task>.zip files, unpacked (huggingface.co/datasets/tau/zero_scrolls)"

    @classmethod
    def file_name(cls, dataset: str) -> str:
        return f"{dataset}/validation.jsonl"

    @classmethod
    def data_files(cls, cfg: dict) -> list[Path]:
        """The ``<task>/validation.jsonl`` files of ``task.datasets`` found in ``task.data_dir``."""
        root = Path(cfg["data_dir"]).expanduser()
        return [p for d in cfg.get("datasets") or TASKS if is_data_file(p := root / cls.file_name(d))]

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        require(row, where, id=str, input=str, output=str, document_end_index=int, query_start_index=int,
                truncation_seperator=str)
        if not 0 <= row["document_end_index"] <= row["query_start_index"] <= len(row["input"]):
            raise TaskConfigError(f"{where}: fields 'document_end_index' <= 'query_start_index' must lie in 'input'")
        ids = summary_ids(row["output"])
        bad = {"quality": letter(row["output"]) is None, "space_digest": percentage(row["output"]) is None,
               "book_sum_sort": len(ids) < 2 or sorted(ids) != list(range(1, len(ids) + 1))}.get(dataset)
        if bad:
            raise TaskConfigError(f"{where}: field 'output' holds no {METRIC[dataset]} reference")

    @classmethod
    def read_file(cls, path: Path, dataset: str, limit: int | None) -> list[dict]:
        """The first ``limit`` examples, the rows of one ``id`` merged (``outputs``: their references)."""
        examples: dict[str, dict] = {}
        for row in read_jsonl(path, lambda r, where: cls.check_row(dataset, r, where)):
            examples.setdefault(row["id"], {**row, "outputs": []})["outputs"].append(row["output"])
        return list(examples.values())[:limit]

    def official_hub_file(self, dataset: str) -> Path:
        """``<task>.zip`` of ``hub_dataset``, its ``validation.jsonl`` unpacked beside it."""
        from huggingface_hub import hf_hub_download

        repo = self.cfg.get("hub_dataset") or self.official_hub
        zipped = Path(self._hub(lambda: hf_hub_download(repo, f"{dataset}.zip", repo_type="dataset")))
        with zipfile.ZipFile(zipped) as z:
            member = next((n for n in z.namelist() if n.endswith("validation.jsonl")), None)
            if member is None:
                raise TaskConfigError(f"task.hub_dataset={repo}: {dataset}.zip holds no validation.jsonl")
            return Path(z.extract(member, zipped.parent / f".{dataset}"))

    def official_sample(self, dataset: str, index: int, row: dict) -> Sample:
        """The row's ``input``, cut to ``max_length - MAX_NEW_TOKENS[dataset]`` tokens (module docstring).

        Raises:
            TaskConfigError: ``max_length`` leaves no room for the prompt after the task's generation.
        """
        budget = self.max_length - MAX_NEW_TOKENS[dataset]  # api.py: max_input_output_tokens - max_generation_tokens
        if budget < 1:
            raise TaskConfigError(f"task.max_length={self.max_length}: must exceed {dataset}'s "
                                  f"{MAX_NEW_TOKENS[dataset]} new tokens (it bounds prompt + generation)")
        text, query = row["input"], row["input"][row["document_end_index"]:]
        ids = list(self.tokenizer(text, truncation=False).input_ids)
        if len(ids) > budget:
            query = row["truncation_seperator"] + text[row["query_start_index"]:]
            keep = budget - len(self.tokenizer(query, truncation=False).input_ids)
            head = list(self.tokenizer(text[:row["query_start_index"]], truncation=False).input_ids)[:max(keep, 0)]
            text = self.tokenizer.decode(head, skip_special_tokens=True) + query
        text, query = split(text, query)
        return Sample(id=f"{dataset}/{index}", dataset=dataset, prompt=text, query=query, chat=False,
                      max_new_tokens=MAX_NEW_TOKENS[dataset], answers=row["outputs"],
                      meta={"id": row["id"], "prompt_tokens_full": len(ids), "truncated": len(ids) > budget})

    def tokens_needed(self, sample: Sample) -> int:
        """``max_length``: the prompt is cut to leave the sample's ``max_new_tokens`` inside it."""
        return self.max_length

    def kvpress_sample(self, dataset: str, index: int, row: dict) -> Sample:
        if not row.get("answer"):
            raise TaskConfigError(f"{self.cfg.get('hub_dataset') or self.kvpress_hub} {dataset} row {index}: no "
                                  "reference (kvpress's copy is the test split, whose references are private); use "
                                  "task.source=official (the validation split)")
        query = row["question"]  # the answer prefix: SuiteTask.answer_turn
        return Sample(id=f"{dataset}/{index}", dataset=dataset, prompt=row["context"] + query, query=query, chat=True,
                      max_new_tokens=int(row.get("max_new_tokens") or MAX_NEW_TOKENS[dataset]), answers=[row["answer"]])

    def kvpress_config(self, dataset: str) -> str | None:
        return None

    @staticmethod
    def scores(sample: Sample, prediction: str) -> dict[str, float]:
        """The task's metric, max over the references (ROUGE: each of ROUGE-1/2/L apart), in [0, 1]."""
        if METRIC[sample.dataset] == "rouge":
            each = [rouge(prediction, ref) for ref in sample.answers]
            return {k: max(e[k] for e in each) for k in ROUGE}
        return {METRIC[sample.dataset]: max(SCORERS[METRIC[sample.dataset]](prediction, r) for r in sample.answers)}

    def score(self, sample: Sample, prediction: str) -> float:
        got = self.scores(sample, prediction)
        return geometric_mean([got[k] for k in ROUGE]) if "rouge1" in got else got[METRIC[sample.dataset]]

    def extra_scores(self, sample: Sample, prediction: str) -> dict[str, float]:
        return self.scores(sample, prediction) if METRIC[sample.dataset] == "rouge" else {}

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """ROUGE tasks score the geometric mean of their mean ROUGE-1/2/L (×100, ``averages["<task> rougeN"]``)."""
        out = super().aggregate(records)
        ok = [r for r in records if r.get("error") is None and r.get("score") is not None]
        for ds, entry in out["datasets"].items():
            if METRIC[ds] == "rouge":
                part = [r.get("scores") or {} for r in ok if r["dataset"] == ds]
                means = [100 * sum(p.get(k, 0.0) for p in part) / len(part) for k in ROUGE]
                out["averages"].update({f"{ds} {k}": round(m, 2) for k, m in zip(ROUGE, means)})
                entry["score"] = round(geometric_mean(means), 2)
        scores = [v["score"] for v in out["datasets"].values()]
        out["averages"][self.name] = round(sum(scores) / len(scores), 2) if scores else None
        return out
