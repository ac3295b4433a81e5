"""RULER: loader on the shared file and on each layout RULER and kvpress write, the chat template and query,
RULER's scorers on hand-made cases, config checks, one job end to end on a tiny model."""

import json

import pytest

from eval.base import TaskConfigError
from eval.ruler import RulerConfig, RulerTask, max_new_tokens, string_match_all, string_match_part
from tests.kvbench.cli_util import byte_tokenizer, make_tiny_model_dir, read_lines, run_cli, tiny_model_args


def cfg(**kw):
    return {"name": "ruler", "subtasks": ["niah_multikey_3"], "context_lengths": [4096], "n_samples": None,
            "data_dir": None, "hub_dataset": "simonjegou/ruler", "chat_template": True, **kw}


QUESTION = "What is the special magic number for wry-cat mentioned in the provided text?"
PREFIX = " The special magic number for wry-cat mentioned in the provided text is"
#: two rows as RULER's niah.py writes them: the same ``index`` (its answer's character offset), the prefix apart
ROWS = [{"index": 33, "input": f"A special magic number is hidden within the following text. Make sure to memorize it. "
         f"I will quiz you about the number afterwards.\nOne of the special magic numbers for wry-cat is: {v}.\n{QUESTION}",
         "outputs": [v], "length": 80, "answer_prefix": PREFIX} for v in ("1234567", "7654321")]


def write_layouts(root):
    """The two rows in RULER's output folder, as old-style files (prefix inside ``input``), as kvpress's parquet."""
    import pandas as pd

    (root / "ruler" / "128" / "data" / "niah_single_1").mkdir(parents=True)
    (root / "ruler" / "128" / "data" / "niah_single_1" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (root / "old").mkdir()
    (root / "old" / "niah_single_1_128.jsonl").write_text("".join(
        json.dumps({"index": i, "input": r["input"] + PREFIX, "outputs": r["outputs"]}) + "\n" for i, r in enumerate(ROWS)))
    (root / "kvpress" / "128").mkdir(parents=True)
    cut = len(ROWS[0]["input"]) - len(QUESTION)
    pd.DataFrame([{"context": r["input"][:cut], "question": r["input"][cut:], "answer_prefix": PREFIX, "answer": r["outputs"],
                   "task": t, "max_new_tokens": 128} for t in ("vt", "niah_single_1") for r in ROWS]).to_parquet(
        root / "kvpress" / "128" / "test-00000-of-00001.parquet")
    return [root / d for d in ("ruler", "old", "kvpress")]


def test_every_layout_gives_one_sample_per_row_prompt_input_plus_prefix(tmp_path):
    for data_dir in write_layouts(tmp_path):
        task_cfg = cfg(data_dir=str(data_dir), subtasks=["niah_single_1"], context_lengths=[128])
        RulerTask.validate(task_cfg)
        samples = list(RulerTask(task_cfg).samples())
        assert [s.id for s in samples] == ["niah_single_1/128/0", "niah_single_1/128/1"], data_dir
        assert [s.prompt for s in samples] == [r["input"] + r["answer_prefix"] for r in ROWS]  # pred/call_api.py
        assert [s.query for s in samples] == [QUESTION + PREFIX] * 2 and samples[1].answers == ["7654321"]


def test_the_chat_template_wraps_the_input_and_the_answer_prefix_follows_it(tmp_path):
    tok = byte_tokenizer()
    tok.chat_template = "{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    (data_dir, *_) = write_layouts(tmp_path)
    task_cfg = cfg(data_dir=str(data_dir), subtasks=["niah_single_1"], context_lengths=[128], n_samples=1)
    (sample,) = RulerTask(task_cfg, tok).samples()
    assert sample.prompt == f"<s><|user|>{ROWS[0]['input']}<|end|><|assistant|>{PREFIX}" and not sample.chat
    assert sample.query == f"{QUESTION}<|end|><|assistant|>{PREFIX}"
    (sample,) = RulerTask({**task_cfg, "chat_template": False}, tok).samples()
    assert sample.prompt == ROWS[0]["input"] + PREFIX


def test_the_shared_file_loads_as_rulers_samples(shared_data):
    task_cfg = cfg(data_dir=str(shared_data / "ruler"), n_samples=3)
    RulerTask.validate(task_cfg)
    samples = list(RulerTask(task_cfg).samples())
    assert [s.id for s in samples] == ["niah_multikey_3/4096/0", "niah_multikey_3/4096/1", "niah_multikey_3/4096/2"]
    first = samples[0]
    assert first.prompt.startswith("A special magic uuid is hidden within the following text.")
    assert first.prompt.endswith("mentioned in the provided text is")  # RULER's answer prefix, in the file
    assert first.answers == ["1ee34dc4-3b04-4a8b-805b-fdc94e7ed827"] and first.answers[0] in first.prompt
    assert first.max_new_tokens == 128 and not first.chat and first.meta == {"context_length": 4096}
    assert first.query.startswith("What is the special magic uuid for ") and first.prompt.endswith(first.query)
    assert RulerTask(task_cfg).score(first, " 1EE34DC4-3b04-4a8b-805b-fdc94e7ed827.\n") == 1.0


def test_rulers_scorers():
    assert string_match_all("the numbers are 12 and 7", ["12", "7", "99"]) == pytest.approx(2 / 3)
    assert string_match_all("\x00 ABC \x1f", ["abc"]) == 1.0  # control characters become newlines, then stripped
    assert string_match_part("Paris, France", ["paris", "lyon"]) == 1.0
    assert string_match_part("Rome", ["paris", "lyon"]) == 0.0
    assert [max_new_tokens(s) for s in ("niah_single_1", "vt", "cwe", "fwe", "qa_2")] == [128, 30, 120, 50, 32]
    task = RulerTask(cfg())
    records = [{"dataset": "qa_1", "score": 1.0}, {"dataset": "qa_1", "score": 0.0}, {"dataset": "vt", "score": 1.0}]
    agg = task.aggregate(records)
    assert agg["datasets"]["qa_1"]["score"] == 50.0 and agg["averages"]["ruler"] == 75.0


@pytest.mark.parametrize("bad, key", [({"subtasks": ["niah_single_9"]}, "task.subtasks"),
                                      ({"context_lengths": [0]}, "task.context_lengths"),
                                      ({"n_samples": 0}, "task.n_samples"),
                                      ({"data_dir": "/nonexistent"}, "task.data_dir")])
def test_bad_config_names_the_key(bad, key):
    with pytest.raises(TaskConfigError, match=rf"^{key}="):
        RulerTask.validate(vars(RulerConfig(**cfg(**bad))))


def test_read_jsonl_names_file_and_line(tmp_path):
    """Every data reader goes through eval.base.read_jsonl: bad bytes, bad JSON, a non-object row name file and line."""
    from eval.base import TaskConfigError, read_jsonl

    path = tmp_path / "d.jsonl"
    for bad, why in ((b'{"a": 1}\n\n{"b": "\xff"}\n', "UTF-8"), (b'{"a": 1}\n\n{"b": \n', "JSON"), (b'{"a": 1}\n\n[1]\n', "object"),
                     (b'{"a": 1}\n\nnull\n', "object")):
        path.write_bytes(bad)
        with pytest.raises(TaskConfigError, match=rf"d\.jsonl line 3: not (valid )?(a JSON )?{why}"):
            read_jsonl(path)
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n')
    assert read_jsonl(path, limit=1) == [{"a": 1}]


def test_rulers_folder_runs_one_record_per_row_with_the_prefix_in_the_prompt(tmp_path):
    """Acceptance (issue 39, item 3): rows sharing one ``index``, the prefix in its own field, give one record each
    and the same prompt tokens as the same rows with the prefix inside ``input``."""
    model = make_tiny_model_dir(tmp_path / "model")
    ruler, old, _ = write_layouts(tmp_path)
    tokens = []
    for data_dir in (ruler, old):
        out = tmp_path / f"out_{data_dir.name}"
        done = run_cli([*tiny_model_args(model), "task=ruler", f"task.data_dir={data_dir}", "task.subtasks=[niah_single_1]",
                        "task.context_lengths=[128]", f"output_root={out}", "quiet=true", "threads=1"])
        assert done.returncode == 0, done.stderr[-2000:]
        (pred,) = out.rglob("predictions.jsonl")
        records = read_lines(pred)
        assert [r["id"] for r in records] == ["niah_single_1/128/0", "niah_single_1/128/1"]
        tokens.append([r["prompt_tokens"] for r in records])
    assert all(abs(a - b) <= 1 for a, b in zip(*tokens)) and tokens[0][0] > len(PREFIX)
