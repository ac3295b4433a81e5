"""SCBench's scorers: ``scbench/compute_scores.py`` and ``scbench/repo_qa_utils.py`` of microsoft/MInference
(commit fb56c91), each a function ``(prediction, label) -> score in [0, 1]`` of one answer.

The label is ``get_ground_truth``'s: ``[answer, letter]`` for ``scbench_choice_eng``, ``[answer]`` for
``scbench_qa_eng``, else the turn's ``answer`` as stored (a string, a list of strings for ``scbench_vt``, an integer
for ``scbench_mf``). As in the official code a string label is iterated where the metric iterates labels: the
Chinese QA F1 is then the best F1 against a single character of the answer, and ``scbench_many_shot`` matches when
any character of the answer is in the prediction. ``compute_scores.py`` maps the datasets to InfiniteBench's
metric names (``Multiturnbench_to_Infinitebench``); where its function equals InfiniteBench's it is reused from
:mod:`eval.infinitebench`.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

from .infinitebench import qa_f1_zh, score_choice, score_first_int, score_sum

#: tree-sitter queries of a function definition per language (``repo_qa_utils.FUNCTION_QUERY``)
FUNCTION_QUERY = {
    "python": "(function_definition name: (_)) @fdef",
    "java": "(method_declaration name: (_)) @fdef",
    "typescript": "(function_declaration name: (_)) @fdef",
    "rust": "(function_item name: (_)) @fdef",
    "cpp": "(function_definition declarator: (function_declarator declarator: (identifier))) @fdef",
    "go": "(function_declaration name: (_)) @fdef",
}
REPOQA_THRESHOLD = 0.8  # compute_scores.py reports pass@1 at this similarity threshold


def score_kv(pred: str, label: str) -> float:
    """``get_score_one_kv_retrieval``: the value is a substring of the prediction (``scbench_kv``,
    ``scbench_prefix_suffix``, the kv turns of ``scbench_repoqa_and_kv``)."""
    return float(label in pred)


def score_any_upper(pred: str, label: Any) -> float:
    """``get_score_one_longdialogue_qa_eng``: some item of the label, upper-cased, is a substring of the stripped,
    upper-cased prediction (``scbench_qa_eng``, ``scbench_many_shot``)."""
    pred = pred.strip().upper()
    return float(any(item.upper() in pred for item in label))


def score_match_all(pred: str, label: Any) -> float:
    """``string_match_all``: the fraction of the label's items found (case-insensitive) in the prediction, rounded to
    2 decimals (``scbench_vt``)."""
    return round(sum(r.lower() in pred.lower() for r in label) / len(label), 2)


def score_math_find(pred: str, label: Any) -> float:
    """``get_score_one_math_find`` of compute_scores.py: the first number of the prediction (``\\d+\\.\\d+|\\d+``)
    equals the label (``int(float(x))`` for an integer label). TypeError: a label neither int nor float."""
    label = label[0] if isinstance(label, list) else label
    if not isinstance(label, (int, float)):
        raise TypeError(f"Expected int or float, got {type(label)}")
    found = re.search(r"\d+\.\d+|\d+", pred)
    if found is None:
        return 0.0
    return float((int(float(found.group(0))) if isinstance(label, int) else float(found.group(0))) == label)


SCORERS = {
    "scbench_kv": score_kv, "scbench_prefix_suffix": score_kv, "scbench_vt": score_match_all,
    "scbench_qa_eng": score_any_upper, "scbench_many_shot": score_any_upper, "scbench_qa_chn": qa_f1_zh,
    "scbench_choice_eng": score_choice, "scbench_mf": score_math_find, "scbench_summary": score_sum,
    "scbench_passkey": score_first_int,
}
"""Scorer per dataset, or per turn ``task`` of the two mixed datasets (``scbench_repoqa``: :func:`score_repoqa`)."""


@functools.cache
def _code_parser(lang: str) -> tuple[Any, Any]:
    """tree-sitter's parser and function query for ``lang`` (``tree_sitter_languages``, as repo_qa_utils.py)."""
    try:
        from tree_sitter_languages import get_language, get_parser
    except ImportError:
        raise ImportError("SCBench's RepoQA scorer needs tree-sitter-languages: pip install -e '.[scbench]'") from None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tree_sitter 0.21's Language(path, name) deprecation
        return get_parser(lang), get_language(lang).query(FUNCTION_QUERY[lang])


def sanitize_output(output: str, lang: str) -> str:
    """``sanitize_output``: the first function definition tree-sitter finds in the prediction's fenced code blocks,
    else the first block, else the stripped prediction."""
    output = output.strip()
    blocks = re.findall(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", output, re.DOTALL | re.MULTILINE)
    parser, query = _code_parser(lang)
    for block in blocks:
        try:
            data = bytes(block, "utf8")
            for node, _ in query.captures(parser.parse(data).root_node):
                return data[node.start_byte:node.end_byte].decode("utf8")
        except Exception:  # noqa: BLE001 - the official code moves on to the next block
            pass
    return blocks[0] if blocks else output


def function_similarity(candidate: str, reference: str) -> float:
    """``compute_function_similarity``: sentence BLEU (nltk, smoothing method 4) over whitespace tokens."""
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nltk's zero-overlap warnings
        return float(sentence_bleu([re.split(r"\s+", reference.strip())], re.split(r"\s+", candidate.strip()),
                                   smoothing_function=SmoothingFunction().method4))


def score_repoqa(pred: str, lang: str, name: str, needles: list[tuple[str, str]]) -> float:
    """``needle_evaluator`` + pass@1 at :data:`REPOQA_THRESHOLD`: 1 when, among ``needles`` (``(function name,
    code)`` of every function asked about in the repository, in the official order), the most similar to the
    sanitized prediction (the first of equals, similarity > 0) is ``name`` and its similarity is >= 0.8."""
    out = sanitize_output(pred, lang)
    best, best_sim = None, 0.0
    for needle_name, code in needles:
        sim = function_similarity(out, code)
        if sim > best_sim:
            best, best_sim = needle_name, sim
    return float(best == name and best_sim >= REPOQA_THRESHOLD)
