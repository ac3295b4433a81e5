"""ZeroSCROLLS: the unpacked official files (validation split), process_model_input's cut, the metrics/ scorers and
the task scores (ROUGE geometric mean of means)."""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter

import pytest

from eval import TaskConfigError, get_task_class
from eval.zero_scrolls import MAX_NEW_TOKENS, METRIC, ROUGE, SCORERS, TASKS, ZeroScrollsTask, rouge


class CharTokenizer:
    def __call__(self, text, truncation=False):
        return type("Enc", (), {"input_ids": [0] + [ord(c) for c in text]})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


SEP = "... [The rest of the story is omitted]\n\n"


def row(i: str, doc: str, query: str, output: str, pid: str = "") -> dict:
    """A row in the official schema: instruction, document, query and answer prefix in ``input``, with offsets."""
    head = "You are given a story and a question. Answer briefly.\n\nStory:\n"
    text = f"{head}{doc}\n\nQuestion:\n{query}\n\nAnswer:"
    start = len(head)
    q = text.index(f"Question:\n{query}") + len("Question:\n")
    return {"id": i, "pid": pid or f"{i}_0", "input": text, "output": output, "document_start_index": start,
            "document_end_index": start + len(doc), "query_start_index": q, "query_end_index": q + len(query),
            "truncation_seperator": SEP}


OUTPUTS = {"gov_report": "The report finds costs rose.", "summ_screen_fd": "Rory sells things.", "qmsum": "They agreed.",
           "qasper": "English, German", "narrative_qa": "In Paris.", "quality": "(B) He left", "musique": "1919",
           "squality": "A crew lands.", "space_digest": "42.5%", "book_sum_sort": "3, 1, 2"}


def cfg(data_dir=None, **kw) -> dict:
    return {"name": "zero_scrolls", "datasets": None, "n_samples": None, "data_dir": data_dir, "source": "official",
            "hub_dataset": None, "max_length": 100_000, "compress": "prompt", **kw}


@pytest.fixture
def folder(tmp_path):
    for task in TASKS:
        (tmp_path / task).mkdir()
        rows = [row(f"{task}-a", f"The {task} document.", "What happened?", OUTPUTS[task])]
        if task == "squality":  # several references: rows of one id
            rows.append({**rows[0], "pid": f"{task}-a_1", "output": "Astronauts land on a planet."})
        rows.append(row(f"{task}-b", "Another document.", "Why?", OUTPUTS[task]))
        (tmp_path / task / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_every_task_prompts_with_the_input_as_distributed(folder):
    ZeroScrollsTask.validate(cfg(str(folder)))
    samples = list(ZeroScrollsTask(cfg(str(folder)), CharTokenizer()).samples())
    assert [s.id for s in samples] == [f"{t}/{i}" for t in TASKS for i in (0, 1)]
    first = samples[0]
    assert first.prompt.startswith("You are given a story") and first.prompt.endswith("Question:\nWhat happened?\n\nAnswer:")
    assert first.query == "\n\nQuestion:\nWhat happened?\n\nAnswer:" and not first.chat and first.max_new_tokens == 1024
    squality = next(s for s in samples if s.id == "squality/0")
    assert squality.answers == ["A crew lands.", "Astronauts land on a planet."] and squality.meta["id"] == "squality-a"
    for s in samples:
        assert s.prompt.endswith(s.query) and s.max_new_tokens == MAX_NEW_TOKENS[s.dataset]
    assert MAX_NEW_TOKENS["quality"] == 10 and MAX_NEW_TOKENS["space_digest"] == 36


def test_a_long_input_keeps_its_head_the_separator_and_the_query_within_the_room_left_for_generation(folder):
    """api.py: max_length bounds prompt + generation, so the prompt budget is max_length - the task's new tokens."""
    room = MAX_NEW_TOKENS["qasper"]
    (sample, _) = ZeroScrollsTask(cfg(str(folder), datasets=["qasper"], max_length=80 + room), CharTokenizer()).samples()
    r = row("qasper-a", "The qasper document.", "What happened?", "x")
    tail = SEP + r["input"][r["query_start_index"]:]
    keep = 80 - (1 + len(tail))  # the tail's ids count its BOS, as the official tokenizer call does
    assert sample.prompt == r["input"][:keep - 1] + tail and sample.query == tail and sample.meta["truncated"]
    n = 1 + len(r["input"])  # the whole input fits a budget of exactly its length, not one token less
    for max_length, cut in ((n + room, False), (n + room - 1, True)):
        task = ZeroScrollsTask(cfg(str(folder), datasets=["qasper"], max_length=max_length), CharTokenizer())
        (sample, _) = task.samples()
        assert sample.meta["truncated"] == cut and (sample.prompt == r["input"]) != cut
        assert task.tokens_needed(sample) == max_length  # the window check's bound: prompt + generation
    with pytest.raises(TaskConfigError, match=r"^task\.max_length=1000: must exceed gov_report's 1024"):
        list(ZeroScrollsTask(cfg(str(folder), datasets=["gov_report"], max_length=1000), CharTokenizer()).samples())


def test_the_window_check_counts_the_room_left_for_generation(tmp_path):
    """A job whose budget equals the model's window (2048) runs gov_report's 1024 new tokens: each prompt is cut to
    1024 tokens; the same budget + 1 is refused, naming the key (the base bound, budget + new tokens, is unchanged)."""
    from eval.base import Sample, Task
    from kvbench.job.run import load
    from methods.base import ConfigError
    from tests.kvbench.cli_util import check, make_tiny_model_dir, tiny_model_args

    (tmp_path / "data" / "gov_report").mkdir(parents=True)
    rows = [row(f"g{i}", "Costs rose again. " * 200, "Summarize.", "Costs rose.") for i in range(2)]
    (tmp_path / "data" / "gov_report" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [*tiny_model_args(make_tiny_model_dir(tmp_path / "model")), "model.max_input_length=2048", "task=zero_scrolls",
            f"task.data_dir={tmp_path / 'data'}", "task.datasets=[gov_report]", "max_samples=2", "threads=1",
            f"output_root={tmp_path / 'out'}"]
    loaded, task, mine, _, _ = load(check(args))
    assert [s.meta["truncated"] for s in mine] == [True, True]
    for s in mine:
        assert len(loaded.tokenizer(s.prompt).input_ids) <= 2048 - 1024 and s.prompt.endswith("Summarize.\n\nAnswer:")
    with pytest.raises(ConfigError, match=r"^task\.max_length / model\.max_input_length: 2049 tokens"):
        load(check([*args, "task.max_length=2049"]))
    assert Task({}, None, 100).tokens_needed(Sample("a", "d", "p", 7, [])) == 107


def test_a_malformed_row_names_file_line_and_field(folder):
    good = row("q", "doc", "Which?", "(A) yes")
    (folder / "quality" / "validation.jsonl").write_text(json.dumps(good) + "\n" + json.dumps({**good, "output": "yes"}) + "\n")
    with pytest.raises(TaskConfigError, match=r"quality/validation\.jsonl line 2: field 'output' holds no accuracy"):
        ZeroScrollsTask.validate(cfg(str(folder), datasets=["quality"]))
    (folder / "musique" / "validation.jsonl").write_text(json.dumps({**good, "query_start_index": 10**6}) + "\n")
    with pytest.raises(TaskConfigError, match=r"musique/validation\.jsonl line 1: fields 'document_end_index'"):
        ZeroScrollsTask.validate(cfg(str(folder), datasets=["musique"]))
    (folder / "qmsum" / "validation.jsonl").write_text(json.dumps({**good, "output": None}) + "\n")
    with pytest.raises(TaskConfigError, match=r"qmsum/validation\.jsonl line 1: field 'output' must be str"):
        ZeroScrollsTask.validate(cfg(str(folder), datasets=["qmsum"]))
    (folder / "book_sum_sort" / "validation.jsonl").write_text(json.dumps({**good, "output": "1, 3"}) + "\n")
    with pytest.raises(TaskConfigError, match=r"book_sum_sort/validation\.jsonl line 1: field 'output' holds no"):
        ZeroScrollsTask.validate(cfg(str(folder), datasets=["book_sum_sort"]))
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir=.*no gov_report/validation\.jsonl"):
        (folder / "gov_report" / "validation.jsonl").unlink()
        ZeroScrollsTask.validate(cfg(str(folder), datasets=["gov_report"]))


def test_offline_without_a_folder_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir is not set and the Hugging Face Hub is unreachable: "
                                              r"download ZeroSCROLLS's") as e:
        get_task_class("zero_scrolls").validate(cfg())
    assert "\n" not in str(e.value)


def test_kvpress_copy_without_references_is_refused(tmp_path, monkeypatch):
    """A local snapshot of simonjegou/zero_scrolls: one test table, a ``task`` column, empty answers."""
    import pandas as pd

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    base = {"context": "Story:\nctx", "question": "\n\nQuestion:\nWhy?", "answer_prefix": "Answer:", "max_new_tokens": 64}
    pd.DataFrame([{**base, "answer": "Because.", "task": "narrative_qa"}, {**base, "answer": "", "task": "quality"}]
                 ).to_parquet(tmp_path / "hub" / "data" / "test-0.parquet")
    task = ZeroScrollsTask(cfg(source="kvpress", hub_dataset=str(tmp_path / "hub"), datasets=["narrative_qa"]),
                           CharTokenizer())
    (sample,) = task.samples()
    assert sample.prompt == "Story:\nctx\n\nQuestion:\nWhy?Answer:" and sample.query == "\n\nQuestion:\nWhy?Answer:"
    assert not sample.chat and task.score(sample, "because") == 1.0
    task = ZeroScrollsTask(cfg(source="kvpress", hub_dataset=str(tmp_path / "hub"), datasets=["quality"]), CharTokenizer())
    with pytest.raises(TaskConfigError, match=r"quality row 0: no reference .*task\.source=official"):
        list(task.samples())


# ------------------------------------------------------------------ metrics/, transcribed


def o_norm(s):
    from unidecode import unidecode

    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return unidecode(" ".join(s.split()))


def o_f1(prediction, ground_truth):
    p, g = o_norm(prediction).split(), o_norm(ground_truth).split()
    common = Counter(p) & Counter(g)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision, recall = 1.0 * num_same / len(p), 1.0 * num_same / len(g)
    return (2 * precision * recall) / (precision + recall)


def o_find(s):
    m = re.compile(r"\b[A-D]\b").search(s)
    return None if m is None else m.group()


def o_accuracy(prediction, ground_truth):
    return o_find(str(prediction)) == o_find(ground_truth)


def o_to_int(s):
    m = re.compile(r"\d+\.?\d*%").search(s)
    return None if m is None else float(m.group(0).replace("%", ""))


def o_exp(prediction, ground_truth):
    gt, pred = o_to_int(ground_truth), o_to_int(str(prediction))
    if gt is None:
        raise ValueError(f"ground_truth_percentage is None: {gt}")
    return 0.0 if pred is None else 0.5 ** (abs(gt - pred) / 10)


def o_ci_norm(s):
    words = re.sub(r"[^0-9\s,]", "", str(s)).replace(",", " ").strip(string.punctuation).split()
    try:
        return [int("".join(ch for ch in x if ch not in set(string.punctuation)).strip()) for x in words]
    except ValueError:
        return []


def o_lifelines_ci(event_times, predicted_scores):
    """lifelines.utils.concordance_index without censoring: concordant pairs (+0.5 per tied prediction) over pairs
    of distinct event times."""
    num = den = 0.0
    for i in range(len(event_times)):
        for j in range(i + 1, len(event_times)):
            if event_times[i] == event_times[j]:
                continue
            den += 1
            d = (event_times[i] - event_times[j]) * (predicted_scores[i] - predicted_scores[j])
            num += 1.0 if d > 0 else 0.5 if predicted_scores[i] == predicted_scores[j] else 0.0
    return num / den


def o_ci(prediction, ground_truth):
    p, g = o_ci_norm(prediction), o_ci_norm(ground_truth)
    if sorted(g) != sorted(p):
        return 0.0

    def order(ids):
        out = [-1] * len(ids)
        for i, id_ in enumerate(ids, 1):
            out[id_ - 1] = i
        return out

    return o_lifelines_ci(order(g), order(p))


def o_postprocess(text):
    """rouge.py's postprocess_text, "\\n".join(nltk.sent_tokenize(text)), with punkt's cut (after . ! ?, spaces
    dropped) written out: nltk's punkt data is not installed here."""
    return "\n".join(p for p in re.split(r"(?<=[.!?])\s+", text.strip()) if p)


def o_rouge(prediction, references):
    """zero_scrolls.py's rouge: inputs post-processed, rouge.py's compute_rouge (use_stemmer=False), fmeasure × 100,
    max over the references per key (its _compute_helper with agg_fn=max)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL", "rougeLsum"], use_stemmer=False)
    prediction, references = o_postprocess(prediction), [o_postprocess(r) for r in references]
    per_ref = [{k: v.fmeasure * 100 for k, v in scorer.score(r, prediction).items()} for r in references]
    return {k: max(s[k] for s in per_ref) for k in ("rouge1", "rouge2", "rougeL")}


OFFICIAL = {"f1": o_f1, "accuracy": o_accuracy, "exp_similarity": o_exp, "concordance_index": o_ci}
REFERENCES = {"f1": ["English, German", "The café in Zürich"], "accuracy": ["(B) He left", "D"],
              "exp_similarity": ["42.5%", "7%"], "concordance_index": ["3, 1, 2, 4", "1 2"]}
PIECES = ["English", "german", "the", "a", "café", "Cafe", "Zürich", "zurich", ",", ".", " ", "  ", "B", "(B)", "D",
          "AB", "b", "42.5%", "42%", "50%", "7.0%", "%", "3", "1", "2", "4", "3,", "1,", "2.", "x", "in", "\n"]


@pytest.mark.parametrize("metric", list(OFFICIAL))
def test_scorers_equal_the_metrics_files_on_fuzzed_predictions(metric):
    rng = random.Random(metric)
    preds = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8))) for _ in range(1500)]
    preds += ["", "3 1 2 4", "4, 2, 1, 3", "1, 2", "2 1", "B", "42.5%"]
    for _ in range(300):  # orders of summary ids, with other separators and noise
        ids = [str(i) for i in rng.sample([1, 2, 3, 4], rng.choice([2, 4]))] + ["5"] * (rng.random() < 0.1)
        preds.append(rng.choice(["", "Order: ", "x "]) + rng.choice([", ", " ", ",", "\n", " - "]).join(ids)
                     + rng.choice(["", ".", " x"]))
    hits = 0
    for pred in preds:
        for ref in REFERENCES[metric]:
            got = SCORERS[metric](pred, ref)
            assert got == float(OFFICIAL[metric](pred, ref)), (pred, ref)  # bit for bit
            hits += got > 0
    assert hits > 20  # the fuzz reaches non-zero scores


def test_rouge_equals_rouge_py_max_over_references():
    rng = random.Random(3)
    words = ["the", "crew", "lands", "on", "a", "planet", "Astronauts", "landed", ".", "\n", "ship", "Crew!", "now?"]
    refs = ["A crew lands.", "Astronauts land on a planet and the ship waits."]
    for _ in range(300):
        pred = " ".join(rng.choice(words) for _ in range(rng.randint(0, 12)))
        sample = type("S", (), {"dataset": "squality", "answers": refs})
        got = ZeroScrollsTask.scores(sample, pred)
        assert {k: 100 * v for k, v in got.items()} == o_rouge(pred, refs), pred  # bit for bit
    assert rouge("", "A crew.") == {k: 0.0 for k in ROUGE}


def test_metric_of_each_task_and_edge_cases():
    assert METRIC["gov_report"] == "rouge" and METRIC["musique"] == "f1" and METRIC["book_sum_sort"] == "concordance_index"
    assert SCORERS["concordance_index"]("2, 1, 3", "1, 2, 3") == pytest.approx(2 / 3)
    assert SCORERS["concordance_index"]("1, 2", "1, 2, 3") == 0.0  # other ids: 0
    assert SCORERS["exp_similarity"]("about 52.5 %", "42.5%") == 0.0 and SCORERS["exp_similarity"]("52.5%", "42.5%") == 0.5
    assert SCORERS["f1"]("Cafe", "café") == 1.0 and SCORERS["accuracy"]("I think A or B", "(B)") == 0.0
    assert SCORERS["f1"]("Paris", "Paris is in France now") == 0.33333333333333337  # 2PR/(P+R), not 2/6


def test_aggregate_scores_rouge_tasks_by_the_geometric_mean_of_means(folder):
    recs = [{"dataset": "qmsum", "score": 0.1, "scores": {"rouge1": 0.4, "rouge2": 0.1, "rougeL": 0.2}},
            {"dataset": "qmsum", "score": 0.2, "scores": {"rouge1": 0.6, "rouge2": 0.3, "rougeL": 0.4}},
            {"dataset": "quality", "score": 1.0}, {"dataset": "quality", "score": 0.0},
            {"dataset": "quality", "score": None, "error": {"type": "X"}}]
    out = ZeroScrollsTask(cfg(str(folder))).aggregate(recs)
    assert out["averages"]["qmsum rouge1"] == 50.0 and out["averages"]["qmsum rouge2"] == 20.0
    assert out["datasets"]["qmsum"]["score"] == round((50.0 * 20.0 * 30.0) ** (1 / 3), 2) == 31.07
    assert out["datasets"]["quality"] == {"score": 50.0, "n": 2} and out["averages"]["zero_scrolls"] == round((31.07 + 50) / 2, 2)


def test_the_report_prints_the_average_and_rouge_components(tmp_path):
    from test_report import make_job

    from kvbench.report.data import load_results
    from kvbench.report.tables import averages_tables

    job = make_job(tmp_path, task="zero_scrolls", model="llama31", method="snapkv", scores={"qmsum": 31.07})
    summary = json.loads((job / "summary.json").read_text())
    summary["averages"] = {"zero_scrolls": 31.07, "qmsum rouge1": 50.0, "qmsum rouge2": 20.0, "qmsum rougeL": 30.0}
    (job / "summary.json").write_text(json.dumps(summary))
    (table,) = averages_tables(load_results(tmp_path), tmp_path, "zero_scrolls")
    assert table.name == "zero_scrolls_llama31" and list(table.data.columns)[2:] == list(summary["averages"])


def test_the_job_identity_hashes_the_task_files(folder):
    from kvbench.job.config import resolved_inputs

    inputs, _ = resolved_inputs(cfg(str(folder), datasets=["quality", "musique"]))
    assert sorted(inputs["data_files"]) == ["musique/validation.jsonl", "quality/validation.jsonl"]


def test_two_jobs_of_different_methods_or_settings_are_two_rows_apart(tmp_path):
    """kvbench report: a row per job named by its method, and by its method fields where two jobs share a label."""
    from test_report import make_job

    from kvbench.report.data import load_results
    from kvbench.report.tables import averages_tables

    for method, folder_tag, params, score in (("snapkv", "", None, 31.0), ("streamingllm", "", None, 20.0),
                                              ("snapkv", "w8", {"window_size": 8}, 25.0)):
        job = make_job(tmp_path, task="zero_scrolls", model="llama31", method=method, folder_tag=folder_tag,
                       params=params, scores={"quality": score})
        summary = json.loads((job / "summary.json").read_text())
        (job / "summary.json").write_text(json.dumps({**summary, "averages": {"zero_scrolls": score}}))
    (table,) = averages_tables(load_results(tmp_path), tmp_path, "zero_scrolls")
    rows = table.data[["Method", "Variant", "Budget"]].astype(str).agg(" ".join, axis=1)
    assert len(rows) == 3 == rows.nunique() and sorted(table.data["zero_scrolls"]) == [20.0, 25.0, 31.0]
    assert set(table.data["Variant"]) >= {"window_size=8"}


def test_scoring_logs_nothing(caplog):
    import logging

    with caplog.at_level(logging.INFO):
        for _ in range(3):
            rouge("The crew lands.", "A crew lands on a planet.")
    assert not [r for r in caplog.records if "tokenizer" in r.getMessage()]  # absl's "Using default tokenizer."
