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


#: NVIDIA/RULER scripts/data/template.py (c3f5e3b), the families kvbench's models fall in
OFFICIAL_TEMPLATES = {
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",
    "base": "{task_template}",
}
LLAMA31 = ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
           "Today Date: 26 Jul 2024\n\n<|eot_id|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
           "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>\n\n")
SMOLLM2 = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
           "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "<|im_start|>assistant\n")


def test_rulers_own_template_of_the_family_by_default_the_tokenizers_as_a_switch(tmp_path):
    from eval.ruler_data import TEMPLATES

    assert {k: TEMPLATES[k] for k in OFFICIAL_TEMPLATES} == OFFICIAL_TEMPLATES and len(TEMPLATES) == 11
    (data_dir, *_) = write_layouts(tmp_path)
    base = {**cfg(data_dir=str(data_dir), subtasks=["niah_single_1"], context_lengths=[128], n_samples=1)}
    del base["chat_template"]  # the default

    def prompt(template, **kw):
        tok = byte_tokenizer()
        tok.chat_template = template
        (sample,) = RulerTask(vars(RulerConfig(**{**base, **kw})), tok).samples()
        assert sample.prompt.endswith(sample.query) and sample.query.startswith(QUESTION)
        return sample.prompt

    text = ROWS[0]["input"]
    llama3 = OFFICIAL_TEMPLATES["meta-llama3"].replace("{task_template}", text) + PREFIX
    assert prompt(LLAMA31) == llama3 and "Cutting Knowledge" not in llama3  # RULER's meta-llama3: no system block
    assert prompt(LLAMA31, chat_template=True).startswith("<|begin_of_text|><|start_header_id|>system")
    assert prompt("[INST] {{ messages[0]['content'] }} [/INST]") == f"[INST] {text} [/INST]{PREFIX}"  # Mistral's family
    assert prompt(SMOLLM2) == prompt(SMOLLM2, chat_template=True)  # no RULER template for ChatML: the tokenizer's own
    assert prompt(SMOLLM2, chat_template="vicuna-chat") == OFFICIAL_TEMPLATES["vicuna-chat"].replace("{task_template}", text) + PREFIX
    assert prompt(LLAMA31, chat_template=False) == text + PREFIX


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
                                      ({"chat_template": "llama3"}, "task.chat_template"),
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
