"""RULER (Hsieh et al., 2024), the synthetic long-context suite of KV-compression papers and kvpress's
leaderboard: 13 subtasks at a context length, scored by substring match.

Data, in ``task.data_dir`` (:func:`data_files`), one file per subtask and length: RULER's own output
(``<length>/data/<subtask>/validation.jsonl``, rows ``input``, ``answer_prefix``, ``outputs``), the older
``<subtask>_<length>.jsonl`` files (the answer prefix inside ``input``), or a local copy of kvpress's
distribution (``<length>/test-*.parquet``: ``context``, ``question``, ``answer_prefix``, ``answer``, ``task``);
with no ``data_dir``, that distribution from the Hub (``task.hub_dataset``); with ``task.generate``, RULER's generator
run for the model's tokenizer (:mod:`eval.ruler_data`, the files kept in the job folder). Every row is one sample, its id
``<subtask>/<length>/<row>`` (RULER's ``index`` repeats). The prompt is ``input + answer_prefix`` as RULER's
``pred/call_api.py`` sends it; ``task.chat_template`` wraps ``input`` in RULER's template of the model's family
(``scripts/data/template.py``; default), the tokenizer's own (``true``: kvpress's pipeline) or none, and the answer
prefix follows, where RULER's ``prepare.py`` puts it. ``Sample.query`` is the question (from RULER's question line, split as
kvpress's ``create_huggingface_dataset.py`` does), the template's tail and the answer prefix.
Generation limits are RULER's ``tokens_to_generate`` per task family; scores are RULER's
``string_match_all`` (the share of references found in the prediction, case-insensitive) for the
niah / vt / cwe / fwe subtasks and ``string_match_part`` (any reference found) for qa.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

from .base import Sample, Task, TaskConfig, TaskConfigError, count, is_data_file, looked_for, read_jsonl, require
from .ruler_data import FAMILIES, QA_FILES, TASKS, TEMPLATES, check_qa_file

SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
            "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
#: RULER's tokens_to_generate per task family (its constants.py)
MAX_NEW_TOKENS = {family: task[2] for family, task in TASKS.items()}
#: where each family's question starts in RULER's templates (its last match); kvpress splits there too
QUESTION = {"niah": r"What (?:is|are all) the special magic", "vt": r"Question: Find all variables",
            "cwe": r"Question: What are the 10 most common words", "fwe": r"Question: Do not provide any explanation",
            "qa": r"Answer the question based on the given documents"}
#: the first characters of each family's answer prefix: RULER's generator cuts ``input`` at their last
#: occurrence (``input_text.rfind(answer_prefix[:10])``); files without ``answer_prefix`` are cut the same way
PREFIX_START = {family: task[1][:10] for family, task in TASKS.items()}


def family(subtask: str) -> str:
    return subtask.split("_")[0]


def max_new_tokens(subtask: str) -> int:
    return MAX_NEW_TOKENS[family(subtask)]


def postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: control characters become newlines, outer whitespace is stripped."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Share of ``references`` contained in ``prediction`` (case-insensitive), in [0, 1]."""
    pred = postprocess(prediction).lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """1.0 when any reference is contained in ``prediction`` (case-insensitive), else 0.0."""
    pred = postprocess(prediction).lower()
    return float(any(r.lower() in pred for r in references))


def data_files(data_dir: str, subtask: str, length: int) -> list[Path]:
    """The file(s) holding ``subtask`` at ``length`` in ``data_dir``, first layout found: RULER's
    ``<length>/data/<subtask>/validation.jsonl`` (or without ``data/``, as kvpress's generate.sh writes it),
    ``<subtask>_<length>.jsonl``, kvpress's ``<length>/test-*.parquet``; [] when none is there."""
    d = Path(data_dir).expanduser()
    for path in (d / str(length) / "data" / subtask / "validation.jsonl", d / str(length) / subtask / "validation.jsonl",
                 d / f"{subtask}_{length}.jsonl"):
        if is_data_file(path):
            return [path]
    return sorted((d / str(length)).glob("test-*.parquet"))


def check_row(row: dict, where: str) -> None:
    """Check a RULER jsonl row (``where``: its file and line). TaskConfigError: ``input`` is not a string,
    ``outputs`` not a list of strings, or ``answer_prefix`` neither absent, null nor a string."""
    outputs, prefix = row.get("outputs"), row.get("answer_prefix", "")
    ok = isinstance(row.get("input"), str) and isinstance(outputs, list) and all(isinstance(o, str) for o in outputs)
    if not ok or not isinstance(prefix, (str, type(None))):
        raise TaskConfigError(f"{where}: a RULER row has 'input' (a string), 'outputs' (a list of strings) and "
                              f"optionally 'answer_prefix' (a string); got {', '.join(sorted(row)) or 'no field'}")


def chat(tokenizer: Any, text: str, template: Any = True) -> str:
    """``text`` in a chat template with the assistant's turn opened (RULER's ``prepare.py``:
    ``model_template.format(task_template=...)``), without the BOS the engine's tokenizer adds itself. ``template``:
    ``True`` the tokenizer's own (unchanged text without one), ``False`` none, a name of :data:`TEMPLATES` (RULER's
    ``template.py``), or ``"ruler"``: RULER's template of the tokenizer's family (:data:`FAMILIES`: its chat template
    holds the family's mark), else the tokenizer's own."""
    if template == "ruler":
        own = getattr(tokenizer, "chat_template", None) or ""
        template = next((name for mark, name in FAMILIES if mark in own), True)
    if template is False or tokenizer is None or (template is True and not getattr(tokenizer, "chat_template", None)):
        return text
    out = TEMPLATES[template].replace("{task_template}", text) if template is not True else tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    bos = tokenizer.bos_token
    return out[len(bos):] if bos and out.startswith(bos) and tokenizer("x")["input_ids"][:1] == [tokenizer.bos_token_id] else out


def generated(cfg: dict, tokenizer: Any) -> dict[str, str]:
    """``task.generate``: RULER's files for ``cfg`` built with ``tokenizer`` (:func:`eval.ruler_data.generate`;
    the essays of ``task.haystack_dir`` as NIAH reads them), ``{"<length>/data/<subtask>/validation.jsonl": text}``.

    Raises:
        TaskConfigError: a haystack folder, qa file or cwe length that cannot serve, or a length below a subtask's
            minimum (:func:`eval.ruler_data.generate`)."""
    from .niah import load_haystack
    from .ruler_data import NIAH, generate

    essay = any(NIAH.get(s, ("",))[0] == "essay" for s in cfg["subtasks"])
    haystack = load_haystack({"haystack_dir": cfg.get("haystack_dir")})[0] if essay else ""
    return generate(cfg, tokenizer, len(tokenizer.tokenize(chat(tokenizer, "", cfg.get("chat_template", "ruler")))), haystack)


def split(subtask: str, text: str, answer_prefix: str | None) -> tuple[str, str, str]:
    """``(context, question, answer_prefix)`` of a RULER input; ``answer_prefix`` None: cut from ``text``'s
    end as RULER's generator does (:data:`PREFIX_START`). The question starts at the last match of
    :data:`QUESTION` ("" when none: the whole text is context)."""
    if answer_prefix is None:
        cut = text.rfind(PREFIX_START[family(subtask)])
        text, answer_prefix = (text[:cut], text[cut:]) if cut >= 0 else (text, "")
    starts = [m.start() for m in re.finditer(QUESTION[family(subtask)], text)]
    at = starts[-1] if starts else len(text)
    return text[:at], text[at:], answer_prefix


@dataclass
class RulerConfig(TaskConfig):
    """``conf/task/ruler.yaml``: RULER's 13 synthetic subtasks as KV-compression papers and kvpress's leaderboard use it."""

    name: str = "ruler"
    subtasks: List[str] = field(default_factory=lambda: list(SUBTASKS))  # any of SUBTASKS
    context_lengths: List[int] = field(default_factory=lambda: [4096])  # tokens: RULER's data per length
    n_samples: Optional[int] = None  # first n rows of each subtask and length; null = all (generate: 500, RULER's)
    # RULER's output folder (<length>/data/<subtask>/validation.jsonl), <subtask>_<length>.jsonl files or kvpress's
    # copy (<length>/test-*.parquet); null = the Hub
    data_dir: Optional[str] = None
    hub_dataset: str = "simonjegou/ruler"  # the Hub dataset kvpress's leaderboard reads when data_dir is null
    # the input's chat template, the answer prefix after it (RULER's placement): ruler (RULER's template.py template of
    # the model's family, else the tokenizer's), true (the tokenizer's; kvpress), false (none: files already templated)
    # or a template.py name (meta-llama3, meta-chat, vicuna-chat, ...)
    chat_template: Any = "ruler"
    generate: bool = False  # true: build RULER's data for the model's tokenizer (RULER's generator), kept in the job folder
    seed: int = 42  # the generator's seed (RULER's --random_seed)
    # generate: the essays (.txt) of the essay haystack, e.g. ../shared/data/paul_graham_essays; null = the Hub, else embedded
    haystack_dir: Optional[str] = None
    # generate: SQuAD v2.0 dev / HotpotQA dev distractor json (RULER's download_qa_dataset.sh); null = the Hub
    qa_files: Dict[str, Optional[str]] = field(default_factory=lambda: {"squad": None, "hotpotqa": None})
    cwe_words: Optional[str] = None  # generate: RULER's json/english_words.json (git LFS), for cwe lists over 8166 words

    def check(self) -> None:
        require(bool(self.subtasks) and set(self.subtasks) <= set(SUBTASKS), "subtasks", self.subtasks,
                f"a non-empty list of {', '.join(SUBTASKS)}")
        require(bool(self.context_lengths) and min(self.context_lengths) > 0, "context_lengths", self.context_lengths,
                "must be a non-empty list of positive integers (tokens)")
        count(self.n_samples, "n_samples")
        require(self.chat_template in (True, False, "ruler", *TEMPLATES), "chat_template", self.chat_template,
                f"accepted values are ruler, true, false, {', '.join(TEMPLATES)}")


class RulerTask(Task):
    """RULER subtasks × context lengths; sample ids ``<subtask>/<length>/<row>``."""

    name = "ruler"
    Config = RulerConfig

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """Raises: TaskConfigError for a missing file, or no ``data_dir`` (with ``generate``: no qa file) while the Hub
        is unreachable."""
        subtasks, lengths = cfg["subtasks"], cfg["context_lengths"]
        if cfg.get("generate"):
            if cfg.get("data_dir"):
                raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: set with task.generate=true; keep one of the two")
            for s in [s for s in subtasks if s in QA_FILES]:  # the lengths: with the tokenizer (ruler_data.generate)
                check_qa_file(s, cfg.get("qa_files"))
            return
        if not cfg.get("data_dir"):
            from .longbench_data import hub_reachable

            if not hub_reachable():
                raise TaskConfigError("task.data_dir is not set and the Hugging Face Hub is unreachable: pass "
                                      "task.data_dir=/path/to/ruler (RULER's output folder or its jsonl files)")
            return
        for s in subtasks:
            for length in lengths:
                files = data_files(cfg["data_dir"], s, length)
                if not files:
                    d = Path(cfg["data_dir"]).expanduser()
                    raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: no {length}/data/{s}/validation.jsonl, "
                                          f"{s}_{length}.jsonl or {length}/test-*.parquet{looked_for(d)}")
                if files[0].suffix == ".jsonl" and not read_jsonl(files[0], check_row, cfg.get("n_samples")):
                    raise TaskConfigError(f"task.data_dir={cfg['data_dir']}: {files[0]} holds no samples")

    @classmethod
    def data_files(cls, cfg: dict) -> list[Path]:
        """The RULER files of ``data_dir`` in any layout (their SHA-256 are part of the job's identity)."""
        d = Path(cfg["data_dir"]).expanduser()
        return sorted({p for g in ("*.jsonl", "*/data/*/validation.jsonl", "*/*/validation.jsonl", "*/test-*.parquet")
                       for p in d.glob(g)})

    def rows(self, subtask: str, length: int) -> list[dict[str, Any]]:
        """The first ``n_samples`` rows as ``{input, answer_prefix, outputs}`` (``answer_prefix`` None: inside
        ``input``), from ``data_dir`` or the Hub."""
        n = self.cfg.get("n_samples")
        if "files" in self.resolved:  # task.generate: the generated text, stored in the job folder
            rows = [json.loads(line) for line in self.resolved["files"][f"{length}/data/{subtask}/validation.jsonl"].splitlines()]
            return rows[:n]
        files = data_files(self.cfg["data_dir"], subtask, length) if self.cfg.get("data_dir") else []
        if files and files[0].suffix == ".jsonl":
            return [{"input": r["input"], "answer_prefix": r.get("answer_prefix"), "outputs": r["outputs"]}
                    for r in read_jsonl(files[0], limit=n)]
        if files:
            import pandas as pd

            rows = pd.concat([pd.read_parquet(f) for f in files]).to_dict("records")
        else:
            from datasets import load_dataset

            rows = load_dataset(self.cfg["hub_dataset"], str(length), split="test")
        rows = [r for r in rows if r["task"] == subtask][:n]
        return [{"input": r["context"] + r["question"], "answer_prefix": r["answer_prefix"], "outputs": r["answer"]}
                for r in rows]

    def samples(self) -> Iterator[Sample]:
        for subtask in self.cfg["subtasks"]:
            for length in self.cfg["context_lengths"]:
                for i, row in enumerate(self.rows(subtask, length)):
                    context, question, prefix = split(subtask, row["input"], row["answer_prefix"])
                    head = chat(self.tokenizer, context + question, self.cfg.get("chat_template", "ruler"))
                    at = head.rfind(question) if question else -1
                    yield Sample(id=f"{subtask}/{length}/{i}", dataset=subtask, prompt=head + prefix,
                                 max_new_tokens=max_new_tokens(subtask), answers=list(row["outputs"]), chat=False,
                                 meta={"context_length": length}, query=(head[at:] if at >= 0 else "") + prefix)

    def score(self, sample: Sample, prediction: str) -> float:
        match = string_match_part if sample.dataset.startswith("qa") else string_match_all
        return match(prediction, sample.answers)

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per-subtask scores (×100) and their ``average``."""
        out = super().aggregate(records)
        scores = [v["score"] for v in out["datasets"].values()]
        out["averages"] = {"ruler": round(sum(scores) / len(scores), 2) if scores else None}
        return out
