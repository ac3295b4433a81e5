"""LongBench v1 metrics, value for value as the official ``metrics.py`` and ``eval.py`` return them.

Every metric is ``(prediction: str, ground_truth: str, **kwargs) -> float`` in [0, 1]
(``all_classes`` is passed as a keyword, as the official scorer does). The official
scripts' quirks are part of the protocol and are reproduced on purpose; each is named
where it happens:

* English QA F1 normalises with lower-case, ASCII punctuation removal, article removal
  (``a``/``an``/``the`` as whole words) and whitespace collapsing, in that order.
* Chinese QA F1 and Chinese ROUGE cut words with ``jieba.cut`` (precise mode, HMM on).
* ROUGE-L is the ``rouge`` package's summary-level ``rouge-l`` F (``rouge`` 1.0.1):
  sentences are split at ``.``; the LCS union and both lengths count *distinct words*;
  ``F = 2PR / (P + R + 1e-8)``; an empty hypothesis or reference scores 0. It is
  reimplemented here (iteratively) so that one quirk does not depend on the caller's stack:
  the package rebuilds each LCS recursively, and in the official ``eval.py`` an LCS
  backtrack longer than the default recursion limit allows raises RecursionError, which
  the official ``rouge_score`` turns into a score of 0. :func:`rouge_score` returns 0 for
  exactly those inputs (see :data:`ROUGE_MAX_BACKTRACK`).
* Code similarity is fuzzywuzzy 0.18.0's ``fuzz.ratio`` *without* python-Levenshtein (the
  official requirements install fuzzywuzzy alone, so it runs on ``difflib.SequenceMatcher``;
  python-Levenshtein gives other values). It is computed here with ``difflib`` directly,
  so installing python-Levenshtein cannot change a score. It compares the first line of the
  prediction that holds no ``\\```, ``#`` or ``//`` (an empty line counts as a line).
* Classification removes, from the classes found in the prediction, those that are part of
  the ground truth, while iterating over that same list (so the element after each removed
  one is skipped), then scores ``1/len(matches)`` if the ground truth is among them.
* Dataset scores: the prediction is cut to its first line (after stripping leading newlines)
  for trec, triviaqa, samsum and lsht; a sample scores the max over its answers; a dataset
  scores ``round(100 * sum / n, 2)``; LongBench-E buckets score ``round(100 * np.mean, 2)``
  (numpy's rounding, as the official ``scorer_e``) by the ``length`` field.

Dependencies: ``jieba`` (0.42.1; its dictionary decides the Chinese word cut), ``numpy``.
"""

from __future__ import annotations

import difflib
import logging
import re
import string
from collections import Counter
from functools import lru_cache
from typing import Any, Callable, Sequence

import numpy as np


# --------------------------------------------------------------------------- normalisation

_ASCII_PUNCT = frozenset(string.punctuation)
# Chinese and full-width punctuation removed by the official normalize_zh_answer (with the ASCII set).
_ZH_PUNCT = _ASCII_PUNCT | frozenset(
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """English answer normalisation: lower → drop ASCII punctuation → articles to spaces → collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def normalize_zh_answer(text: str) -> str:
    """Chinese token normalisation: lower → drop ASCII and Chinese punctuation → drop all whitespace."""
    return "".join("".join(ch for ch in text.lower() if ch not in _ZH_PUNCT).split())


_jieba = None


def _cut_zh(text: str) -> list[str]:
    """jieba's precise-mode word cut (``jieba.cut(text, cut_all=False)``, HMM on)."""
    global _jieba
    if _jieba is None:
        import jieba

        jieba.setLogLevel(logging.WARNING)  # silence "Building prefix dict..." only
        _jieba = jieba
    return list(_jieba.cut(text, cut_all=False))


# --------------------------------------------------------------------------- QA F1


def _token_f1(pred_tokens: Sequence[str], gold_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1: ``2PR/(P+R)`` over the multiset overlap; 0 when nothing overlaps."""
    overlap = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = 1.0 * overlap / len(pred_tokens)
    recall = 1.0 * overlap / len(gold_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 of the normalised English answers (narrativeqa, qasper, multifieldqa_en, hotpotqa, ...)."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Token F1 over jieba words, each normalised with :func:`normalize_zh_answer`, empties dropped (multifieldqa_zh)."""

    def words(text: str) -> list[str]:
        return [w for w in (normalize_zh_answer(t) for t in _cut_zh(text)) if w]

    return _token_f1(words(prediction), words(ground_truth))


# --------------------------------------------------------------------------- ROUGE-L

# The official eval.py reaches the package's recursive LCS backtrack at Python stack depth 10
# (eval.py module → scorer → rouge_score → Rouge.get_scores → _get_avg_scores → metric lambda →
# rouge_l_summary_level → _union_lcs → _recon_lcs → _recon), one deeper through rouge_zh_score.
# The backtrack adds one frame per step, and CPython's default recursion limit is 1000, so a
# backtrack of more than 1000 - 10 steps fails and the official score is 0.
_DEFAULT_RECURSION_LIMIT = 1000
_OFFICIAL_BACKTRACK_DEPTH = 10
ROUGE_MAX_BACKTRACK = _DEFAULT_RECURSION_LIMIT - _OFFICIAL_BACKTRACK_DEPTH
"""Longest LCS backtrack (steps) the official English ROUGE survives; one less for Chinese."""


class _BacktrackTooDeep(Exception):
    """The official recursive LCS backtrack would have hit the recursion limit."""


def _lcs_words(ref: list[str], hyp: list[str], max_steps: int) -> set[str]:
    """Distinct words of the LCS of ``ref`` and ``hyp`` that the ``rouge`` package's backtrack picks.

    DP table ``T[i][j]`` = LCS length of ``ref[:i]`` and ``hyp[:j]``; the backtrack starts at
    ``(len(ref), len(hyp))``: a word match moves diagonally, else it moves up when
    ``T[i-1][j] > T[i][j-1]`` and left otherwise, until ``i == 0`` or ``j == 0``.

    Raises:
        _BacktrackTooDeep: the backtrack takes more than ``max_steps`` steps.
    """
    if not set(ref) & set(hyp):
        # No common word: the table is all zeros and the backtrack walks left len(hyp) steps.
        if len(hyp) > max_steps:
            raise _BacktrackTooDeep
        return set()
    table = [[0] * (len(hyp) + 1)]
    for i, r in enumerate(ref, start=1):
        prev, row = table[i - 1], [0]
        for j, h in enumerate(hyp, start=1):
            row.append(prev[j - 1] + 1 if r == h else max(prev[j], row[j - 1]))
        table.append(row)
    words: set[str] = set()
    i, j, steps = len(ref), len(hyp), 0
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
        steps += 1
    if steps > max_steps:
        raise _BacktrackTooDeep
    return words


def _rouge_sentences(text: str) -> list[str]:
    """The ``rouge`` package's sentence split: at ``.``, empty pieces dropped, whitespace collapsed."""
    return [" ".join(piece.split()) for piece in text.split(".") if len(piece) > 0]


def _rouge_l_f(prediction: str, ground_truth: str, max_steps: int) -> float:
    """``rouge`` 1.0.1 ``Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]``.

    Returns 0.0 where the official call raises (empty hypothesis/reference, too deep a backtrack).
    """
    hyp_sents, ref_sents = _rouge_sentences(prediction), _rouge_sentences(ground_truth)
    if not hyp_sents or not ref_sents:
        return 0.0  # rouge-1 raises "Hypothesis is empty." / "Reference is empty."
    hyp_words = [s.split(" ") for s in hyp_sents]
    ref_words = [s.split(" ") for s in ref_sents]
    m = len({w for s in ref_words for w in s})  # distinct reference words
    n = len({w for s in hyp_words for w in s})  # distinct hypothesis words
    union: set[str] = set()
    try:
        for ref in ref_words:
            for hyp in hyp_words:
                union |= _lcs_words(ref, hyp, max_steps)
    except _BacktrackTooDeep:
        return 0.0
    llcs = len(union)
    r_lcs, p_lcs = llcs / m, llcs / n
    return 2.0 * ((p_lcs * r_lcs) / (p_lcs + r_lcs + 1e-8))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Official ROUGE-L F (gov_report, qmsum, multi_news, samsum); see the module docstring."""
    return _rouge_l_f(prediction, ground_truth, ROUGE_MAX_BACKTRACK)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the jieba words joined by spaces (dureader, vcsum)."""
    return _rouge_l_f(
        " ".join(_cut_zh(prediction)), " ".join(_cut_zh(ground_truth)), ROUGE_MAX_BACKTRACK - 1
    )


# --------------------------------------------------------------------------- counting metrics


def _share_of_numbers(prediction: str, target: str) -> float:
    """Share of the digit runs (``\\d+``, Unicode digits included) in ``prediction`` equal to ``target``; 0 if none."""
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return float(sum(1 for x in numbers if x == target) / len(numbers))


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_count: share of the numbers in the prediction equal to the ground truth."""
    return _share_of_numbers(prediction, str(ground_truth))


def _paragraph_number(ground_truth: str, pattern: str) -> str:
    found = re.findall(pattern, ground_truth)
    if not found:
        raise ValueError(f"ground truth {ground_truth!r} has no paragraph number matching {pattern!r}")
    return found[0]


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_retrieval_en: share of the numbers in the prediction equal to N of ``Paragraph N``.

    Raises:
        ValueError: the ground truth holds no ``Paragraph N``.
    """
    return _share_of_numbers(prediction, _paragraph_number(ground_truth, r"Paragraph (\d+)"))


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """passage_retrieval_zh: share of the numbers in the prediction equal to N of ``段落N``.

    Raises:
        ValueError: the ground truth holds no ``段落N``.
    """
    return _share_of_numbers(prediction, _paragraph_number(ground_truth, r"段落(\d+)"))


# --------------------------------------------------------------------------- classification, code


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """trec, lsht: ``1/len(matches)`` if the ground truth is among the classes found in the prediction.

    Args:
        all_classes: (keyword) the dataset's class names.

    Raises:
        ValueError: ``all_classes`` is not given.
    """
    all_classes = kwargs.get("all_classes")
    if all_classes is None:
        raise ValueError("classification_score needs all_classes=[...]")
    matches = [c for c in all_classes if c in prediction]
    # Official quirk: remove the classes contained in the ground truth while walking the same
    # list by position, so the class right after each removed one is never examined.
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)  # first occurrence, like list.remove in the official loop
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18.0 ``fuzz.ratio`` on pure-python difflib: equal → 100, one empty → 0,
    else ``int(round(100 * SequenceMatcher(None, a, b).ratio()))`` (autojunk on)."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """lcc, repobench-p: ``fuzz.ratio / 100`` of the first line without a backtick, ``#`` or ``//``."""
    line = next(
        (x for x in prediction.lstrip("\n").split("\n") if "`" not in x and "#" not in x and "//" not in x),
        "",
    )
    return _fuzz_ratio(line, ground_truth) / 100


# --------------------------------------------------------------------------- datasets

dataset2metric: dict[str, Callable[..., float]] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "multifieldqa_zh": qa_f1_zh_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "dureader": rouge_zh_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "vcsum": rouge_zh_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "lsht": classification_score,
    "passage_retrieval_en": retrieval_score,
    "passage_count": count_score,
    "passage_retrieval_zh": retrieval_zh_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}
"""Official metric of each of the 21 LongBench datasets."""

FIRST_LINE_DATASETS = frozenset({"trec", "triviaqa", "samsum", "lsht"})
"""Datasets whose prediction is cut to its first line before scoring."""

BUCKETS = ("0-4k", "4-8k", "8k+")
"""LongBench-E length buckets (by the ``length`` field: < 4000, < 8000, else)."""


def first_line(prediction: str) -> str:
    """The official cut: strip leading newlines, keep the text before the next newline."""
    return prediction.lstrip("\n").split("\n")[0]


def bucket_of(length: int) -> str:
    """LongBench-E bucket of a sample's ``length`` field (words, or characters for Chinese)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"


def _metric(dataset: str) -> Callable[..., float]:
    if dataset not in dataset2metric:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; accepted: {', '.join(dataset2metric)}")
    return dataset2metric[dataset]


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """One sample's official score in [0, 1]: first-line cut where the protocol says, max over ``answers``.

    Raises:
        ValueError: unknown dataset.
    """
    metric = _metric(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = first_line(prediction)
    score = 0.0
    for answer in answers:
        score = max(score, metric(prediction, answer, all_classes=all_classes))
    return score


def score_dataset(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None,
    lengths: Sequence[int] | None = None,
) -> float | None | dict[str, float | None]:
    """The official dataset score (``eval.py``'s ``scorer``), or LongBench-E buckets (``scorer_e``).

    Args:
        dataset: one of the 21 dataset names (LongBench-E files use the same names).
        predictions: generated texts, one per sample, in file order.
        answers: each sample's reference answers.
        all_classes: the dataset's class names (trec, lsht), else None; one list for the dataset.
        lengths: each sample's ``length`` field; when given, the result is bucketed.

    Returns:
        Without ``lengths``: ``round(100 * sum(scores) / n, 2)``, None for no samples.
        With ``lengths``: ``{"0-4k": s, "4-8k": s, "8k+": s}`` with ``s = round(100 * np.mean, 2)``
        (numpy's rounding, as the official scorer_e) and None for an empty bucket.

    Raises:
        ValueError: unknown dataset, or the sequences differ in length.
    """
    if len(predictions) != len(answers) or (lengths is not None and len(lengths) != len(predictions)):
        raise ValueError(f"{dataset}: predictions, answers and lengths must be equally long")
    scores = [score_sample(dataset, p, a, all_classes) for p, a in zip(predictions, answers)]
    return dataset_score(scores) if lengths is None else bucket_scores(scores, lengths)


def dataset_score(scores: Sequence[float]) -> float | None:
    """Official dataset score from sample scores in [0, 1]: ``round(100 * sum / n, 2)``
    (sequential sum in the given order, Python's rounding); None for no samples."""
    if not scores:
        return None
    total = 0.0
    for s in scores:
        total += s
    return round(100 * total / len(scores), 2)


def bucket_scores(scores: Sequence[float], lengths: Sequence[int]) -> dict[str, float | None]:
    """Official LongBench-E buckets: ``{"0-4k", "4-8k", "8k+"}`` → ``round(100 * np.mean, 2)``
    with numpy's rounding (as the official ``scorer_e``), None for an empty bucket."""
    by_bucket: dict[str, list[float]] = {b: [] for b in BUCKETS}
    for s, length in zip(scores, lengths):
        by_bucket[bucket_of(length)].append(s)
    return {b: (float(round(100 * np.mean(v), 2)) if v else None) for b, v in by_bucket.items()}


@lru_cache(maxsize=None)
def rouge_scorer(*types: str) -> Any:
    """``rouge_score``'s ``RougeScorer(types)``, no stemmer, built once; its default tokenizer is passed explicitly, so
    that it does not log "Using default tokenizer." (absl, INFO) at every construction."""
    from rouge_score import rouge_scorer as rs, tokenizers

    return rs.RougeScorer(list(types), tokenizer=tokenizers.DefaultTokenizer(use_stemmer=False))
