"""SCBench: the hand-written rows of tests/data/scbench (the Hub's schema) as samples, against a transcription of
eval_utils.py's create_multiturn_prompt / create_scdq_prompt and run_scbench.py's truncation and generation limits;
compute_scores.py's and repo_qa_utils.py's scorers against transcriptions on fuzzed predictions; a job end to end."""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from eval import TaskConfigError
from eval.infinitebench import score_sum
from eval.scbench import DATASETS, FIRST_TURN, FOLLOW_UP, FOLLOW_UP_CHAT, MAX_NEW_TOKENS, SCBenchTask, turn_of
from eval.scbench_metrics import SCORERS, score_repoqa
from kvbench.job.prompts import encode_prompt, split_prompt
from tests.eval.test_infinitebench import o_choice as official_choice  # the same function in SCBench
from tests.kvbench.cli_util import byte_tokenizer, make_tiny_model_dir, read_lines, run_cli, tiny_model_args

DATA = Path(__file__).resolve().parents[1] / "data" / "scbench"
#: a Llama-3.1-like template: a default system block when the first message is not a system one, contents trimmed
TEMPLATE = ("{{ bos_token }}{% if messages[0]['role'] != 'system' %}<|sys|>Today<|e|>{% endif %}{% for m in messages %}"
            "<|{{ m['role'] }}|>{{ m['content'] | trim }}<|e|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tok():
    """The byte tokenizer (one token per byte), adding a BOS as Llama's does, with :data:`TEMPLATE`."""
    from tokenizers.processors import TemplateProcessing

    t = byte_tokenizer()
    t._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", t.bos_token_id)])
    t.chat_template = TEMPLATE
    return t


def cfg(**kw) -> dict:
    return {"name": "scbench", "datasets": None, "n_samples": None, "data_dir": str(DATA), "source": "official",
            "hub_dataset": None, "max_length": 131072, "compress": "context", "mode": "multi_turn", "max_turns": 5,
            "golden_context": True, "chat_template": True, **kw}


def rows(dataset: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / f"{dataset}.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------- transcription of the official prompts


def official_multiturn(eg, name, tok, chat, own):
    """create_multiturn_prompt (eval_utils.py), branch by branch."""
    turns, follow = eg["multi_turns"], (FOLLOW_UP_CHAT if own else FOLLOW_UP)[name]
    render = lambda msgs, gen=True: tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    sys_gen = render([{"role": "system", "content": ""}], not own) if chat else None
    opts = lambda t: {"OPTION_A": t["options"][0], "OPTION_B": t["options"][1], "OPTION_C": t["options"][2],
                      "OPTION_D": t["options"][3]} if "options" in t else {}
    context = eg["context"] if "context" in eg else eg["input"]
    if name in ("scbench_choice_eng", "scbench_qa_eng", "scbench_qa_chn"):
        kw = lambda t: {"question": t["input"], **opts(t)}
        content = lambda i: turns[i - 1]["answer"]
    else:
        kw = lambda t: {"input": t["input"]}
        content = lambda i: turns[i - 1]["answer"] if name == "scbench_summary" else str(turns[i - 1]["answer"])
    if name == "scbench_mf":
        target = lambda t: "What is " + re.findall(r"The .+ is", t["input"])[0].lower()[:-3] + "?"
        first = FIRST_TURN[name].format(prefix=target(turns[0]), context=context, input=turns[0]["input"])
        follows, prefix = [], target(turns[0])
        for i in range(1, len(turns)):
            prefix = target(turns[i])
            follows.append(follow.format(pre_ans=None if own else turns[i - 1]["answer"], prefix=prefix, input=turns[i]["input"]))
        kw = lambda t: {"prefix": prefix, "input": t["input"]}  # the chat follow-ups read the loop's last prefix
    else:
        first = FIRST_TURN[name].format(context=context, **kw(turns[0]))
        follows = [follow.format(pre_ans=None if own else turns[i - 1]["answer"], **kw(turns[i])) for i in range(1, len(turns))]
    if chat:
        first = render([{"role": "user", "content": first}])
        follows = [render(([{"role": "system", "content": ""}, {"role": "assistant", "content": content(i)}] if not own else [])
                          + [{"role": "user", "content": FOLLOW_UP_CHAT[name].format(**kw(turns[i]))}]).replace(sys_gen, "")
                   + "This paper" * (name == "scbench_summary") for i in range(1, len(turns))]
    return [first] + follows


SCDQ_CONTEXT = {  # multiturn_templates_scdq's context part where it is not "{context}"
    "scbench_kv": "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}",
    "scbench_choice_eng": "Read the book and answer the question.\n\n{context}",
    "scbench_qa_eng": "Read the book and answer the question. Be very concise in your answer.\n\n{context}",
    "scbench_qa_chn": "阅读以下书籍然后回答问题。\n\n{context}",
    "scbench_mf": "{prefix}\n\n{context}",
    "scbench_repoqa": "Based on the function description and code context, please retrieve and repeat the exact described "
                      "function from the code context in a code block wrapped by ```:\n\n{context}",
}


def official_scdq(eg, name, tok, chat):
    """create_scdq_prompt: the context prompt, then one query prompt per turn."""
    turns, sep = eg["multi_turns"], "[SEPSEPSEP]"
    context = eg["context"] if "context" in eg else eg["input"]
    head = SCDQ_CONTEXT.get(name, "{context}")
    if name == "scbench_mf":
        ctx = head.format(prefix=turns[0]["input"], context=context)
        queries = [FOLLOW_UP_CHAT[name].format(prefix="What is " + re.findall(r"The .+ is", t["input"])[0].lower()[:-3] + "?",
                                               input=t["input"]) for t in turns]
    else:
        ctx = head.format(context=context)
        queries = [FOLLOW_UP_CHAT[name].format(question=t["input"], input=t["input"], **{
            f"OPTION_{c}": o for c, o in zip("ABCD", t.get("options", []))}) for t in turns]
    if chat:
        ctx = tok.apply_chat_template([{"role": "user", "content": ctx + sep}], add_generation_prompt=True, tokenize=False).split(sep)[0]
        queries = [tok.apply_chat_template([{"role": "system", "content": ""}, {"role": "user", "content": sep + q}],
                                           add_generation_prompt=True, tokenize=False).split(sep)[1] for q in queries]
    return [ctx] + queries


def official_ids(name, tok, mode, chat, own, max_seq_length, max_turns=5):
    """run_scbench.py: max_turns, max_input_length, truncate_by_tokens of prompts[0]; GreedySearch.test / test_scdq's
    input ids per question and DATA_NAME_TO_MAX_NEW_TOKENS per question."""
    egs = rows(name)
    n_turns = len(egs[0]["multi_turns"])
    if 0 < max_turns < n_turns:
        egs, n_turns = [{**e, "multi_turns": e["multi_turns"][:max_turns]} for e in egs], max_turns
    new = MAX_NEW_TOKENS[name]
    if name in ("scbench_summary_with_needles", "scbench_repoqa_and_kv"):
        limit = max_seq_length - (sum(list(new.values())) * n_turns // 2)
    else:
        new = 500 if new >= max_seq_length else new
        limit = max_seq_length - new * n_turns
    limit -= 1000 * (mode == "multi_request")
    out = []
    for eg in egs:
        prompts = official_scdq(eg, name, tok, chat) if mode == "multi_request" else official_multiturn(eg, name, tok, chat, own)
        ids = tok.encode(prompts[0])
        if limit >= 0 and len(ids) > limit:
            ids = ids[: limit // 2] + ids[-(limit // 2):]
        news = [new[t["task"]] if isinstance(new, dict) else new for t in eg["multi_turns"]]
        if mode == "multi_request":
            out += [(ids + tok.encode(q, add_special_tokens=False), n) for q, n in zip(prompts[1:], news)]
        else:
            out += [(ids, news[0])] + [(tok.encode(p, add_special_tokens=False), n) for p, n in zip(prompts[1:], news[1:])]
    return out


@pytest.mark.parametrize("mode,chat,own", [("multi_turn", True, False), ("multi_turn", True, True),
                                           ("multi_turn", False, False), ("multi_turn", False, True),
                                           ("multi_request", True, False), ("multi_request", False, False)])
@pytest.mark.parametrize("max_seq_length", [131072, 2300, 1000])
def test_samples_give_the_official_input_ids_and_generation_limits(tok, mode, chat, own, max_seq_length):
    loaded = SimpleNamespace(tokenizer=tok, chat_template=None)  # the job's encode_prompt: SCBench's samples are plain
    SCBenchTask.validate(cfg())
    task = SCBenchTask(cfg(mode=mode, chat_template=chat, golden_context=not own, max_length=max_seq_length), tok)
    samples = list(task.samples())
    assert [s.dataset for s in samples] == [d for d in DATASETS for r in rows(d) for _ in r["multi_turns"]]
    for name in DATASETS:
        mine = [s for s in samples if s.dataset == name]
        want = official_ids(name, tok, mode, chat, own, max_seq_length)
        got = [(tok(s.prompt, add_special_tokens=False).input_ids if s.follow_up else encode_prompt(loaded, s),
                s.max_new_tokens) for s in mine]
        assert got == want, name
        for s in mine:
            assert s.group == f"{name}/0" and s.id == f"{name}/0/{s.turn}" and not s.chat
            assert s.follow_up == (mode == "multi_turn" and s.turn > 0)
            assert s.keep_answer == (mode == "multi_turn" and own)
            assert s.prompt.endswith(s.query) and bool(s.query) == (not s.follow_up)
    negative = mode == "multi_request" and max_seq_length == 1000  # a budget < 0 leaves the prompt whole
    assert any(s.meta.get("truncated") for s in samples) == (max_seq_length < 10_000 and not negative)


@pytest.mark.parametrize("mode", ["multi_turn", "multi_request"])
def test_a_context_cut_inside_a_character_feeds_the_kept_ids(tok, mode):
    """get_pred hands truncate_by_tokens' ids to the model as they are: their text re-encoded differs where the cut
    splits a UTF-8 character (scbench_qa_chn, one token per byte); task.compress=context leaves each query apart."""
    length = 305 + 40 * len(rows("scbench_qa_chn")[0]["multi_turns"]) + 1000 * (mode == "multi_request")
    samples = list(SCBenchTask(cfg(datasets=["scbench_qa_chn"], mode=mode, chat_template=False, max_length=length),
                               tok).samples())
    want = [ids for ids, _ in official_ids("scbench_qa_chn", tok, mode, False, False, length)]
    loaded = SimpleNamespace(tokenizer=tok, chat_template=None)
    assert samples[0].meta["truncated"] and encode_prompt(loaded, samples[0]) == want[0]
    assert tok(samples[0].prompt).input_ids != want[0]
    if mode == "multi_request":
        splits = [split_prompt(loaded, s, "context") for s in samples]
        assert [ids for ids, _ in splits] == want
        assert len({str(ids[:-q]) for ids, q in splits}) == 1  # one context: compressed once for the row
        assert [ids[-q:] for ids, q in splits] == [tok(s.query, add_special_tokens=False).input_ids for s in samples]


def test_query_parts_and_templates_verbatim(tok):
    kv = {s.id: s for s in SCBenchTask(cfg(datasets=["scbench_kv"], chat_template=False), tok).samples()}
    first = kv["scbench_kv/0/0"]
    assert first.prompt.startswith("Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:")
    assert first.query == '\n\nKey: "a1b2c3d4-0002-4e5f-8a9b-c0d1e2f3a4b2"\nThe value associated with the specified key is: '
    assert kv["scbench_kv/0/1"].prompt == ('f0e1d2c3-1002-4b5a-9c8d-7e6f5a4b3c22\n\nKey: "a1b2c3d4-0005-4e5f-8a9b-c0d1e2f3a4b5"'
                                           '\nThe value associated with the specified key is: ')
    assert FIRST_TURN["scbench_choice_eng"].endswith("D. {OPTION_D}\n\nThe the correct answer is")
    assert FOLLOW_UP["scbench_choice_eng"].endswith("\n\nThe letter of the correct answer is")
    assert FIRST_TURN["scbench_qa_chn"] == "阅读以下书籍然后回答问题。\n\n{context}\n\n问题：{question}\n答案："
    assert MAX_NEW_TOKENS["scbench_repoqa_and_kv"] == {"scbench_repoqa": 1024, "scbench_kv": 80}
    mr = {s.id: s for s in SCBenchTask(cfg(datasets=["scbench_choice_eng"], mode="multi_request"), tok).samples()}
    assert mr["scbench_choice_eng/0/1"].query == ("Question: Where does Alain walk?\nA. In a forest\nB. On a mountain\n"
                                                  "C. Along the harbour\nD. In a mall\n\nThe the correct answer is<|e|><|assistant|>")
    assert mr["scbench_choice_eng/0/1"].meta["label"] == ["Along the harbour", "C"]


def test_max_turns_cuts_only_when_the_first_row_has_more(tok):
    turns = [s.turn for s in SCBenchTask(cfg(datasets=["scbench_kv"], max_turns=2), tok).samples()]
    assert turns == [0, 1]
    assert [s.turn for s in SCBenchTask(cfg(datasets=["scbench_kv"], max_turns=None), tok).samples()] == [0, 1, 2]


def test_bad_rows_and_keys_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "scbench_kv.jsonl").write_text(json.dumps({"context": "c", "multi_turns": [{"input": "q"}]}) + "\n")
    with pytest.raises(TaskConfigError, match=r"scbench_kv\.jsonl line 1 multi_turns\[0\]: missing field 'answer'"):
        SCBenchTask.validate(cfg(data_dir=str(tmp_path), datasets=["scbench_kv"]))
    with pytest.raises(TaskConfigError, match=r"task.datasets=\['kv'\]"):
        SCBenchTask.validate(cfg(datasets=["kv"]))
    with pytest.raises(TaskConfigError, match="task.mode='both'"):
        SCBenchTask.Config(mode="both")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskConfigError, match="task.data_dir is not set and the Hugging Face Hub is unreachable"):
        SCBenchTask.validate(cfg(data_dir=None))


def test_aggregate_scores_per_dataset_turn_and_mixed_task():
    recs = [{"id": "scbench_kv/0/0", "dataset": "scbench_kv", "score": 1.0, "error": None, "meta": {"task": "scbench_kv"}},
            {"id": "scbench_kv/0/1", "dataset": "scbench_kv", "score": 0.0, "error": None, "turn": 1},
            {"id": "scbench_repoqa_and_kv/0/1", "dataset": "scbench_repoqa_and_kv", "score": 0.5, "error": None,
             "meta": {"task": "scbench_kv"}}]
    out = SCBenchTask(cfg(), None).aggregate(recs)
    assert out["datasets"]["scbench_kv"] == {"score": 50.0, "n": 2}
    assert out["averages"]["scbench_kv turn 0"] == 100.0 and out["averages"]["scbench_kv turn 1"] == 0.0
    assert out["averages"]["scbench_repoqa_and_kv scbench_kv"] == 50.0 and out["averages"]["scbench"] == 50.0
    assert turn_of({"id": "scbench_kv/3/2#1"}) == 2


# --------------------------------------------------------------------------- transcription of compute_scores.py


def normalize_zh(s):
    punct = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
    return "".join("".join(ch for ch in s.lower() if ch not in set(string.punctuation + punct)).split())


def f1(pred, gold):
    same = sum((Counter(pred) & Counter(gold)).values())
    return 0 if same == 0 else 2 * (same / len(pred)) * (same / len(gold)) / (same / len(pred) + same / len(gold))


def first_int_match(p):
    return next((x for x in re.split("[^0-9]", p) if x != ""), "")


def official_math_find(pred, label):
    label = label[0] if isinstance(label, list) else label
    first = re.search(r"\d+\.\d+|\d+", pred)
    if first is None:
        return False
    return int(float(first.group(0).strip())) == label if isinstance(label, int) else float(first.group(0).strip()) == label


OFFICIAL = {  # get_score_one via Multiturnbench_to_Infinitebench
    "scbench_kv": lambda p, l: l in p,
    "scbench_prefix_suffix": lambda p, l: l in p,
    "scbench_passkey": lambda p, l: (l[0] if isinstance(l, list) else l) == first_int_match(p),
    "scbench_vt": lambda p, l: round(sum([1.0 if r.lower() in p.lower() else 0.0 for r in l]) / len(l), 2),
    "scbench_qa_eng": lambda p, l: int(any(i.upper() in p.strip().upper() for i in l)),
    "scbench_many_shot": lambda p, l: int(any(i.upper() in p.strip().upper() for i in l)),
    "scbench_qa_chn": lambda p, l: max([0] + [f1(list(normalize_zh(p)), list(normalize_zh(g))) for g in l]),
    "scbench_choice_eng": official_choice,
    "scbench_mf": official_math_find,
}
LABELS = {"scbench_kv": "F0e1d2C3-1002", "scbench_prefix_suffix": "abc3xyz21qq", "scbench_passkey": "71432",
          "scbench_vt": ["QPR", "XKC", "ZZT"], "scbench_qa_eng": ["Alain's dog"], "scbench_many_shot": "(A)",
          "scbench_qa_chn": "去河边打水", "scbench_choice_eng": ["Walking Georgie", "B"], "scbench_mf": 91}


def fuzz(label, rng) -> str:
    parts = [str(x) for x in (label if isinstance(label, list) else [label])]
    pool = parts + [p.lower() for p in parts] + ["The answer is:", "answer:", "option is", "A", "B.", "C:", " ", "\n",
                                                 "，", "。", "91.5", "7", "the", "QPR", "河边", "{", "}", "(A)", "an"]
    return "".join(rng.choice(pool) + rng.choice(["", " ", "\n", ".", ","]) for _ in range(rng.randint(0, 6)))


@pytest.mark.parametrize("name", sorted(OFFICIAL))
def test_scorers_equal_the_official_functions_on_fuzzed_predictions(name):
    rng = random.Random(name)
    for _ in range(400):
        pred = fuzz(LABELS[name], rng)
        assert SCORERS[name](pred, LABELS[name]) == float(OFFICIAL[name](pred, LABELS[name])), (name, pred)
    assert SCORERS["scbench_qa_chn"]("他去河边", "去河边打水") == pytest.approx(2 / 5)  # best single-character F1


def test_summary_is_rougelsum_f_of_rouge_score():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)  # evaluate's rouge, use_aggregator=False
    rng = random.Random(0)
    for _ in range(50):
        pred = fuzz("A man walks his dog by the sea.", rng)
        assert SCORERS["scbench_summary"](pred, "A man walks his dog by the sea.") == scorer.score(
            "A man walks his dog by the sea.", pred)["rougeLsum"].fmeasure
    assert SCORERS["scbench_summary"] is score_sum


def official_repoqa(preds):
    """repo_qa_utils.compute_score(...)['scores']['all'][0.8]['pass@1'] (sanitize_output, needle_evaluator, pass@k)."""
    import numpy as np
    from nltk.translate.bleu_score import SmoothingFunction, sentence_bleu
    from tree_sitter_languages import get_language, get_parser

    needles = {}
    for p in preds:
        needles.setdefault(p["repo"], []).append({"needle": p["ground_truth"], "name": p["func_name"]})
    correct = []
    for p in preds:
        out = p["prediction"].strip()
        blocks = re.findall(r"^```(?:\w+)?\s*\n(.*?)(?=^```)```", out, re.DOTALL | re.MULTILINE)
        parser, q = get_parser(p["lang"]), get_language(p["lang"]).query("(function_definition name: (_)) @fdef")
        found = None
        for block in blocks:
            caps = q.captures(parser.parse(bytes(block, "utf8")).root_node)
            if caps:
                found = bytes(block, "utf8")[caps[0][0].start_byte:caps[0][0].end_byte].decode("utf8")
                break
        out = found if found is not None else blocks[0] if blocks else out
        best, best_sim = None, 0
        for n in needles[p["repo"]]:
            sim = sentence_bleu([re.split(r"\s+", n["needle"].strip())], re.split(r"\s+", out.strip()),
                                smoothing_function=SmoothingFunction().method4)
            if sim > best_sim:
                best, best_sim = n["name"], sim
        correct.append(int(best == p["func_name"] and best_sim >= 0.8))
    return float(np.mean([1.0 if c else 0.0 for c in correct]))


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
def test_repoqa_equals_pass_at_1_of_repo_qa_utils(tok):
    task = SCBenchTask(cfg(datasets=["scbench_repoqa"]), tok)
    samples = list(task.samples())
    code = {t["name"]: t["answer"] for t in rows("scbench_repoqa")[0]["multi_turns"]}
    rng = random.Random(1)
    for _ in range(30):
        preds = []
        for s in samples:
            body = rng.choice([code[s.meta["name"]], code["first"], code["scale"].replace("k *", "k +"), "no code", ""])
            text = rng.choice([body, f"```python\n{body}\n```", f"Here:\n```\nx = 1\n{body}\n```\nDone", f"```\n{body}"])
            preds.append({"repo": s.meta["repo"], "lang": "python", "func_name": s.meta["name"], "prediction": text,
                          "ground_truth": code[s.meta["name"]]})
        mine = sum(task.score(s, p["prediction"]) for s, p in zip(samples, preds)) / len(samples)
        assert mine == official_repoqa(preds)
    assert score_repoqa("```python\ndef first(xs):\n    return xs[0] if xs else None\n```", "python", "first",
                        task.needles[("scbench_repoqa", "toy/mathutils")]) == 1.0


def test_multi_request_implies_one_compression_of_the_shared_context():
    """SCBench's multi-request shares the context: ``task.mode=multi_request`` implies ``task.compress=context`` (the
    job is the one named with it); multi-turn keeps its choice."""
    from kvbench.job.config import check, compose

    args = ["task=scbench", f"task.data_dir={DATA}", "task.datasets=[scbench_kv]"]
    implied, named, turns = (check(compose(args + extra)) for extra in (
        ["task.mode=multi_request"], ["task.mode=multi_request", "task.compress=context"], ["task.mode=multi_turn"]))
    assert implied.cfg["task"]["compress"] == "context" and implied.relpath == named.relpath
    assert turns.cfg["task"]["compress"] == "prompt" and "compress" not in turns.identity["task"]


@pytest.mark.slow
def test_a_job_runs_every_turn_in_both_modes(tmp_path):
    model = make_tiny_model_dir(tmp_path / "model")
    out = tmp_path / "out"
    done = run_cli(["-m", *tiny_model_args(model), "task=scbench", f"task.data_dir={DATA}", "task.datasets=[scbench_kv]",
                    "task.chat_template=false", "task.mode=multi_turn,multi_request", "method=snapkv", "budget=0.25",
                    "max_samples=3", f"output_root={out}", "quiet=true", "threads=1"])
    assert done.returncode == 0, done.stderr[-2000:]
    runs = sorted(out.rglob("predictions.jsonl"))
    assert len(runs) == 2
    for pred in runs:
        records = read_lines(pred)
        assert [r["id"] for r in records] == ["scbench_kv/0/0", "scbench_kv/0/1", "scbench_kv/0/2"]
        assert all(r["error"] is None for r in records)
        if "multi_request" in (pred.parent / "config.yaml").read_text():  # one compression of the row's context
            assert [(r["group"], r["group_compressions"]) for r in records] == [("scbench_kv/0", 1)] * 3
        summary = json.loads((pred.parent / "summary.json").read_text())
        assert set(summary["averages"]) >= {"scbench", "scbench_kv turn 0", "scbench_kv turn 2"}
