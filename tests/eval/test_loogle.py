"""LooGLE: official files read (a sample per question), task2prompt's prompts, get_pred's truncation,
automatic_metrics.py's scores and automatic_eval.py's aggregation."""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest

from eval import TaskConfigError, get_task_class
from eval.base import Sample
from eval.loogle import MAX_NEW_TOKENS, PROMPTS, TASKS, LoogleTask, cloze_scores, text_scores
from eval.wordnet import INSTALL, require as wordnet
from tests.conftest import ROOT
from tests.eval.test_longbench import tokenizer  # noqa: F401 - the embedded model's tokenizer (fixture)


class CharTokenizer:
    def __call__(self, text, truncation=False):
        return type("Enc", (), {"input_ids": [0] + [ord(c) for c in text]})

    def decode(self, ids, skip_special_tokens=False):
        return "".join(("" if skip_special_tokens else "<s>") if i == 0 else chr(i) for i in ids)


CLOZE_A = {"<mask-0>": "Justin Timberlake", "<mask-1>": "Kentwood"}
ROWS = {  # one hand-written document per task in the repository's schema (input, title, qa_pairs, output)
    "shortdep_qa": {"input": "Picardo was born in Jerez.", "title": "Picardo", "output": "none",
                    "qa_pairs": str([{"S": "born in Jerez", "Q": "Where was he born?", "A": "In Jerez."},
                                     {"S": "", "Q": "Who?", "A": "Picardo."}])},
    "longdep_qa": {"input": "He had four brothers.", "title": "Picardo", "output": "None",
                   "qa_pairs": str([{"Q": "How many?\n1. five", "A": "1", "type": "computation", "S": ["four"]}])},
    "shortdep_cloze": {"input": "Britney sang with Justin Timberlake in Kentwood.", "title": "Britney",
                       "output": "None", "qa_pairs": str([{"Q": "She sang with <mask-0> in <mask-1>.", "S": "",
                                                           "A": CLOZE_A}])},
    "longdep_summarization": {"input": "A paper on conjectures.", "title": "2301.1", "qa_pairs": "none",
                              "question": "none", "output": "We study a conjecture."},
}


def wordnet_found() -> bool:
    try:
        wordnet()
        return True
    except TaskConfigError:
        return False


def cfg(data_dir=None, **kw) -> dict:
    return {"name": "loogle", "datasets": None, "n_samples": None, "data_dir": data_dir, "source": "official",
            "hub_dataset": None, "max_length": 100_000, "compress": "prompt", **kw}


@pytest.fixture
def folder(tmp_path):
    for task, r in ROWS.items():
        (tmp_path / f"{task}.jsonl").write_text(json.dumps(r) + "\n")
    return tmp_path


def test_every_task_builds_the_official_prompt_per_question(folder):
    LoogleTask.validate(cfg(str(folder)))
    samples = list(LoogleTask(cfg(str(folder)), CharTokenizer()).samples())
    assert [s.id for s in samples] == ["shortdep_qa/0", "shortdep_qa/1", "longdep_qa/0", "shortdep_cloze/0",
                                       "longdep_summarization/0"]
    qa, _, long_qa, cloze, summ = samples
    assert qa.prompt == ("Please answer the question based on the long texts below. \nPicardo was born in Jerez.\n"
                         "Question: Where was he born?\nAnswer: ")
    assert qa.query == "\nQuestion: Where was he born?\nAnswer: " and qa.answers == ["In Jerez."]
    assert long_qa.answers == ["1"] and long_qa.max_new_tokens == 500
    assert cloze.prompt.startswith("Please fill in the clozes based on the given long texts below. Each of the "
                                   "placeholder '<mask-n>'")
    assert "for example: {'<mask-0>': 'Bob', '<mask-1>': 'Gorrosion Magazine','<mask-2>': 'Bethel Horizon'}\n" \
           "Britney sang" in cloze.prompt
    assert cloze.query == "\n Question: She sang with <mask-0> in <mask-1>. What are the masked entities? \nAnswer:"
    assert json.loads(cloze.answers[0]) == CLOZE_A and cloze.meta["masks"] == 2
    assert summ.prompt.endswith("A paper on conjectures.\n Summarization: ") and summ.query == "\n Summarization: "
    assert summ.answers == ["We study a conjecture."]
    for s in samples:
        assert s.prompt.endswith(s.query) and not s.chat and s.max_new_tokens == MAX_NEW_TOKENS[s.dataset]
    assert MAX_NEW_TOKENS == {"shortdep_qa": 300, "longdep_qa": 500, "longdep_summarization": 500, "shortdep_cloze": 50}
    assert set(PROMPTS) == set(TASKS) and PROMPTS["longdep_qa"] == PROMPTS["shortdep_qa"]


def test_truncation_decodes_the_halves_apart_as_get_pred(folder):
    (sample,) = LoogleTask(cfg(str(folder), datasets=["shortdep_qa"], max_length=9, n_samples=1),
                           CharTokenizer()).samples()
    # 9 tokens: the first int(9/2) = 4 ids (BOS + "Ple") and the last 4, decoded apart and concatenated
    assert sample.prompt == "Ple" + "er: " and sample.query == "" and sample.meta["truncated"]


def test_hub_question_rows_and_n_samples(folder):
    (folder / "shortdep_cloze.jsonl").write_text("".join(json.dumps(
        {"context": f"Doc {i}.", "question": "Q <mask-0>.", "answer": ["Bob"], "title": "t"}) + "\n" for i in range(3)))
    task = LoogleTask(cfg(str(folder), datasets=["shortdep_cloze"], n_samples=2), CharTokenizer())
    first, second = task.samples()
    assert json.loads(first.answers[0]) == {"<mask-0>": "Bob"} and "Doc 1." in second.prompt
    assert task.cut_datasets == ["shortdep_cloze"] and task.score(first, "{'<mask-0>': 'Bob'}") == 1.0


def test_a_malformed_row_names_file_line_and_field(folder):
    (folder / "shortdep_qa.jsonl").write_text(json.dumps(ROWS["shortdep_qa"]) + "\n" + json.dumps(
        {"input": "x", "qa_pairs": str([{"Q": "q", "A": 3}])}) + "\n")
    with pytest.raises(TaskConfigError, match=r"shortdep_qa\.jsonl line 2 qa_pairs\[0\]: field 'A' must be str"):
        LoogleTask.validate(cfg(str(folder), datasets=["shortdep_qa"]))
    (folder / "longdep_qa.jsonl").write_text(json.dumps({"input": "x", "qa_pairs": "[{'Q': "}) + "\n")
    with pytest.raises(TaskConfigError, match=r"longdep_qa\.jsonl line 1: field 'qa_pairs' is not a list literal"):
        LoogleTask.validate(cfg(str(folder), datasets=["longdep_qa"]))
    (folder / "longdep_summarization.jsonl").write_text(json.dumps({"input": "x", "qa_pairs": "none"}) + "\n")
    with pytest.raises(TaskConfigError, match=r"longdep_summarization\.jsonl line 1: missing field 'output'"):
        LoogleTask.validate(cfg(str(folder), datasets=["longdep_summarization"]))
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir=.*no shortdep_cloze\.jsonl"):
        (folder / "shortdep_cloze.jsonl").unlink()
        LoogleTask.validate(cfg(str(folder), datasets=["shortdep_cloze"]))
    with pytest.raises(TaskConfigError, match=r"^task\.datasets="):
        LoogleTask.validate(cfg(str(folder), datasets=["summarization"]))


def test_offline_without_a_folder_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TaskConfigError, match=r"^task\.data_dir is not set and the Hugging Face Hub is unreachable: "
                                              r"download LooGLE's") as e:
        get_task_class("loogle").validate(cfg())
    assert "\n" not in str(e.value)


def kvpress_task(tmp_path, monkeypatch, tokenizer) -> LoogleTask:
    """A local snapshot of simonjegou/loogle: a config per task, kvpress's columns, cloze answers as JSON."""
    import pandas as pd

    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    hub, configs = tmp_path / "hub", ""
    for task, answer in (("shortdep_cloze", json.dumps(CLOZE_A)), ("longdep_qa", "1")):
        (hub / task).mkdir(parents=True)
        configs += f"- config_name: {task}\n  data_files:\n  - split: test\n    path: {task}/*.parquet\n"
        pd.DataFrame([{"context": "Please fill in. \nctx", "question": "\n Question: Q?\n", "answer_prefix": "Answer:",
                       "answer": answer, "task": task, "max_new_tokens": 50}]).to_parquet(hub / task / "t.parquet")
    (hub / "README.md").write_text(f"---\nconfigs:\n{configs}---\n")
    task_cfg = cfg(source="kvpress", hub_dataset=str(hub), datasets=["shortdep_cloze", "longdep_qa"])
    LoogleTask.validate(task_cfg)
    return LoogleTask(task_cfg, tokenizer)


def test_kvpress_copy_uses_its_prompt_parts(tmp_path, monkeypatch):
    task = kvpress_task(tmp_path, monkeypatch, CharTokenizer())
    cloze, qa = task.samples()  # no chat template: the answer prefix is appended to the prompt
    assert cloze.prompt == "Please fill in. \nctx\n Question: Q?\nAnswer:" and cloze.query == "\n Question: Q?\nAnswer:"
    assert not cloze.chat and cloze.max_new_tokens == 50 and cloze.meta["masks"] == 2
    assert task.score(cloze, " {'<mask-0>': 'Justin Timberlake', '<mask-1>': 'x'}") == 0.5 and qa.answers == ["1"]


def test_kvpress_answer_prefix_follows_the_generation_prompt_on_the_embedded_tokenizer(tmp_path, monkeypatch, folder,
                                                                                       tokenizer):
    """kvpress's pipeline (``preprocess``): context + question in the user turn, the answer prefix after the
    generation prompt, tokenized without special tokens; the query part runs from the question through the prefix.
    The official source's prompt is unchanged (no template, the prompt as task2prompt builds it)."""
    from types import SimpleNamespace

    from kvbench.job.run import encode_prompt, split_prompt

    loaded = SimpleNamespace(tokenizer=tokenizer, chat_template="tokenizer")
    cloze, _ = kvpress_task(tmp_path, monkeypatch, tokenizer).samples()
    turn = tokenizer.apply_chat_template([{"role": "user", "content": "Please fill in. \nctx\n Question: Q?\n"}],
                                         add_generation_prompt=True, tokenize=False)
    ids = encode_prompt(loaded, cloze)
    assert ids == tokenizer.encode(turn, add_special_tokens=False) + tokenizer.encode("Answer:", add_special_tokens=False)
    _, q = split_prompt(loaded, cloze, "context")
    assert tokenizer.decode(ids[len(ids) - q:]) == "\n Question: Q?\n<|im_end|>\n<|im_start|>assistant\nAnswer:"
    official = next(s for s in LoogleTask(cfg(str(folder), datasets=["shortdep_cloze"]), tokenizer).samples())
    assert not official.chat and encode_prompt(loaded, official) == tokenizer(official.prompt).input_ids
    assert official.prompt.endswith("What are the masked entities? \nAnswer:")


# ------------------------------------------------------------------ automatic_metrics.py, transcribed


def o_exact(reference, hypothesis):
    count = len(reference)
    if type(hypothesis) is str:
        try:
            hypothesis = eval(hypothesis, {"__builtins__": {}})
            assert isinstance(hypothesis, dict)
        except Exception:
            return 0, count
    n = 0
    for key in reference:
        if key in hypothesis and hypothesis[key] == reference[key]:
            n += 1
    return n, count


def o_partial(reference, hypothesis):
    count = len(reference)
    if isinstance(hypothesis, str):
        try:
            hypothesis = eval(hypothesis, {"__builtins__": {}})
            assert isinstance(hypothesis, dict)
        except Exception:
            return 0, count
    try:  # kvpress's copy: a value without .split() scores the sample 0 (the official script stops)
        n = 0
        for key in reference:
            if key in hypothesis:
                n += int(len(set(reference[key].split()).intersection(set(hypothesis[key].split()))) > 0)
        return n, count
    except Exception:
        return 0, count


def o_text(reference, hypothesis):
    from nltk.translate.bleu_score import sentence_bleu
    from rouge import Rouge

    if hypothesis == "":
        hypothesis = "None"
    ref, hyp = reference.replace("\n", " ").split(), hypothesis.replace("\n", " ").split()
    bleu1, bleu4 = sentence_bleu([ref], hyp, weights=(1, 0, 0, 0)), sentence_bleu([ref], hyp, weights=(0, 0, 0, 1))
    try:
        r = Rouge().get_scores(hyps=[hypothesis], refs=[reference])[0]
        rouge = (r["rouge-1"]["r"], r["rouge-2"]["r"], r["rouge-l"]["r"])
    except ValueError:  # kvpress's try_except_metric (the official script stops)
        rouge = (0.0, 0.0, 0.0)
    return {"bleu1": bleu1, "bleu4": bleu4, "rouge_1": rouge[0], "rouge_2": rouge[1], "rouge_l": rouge[2]}


KEYS = ["'<mask-0>'", "'<mask-1>'", '"<mask-1>"', "'<mask-2>'", "'mask-0'"]
VALUES = ["'Justin Timberlake'", "'Justin'", "'Kentwood'", "'kentwood'", "'Timberlake Justin'", "7", "None", "['Kentwood']",
          "'New Kentwood'", "x"]


def cloze_prediction(rng: random.Random) -> str:
    """A dict literal of random masks and entities, sometimes with text around it or a character dropped."""
    keys = rng.sample(KEYS, rng.randint(0, 3)) if rng.random() < 0.5 else [rng.choice(KEYS) for _ in range(2)]
    text = "{" + ", ".join(f"{k}: {rng.choice(VALUES)}" for k in keys) + "}"
    if rng.random() < 0.2:
        text = rng.choice(["Answer: ", " ", "\n", "["]) + text + rng.choice(["", ".", " ", "]"])
    if rng.random() < 0.2 and text:
        i = rng.randrange(len(text))
        text = text[:i] + text[i + 1:]
    return text


TEXT_PIECES = ["In", "Jerez", "jerez", ".", " ", "\n", "de", "la", "Frontera", "born", "was", "He", "...", ",", "the"]


@pytest.mark.filterwarnings("ignore")
def test_scores_equal_automatic_metrics_on_fuzzed_predictions():
    rng = random.Random(7)
    for _ in range(2000):
        pred = cloze_prediction(rng)
        got = cloze_scores(pred, CLOZE_A)
        assert (got["exact_match"], got["partial_match"]) == (o_exact(CLOZE_A, pred)[0] / 2,
                                                              o_partial(CLOZE_A, pred)[0] / 2), pred
    reference = "He was born in Jerez de la Frontera. He moved to Madrid."
    for _ in range(600):
        pred = "".join(rng.choice(TEXT_PIECES) + rng.choice([" ", " ", ""]) for _ in range(rng.randint(0, 12)))
        assert text_scores(pred, reference) == pytest.approx(o_text(reference, pred)), pred


def test_score_edge_cases():
    assert cloze_scores("{'<mask-0>': 'Justin', '<mask-1>': 7}", CLOZE_A) == {"exact_match": 0.0, "partial_match": 0.0}
    assert cloze_scores("{'<mask-0>': 'Justin'}", CLOZE_A) == {"exact_match": 0.0, "partial_match": 0.5}
    assert cloze_scores("{'<mask-0>': 'a' + 'b'}", CLOZE_A)["exact_match"] == 0.0  # a literal only, never eval
    assert text_scores("...", "A ref.")["rouge_l"] == 0.0  # rouge raises "Hypothesis is empty."
    assert text_scores("", "None of it")["rouge_1"] == pytest.approx(1 / 3)  # '' is scored as 'None'


def test_aggregate_as_automatic_eval(folder):
    """Cloze: sum of matches / sum of masks; the others: the mean over questions (np.mean), ×100."""
    recs = [{"dataset": "shortdep_cloze", "score": 1.0, "scores": {"partial_match": 1.0}, "meta": {"masks": 1}},
            {"dataset": "shortdep_cloze", "score": 0.0, "scores": {"partial_match": 2 / 3}, "meta": {"masks": 3}},
            {"dataset": "shortdep_qa", "score": 0.5, "scores": {"bleu1": 0.2, "rouge_1": 0.6}},
            {"dataset": "shortdep_qa", "score": 0.25, "scores": {"bleu1": 0.4, "rouge_1": 0.3}},
            {"dataset": "shortdep_qa", "score": None, "error": {"type": "X"}}]
    out = LoogleTask(cfg(str(folder))).aggregate(recs)
    assert out["datasets"]["shortdep_cloze"] == {"score": 25.0, "n": 2}
    assert out["averages"]["shortdep_cloze partial_match"] == 75.0
    assert out["averages"]["shortdep_qa rouge_l"] == round(100 * float(np.mean([0.5, 0.25])), 2) == 37.5
    assert out["averages"]["shortdep_qa bleu1"] == 30.0 and out["averages"]["loogle"] == 31.25


def test_the_report_prints_every_metric_per_job(tmp_path):
    from test_report import make_job

    from kvbench.report.data import load_results
    from kvbench.report.tables import averages_tables

    for method, budget, em in (("full", 1.0, 40.0), ("snapkv", 0.25, 30.5)):
        job = make_job(tmp_path, task="loogle", model="llama31", method=method, budget=budget,
                       scores={"shortdep_cloze": em, "shortdep_qa": 20.0})
        summary = json.loads((job / "summary.json").read_text())
        summary["averages"] = {"loogle": (em + 20) / 2, "shortdep_cloze exact_match": em,
                               "shortdep_cloze partial_match": 50.0, "shortdep_qa rouge_l": 20.0}
        (job / "summary.json").write_text(json.dumps(summary))
    (table,) = averages_tables(load_results(tmp_path), tmp_path, "loogle")
    assert table.name == "loogle_llama31" and list(table.data["shortdep_cloze exact_match"]) == [40.0, 30.5]
    assert list(table.data.columns)[:3] == ["Method", "Budget", "loogle"] and len(table.sources) == 2


# ------------------------------------------------------------------ METEOR, BERTScore (issue 45)

needs_wordnet = pytest.mark.skipif(not wordnet_found(), reason="NLTK's WordNet not installed: bash .ci/wordnet_setup.sh")


@needs_wordnet
def test_meteor_by_hand_with_wordnet_synonyms_and_the_bleu_floor():
    """METEOR = Fmean · (1 − 0.5 · (chunks / matches)³), Fmean = PR / (0.9P + 0.1R), on the distinct words."""
    def score(prediction, reference):
        sample = Sample(id="q", dataset="shortdep_qa", prompt="", max_new_tokens=1, answers=[reference])
        return LoogleTask(cfg()).scores(sample, prediction)["meteor"]

    assert score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1 - 0.5 / 5 ** 3)
    # dog ~ hound through WordNet (stems first, so car ~ automobile would not: 'automobil'); 3 matches, one chunk
    assert score("the old dog\nbarked", "an old hound barked") == pytest.approx(0.75 * (1 - 0.5 / 27))
    assert score("the dog", "a hound") == pytest.approx(0.5 * (1 - 0.5))
    got = text_scores("In Jerez", "He was born in Jerez de la Frontera.")
    assert got["bleu4"] == 0.0 and got["bleu1"] > 0  # no 4-gram: NLTK's floor 2.2e-308 is stored as 0


PAIR = ("The author moved to Madrid in 1990 and then he taught music at the conservatory",
        "He taught music in Madrid after he moved there in 1990")


def run_with_hash_seed(seed: int, code: str) -> list[float]:
    """The numbers ``code`` prints (one line), run in a new interpreter under ``PYTHONHASHSEED=seed``."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONHASHSEED": str(seed)}, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr[-1000:]
    return [float(x) for x in done.stdout.split()]


def test_meteor_is_deterministic_where_the_official_set_order_is_not():
    code = ("from eval.loogle import meteor; from nltk.translate.meteor_score import single_meteor_score as m; "
            f"print(meteor({PAIR[0]!r}.split(), {PAIR[1]!r}.split()), "
            f"m(set({PAIR[0]!r}.split()), set({PAIR[1]!r}.split())))")  # ours, then the official get_meteor_score
    mine, spread = zip(*(run_with_hash_seed(s, code) for s in range(6)))
    assert len(set(mine)) == 1 and len(set(spread)) > 1  # official: 0.241 to 0.464 over seeds 0-39 (docs/BENCHMARKS.md)
    assert min(spread) <= mine[0] <= max(spread)


def tiny_roberta(path):
    """A random 3-layer RoBERTa with a byte-level BPE vocabulary (no merges), saved as bert-score loads it."""
    import torch
    from tokenizers import pre_tokenizers
    from transformers import RobertaConfig, RobertaModel

    path.mkdir()
    vocab = {t: i for i, t in enumerate(["<s>", "<pad>", "</s>", "<unk>", "<mask>", *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "RobertaTokenizer", "model_max_length": 512}))
    torch.manual_seed(0)
    RobertaModel(RobertaConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=600, pad_token_id=1)).save_pretrained(path)
    return path


def o_bert_recall(folder, layer: int, candidate: str, reference: str) -> float:
    """BERTScore's R (Zhang et al., 2020, eq. 1 without idf): each reference token's best cosine similarity to the
    candidate's tokens, averaged, <s> and </s> weighted 0; hidden states of layer ``layer``."""
    import torch
    from transformers import AutoTokenizer, RobertaModel

    tok, model = AutoTokenizer.from_pretrained(folder), RobertaModel.from_pretrained(folder).eval()

    def embed(text):
        ids = tok.encode(text.strip(), add_prefix_space=True)
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[layer][0]
        return torch.nn.functional.normalize(h, dim=-1)[1:-1]  # the special tokens weigh 0

    return float((embed(reference) @ embed(candidate).T).max(dim=1).values.mean())


def test_bert_score_passes_the_reference_as_the_candidate_and_keeps_the_recall(tmp_path, folder):
    pytest.importorskip("bert_score", reason="bert-score not installed (pip install -e '.[loogle]')")
    from eval.loogle import bert_score

    model = tiny_roberta(tmp_path / "roberta")
    reference, prediction = "He was born in Jerez de la Frontera.", "In Jerez."
    got = bert_score(str(model), 2, reference, prediction)
    # get_bertscore: score([reference], [hypothesis])[1], i.e. candidate = reference, R over the prediction's tokens
    assert got == pytest.approx(o_bert_recall(model, 2, reference, prediction), abs=1e-5)
    assert got != pytest.approx(o_bert_recall(model, 2, prediction, reference), abs=1e-3)  # the quirk matters
    task = LoogleTask(cfg(str(folder), bert_score_model=str(model), bert_score_layers=2), CharTokenizer())
    if wordnet_found():
        qa = next(iter(task.samples()))
        extra = task.extra_scores(qa, prediction)
        assert extra["bert_score"] == pytest.approx(bert_score(str(model), 2, qa.answers[0], prediction))
        assert {"meteor", "bleu4", "rouge_1"} <= set(extra)
        recs = [{"dataset": "shortdep_qa", "score": 0.5, "scores": extra, "error": None}]
        assert task.aggregate(recs)["averages"]["shortdep_qa bert_score"] == round(100 * extra["bert_score"], 2)


def test_metric_inputs_missing_are_one_line_errors(folder, monkeypatch):
    monkeypatch.setattr("eval.loogle.hub_reachable", lambda *a: False)
    with pytest.raises(TaskConfigError, match=r"^task\.bert_score_model=/nonexistent: no such folder"):
        LoogleTask.validate(cfg(str(folder), datasets=["shortdep_cloze"], bert_score_model="/nonexistent"))
    monkeypatch.setitem(sys.modules, "bert_score", None)  # an existing folder, no package
    with pytest.raises(TaskConfigError, match=r"^task\.bert_score_model=.*: needs the bert-score package"):
        LoogleTask.validate(cfg(str(folder), datasets=["shortdep_cloze"], bert_score_model=str(folder)))
    monkeypatch.setattr("eval.loogle.wordnet", lambda: (_ for _ in ()).throw(TaskConfigError(INSTALL)))
    LoogleTask.validate(cfg(str(folder), datasets=["shortdep_cloze"]))  # the cloze task needs no WordNet
    with pytest.raises(TaskConfigError, match=r"wordnet_setup\.sh.*nltk\.download\('wordnet'\)"):
        LoogleTask.validate(cfg(str(folder), datasets=["shortdep_qa"]))


@needs_wordnet
def test_a_job_records_meteor_and_bert_score_the_same_under_any_hash_seed(tmp_path, folder):
    """Acceptance (issue 45): run.py on a tiny model; each record carries meteor and bert_score, equal under two
    PYTHONHASHSEED values (the official set order would differ) and to the metric functions on its prediction."""
    pytest.importorskip("bert_score", reason="bert-score not installed (pip install -e '.[loogle]')")
    from eval.loogle import bert_score, meteor
    from tests.kvbench.cli_util import make_tiny_model_dir, read_lines, run_cli, tiny_model_args

    model, roberta = make_tiny_model_dir(tmp_path / "model"), tiny_roberta(tmp_path / "roberta")
    records = []
    for seed in ("0", "1"):
        out = tmp_path / f"out{seed}"
        done = run_cli([*tiny_model_args(model), "task=loogle", f"task.data_dir={folder}", "task.datasets=[shortdep_qa]",
                        "task.n_samples=1", f"task.bert_score_model={roberta}", "task.bert_score_layers=2",
                        "method=full", f"output_root={out}", "quiet=true", "threads=1"], PYTHONHASHSEED=seed)
        assert done.returncode == 0, done.stderr[-2000:]
        (pred,) = out.rglob("predictions.jsonl")
        records += read_lines(pred)
    first, second = records
    assert first["scores"] == second["scores"] and first["prediction"] == second["prediction"]
    words = [t.replace("\n", " ").split() for t in ("In Jerez.", first["prediction"] or "None")]
    assert first["scores"]["meteor"] == meteor(*words)
    assert first["scores"]["bert_score"] == pytest.approx(bert_score(str(roberta), 2, "In Jerez.", first["prediction"] or "None"))
