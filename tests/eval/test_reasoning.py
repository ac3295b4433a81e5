"""Math reasoning tasks: data in each official schema, R-KV's prompts and limits, the last box, math-verify
equivalence, kvpress's string rule (against an independent transcription of its calculate_metrics), pass@k."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from eval import TaskConfigError, get_task_class
from eval.reasoning import PROMPTS, equivalent, kvpress_answer, last_boxed, rkv_answer, rkv_equal, rkv_normal
from eval.sampling import pass_at_k, summary

DATA = Path(__file__).resolve().parents[1] / "data"


def cfg(name: str, **kw) -> dict:
    return {"name": name, "compress": "prompt", "datasets": None, "n_samples": None, "data_dir": str(DATA / name),
            "source": "official", "hub_dataset": None, "max_length": None, "prompt": "r1", "scorer": "math_verify",
            "max_new_tokens": None, **kw}


def task(name: str, **kw):
    return get_task_class(name)(cfg(name, **kw), max_input_tokens=1000)


# --------------------------------------------------------------------------- answer extraction


@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),                       # nested braces
    ("\\boxed{\\left\\{ 1, 2 \\right\\}}", "\\left\\{ 1, 2 \\right\\}"),  # escaped braces balance too
    ("first \\boxed{1}, then \\boxed{2}", "2"),                      # several boxes: the last
    ("\\boxed{3} and \\fbox{x^{2}}", "x^{2}"),
    ("\\boxed {7}", "7"),
    ("so \\boxed 5.", "5"), ("\\boxed{1} then \\boxed 12 $", "12"),  # no braces: the word after it
    ("\\boxed{\\text{(B)}}", "\\text{(B)}"),
    ("no box: 5", None),
    ("cut short \\boxed{\\frac{1}{", None),                           # not closed
    ("boxed{9} without a backslash", None),
])
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer


@pytest.mark.parametrize("answer, reference, same", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True), ("\\frac12", "\\frac{1}{2}", True), ("0.5", "\\frac{1}{2}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("\\text{Evelyn}", "\\text{Evelyn}", True), ("Evelyn", "\\text{Evelyn}", True),
    ("10\\text{ cm}", "10", True), ("90^\\circ", "90", True), ("\\$18.90", "18.90", True),   # units dropped
    ("(-\\infty, 3]", "(-\\infty,3]", True), ("(2,5)", "[2,5)", False), ("[1,2)", "(1,2)", False),  # intervals
    ("C", "\\text{(C)}", True), ("1,000", "1000", True), ("x+1", "1+x", True),
    ("3", "4", False), ("\\frac{1}{3}", "0.33", False), ("", "0", False),
    ("50\\%", "50", True), ("50%", "0.5", False),  # MATH writes a percentage without its sign
])
def test_equivalent(answer, reference, same):
    assert equivalent(answer, reference) is same


def test_score_reads_the_last_box_and_records_whether_one_was_found():
    t = task("math500")
    s = next(iter(t.samples()))  # answer "6"
    assert t.score(s, "try \\boxed{5}... no: \\boxed{\\dfrac{12}{2}}") == 1.0
    assert t.score(s, "\\boxed{6} wait, \\boxed{7}") == 0.0
    assert t.extra_scores(s, "it is 6") == {"answer": None, "found": False}
    assert t.extra_scores(s, "\\boxed{6}") == {"answer": "6", "found": True}


# --------------------------------------------------------------------------- R-KV's rule (task.scorer=rkv)


@pytest.mark.parametrize("prediction, reference, right", [
    ("\\boxed 5", "5", True), ("\\boxed{50\\%}", "50", True), ("\\boxed{x = 3}", "3", True),
    ("\\boxed{10 \\text{ inches}}", "10", True), ("\\boxed{\\text{(C)}}", "\\text{(C)}", True),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", True), ("\\boxed{3/4}", "\\frac34", True),
    ("\\boxed{five}", "5", True), ("\\boxed{90^\\circ}", "90", True),
    # where R-KV's evaluator and math-verify part: a hundredth or hundredfold counts (percentages), intervals are
    # compared element-wise, an unclosed box is read to the end, no box falls back to "the answer is" / the last number
    ("\\boxed{0.5}", "50", True), ("\\boxed{5000}", "50", True), ("\\boxed{(2,5)}", "[2,5)", True),
    ("\\boxed{\\frac{1}{2", "\\frac{1}{2}", True), ("The answer is 1,000.", "1000", True), ("so it is 7", "7", True),
    ("\\boxed{\\frac{1}{3}}", "0.33", False), ("\\boxed{a}", "b", False), ("\\boxed{2}", "\\text{two}", False),
    ("no number at all", "7", False),
])
def test_rkv_scorer_follows_rkv_eval_math(prediction, reference, right):
    assert rkv_equal(rkv_answer(prediction), rkv_normal(reference)) is right
    t = task("math500", scorer="rkv")
    sample = next(iter(t.samples()))
    sample.answers = [reference]
    assert t.score(sample, prediction) == float(right)
    assert t.extra_scores(sample, prediction)["found"] == ("boxed" in prediction)


def test_max_total_tokens_counts_the_prompt_as_run_math_max_length():
    t = get_task_class("math500")(cfg("math500", max_total_tokens=8192), max_input_tokens=1000,
                                  encode=lambda s: list(range(100)))
    assert next(iter(t.samples())).max_new_tokens == 8192 - 100
    with pytest.raises(TaskConfigError, match="task.max_total_tokens=100"):
        next(iter(get_task_class("math500")(cfg("math500", max_total_tokens=100), max_input_tokens=1000,
                                             encode=lambda s: list(range(100))).samples()))


# --------------------------------------------------------------------------- kvpress's rule


def kvpress_metrics(predicted: list[str], answers: list, last: bool) -> dict:
    """kvpress evaluation/benchmarks/{aime25 (last=True), math500}/calculate_metrics.py, transcribed independently:
    extract_boxed = str(pred.split("boxed{")[-1 or 1].split("}")[0]), None on IndexError; score_aime compares it
    with str(true_answer); answered counts "boxed{" in pred."""
    correct = answered = 0
    for pred, true in zip(predicted, answers):
        parts = pred.split("boxed{")
        got = (parts[-1] if last else parts[1] if len(parts) > 1 else None)
        got = None if got is None else str(got.split("}")[0])
        correct += got == str(true)
        answered += "boxed{" in pred
    return {"correct": correct, "answered": answered, "accuracy": correct / len(predicted), "total": len(predicted)}


@pytest.mark.parametrize("name", ["aime25", "math500"])
def test_kvpress_scorer_equals_kvpress_calculate_metrics_on_fuzzed_predictions(name):
    rng = random.Random(0)
    atoms = ["boxed{", "\\boxed{", "}", "{", "\\frac", "1", "2", "12", " ", "\n", "x", "</think>", "\\dfrac"]
    t = task(name, scorer="kvpress")
    samples = list(t.samples())
    preds, answers, scores, found = [], [], [], 0
    for i in range(400):
        pred = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        sample = samples[i % len(samples)]
        sample.answers = [rng.choice(["1", "12", "\\frac{1", "2", "x"])]
        preds.append(pred), answers.append(sample.answers[0])
        scores.append(t.score(sample, pred))
        found += t.extra_scores(sample, pred)["found"]
    ref = kvpress_metrics(preds, answers, last=name == "aime25")
    assert 0 < ref["correct"] < len(preds)  # the fuzz hits both outcomes
    assert (sum(scores), found, sum(scores) / len(preds)) == (ref["correct"], ref["answered"], ref["accuracy"])


def test_kvpress_quirks():
    assert kvpress_answer("\\boxed{\\frac{1}{2}}", -1) == "\\frac{1"           # up to the first }
    assert kvpress_answer("\\boxed{1} \\boxed{2}", 1) == "1"                   # math500: the first box
    assert kvpress_answer("\\boxed{1} \\boxed{2}", -1) == "2"                  # aime25: the last
    assert kvpress_answer("the answer is 70", -1) == "the answer is 70"        # no box: the text up to a }
    assert kvpress_answer("the answer is 70", 1) is None


# --------------------------------------------------------------------------- data, prompts, limits


def test_official_files_prompts_and_limits():
    aime24 = list(task("aime24").samples())
    assert [s.answers for s in aime24] == [["24"], ["1001"]]                  # the 2023 row is left out
    assert aime24[0].max_new_tokens == 32768 and aime24[0].meta["id"] == 0
    assert [s.answers for s in task("aime25").samples()] == [["81"], ["144"]]  # AIME 2025 I then II
    assert [s.answers for s in task("gsm8k").samples()] == [["7"], ["2000"]]   # after ####, commas dropped
    math = list(task("math500").samples())
    assert math[0].prompt == "What is $1+2+3$?\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert math[0].chat and math[0].max_new_tokens == 16384 and math[0].id == "math500/0"
    rkv = next(iter(task("math500", prompt="rkv", max_new_tokens=99).samples()))
    assert rkv.prompt == PROMPTS["rkv"].replace("{problem}", "What is $1+2+3$?") and rkv.max_new_tokens == 99
    assert rkv.prompt.endswith("Final answer:  \\boxed{}") and "\n\n You need" in rkv.prompt
    assert task("gsm8k").samples().__next__().max_new_tokens == 8192
    t = task("math500", n_samples=2)
    assert len(list(t.samples())) == 2 and t.cut_datasets == ["math500"]


def test_kvpress_copy_from_a_local_snapshot(tmp_path):
    rows = [{"context": "", "question": "What is 1+1? Put it in \\boxed{}.", "answer_prefix": "", "answer": 2,
             "max_new_tokens": 321}, {"context": "Ctx. ", "question": "Q2", "answer_prefix": "", "answer": "x",
                                      "max_new_tokens": 5}]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = task("math500", source="kvpress", hub_dataset=str(tmp_path), data_dir=None, scorer="kvpress")
    t.validate(t.cfg)
    s = list(t.samples())
    assert [(x.prompt, x.query, x.answers, x.max_new_tokens) for x in s] == [
        ("What is 1+1? Put it in \\boxed{}.", "What is 1+1? Put it in \\boxed{}.", ["2"], 321),
        ("Ctx. Q2", "Q2", ["x"], 5)]
    assert t.score(s[0], "\\boxed{2} or \\boxed{3}") == 1.0  # kvpress's math500: the first box


def test_bad_inputs_are_one_line_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cls = get_task_class("aime25")
    with pytest.raises(TaskConfigError, match=r"task.data_dir.*opencompass"):
        cls.validate(cfg("aime25", data_dir=None))                          # offline without a folder
    with pytest.raises(TaskConfigError, match=r"task.data_dir=.*no aime2025-II.jsonl"):
        (tmp_path / "aime2025-I.jsonl").write_text('{"question": "q", "answer": "1"}\n')
        cls.validate(cfg("aime25", data_dir=str(tmp_path)))
    with pytest.raises(TaskConfigError, match=r"line 1: missing field 'problem'"):
        (tmp_path / "test.jsonl").write_text('{"question": "q", "answer": "1"}\n')
        get_task_class("math500").validate(cfg("math500", data_dir=str(tmp_path)))
    with pytest.raises(TaskConfigError, match=r"task.source=kvpress"):
        get_task_class("aime24").validate(cfg("aime24", source="kvpress"))
    for key, value in (("scorer", "exact"), ("prompt", "cot"), ("max_new_tokens", 0)):
        with pytest.raises(TaskConfigError, match=f"task.{key}="):
            get_task_class("gsm8k").Config(**{key: value})


# --------------------------------------------------------------------------- pass@k and sampled summaries


@pytest.mark.parametrize("n, c, k, value", [
    (4, 1, 1, 1 / 4), (4, 1, 2, 1 - 3 / 6), (4, 2, 2, 1 - 1 / 6), (4, 0, 4, 0.0), (4, 3, 2, 1.0),
    (5, 2, 3, 1 - 1 / 10), (64, 1, 64, 1.0), (64, 1, 32, 0.5),
])
def test_pass_at_k_by_hand(n, c, k, value):
    assert pass_at_k(n, c, k) == pytest.approx(value, abs=1e-15)


def test_sampled_summary_and_aggregate():
    def rec(p, k, s, found=True, tokens=100):
        return {"id": f"math500/{p}#{k}", "problem": f"math500/{p}", "candidate": k, "dataset": "math500",
                "score": s, "scores": {"found": found}, "generated_tokens": tokens, "error": None}
    # problem 0: 3 of 4 correct; problem 1: 1 of 4; problem 2: 0 of 4 (one failed candidate is left out)
    records = [rec(0, k, float(k < 3)) for k in range(4)] + [rec(1, k, float(k == 0), found=k < 2) for k in range(4)]
    records += [rec(2, k, 0.0, tokens=400) for k in range(4)] + [{**rec(2, 4, None), "error": {"type": "X"}}]
    out = summary(records)["math500"]
    means = [0.75, 0.25, 0.0]
    se = (sum((m - 1 / 3) ** 2 for m in means) / 2) ** 0.5 / 3 ** 0.5
    assert out["pass@1"] == round(100 / 3, 2) and out["pass@1_se"] == round(100 * se, 2)
    assert out["pass@k"] == {"1": round(100 / 3, 2), "2": round(100 * (1 + 0.5 + 0) / 3, 2),
                             "4": round(100 * 2 / 3, 2)}  # pass@2: 1 - C(1,2)/C(4,2) = 1, 1 - C(3,2)/6 = 0.5
    assert out["answered"] == round(100 * 10 / 12, 2) and out["generated_tokens"] == 200.0
    assert (out["problems"], out["candidates"]) == (3, 12)
    agg = task("math500").aggregate(records)
    assert agg["datasets"] == {"math500": {"score": round(100 / 3, 2), "n": 3}}  # a problem is one sample
    assert agg["pass_at_k"]["math500"] == out
    partial = summary([{**r, "score": 0.5} if r["id"] == "math500/0#0" else r for r in records])["math500"]
    assert partial["pass@k"] == {} and partial["pass@1"] < out["pass@1"]  # a score of 0.5 is no right answer


def test_official_hub_dataset_from_a_local_snapshot(tmp_path):
    """Without task.data_dir the official Hub dataset is read with datasets.load_dataset (AI-MO's split train: its
    2024 rows kept by url); task.hub_dataset may name a local snapshot."""
    rows = [{"id": i, "problem": f"P{i}", "solution": "", "answer": str(i),
             "url": f"https://artofproblemsolving.com/wiki/index.php/{year}_AIME_I_Problems/Problem_{i}"}
            for i, year in enumerate([2022, 2024, 2023, 2024])]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = task("aime24", data_dir=None, hub_dataset=str(tmp_path))
    t.validate(t.cfg)
    assert [(s.id, s.answers, s.meta["id"]) for s in t.samples()] == [("aime24/0", ["1"], 1), ("aime24/1", ["3"], 3)]
