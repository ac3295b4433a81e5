"""eval.metrics against hand-computed values of the official LongBench v1 metrics (quirks included)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import pytest

from eval import metrics as M


def f1(p: float, r: float) -> float:
    return 2 * p * r / (p + r)


def rouge_f(p: float, r: float) -> float:
    """The rouge package's F with its 1e-8 in the denominator."""
    return 2.0 * ((p * r) / (p + r + 1e-8))


# ---------------------------------------------------------------- English QA F1


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, punctuation, article
        ("a cat and the dog", "an cat dog", f1(2 / 3, 1.0)),  # articles removed, "and" is extra
        ("U.S.A.", "usa", 1.0),  # punctuation removed inside a word
        ("well-known", "well known", 0.0),  # hyphen removed without a space: one token "wellknown"
        ("The-cat", "cat", 0.0),  # "the" glued to "cat" once "-" goes: "thecat"
        ("Ünïcode CAFÉ", "ünïcode café", 1.0),  # Unicode lower-casing
        ("\u2018hello\u2019", "hello", 0.0),  # curly quotes are not ASCII punctuation
        ("", "paris", 0.0),  # empty prediction
        ("the a an", "the", 0.0),  # both normalise to nothing
        ("paris paris london", "paris", f1(1 / 3, 1.0)),  # multiset overlap counts once
        ("1,000 people", "1000 people", 1.0),
    ],
)
def test_qa_f1_score(pred, gold, expected):
    assert M.qa_f1_score(pred, gold) == pytest.approx(expected, abs=1e-12)


def test_normalize_answer_order():
    # lower → punctuation → articles → whitespace
    assert M.normalize_answer("  The  Cat's   hat, AN apple ") == "cats hat apple"


# ---------------------------------------------------------------- Chinese QA F1


def test_jieba_cut_is_the_one_the_expectations_assume():
    # The Chinese expectations below depend on jieba 0.42.1's default dictionary.
    assert M._cut_zh("在厦门大学举办") == ["在", "厦门大学", "举办"]
    assert M._cut_zh("会议讨论了预算问题。") == ["会议", "讨论", "了", "预算", "问题", "。"]


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("厦门大学。", "厦门大学", 1.0),  # "。" normalises to "" and is dropped
        ("在厦门大学举办", "厦门大学", f1(1 / 3, 1.0)),
        ("会议讨论了预算问题。", "会议讨论预算。", f1(3 / 5, 1.0)),
        ("", "厦门大学", 0.0),
        ("，。！", "厦门大学", 0.0),  # only punctuation
    ],
)
def test_qa_f1_zh_score(pred, gold, expected):
    assert M.qa_f1_zh_score(pred, gold) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------- ROUGE-L


def test_rouge_note_from_the_issue():
    # distinct words: hyp {the, cat, sat, on, mat} = 5, ref {the, cat, was, sitting, on, mat} = 6,
    # LCS words {the, cat, on, mat} = 4 → P = 4/5, R = 4/6 → F = 0.727... (rouge-score gives 0.769)
    score = M.rouge_score("the cat sat on the mat", "the cat was sitting on the mat")
    assert score == pytest.approx(rouge_f(4 / 5, 4 / 6), rel=1e-12)
    assert round(score, 3) == 0.727


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("", "the cat", 0.0),  # empty hypothesis: the package raises, the official score is 0
        ("...", "the cat", 0.0),  # only periods: no sentence left
        ("the cat", "", 0.0),  # empty reference
        ("the the the", "the", rouge_f(1.0, 1.0)),  # distinct words: repetition costs nothing
        ("cat sat. dog ran", "dog ran. cat sat", rouge_f(1.0, 1.0)),  # union LCS over sentences
        # "3.5" is split at the period: hyp words {3, 5, million}, ref {35, million}, LCS {million}
        ("3.5 million", "35 million", rouge_f(1 / 3, 1 / 2)),
        ("Paris, France", "paris france", 0.0),  # no lower-casing, no punctuation removal
    ],
)
def test_rouge_score(pred, gold, expected):
    assert M.rouge_score(pred, gold) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_rouge_zh_score_cuts_words_with_jieba():
    # hyp words {会议, 讨论, 了, 预算, 问题, 。} = 6, ref {会议, 讨论, 预算, 。} = 4, LCS 4 ("。" is no period)
    assert M.rouge_zh_score("会议讨论了预算问题。", "会议讨论预算。") == pytest.approx(rouge_f(4 / 6, 1.0), rel=1e-12)


def _long_run(n_words: int) -> str:
    """One sentence of n words whose LCS with "zzz" needs an n-step backtrack."""
    return "zzz " + " ".join(f"h{i}" for i in range(n_words - 1))


def test_rouge_recursion_quirk_boundary():
    # The official eval.py survives a 990-step backtrack and scores 0 from 991 steps on (990/989 for zh).
    ok = M.rouge_score(_long_run(990), "zzz")
    assert ok == pytest.approx(rouge_f(1 / 990, 1.0), rel=1e-12)
    assert M.rouge_score(_long_run(991), "zzz") == 0.0
    assert M.rouge_zh_score(_long_run(989), "zzz") > 0
    assert M.rouge_zh_score(_long_run(990), "zzz") == 0.0


_OFFICIAL_DEPTH_SCRIPT = textwrap.dedent(
    """
    import sys, json, jieba
    jieba.setLogLevel(60)
    from rouge import Rouge
    def rouge_score(prediction, ground_truth, **kwargs):
        try:
            scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
        except Exception:
            return 0.0
        return scores["rouge-l"]["f"]
    def rouge_zh_score(prediction, ground_truth, **kwargs):
        prediction = " ".join(list(jieba.cut(prediction, cut_all=False)))
        ground_truth = " ".join(list(jieba.cut(ground_truth, cut_all=False)))
        return rouge_score(prediction, ground_truth)
    def scorer(metric, pairs):
        out = []
        for p, g in pairs:
            out.append(metric(p, g))
        return out
    pairs = json.loads(sys.argv[1])
    print(json.dumps([scorer(rouge_score, pairs), scorer(rouge_zh_score, pairs)]))
    """
)


def test_rouge_matches_the_package_at_the_official_call_depth():
    """Runs the `rouge` package the way the official eval.py calls it (module → scorer → metric)."""
    pytest.importorskip("rouge")
    pairs = [(_long_run(n), "zzz") for n in (989, 990, 991)]
    out = subprocess.run(
        [sys.executable, "-c", _OFFICIAL_DEPTH_SCRIPT, __import__("json").dumps(pairs)],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    en, zh = __import__("json").loads(out.stdout)
    assert en == [M.rouge_score(p, g) for p, g in pairs]
    assert zh == [M.rouge_zh_score(p, g) for p, g in pairs]
    assert en[2] == 0.0 and zh[1] == 0.0 and en[1] > 0  # the quirk is really exercised


def test_rouge_matches_the_package_on_random_texts():
    rouge = pytest.importorskip("rouge")
    rng = random.Random(0)
    vocab = ["the", "cat", "a", "sat", ".", "on", "mat", "dog", "  ", "x.y", "", "b", "\n"]
    for _ in range(400):
        pred = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 25)))
        gold = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 25)))
        try:
            ref = rouge.Rouge().get_scores([pred], [gold], avg=True)["rouge-l"]["f"]
        except Exception:
            ref = 0.0
        assert M.rouge_score(pred, gold) == ref, (pred, gold)


# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(
    "pred, gold, classes, expected",
    [
        ("Person", "Person", ["Location", "Person", "Date"], 1.0),
        ("Person or Date", "Person", ["Location", "Person", "Date"], 0.5),  # two classes named
        ("Location", "Person", ["Location", "Person", "Date"], 0.0),
        ("", "Person", ["Location", "Person", "Date"], 0.0),  # empty prediction
        ("person", "Person", ["Location", "Person", "Date"], 0.0),  # case-sensitive
        # overlapping names: "Manner" is part of the ground truth and removed, but the removal
        # shifts the list so "an" is skipped and stays: 2 matches → 0.5 (the official quirk)
        ("Manner of an action", "Manner of an action", ["Manner", "an", "Manner of an action"], 0.5),
        ("Manner of an action", "Manner of an action", ["Manner", "Manner of an action"], 1.0),
        ("农业、农村", "农业、农村", ["农业", "农业、农村", "体育"], 1.0),  # lsht-style Chinese classes
    ],
)
def test_classification_score(pred, gold, classes, expected):
    assert M.classification_score(pred, gold, all_classes=classes) == expected


def test_classification_needs_all_classes():
    with pytest.raises(ValueError, match="all_classes"):
        M.classification_score("Person", "Person")


# ---------------------------------------------------------------- retrieval and count


@pytest.mark.parametrize(
    "pred, expected",
    [
        ("Paragraph 12", 1.0),
        ("Paragraph 3 and Paragraph 12", 0.5),  # several numbers
        ("The answer is Paragraph 12, not 21", 0.5),
        ("Paragraph 012", 0.0),  # compared as strings
        ("Paragraph \uff11\uff12", 0.0),  # full-width digits are \d but not "12"
        ("", 0.0),
    ],
)
def test_retrieval_score(pred, expected):
    assert M.retrieval_score(pred, "Paragraph 12") == expected


def test_retrieval_zh_score():
    assert M.retrieval_zh_score("段落27", "段落27") == 1.0
    assert M.retrieval_zh_score("答案是：段落27，不是段落2", "段落27") == 0.5
    assert M.retrieval_zh_score("第二十七段", "段落27") == 0.0
    with pytest.raises(ValueError):
        M.retrieval_zh_score("段落27", "27")


@pytest.mark.parametrize(
    "pred, gold, expected",
    [
        ("There are 5 unique paragraphs out of 12", "5", 0.5),
        ("5", "5", 1.0),
        ("five", "5", 0.0),
        ("55", "5", 0.0),
        ("5, 5 and 6", 5, 2 / 3),  # an int ground truth is compared as text
    ],
)
def test_count_score(pred, gold, expected):
    assert M.count_score(pred, gold) == pytest.approx(expected, abs=1e-12)


# ---------------------------------------------------------------- code similarity


@pytest.mark.parametrize(
    "pred, expected",
    [
        ("return x + 1", 1.0),
        ("# comment\nreturn x + 1", 1.0),  # comment line skipped
        ("\n\n// c\nreturn x+1", 0.91),  # leading newlines stripped; 2·10/22 → 91
        ("```python\nreturn x + 1\n```", 1.0),  # fence skipped
        ("return x + 1  # add one", 0.0),  # a line with a trailing comment is skipped too
        ("# c\n\nreturn x + 1", 0.0),  # the empty line is the first non-comment line
        ('url = "http://x"', 0.0),  # "//" anywhere skips the line
        ("", 0.0),
    ],
)
def test_code_sim_score(pred, expected):
    assert M.code_sim_score(pred, "return x + 1") == expected


def test_code_sim_rounding_and_equal_empty():
    # 1 matching char over 8 + 8 chars: 12.5 → Python's round gives 12
    assert M.code_sim_score("abcdefgh", "ijklmnoa") == 0.12
    assert M.code_sim_score("", "") == 1.0  # equal strings score 100 before the empty check


def test_code_sim_matches_fuzzywuzzy_without_levenshtein():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    import difflib

    if fuzz.SequenceMatcher is not difflib.SequenceMatcher:
        pytest.skip("python-Levenshtein is installed: fuzzywuzzy does not use difflib here")
    rng = random.Random(1)
    chars = "ab c(d)#/ \n`xyz=+1"
    for _ in range(500):
        pred = "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
        gold = "".join(rng.choice(chars) for _ in range(rng.randint(0, 40)))
        line = next((x for x in pred.lstrip("\n").split("\n") if not any(t in x for t in "`#") and "//" not in x), "")
        assert M.code_sim_score(pred, gold) == fuzz.ratio(line, gold) / 100


# ---------------------------------------------------------------- dataset scores


def test_score_sample_first_line_and_max_over_answers():
    classes = ["Person", "Location"]
    assert M.score_sample("trec", "\n\nPerson\nLocation", ["Person"], classes) == 1.0  # 0.5 without the cut
    assert M.score_sample("triviaqa", "Paris\nLondon", ["London", "Paris"]) == 1.0
    assert M.score_sample("qasper", "Paris\nLondon", ["London", "Paris"]) == pytest.approx(f1(0.5, 1.0))
    assert M.score_sample("narrativeqa", "x", []) == 0.0
    with pytest.raises(ValueError, match="unknown LongBench dataset"):
        M.score_sample("nope", "x", ["x"])


def test_score_dataset_rounding():
    assert M.score_dataset("passage_count", ["1", "2", "3"], [["1"], ["1"], ["1"]], None) == 33.33
    assert M.score_dataset("passage_count", [], [], None) is None


def test_score_dataset_buckets():
    preds = ["1", "1", "2", "1", "1", "1"]
    answers = [["1"]] * 6
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    # 0-4k: [1, 1] → 100; 4-8k: [0, 1] → 50; 8k+: [1, 1] → 100
    assert M.score_dataset("passage_count", preds, answers, None, lengths) == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 100.0}
    only_short = M.score_dataset("passage_count", ["1"], [["1"]], None, [10])
    assert only_short == {"0-4k": 100.0, "4-8k": None, "8k+": None}  # empty bucket: missing, not 0


def test_buckets_use_numpy_rounding_and_datasets_python_rounding():
    # 100 * 0.02675 == 2.675: Python's round gives 2.67, numpy's (official scorer_e) 2.68
    assert M.dataset_score([0.02675]) == 2.67
    assert M.bucket_scores([0.02675], [10]) == {"0-4k": 2.68, "4-8k": None, "8k+": None}
