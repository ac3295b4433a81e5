"""InfiniteBench: official files read, create_prompt's prompts, get_answer's labels, compute_scores.py's scorers."""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter

import pytest

from eval import TaskConfigError
from eval.infinitebench import MAX_NEW_TOKENS, PROMPTS, SCORERS, TASKS, InfiniteBenchTask


class CharTokenizer:
    def __call__(self, text, truncation=False):
        return type("Enc", (), {"input_ids": [0] + [ord(c) for c in text]})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


ROWS = {  # one hand-written row per task in the official schema (id, context, input, answer, options)
    "passkey": {"context": "Noise. The pass key is 71432. Noise.", "input": "What is the pass key?", "answer": ["71432"]},
    "number_string": {"context": "The sequence of digits is 2200012222.", "input": "What is the sequence number?",
                      "answer": ["2200012222"]},
    "kv_retrieval": {"context": 'JSON data: {"k1": "v1", "k2": "v2"}', "answer": "v2",
                     "input": 'Key: "k2"\nThe value associated with the specified key is: '},
    "longdialogue_qa_eng": {"context": "ACE: Hi.\n$$MASK$$: Hello.", "input": "", "answer": ["ACE", "ACE ROTHSTEIN"]},
    "longbook_sum_eng": {"context": "A long book.", "input": "", "answer": ["A summary."]},
    "longbook_choice_eng": {"context": "Alain walked Georgie.", "input": "Which is one of Alain's chores?",
                            "answer": ["Walking Georgie"], "options": ["Cooking", "Walking Georgie", "Sailing", "Diving"]},
    "longbook_qa_eng": {"context": "Book.", "input": "Who died?", "answer": ["fighting in world war 1"]},
    "longbook_qa_chn": {"context": "书。", "input": "谁？", "answer": ["田归农"]},
    "math_find": {"context": "[3, 9, 1]", "answer": 9, "input": "What is the largest number in the list? You should "
                  "answer with only one number, no other words. The largest number of the list is: "},
    "math_calc": {"context": "1 + 2 - 4", "input": "", "answer": [[1, 3, -1]]},
    "code_run": {"context": "def func_1(x):\n    return x + 1", "input": "Compute func_1(-3).", "answer": -2},
    "code_debug": {"context": "def a(): pass", "input": "", "answer": "b_fn", "options": ["a_fn", "b_fn", "c_fn", "d_fn"]},
}


def cfg(data_dir=None, **kw) -> dict:
    return {"name": "infinitebench", "datasets": None, "n_samples": None, "data_dir": data_dir, "source": "official",
            "hub_dataset": None, "max_length": 100_000, "compress": "prompt", **kw}


@pytest.fixture
def folder(tmp_path):
    for task, r in ROWS.items():
        (tmp_path / f"{task}.jsonl").write_text(json.dumps({"id": 0, "options": [], **r}, ensure_ascii=False) + "\n")
    return tmp_path


def test_every_task_builds_the_official_prompt_and_label(folder):
    InfiniteBenchTask.validate(cfg(str(folder)))
    samples = {s.dataset: s for s in InfiniteBenchTask(cfg(str(folder)), CharTokenizer()).samples()}
    assert list(samples) == list(TASKS)
    assert samples["passkey"].prompt == (
        "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. I will quiz you "
        "about the important information.\n\nNoise. The pass key is 71432. Noise.\n\nWhat is the pass key?\n\n"
        "The pass key is")
    assert samples["passkey"].query == "\n\nWhat is the pass key?\n\nThe pass key is"
    assert samples["code_run"].prompt.startswith("There is a function called func_1 in the following Python code.")
    assert samples["code_run"].prompt.endswith("Please compute the exact value of func_1(-3). The value of func_1(-3) is")
    assert samples["math_find"].prompt.startswith("What is the largest number in the following list?\n\n[3, 9, 1]")
    assert samples["longbook_choice_eng"].meta["label"] == ["Walking Georgie", "B"]
    assert samples["code_debug"].meta["label"] == ["b_fn", "B"] and "\nB. b_fn\n" in samples["code_debug"].prompt
    for task, s in samples.items():
        assert s.prompt.endswith(s.query) and s.query and not s.chat and s.max_new_tokens == MAX_NEW_TOKENS[task]
    assert MAX_NEW_TOKENS["passkey"] == 6 and MAX_NEW_TOKENS["math_calc"] == 30000
    assert PROMPTS["longbook_qa_eng"].endswith("\n\nQuestion: {question}\nAnswer:")


def test_a_malformed_row_names_file_line_and_field(folder):
    (folder / "passkey.jsonl").write_text(json.dumps(ROWS["passkey"]) + "\n" + json.dumps({"context": "c", "answer": []}) + "\n")
    with pytest.raises(TaskConfigError, match=r"passkey\.jsonl line 2: missing field 'input'"):
        InfiniteBenchTask.validate(cfg(str(folder), datasets=["passkey"]))
    (folder / "code_debug.jsonl").write_text(json.dumps({**ROWS["code_debug"], "answer": "z_fn"}) + "\n")
    with pytest.raises(TaskConfigError, match=r"code_debug\.jsonl line 1: field 'answer' is not one of 'options'"):
        InfiniteBenchTask.validate(cfg(str(folder), datasets=["code_debug"]))
    with pytest.raises(TaskConfigError, match=r"^task\.datasets="):
        InfiniteBenchTask.validate(cfg(str(folder), datasets=["longbook_sum"]))
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir=.*no math_find\.jsonl"):
        (folder / "math_find.jsonl").unlink()
        InfiniteBenchTask.validate(cfg(str(folder), datasets=["math_find"]))


def test_numbers_cast_to_strings_on_the_hub_are_numbers_again(folder):
    (folder / "code_run.jsonl").write_text(json.dumps({**ROWS["code_run"], "answer": ["-2"]}) + "\n")
    (sample,) = InfiniteBenchTask(cfg(str(folder), datasets=["code_run"]), CharTokenizer()).samples()
    assert sample.meta["label"] == [-2] and InfiniteBenchTask(cfg()).score(sample, "The value is -2.") == 1.0


def test_kvpress_copy_uses_its_prompt_parts_and_letters(tmp_path, monkeypatch):
    """A local snapshot of MaxJeblick/InfiniteBench: a config per task, answers as strings, letters for choices."""
    import pandas as pd

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hub = tmp_path / "hub"
    configs = ""
    for task, answer in (("longbook_choice_eng", ["B"]), ("code_run", ["-2"])):
        (hub / task).mkdir(parents=True)
        configs += f"- config_name: {task}\n  data_files:\n  - split: test\n    path: {task}/*.parquet\n"
        pd.DataFrame([{"context": "Read the book.\n\nctx\n\n", "question": "Q?", "answer_prefix": "The answer is",
                       "answer": answer, "task": task, "max_new_tokens": 60}]).to_parquet(hub / task / "t.parquet")
    (hub / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    task_cfg = cfg(source="kvpress", hub_dataset=str(hub), datasets=["longbook_choice_eng", "code_run"])
    InfiniteBenchTask.validate(task_cfg)
    task = InfiniteBenchTask(task_cfg, CharTokenizer())
    choice, run = task.samples()
    assert choice.prompt == "Read the book.\n\nctx\n\nQ?The answer is" and choice.query == "Q?The answer is"
    assert choice.meta["label"] == ["B", "B"] and not choice.chat and choice.max_new_tokens == 60
    assert task.score(choice, " B. Walking") == 1.0 and run.meta["label"] == [-2] and task.score(run, "-2") == 1.0


# ------------------------------------------------------------------ compute_scores.py, transcribed


def o_norm(s):
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def o_norm_zh(s):
    cn = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
    return "".join("".join(ch for ch in s.lower() if ch not in set(string.punctuation + cn)).split())


def o_f1(p, g):
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0
    pr, rc = same / len(p), same / len(g)
    return 2 * pr * rc / (pr + rc)


def o_first_int(pred):
    for item in re.split("[^0-9]", pred):
        if item != "":
            return item
    return ""


def o_kv(pred, label):
    for c in ['\n', ':', '"', "'", '.', ',', '?', '!', '{', '}']:
        pred = pred.replace(c, ' ')
    return label in pred.split()


def o_passkey(pred, label):
    return (label[0] if isinstance(label, list) else label) == o_first_int(pred)


def o_code_run(pred, label):
    label = label[0] if isinstance(label, list) else label
    pred = pred.strip()
    for c in ["\n", ".", "`", "'", '"', ":"]:
        pred = pred.replace(c, " ")
    words = pred.split()
    if not words:
        return False
    try:
        return label == int(words[-1])
    except Exception:
        return False


def o_code_debug(pred, label):
    pred = pred.strip()
    label_c, fn_name = label[1], label[0]
    if pred[:2] in [f"{label_c}.", f"{label_c}:"]:
        return True
    pred = pred.strip()
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "is:", "answer:", "correct option is:"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        pred = pred[idx + len(prefix) + 1:]
        for s in [label_c, fn_name]:
            if pred.startswith(s):
                return True
        return False
    return False


def o_math_find(pred, label):
    label = label[0] if isinstance(label, list) else label
    m = re.search(r"\d+\.\d+|\d+", pred)
    if m is None:
        return False
    try:
        return (int if isinstance(label, int) else float)(m.group(0).strip()) == label
    except ValueError:  # kvbench scores 0 where the official script stops with this error
        return False


def o_dialogue(pred, label):
    label = label[0]
    pred = pred.strip()
    for c in ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    return label in [x.upper() for x in pred.split()]


def o_choice(pred, label):
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return False
        after = pred[idx + len(prefix) + 1:]
        for s in label:
            if after.startswith(s):
                return True
        return False
    for word in pred.split():
        if word in "ABCD":
            return word in label
    return False


def o_qa(pred, labels):
    return max(o_f1(o_norm(pred).split(), o_norm(g).split()) for g in labels)


def o_qa_zh(pred, labels):
    return max(o_f1(list(o_norm_zh(pred)), list(o_norm_zh(g))) for g in labels)


def o_math_calc(pred, label):
    if isinstance(label[0], list):
        label = label[0]
    nums = [int(x) for x in re.split("[^0-9]", pred) if x != ""]
    cnt = 0
    for i in range(len(label)):
        if i >= len(nums):
            break
        if label[i] == nums[i]:
            cnt += 1
        else:
            break
    return cnt / len(label)


OFFICIAL = {"passkey": o_passkey, "number_string": o_passkey, "kv_retrieval": o_kv, "code_run": o_code_run,
            "code_debug": o_code_debug, "math_find": o_math_find, "longdialogue_qa_eng": o_dialogue,
            "longbook_choice_eng": o_choice, "longbook_qa_eng": o_qa, "longbook_qa_chn": o_qa_zh, "math_calc": o_math_calc}
LABELS = {"passkey": ["71432"], "number_string": ["2200012222"], "kv_retrieval": "c14cb8ba", "code_run": -2,
          "code_debug": ["b_fn", "B"], "math_find": 9, "longdialogue_qa_eng": ["ACE", "ACE ROTHSTEIN"],
          "longbook_choice_eng": ["Walking Georgie", "B"], "longbook_qa_eng": ["fighting in world war 1", "The War"],
          "longbook_qa_chn": ["田归农，商老太"], "math_calc": [[1, 3, 2, 5]]}
PIECES = ["71432", "2200012222", "c14cb8ba", "-2", "2", "9", "9.0", "b_fn", "B", "A", "C", "D", "AB", "B.", "B:", "ACE",
          "ace", "Walking Georgie", "fighting", "war", "The", "1", "3", "5", "田归农", "，", "商", " ", "  ", "\n", ".", ":",
          "'", '"', "`", "-", "*", "Option", "answer is:", "answer:", "answer is", "option is", "is:",
          "correct option is:", "{", "}", "?", "!", "x"]


@pytest.mark.parametrize("task", list(OFFICIAL))
def test_scorers_equal_compute_scores_on_fuzzed_predictions(task):
    rng = random.Random(task)
    preds = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 10))) for _ in range(1500)]
    preds += ["", " ", "B", "B. b_fn", "answer is:", "The answer is: B", "answer is", "[1, 3, 2, 5]"]
    for pred in preds:
        assert SCORERS[task](pred, LABELS[task]) == pytest.approx(float(OFFICIAL[task](pred, LABELS[task]))), pred


def test_scorer_edge_cases():
    assert SCORERS["kv_retrieval"]("value: c14cb8ba.", ["c14cb8ba"]) == 1.0  # a one-item list label is unwrapped
    assert SCORERS["math_calc"]("[1, 3, 2, 6]", [[1, 3, 2, 5]]) == 0.75
    assert SCORERS["math_calc"]("[1, -3]", [[1, -3]]) == 0.5  # the minus sign is not read, as in the official code
    assert SCORERS["longbook_sum_eng"]("the cat sat", ["the cat sat on the mat", "a dog"]) == pytest.approx(2 * 1 * 0.5 / 1.5)
    with pytest.raises(TypeError):
        SCORERS["math_find"]("9", ["9"])


# ------------------------------------------------------------------ the context window (issue 45)


def encode(sample):
    return CharTokenizer()(sample.prompt).input_ids  # the engine's ids: no chat template on the official prompts


def test_prompt_and_generation_fit_the_window_and_the_cut_is_recorded(folder):
    (folder / "passkey.jsonl").write_text(json.dumps({**ROWS["passkey"], "context": "Noise. " * 60}) + "\n")
    (folder / "math_calc.jsonl").write_text(json.dumps({**ROWS["math_calc"], "context": "1 + 2 - 4 " * 60}) + "\n")
    plain = {s.dataset: s for s in InfiniteBenchTask(cfg(str(folder), max_length=300), CharTokenizer()).samples()}
    task = InfiniteBenchTask(cfg(str(folder), max_length=300), CharTokenizer(), encode=encode,
                             resolved={"context_window": 300})
    fitted = {s.dataset: s for s in task.samples()}
    for name, s in fitted.items():
        assert len(encode(s)) + s.max_new_tokens <= 300 and task.tokens_needed(s) == 300
    assert fitted["code_run"] == plain["code_run"] and fitted["passkey"].max_new_tokens == 6  # short, or fits: as before
    passkey, calc = fitted["passkey"], fitted["math_calc"]
    assert len(encode(passkey)) == 294 and passkey.meta["prompt_budget"] == 294 and passkey.meta["truncated"]
    assert passkey.prompt.endswith(plain["passkey"].query) and passkey.query == plain["passkey"].query
    assert calc.max_new_tokens == 150 and calc.meta["max_new_tokens"] == 30000  # W // 2, the official limit recorded
    assert len(encode(calc)) == 150 and calc.meta["prompt_tokens_full"] == plain["math_calc"].meta["prompt_tokens_full"]
    with pytest.raises(TaskConfigError, match=r"^task=infinitebench number_string/0: 40 prompt tokens .* 12 new tokens "
                                              r"exceed the model's context window of 24 tokens"):
        list(InfiniteBenchTask(cfg(str(folder), datasets=["number_string"], max_length=300), CharTokenizer(),
                               encode=lambda s: [0] * 40, resolved={"context_window": 24}).samples())


def test_every_kvpress_preset_job_fits_llama31s_window(tmp_path, monkeypatch):
    """make_joblist's jobs of +experiment=kvpress_infinitebench on a model folder with Llama-3.1's window (131,072) and
    a Llama 3 style chat template (one byte a token), kvpress's copy with a row per task of 131,100+ tokens: every
    sample's prompt (as the engine encodes it) plus its generation fits the window."""
    import pandas as pd

    from slurm.make_joblist import expand, job_samples, unique_jobs
    from tests.kvbench.cli_util import byte_tokenizer

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    tok = byte_tokenizer()
    tok.chat_template = ("<s>{% for m in messages %}<|start|>{{ m['role'] }}<|end|>\n\n{{ m['content'] }}<|eot|>"
                         "{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|end|>\n\n{% endif %}")
    tok.save_pretrained(model)
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=131_072).save_pretrained(model)
    hub, configs = tmp_path / "hub", ""
    for task in TASKS:
        (hub / task).mkdir(parents=True)
        configs += f"- config_name: {task}\n  data_files:\n  - split: test\n    path: {task}/*.parquet\n"
        answer = ["A"] if task in ("longbook_choice_eng", "code_debug") else ["1"]
        pd.DataFrame([{"context": "Read.\n\n" + "w " * 65_550, "question": "Q?", "answer_prefix": "Answer:",
                       "answer": answer, "task": task, "max_new_tokens": MAX_NEW_TOKENS[task] + 20}]).to_parquet(
            hub / task / "t.parquet")
    (hub / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    jobs = unique_jobs(expand(["+experiment=kvpress_infinitebench", f"model.source={model}", "model.gguf_file=null",
                               f"task.hub_dataset={hub}", "model.name=llama31"]))
    assert len(jobs) == 21 and {cfg["task"]["max_length"] for _, cfg in jobs} == {131_072}  # full once, 5 × 4 budgets
    tasks = {json.dumps(cfg["task"], sort_keys=True): cfg for _, cfg in jobs}
    (one,) = tasks.values()  # every job reads the same samples
    samples = job_samples(one)
    assert len(samples) == 12 and max(p + n for p, n in samples) <= 131_072
    assert dict(zip(TASKS, samples))["math_calc"] == (131_072 - 30_020, 30_020)  # cut to leave room for 30,020 tokens
