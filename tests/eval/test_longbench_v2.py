"""LongBench-v2: official data.json read, prompt, truncation, choice extraction and result.py breakdown."""

from __future__ import annotations

import json
import random
import re

import pytest

from eval import TaskConfigError, get_task_class
from eval.longbench_v2 import PROMPTS, LongBenchV2Task, breakdown, extract_answer
from eval.suite import truncate_middle



class CharTokenizer:
    """One token per character after a BOS id 0 (special), like an HF tokenizer's call and decode."""

    def __call__(self, text, truncation=False):
        return type("Enc", (), {"input_ids": [0] + [ord(c) for c in text]})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


def row(i: int, **kw) -> dict:
    r = {"_id": f"id{i}", "domain": "Single-Document QA", "sub_domain": "Academic", "difficulty": "easy",
         "length": "short", "question": f" Which one {i}? ", "choice_A": "alpha", "choice_B": "beta ",
         "choice_C": "gamma", "choice_D": "delta", "answer": "B", "context": f"\n  The text {i}.  \n"}
    return {**r, **kw}


def cfg(data_dir=None, **kw) -> dict:
    return {"name": "longbench_v2", "prompt": "0shot", "n_samples": None, "data_dir": data_dir, "source": "official",
            "hub_dataset": None, "max_length": 10_000, "compress": "prompt", **kw}


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "data.json").write_text(json.dumps([row(0), row(1, difficulty="hard", length="long")], indent=2))
    return tmp_path


def test_the_official_prompt_query_and_sample(folder):
    task = LongBenchV2Task(cfg(str(folder)), CharTokenizer())
    first, second = task.samples()
    assert first.prompt == (
        "Please read the following text and answer the question below.\n\n<text>\nThe text 0.\n</text>\n\n"
        "What is the correct answer to this question: Which one 0?\nChoices:\n(A) alpha\n(B) beta\n(C) gamma\n"
        "(D) delta\n\nFormat your response as follows: \"The correct answer is (insert answer here)\".")
    assert first.query.startswith("\n</text>\n\nWhat is the correct answer") and first.prompt.endswith(first.query)
    assert (first.id, first.answers, first.chat, first.max_new_tokens) == ("longbench_v2/0", ["B"], True, 128)
    assert second.meta["difficulty"] == "hard" and second.meta["length"] == "long"
    assert task.score(first, "  **The correct answer is (B)**") == 1.0 and task.score(first, "(B)") == 0.0


def test_the_template_file_is_the_official_one():
    # prompts/0shot.txt of THUDM/LongBench at 2e00731: no trailing newline, curly-free ASCII
    assert PROMPTS["0shot"].endswith('"The correct answer is (insert answer here)".')
    assert PROMPTS["0shot"].count("\n") == 13 and "$DOC$" not in PROMPTS["0shot_no_context"]


def test_json_lines_and_a_malformed_row_name_file_row_and_field(folder):
    (folder / "data.json").write_text(json.dumps([row(0), {**row(1), "choice_C": 3}]))
    with pytest.raises(TaskConfigError, match=r"data\.json row 2: field 'choice_C' must be str"):
        LongBenchV2Task.validate(cfg(str(folder)))
    (folder / "data.json").write_text(json.dumps(row(0)) + "\n" + json.dumps({k: v for k, v in row(1).items()
                                                                          if k != "answer"}) + "\n")
    with pytest.raises(TaskConfigError, match=r"data\.json line 2: missing field 'answer'"):
        LongBenchV2Task.validate(cfg(str(folder)))
    (folder / "data.json").write_text("".join(json.dumps(row(i)) + "\n" for i in range(3)))
    task = LongBenchV2Task(cfg(str(folder), n_samples=2), CharTokenizer())
    assert [s.id for s in task.samples()] == ["longbench_v2/0", "longbench_v2/1"] and task.cut_datasets == ["longbench_v2"]


@pytest.mark.parametrize("bad, key", [({"prompt": "cot"}, "task.prompt"), ({"source": "web"}, "task.source"),
                                      ({"n_samples": 0}, "task.n_samples"), ({"data_dir": "/nonexistent"}, "task.data_dir")])
def test_bad_keys_are_named(bad, key):
    with pytest.raises(TaskConfigError, match=rf"^{key}="):
        LongBenchV2Task.validate(vars(LongBenchV2Task.Config(**cfg(**bad))))


def test_offline_without_a_folder_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir is not set and the Hugging Face Hub is unreachable: "
                                              r"download LongBench-v2's data\.json") as e:
        get_task_class("longbench_v2").validate(cfg())
    assert "\n" not in str(e.value)


def official_truncate(ids: list[int], max_len: int) -> list[int]:
    """pred.py's query_llm cut (transcribed)."""
    if len(ids) > max_len:
        ids = ids[:max_len // 2] + ids[-max_len // 2:]
    return ids


@pytest.mark.parametrize("max_len", [7, 8, 9])
def test_truncation_as_pred_py(max_len):
    tok, text = CharTokenizer(), "abcdefghijklmnopqrstuvwxyz"
    want = tok.decode(official_truncate(tok(text).input_ids, max_len), skip_special_tokens=True)
    assert truncate_middle(text, tok, max_len, ceil_tail=True) == (want, 27)
    assert truncate_middle(text, tok, 9)[0] == "abcwxyz"  # InfiniteBench: 4 ids each side, the BOS skipped


def official_extract(response: str):
    """pred.py's extract_answer (transcribed)."""
    response = response.replace("*", "")
    m = re.search(r"The correct answer is \(([A-D])\)", response)
    if m:
        return m.group(1)
    m = re.search(r"The correct answer is ([A-D])", response)
    return m.group(1) if m else None


def test_choice_extraction_equals_pred_py_on_fuzzed_responses():
    rng = random.Random(0)
    parts = ["The correct answer is ", "(", ")", "A", "B", "C", "D", "E", "*", "**", " ", "\n", "the correct answer is ",
             "The correct answer is: ", "x"]
    cases = ["".join(rng.choice(parts) for _ in range(rng.randint(0, 8))) for _ in range(3000)]
    cases += ["The correct answer is (E) then The correct answer is A", "The *correct* answer is (C)", ""]
    for text in cases:
        assert extract_answer(text) == official_extract(text), text


def official_result(preds: list[dict]) -> list[float]:
    """result.py's row for one file (transcribed; compensated=False)."""
    acc = {k: [0, 0] for k in ("easy", "hard", "short", "medium", "long")}
    for p in preds:
        a = int(p["judge"])
        acc["easy" if p["difficulty"] == "easy" else "hard"][0] += a
        acc["easy" if p["difficulty"] == "easy" else "hard"][1] += 1
        key = p["length"] if p["length"] in ("short", "medium") else "long"
        acc[key][0] += a
        acc[key][1] += 1
    total = acc["easy"][0] + acc["hard"][0]
    return [round(100 * total / len(preds), 1)] + [round(100 * a / n, 1) for a, n in acc.values()]


def test_breakdown_equals_result_py():
    rng = random.Random(1)
    preds = [{"judge": rng.random() < 0.4, "difficulty": rng.choice(["easy", "hard"]),
              "length": rng.choice(["short", "medium", "long"])} for _ in range(97)]
    records = [{"score": float(p["judge"]), "meta": {"difficulty": p["difficulty"], "length": p["length"]}} for p in preds]
    records.append({"score": None, "error": {"type": "X"}, "meta": {"difficulty": "easy", "length": "short"}})
    assert list(breakdown(records).values()) == official_result(preds)
    assert breakdown([{"score": 1.0, "meta": {"difficulty": "easy", "length": "short"}}])["medium"] is None


def test_an_empty_output_is_left_out_as_pred_py_skips_it_and_scored_0_on_kvpresss_copy():
    """pred.py: ``if output == '': continue`` (never written, so result.py never counts it); kvpress: score 0."""
    meta = {"difficulty": "easy", "length": "short"}
    records = [{"dataset": "longbench_v2", "prediction": p, "score": s, "error": None, "meta": meta}
               for p, s in (("The correct answer is (A)", 1.0), ("", 0.0), ("I think B", 0.0), (" ", 0.0))]
    official = LongBenchV2Task(cfg()).aggregate(records)
    assert official["datasets"]["longbench_v2"] == {"score": round(100 / 3, 2), "n": 3} and official["empty_outputs"] == 1
    assert official["averages"]["overall"] == round(100 / 3, 1)  # a blank " " is an output, scored as pred.py does
    kvpress = LongBenchV2Task(cfg(source="kvpress")).aggregate(records)
    assert kvpress["datasets"]["longbench_v2"] == {"score": 25.0, "n": 4} and kvpress["averages"]["overall"] == 25.0


def test_kvpress_copy_uses_its_prompt_parts(tmp_path, monkeypatch):
    """A local snapshot of kvpress's Hub copy (config 0shot, split test, kvpress's columns)."""
    import pandas as pd

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "hub" / "0shot").mkdir(parents=True)
    (tmp_path / "hub" / "README.md").write_text(
        "---\nconfigs:\n- config_name: 0shot\n  data_files:\n  - split: test\n    path: 0shot/*.parquet\n---\n")
    kv = {"context": "Read.\n<text>\nctx\n</text>\n\n", "question": "What is the correct answer? (A) a",
          "answer_prefix": "", "max_new_tokens": 16}
    pd.DataFrame([{**row(0), **kv}, {**row(1), **kv, "answer": "D"}]).to_parquet(tmp_path / "hub" / "0shot" / "t.parquet")
    task_cfg = cfg(source="kvpress", hub_dataset=str(tmp_path / "hub"), n_samples=1)
    LongBenchV2Task.validate(task_cfg)
    (sample,) = LongBenchV2Task(task_cfg, CharTokenizer()).samples()
    assert sample.prompt == kv["context"] + kv["question"] and sample.query == kv["question"]
    assert (sample.answers, sample.max_new_tokens, sample.meta["difficulty"]) == (["B"], 16, "easy")


def test_the_report_prints_result_py_columns_per_job(tmp_path):
    from test_report import make_job

    from kvbench.report.data import load_results
    from kvbench.report.tables import averages_tables

    for method, budget, overall in (("full", 1.0, 40.0), ("snapkv", 0.25, 30.5)):
        job = make_job(tmp_path, task="longbench_v2", model="llama31", method=method, budget=budget,
                       scores={"longbench_v2": overall})
        summary = json.loads((job / "summary.json").read_text())
        summary["averages"] = {"overall": overall, "easy": 50.0, "hard": 20.1, "short": None, "medium": 10.0, "long": 0.0}
        (job / "summary.json").write_text(json.dumps(summary))
    (table,) = averages_tables(load_results(tmp_path), tmp_path, "longbench_v2")
    assert table.name == "longbench_v2_llama31" and list(table.data["overall"]) == [40.0, 30.5]
    assert list(table.data["Budget"].fillna("–")) == ["–", "25%"] and table.data["short"].isna().all()  # pandas 3: NaN
    assert table.headers["overall"] == "Overall" and len(table.sources) == 2
