"""RULER's synthetic data generator (NVIDIA/RULER ``scripts/data/synthetic/*.py`` with ``scripts/synthetic.yaml``),
for any length and the model's own tokenizer: ``task.generate=true`` (:func:`generate`).

Each subtask follows its RULER script: the same template, needle, answer and few-shot formats, the same random
draws in the same order from ``random``/``numpy`` generators seeded with ``task.seed`` (RULER's
``--random_seed 42``), the same length fitting (a binary search for the largest haystack whose prompt plus
``tokens_to_generate`` fits the length; fwe's own growth loop), tokens counted as RULER's HF tokenizer does
(``tokenizer.tokenize``), less the chat template's own tokens (RULER's ``--model_template_token``). Rows are
RULER's: ``index`` (niah: the answer's character offset in ``input``), ``input`` (base template), ``outputs``,
``length``, ``length_w_model_temp``, ``answer_prefix`` (niah: ``token_position_answer``); for the same seed,
tokenizer and inputs they equal RULER's scripts' rows (tests/eval/test_ruler_data.py). Differences, because
RULER's inputs are not on PyPI: the essay haystack is the NIAH task's (``task.haystack_dir``, else the Hub,
else embedded) instead of RULER's downloaded PaulGrahamEssays.json; sentences are cut by nltk's untrained Punkt
(RULER: the trained ``punkt`` model, a download); cwe lists beyond wonderwords' 8166 words come from RULER's LFS
file english_words.json, given as ``task.cwe_words``; qa reads the SQuAD v2 / HotpotQA dev files RULER downloads (``task.qa_files``),
else their Hub copies.
"""

from __future__ import annotations

import heapq
import json
import math
import random
import re
import string
import uuid
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .base import TaskConfigError, looked_for

#: RULER's scripts/data/synthetic/constants.py: template, answer prefix, tokens_to_generate per task family
TASKS = {
    "niah": ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?",
             " The special magic {type_needle_v} for {query} mentioned in the provided text are", 128),
    "vt": ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.",
           " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned the value {query}, they are: ", 30),
    "cwe": ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
            " Answer: The top 10 words that appear most often in the list are:", 120),
    "fwe": ("Read the following coded text and track the frequency of each coded word. Find the three most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most frequently appeared words in the above coded text?",
            " Answer: According to the coded text above, the three most frequently appeared words are:", 50),
    "qa": ("Answer the question based on the given documents. Only give me the answer and do not output any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
           " Answer:", 32),
}
#: scripts/synthetic.yaml: the niah subtasks' (type_haystack, type_needle_k, type_needle_v, num_needle_k, _v, _q)
NIAH = {"niah_single_1": ("noise", "words", "numbers", 1, 1, 1), "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("essay", "words", "uuids", 1, 1, 1), "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1), "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1), "niah_multiquery": ("essay", "words", "numbers", 1, 1, 4)}
#: RULER's scripts/data/template.py: the chat template of each model family ({task_template}: the task's text)
TEMPLATES = {
    "base": "{task_template}",
    "meta-chat": "[INST] {task_template} [/INST]",
    "vicuna-chat": "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, detailed, and polite answers to the user's questions. USER: {task_template} ASSISTANT:",
    "lwm-chat": "You are a helpful assistant. USER: {task_template} ASSISTANT: ",
    "command-r-chat": "<BOS_TOKEN><|START_OF_TURN_TOKEN|><|USER_TOKEN|>{task_template}<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "chatglm-chat": "[gMASK]sop<|user|> \n {task_template}<|assistant|> \n ",
    "RWKV": "User: hi\n\nAssistant: Hi. I am your assistant and I will provide expert full response in full details. Please feel free to ask any question and I will always answer it\n\nUser: {task_template}\n\nAssistant:",
    "Phi3": "<|user|>\n{task_template}<|end|>\n<|assistant|>\n",
    "meta-llama3": "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n{task_template}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "jamba": "<|startoftext|><|bom|><|system|> <|eom|><|bom|><|user|> {task_template}<|eom|><|bom|><|assistant|>",
    "nemotron5-instruct": "<SPECIAL_10>System\n\n<SPECIAL_11>User\n{task_template}\n<SPECIAL_11>Assistant\n",
}
#: a mark of a family's Hugging Face chat template -> RULER's template of the family (scripts/config_models.sh: Llama 3.1
#: meta-llama3, Llama 2 and Mistral meta-chat)
FAMILIES = (("<|start_header_id|>", "meta-llama3"), ("[INST]", "meta-chat"), ("<|START_OF_TURN_TOKEN|>", "command-r-chat"),
            ("[gMASK]", "chatglm-chat"), ("<|bom|>", "jamba"), ("<SPECIAL_11>", "nemotron5-instruct"),
            ("<|end|>", "Phi3"))
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT = "Document {i}:\n{document}"
DEPTHS = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


@lru_cache(maxsize=None)
def wonderwords(*files: str) -> list[str]:
    """The words of wonderwords' lists (RULER reads them with ``random_word._get_words_from_text_file``)."""
    from wonderwords.random_word import _get_words_from_text_file

    return [w for f in files for w in _get_words_from_text_file(f)]


@lru_cache(maxsize=1)
def adj_nouns() -> list[str]:
    """niah's word keys: every ``adjective-noun``, sorted (6.2 M strings)."""
    nouns = wonderwords("nounlist.txt")
    return sorted({f"{a}-{n}" for a in wonderwords("adjectivelist.txt") for n in nouns})


def sentences(text: str) -> list[str]:
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer().tokenize(text)


def fit(make: Callable[[int], tuple[str, Any]], count: Callable[[str], int], limit: int, lower: int, probe: int,
        upper: Callable[[float], int]) -> int:
    """RULER's binary search: the largest haystack size in ``[lower, upper(tokens per unit)]`` whose prompt
    has at most ``limit`` tokens (``lower`` if none)."""
    per = count(make(probe)[0]) / probe
    lo, hi, best = lower, max(upper(per), lower * 2), None
    while lo <= hi:
        mid = (lo + hi) // 2
        if count(make(mid)[0]) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return lower if best is None else best


class TooShort(TaskConfigError):
    """A length too short for a subtask: ``need``, the prompt tokens of its smallest haystack's sample (the most of
    the draws tried), generation and chat template excluded; :func:`generate` names the subtask and the length."""

    def __init__(self, need: int):
        super().__init__(f"RULER's smallest haystack needs {need} prompt tokens")
        self.need = need


def shrink(make: Callable[[int], tuple[str, Any]], count: Callable[[str], int], limit: int, size: int, step: int):
    """A sample at ``size``, redrawn ``step`` smaller while too long (RULER's retry loop); ``(text, answer, tokens)``.

    Raises:
        TooShort: still too long after 20 draws at the smallest size (RULER tries forever)."""
    floor = need = 0
    while floor < 20:
        text, answer = make(size)
        if (n := count(text)) <= limit:
            return text, answer, n
        if size <= step:
            floor, need = floor + 1, max(need, n)
        size -= step if size > step else 0
    raise TooShort(need)


def niah(subtask: str, length: int, room: int, n: int, seed: int, count, haystack_text: str) -> list[tuple]:
    """scripts/data/synthetic/niah.py."""
    limit = room - TASKS["niah"][2]
    kind, type_k, type_v, num_k, num_v, num_q = NIAH[subtask]
    num_k, rng = max(num_k, num_q), random.Random(seed)
    template = TASKS["niah"][0] + TASKS["niah"][1]
    haystack = re.sub(r"\s+", " ", haystack_text).split(" ") if kind == "essay" else NOISE if kind == "noise" else NEEDLE

    def draw(kind: str) -> str:
        if kind == "numbers":
            return str(rng.randint(10**6, 10**7 - 1))
        return rng.choice(adj_nouns()) if kind == "words" else str(uuid.UUID(int=rng.getrandbits(128), version=4))

    def make(size: int):
        keys, values, needles = [], [], []
        for _ in range(num_k):
            keys.append(draw(type_k))
            values.append([draw(type_v) for _ in range(num_v)])
            needles += [NEEDLE.format(type_needle_v=type_v, key=keys[-1], value=v) for v in values[-1]]
        random.Random(seed).shuffle(needles)
        if kind == "essay":
            sents = sentences(" ".join((haystack * -(-size // len(haystack)))[:size]).strip())
            cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles))) + [len(sents)]
            parts = []
            for i in range(1, len(cuts)):
                parts += [" ".join(sents[cuts[i - 1]:cuts[i]])] + ([needles[i - 1]] if i - 1 < len(needles) else [])
            context = " ".join(parts)
        else:
            lines = [haystack] * size if kind == "noise" else [
                NEEDLE.format(type_needle_v=type_v, key=draw(type_k), value=draw(type_v)) for _ in range(size)]
            for at, needle in zip(sorted(rng.sample(range(size), len(needles)), reverse=True), needles):
                lines.insert(at, needle)
            context = "\n".join(lines)
        picked = rng.sample(range(num_k), num_q)
        queries, answers = [keys[i] for i in picked], [a for i in picked for a in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        text, tv = template, type_v
        if num_q * num_v == 1:
            for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
                text = text.replace(a, b)
            tv = type_v[:-1]
        return text.format(type_needle_v=tv, context=context, query=query), answers

    step = 500 if kind == "essay" else 25 if length >= 4096 else 5
    size = fit(make, count, limit, step, step, lambda per: int(room / per * 3))
    return [shrink(make, count, limit, size, step) for _ in range(n)]


def vt(subtask: str, length: int, room: int, n: int, seed: int, count, haystack_text: str, num_chains=1, num_hops=4) -> list[tuple]:
    """scripts/data/synthetic/variable_tracking.py (noise haystack, one in-context example)."""
    rng, nprng = random.Random(seed), np.random.RandomState(seed)
    template = TASKS["vt"][0] + TASKS["vt"][1]

    def make(size: int, icl: bool = False):
        k, hops = (3, min(10, num_hops)) if icl else (5, num_hops)
        names = ["".join(rng.choices(string.ascii_uppercase, k=k)).upper() for _ in range((hops + 1) * num_chains)]
        while len(set(names)) < num_chains * (hops + 1):
            names.append("".join(rng.choices(string.ascii_uppercase, k=k)).upper())
        chains = []
        for i in range(0, len(names), hops + 1):
            v = names[i:i + hops + 1]
            chains.append([f"VAR {v[0]} = {12345 if icl else nprng.randint(10000, 99999)}"]
                          + [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(hops)])
        lines = [NOISE] * size
        for chain in chains:
            for j, at in enumerate(sorted(rng.sample(range(len(lines)), len(chain)))):
                lines.insert(at + j, chain[j])
        context = "\n".join(lines).replace(". \n", ".\n")
        return template.format(context=context, query=chains[0][0].split("=")[-1].strip(), num_v=hops + 1), names[:hops + 1]

    icl_make = lambda size: make(size, icl=True)  # noqa: E731
    icl_room = 500 - (length - room)  # RULER's example: 500 tokens less the template's, nothing generated
    text, answer, _ = shrink(icl_make, count, icl_room, fit(icl_make, count, icl_room, 5, 5, lambda per: int(icl_room / per * 3)), 5)
    example = text + " " + " ".join(answer) + "\n"
    limit, step = room - TASKS["vt"][2], 5 if length < 4096 else 10
    size = fit(make, count, limit - count(example), step, step, lambda per: int(room / per * 3))

    def with_example(size: int):
        text, answer = make(size)
        icl = example
        for name in icl.strip().split()[-num_hops - 1:]:
            icl = icl.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))).upper())
        return icl.replace("12345", str(nprng.randint(10000, 99999))) + "\n" + text, answer

    return [shrink(with_example, count, limit, size, step) for _ in range(n)]


def cwe(subtask: str, length: int, room: int, n: int, seed: int, count, haystack_text: str, num_cw=10,
        words_file: str | None = None) -> list[tuple]:
    """scripts/data/synthetic/common_words_extraction.py (freq_cw 30, freq_ucw 3, one few-shot example). A list longer
    than wonderwords' words (RULER's search probes such lists from about 64k tokens on) is drawn from RULER's
    ``json/english_words.json`` (``task.cwe_words``), as RULER does.

    Raises:
        TaskConfigError: the search needs more words than wonderwords' and ``task.cwe_words`` is not given or unreadable.
    """
    rng, template = random.Random(seed), TASKS["cwe"][0] + TASKS["cwe"][1]
    words = sorted(set(wonderwords("nounlist.txt", "adjectivelist.txt", "verblist.txt")))
    random.Random(seed).shuffle(words)

    def example(num_words: int, common: int, uncommon: int):
        picked = rng.sample(words if num_words <= len(words) else english_words(words_file), num_words)
        listed = picked[:num_cw] * common + picked[num_cw:] * uncommon
        random.Random(seed).shuffle(listed)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), picked[:num_cw]

    def make(num_words: int):
        shot, shot_answer = example(20, 3, 1) if length < 4096 else example(40, 10, 3)
        context, answer = example(num_words, 6, 1) if length < 4096 else example(num_words, 30, 3)
        shot = template.format(context=shot) + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(shot_answer))
        return shot + "\n" + template.format(context=context), answer

    limit = room - TASKS["cwe"][2]
    size = fit(make, count, limit, 10, 4096, lambda per: int(room // per) * 2)
    return [shrink(make, count, limit, size, 10) for _ in range(n)]


@lru_cache(maxsize=1)
def english_words(path: str | None) -> list[str]:
    """RULER's ``randle_words``: the values of ``json/english_words.json``."""
    if not path:
        raise TaskConfigError("task.cwe_words: cwe's search needs more words than wonderwords' lists hold; pass RULER's "
                              "scripts/data/synthetic/json/english_words.json (git LFS)")
    try:
        return list(json.loads(Path(path).expanduser().read_text(encoding="utf-8")).values())
    except (OSError, ValueError, AttributeError) as e:
        raise TaskConfigError(f"task.cwe_words={path}: not RULER's english_words.json ({e})") from None


def fwe(subtask: str, length: int, room: int, n: int, seed: int, count, haystack_text: str, alpha=2.0, wordlen=6) -> list[tuple]:
    """scripts/data/synthetic/freq_words_extraction.py (alpha 2: zeta(2) = pi^2/6; vocabulary length // 50)."""
    length = room - TASKS["fwe"][2]  # fwe fits the prompt alone to this
    if length // 50 < 4:  # the vocabulary: "..." and the 3 answers
        raise TooShort(4 * 50)
    rng, template, vocab_size, step = random.Random(seed), TASKS["fwe"][0] + TASKS["fwe"][1], length // 50, length // 32

    def make(num_words: int, grow: bool):
        vocab = ["".join(rng.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
        while len(set(vocab)) < vocab_size:
            vocab.append("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
        vocab = sorted(set(vocab))
        random.Random(seed).shuffle(vocab)
        vocab[0] = "..."

        def text(num: int):
            counts = (num * np.arange(1, len(vocab) + 1) ** -alpha / (math.pi ** 2 / 6)).astype(int)
            listed = [w for w, c in zip(vocab, counts) for _ in range(c)]
            random.Random(seed).shuffle(listed)
            return template.format(context=" ".join(listed))

        if grow:
            num_words = length // wordlen
            while count(text(num_words)) < length:
                num_words += step
            num_words -= step
        else:
            while count(text(num_words)) > length:
                num_words -= step
        return text(num_words), vocab[1:4], num_words

    num_words = make(0, grow=True)[2]
    return [(text, answer, count(text)) for text, answer, _ in (make(num_words, grow=False) for _ in range(n))]


#: the Hub copies of the files RULER's download_qa_dataset.sh fetches (SQuAD v2.0 dev, HotpotQA dev distractor)
QA_HUB = {"squad": ("rajpurkar/squad_v2", None), "hotpotqa": ("hotpotqa/hotpot_qa", "distractor")}
#: each qa subtask's dataset and the file download_qa_dataset.sh fetches for it
QA_FILES = {"qa_1": ("squad", "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v2.0.json"),
            "qa_2": ("hotpotqa", "http://curtis.ml.cmu.edu/datasets/hotpot/hotpot_dev_distractor_v1.json")}


def check_qa_file(subtask: str, files: dict | None) -> None:
    """Check that the qa ``subtask`` can read its data: its ``task.qa_files`` entry (in ``files``) is a file, or it
    is unset and the Hugging Face Hub reachable. TaskConfigError otherwise, naming the key and where RULER gets it."""
    from .longbench_data import hub_reachable

    dataset, url = QA_FILES[subtask]
    path = (files or {}).get(dataset)
    if path and not Path(path).expanduser().is_file():
        raise TaskConfigError(f"task.qa_files.{dataset}={path}: no such file{looked_for(Path(path))}")
    if not path and not hub_reachable():
        raise TaskConfigError(f"task.qa_files.{dataset}: not set and the Hugging Face Hub is unreachable; {subtask} "
                              f"reads {url} (RULER's download_qa_dataset.sh): pass task.qa_files.{dataset}=<that file>, "
                              f"or leave {subtask} out of task.subtasks")


def hub_qa(dataset: str) -> Any:
    """The validation split of :data:`QA_HUB` in the official json's structure (SQuAD: articles by title,
    paragraphs by context; HotpotQA: ``context`` as ``[title, sentences]`` pairs). TaskConfigError: the Hub is
    unreachable (:func:`check_qa_file`)."""
    from datasets import load_dataset

    check_qa_file(next(s for s, (d, _) in QA_FILES.items() if d == dataset), None)
    rows = load_dataset(*QA_HUB[dataset], split="validation")
    if dataset == "hotpotqa":
        return [{"question": r["question"], "answer": r["answer"],
                 "context": list(zip(r["context"]["title"], r["context"]["sentences"]))} for r in rows]
    articles: dict[str, dict[str, list]] = {}
    for r in rows:
        articles.setdefault(r["title"], {}).setdefault(r["context"], []).append(
            {"question": r["question"], "answers": [{"text": t} for t in r["answers"]["text"]],
             "is_impossible": not r["answers"]["text"]})
    return {"data": [{"paragraphs": [{"context": c, "qas": q} for c, q in a.items()]} for a in articles.values()]}


def read_qa(dataset: str, path: str | None) -> tuple[list[dict], list[str]]:
    """RULER's ``read_squad`` (SQuAD v2 dev json, answerable questions, the article's other paragraphs as
    ``more``) and ``read_hotpotqa`` (HotpotQA dev distractor json): ``(questions, documents)``; ``path`` None:
    :func:`hub_qa`."""
    try:
        data = json.loads(Path(path).expanduser().read_text(encoding="utf-8")) if path else None
    except (OSError, ValueError) as e:
        raise TaskConfigError(f"task.qa_files.{dataset}={path}: not a readable {dataset} json file ({e})") from None
    data = data or hub_qa(dataset)
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        at = {c: i for i, c in enumerate(docs)}
        qas = [{"query": q["question"], "outputs": [a["text"] for a in q["answers"]], "context": [at[p["context"]]],
                "more": [at[o["context"]] for o in d["paragraphs"] if at[o["context"]] != at[p["context"]]]}
               for d in data["data"] for p in d["paragraphs"] for q in p["qas"] if not q["is_impossible"]]
        return qas, docs
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    at = {c: i for i, c in enumerate(docs)}
    return [{"query": d["question"], "outputs": [d["answer"]], "context": [at[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
             "more": []} for d in data], docs


def qa(subtask: str, length: int, room: int, n: int, seed: int, count, haystack_text: str, files: dict | None = None) -> list[tuple]:
    """scripts/data/synthetic/qa.py (qa_1: SQuAD, qa_2: HotpotQA)."""
    dataset = "squad" if subtask == "qa_1" else "hotpotqa"
    qas, docs = read_qa(dataset, (files or {}).get(dataset))
    rng, template = random.Random(seed), TASKS["qa"][0] + TASKS["qa"][1]

    def make(index: int, num_docs: int):
        q = qas[index]
        if num_docs < len(docs):
            if num_docs - len(q["context"]) > len(q["more"]):
                rest = [i for i in range(len(docs)) if i not in q["context"] + q["more"]]
                picked = q["context"] + q["more"] + rng.sample(rest, max(0, num_docs - len(q["context"]) - len(q["more"])))
            else:
                picked = q["context"] + rng.sample(q["more"], num_docs - len(q["context"]))
            picked = [docs[i] for i in picked]
        else:
            picked = (docs * -(-num_docs // len(docs)))[:num_docs]
        random.Random(seed).shuffle(picked)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(picked))
        return template.format(context=context, query=q["query"]), q["outputs"]

    limit = room - TASKS["qa"][2]
    size = fit(lambda k: make(0, k), count, limit, 10, 10, lambda per: int(room / per * 3))
    return [shrink(lambda k, i=i: make(i, k), count, limit, size, 10) for i in range(n)]


GENERATORS = {"niah": niah, "vt": vt, "cwe": cwe, "fwe": fwe, "qa": qa}


def generate(cfg: dict, tokenizer: Any, overhead: int, haystack_text: str) -> dict[str, str]:
    """RULER's ``validation.jsonl`` of every subtask and length of ``cfg`` (task.subtasks, context_lengths,
    n_samples (default 500, RULER's), seed, qa_files): ``{"<length>/data/<subtask>/validation.jsonl": text}``.
    A prompt has at most ``length - tokens_to_generate - overhead`` tokens (``tokenizer.tokenize``);
    ``overhead``: the chat template's own tokens.

    Raises:
        TaskConfigError: qa without its file, cwe beyond wonderwords' words without ``task.cwe_words``, or a length
            below a subtask's minimum (its smallest haystack's prompt + tokens_to_generate + ``overhead``), naming the
            subtask, the minimum and the fix; one row of each subtask at the shortest length is made first, so that
            this comes before the long generation.
    """
    count = lambda text: len(tokenizer.tokenize(text))  # noqa: E731

    def rows(subtask: str, length: int, n: int) -> list[tuple]:
        fam = subtask.split("_")[0]
        extra = {"files": cfg.get("qa_files")} if fam == "qa" else {"words_file": cfg.get("cwe_words")} if fam == "cwe" else {}
        try:
            return GENERATORS[fam](subtask, length, length - overhead, n, cfg.get("seed", 42), count, haystack_text, **extra)
        except TooShort as e:
            need = e.need + TASKS[fam][2] + overhead
            raise TaskConfigError(f"task.context_lengths={length}: RULER's {subtask} needs at least {need} tokens with "
                                  f"this tokenizer ({e.need} of its smallest prompt, {TASKS[fam][2]} generated, {overhead} "
                                  f"of the chat template); use lengths >= {need} or leave {subtask} out of task.subtasks") from None

    for subtask in cfg["subtasks"]:
        rows(subtask, min(cfg["context_lengths"]), 1)
    out = {}
    for subtask in cfg["subtasks"]:
        fam = subtask.split("_")[0]
        for length in cfg["context_lengths"]:
            prefix, tokens_to_generate = TASKS[fam][1:]
            lines = []
            for i, (text, answer, n) in enumerate(rows(subtask, length, cfg.get("n_samples") or 500)):
                cut, length_ = text.rfind(prefix[:10]), n + tokens_to_generate
                row = {"index": i, "input": text[:cut], "outputs": answer, "length": length_,
                       "length_w_model_temp": length_ + overhead, "answer_prefix": text[cut:]}
                if fam == "niah":  # niah.py: index is the answer's character offset, and its position in tokens
                    row["index"] = text[:cut].find(answer[0])
                    row["token_position_answer"] = count(text[:cut][:row["index"]])
                lines.append(json.dumps(row) + "\n")
            out[f"{length}/data/{subtask}/validation.jsonl"] = "".join(lines)
    return out
