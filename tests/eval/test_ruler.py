"""RULER: loader on the shared file, RULER's scorers on hand-made cases, config checks."""

import pytest

from eval.base import TaskConfigError
from eval.ruler import RulerTask, max_new_tokens, string_match_all, string_match_part


def cfg(**kw):
    return {"name": "ruler", "subtasks": ["niah_multikey_3"], "context_lengths": [4096], "n_samples": None,
            "data_dir": None, "hub_dataset": "simonjegou/ruler", **kw}


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
        RulerTask.validate(cfg(**bad))


def test_read_jsonl_names_file_and_line(tmp_path):
    """Every data reader goes through eval.base.read_jsonl: bad bytes, bad JSON, a non-object row name file and line."""
    from eval.base import TaskConfigError, read_jsonl

    path = tmp_path / "d.jsonl"
    for bad, why in ((b'{"a": 1}\n\n{"b": "\xff"}\n', "UTF-8"), (b'{"a": 1}\n\n{"b": \n', "JSON"), (b'{"a": 1}\n\n[1]\n', "object")):
        path.write_bytes(bad)
        with pytest.raises(TaskConfigError, match=rf"d\.jsonl line 3: not (valid )?(a JSON )?{why}"):
            read_jsonl(path)
    path.write_bytes(b'{"a": 1}\n{"a": 2}\n')
    assert read_jsonl(path, limit=1) == [{"a": 1}]
