"""NIAH scores of hand-made predictions: the strict match beside ROUGE-1 recall (eval.niah.NIAHConfig's needle)."""

from types import SimpleNamespace

import pytest

from eval.niah import NIAHTask, strict_match

ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"  # eval.niah.NIAHConfig.answer


@pytest.mark.parametrize("prediction, expected", [
    ("The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.", 1.0),
    ("EAT A SANDWICH, and sit in Dolores-Park... on a sunny day!", 1.0),  # case and punctuation ignored
    ("eat a sandwich and sit in dolores park on a sunny", 0.0),  # phrase cut short
    ("Go to the park and eat a sandwich on a sunny day.", 0.0),  # generic answer: ROUGE-1 recall 75 (9 of 12 words)
    ("eat a sandwiches and sit in Dolores Park on a sunny day", 0.0),  # whole words only
    ("", 0.0),
])
def test_strict_match(prediction, expected):
    assert strict_match(prediction, ANSWER) == expected


def test_extra_scores_store_strict_beside_rouge():
    sample = SimpleNamespace(answers=[ANSWER])
    generic = NIAHTask.extra_scores(None, sample, "Go to the park and eat a sandwich on a sunny day.")
    assert generic["rouge1_recall"] == 75.0 and generic["strict"] == 0.0
    exact = NIAHTask.extra_scores(None, sample, "To eat a sandwich and sit in Dolores Park on a sunny day.")
    assert exact == {"rouge1_recall": 100.0, "word_overlap": 100.0, "strict": 100.0}
