"""SCBench (Li et al., 2025, "SCBench: A KV Cache-Centric Analysis of Long-Context Methods"): 12 tasks whose
questions share one long context, in SCBench's two shared-context modes, with microsoft/MInference's protocol
(commit fb56c91: ``scbench/eval_utils.py``, ``scbench/run_scbench.py``, ``scbench/compute_scores.py``).

A data row (``id``, ``context`` (``scbench_mf``: a list of numbers), ``multi_turns``: ``[{"input", "answer", ...}]``)
becomes a group of samples (``Sample.group`` = ``<dataset>/<row index>``, ``turn`` = the question's index, ids
``<dataset>/<row index>/<turn>``); ``task.max_turns`` cuts every row's turns when the first row has more (as
``--max_turns``, default 5). The templates (``suite_config/scbench.json``, verbatim) are rendered as the official
code renders them, with the tokenizer's chat template (``task.chat_template``, the official scripts'
``--use_chat_template``) or without, into text the engine tokenizes as is (``Sample.chat`` off):

* ``multi_turn`` (``create_multiturn_prompt``): turn 0 is the first-turn prompt (context + first question; the
  query part, left uncompressed under ``task.compress=context``, is what follows the context); each later turn is a
  ``follow_up`` sample whose prompt is the segment SCBench appends to the cache: with ``task.golden_context``
  (default) the previous turn's golden answer and the next question (``keep_answer`` off: the model's answer is
  rolled back), else (``--disable_golden_context``) the next question only (``keep_answer`` on: the model's own
  answer stays in the cache). In chat mode the segment is the template's rendering of
  ``[system "", assistant <golden answer>, user <question>]`` (own answers: ``[user <question>]``) less the
  rendering of the lone system message, ``This paper`` appended for ``scbench_summary``; ``scbench_mf``'s chat
  follow-ups all name the last turn's target, as the official list comprehension does.
* ``multi_request`` (``create_scdq_prompt``, ``--same_context_different_query``): each question is a sample whose
  prompt is the context prompt + that question's query prompt (query = the latter); the mode implies
  ``task.compress=context``: the context is compressed once for the group.

Truncation (``get_pred``): only the context-bearing prompt, by tokens, in the middle (the kept ids are fed as they
are: ``Sample.ids``), to ``max_input_length = max_seq_length - max_new_tokens × turns`` (the mixed tasks: ``-
sum(max_new_tokens) × turns // 2``; minus 1000 more in ``multi_request``), ``turns`` = the first row's turn count after ``max_turns``; ``task.max_length`` is
SCBench's ``--max_seq_length`` (official 131072; null: the model's input budget). Each question generates up to its
task's ``DATA_NAME_TO_MAX_NEW_TOKENS`` (a mixed dataset: its turn's ``task``). Scores: :mod:`eval.scbench_metrics`.
Data: ``task.data_dir`` (``<dataset>.jsonl`` files holding the Hub's rows) or ``data/<dataset>.jsonl`` of the Hub
dataset ``microsoft/SCBench``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from .base import Sample, TaskConfigError, count, one_of
from .scbench_metrics import FUNCTION_QUERY, SCORERS, score_repoqa
from .suite import SuiteConfig, SuiteTask, require, split

_CONFIG = json.loads((Path(__file__).parent / "suite_config" / "scbench.json").read_text(encoding="utf-8"))
FIRST_TURN: dict[str, str] = _CONFIG["first_turn"]  # multiturn_templates
CONTEXT: dict[str, str] = _CONFIG["context"]  # multiturn_templates_scdq (its context part)
FOLLOW_UP: dict[str, str] = _CONFIG["follow_up"]  # multiturn_follow_up_templates (golden answers, no chat)
FOLLOW_UP_CHAT: dict[str, str] = _CONFIG["follow_up_chat"]  # ..._in_chat_tempate: chat turns, own answers, queries
MAX_NEW_TOKENS: dict[str, Any] = _CONFIG["max_new_tokens"]  # DATA_NAME_TO_MAX_NEW_TOKENS (a dict: per turn task)
DATASETS = tuple(FIRST_TURN)
REPOQA = ("scbench_repoqa", "scbench_repoqa_and_kv")
SEP = "[SEPSEPSEP]"  # create_scdq_prompt's special_delimiter
MARK = "\ue000"  # a private-use character: in no template or data
MODES = ("multi_turn", "multi_request")
#: rows (contexts) per dataset of microsoft/SCBench's test split (its dataset viewer)
ROWS = {"scbench_kv": 100, "scbench_prefix_suffix": 100, "scbench_vt": 90, "scbench_repoqa": 88,
        "scbench_qa_eng": 69, "scbench_qa_chn": 35, "scbench_choice_eng": 58, "scbench_many_shot": 54,
        "scbench_summary": 70, "scbench_mf": 100, "scbench_summary_with_needles": 70, "scbench_repoqa_and_kv": 88}
#: SCBench's four capabilities (Li et al. 2024, Table 1) and the tasks that test each, in the paper's order
CAPABILITIES = {"string retrieval": DATASETS[:3], "semantic retrieval": DATASETS[3:7],
                "global information": DATASETS[7:10], "multi-tasking": DATASETS[10:]}


@dataclass
class SCBenchConfig(SuiteConfig):
    """SCBench's keys beside :class:`eval.suite.SuiteConfig`'s (``max_length``: ``--max_seq_length``)."""

    mode: str = "multi_turn"  # multi_turn (turns in sequence) | multi_request (--same_context_different_query)
    max_turns: Optional[int] = 5  # --max_turns: the first turns of each row; null = all
    golden_context: bool = True  # multi_turn: golden answers in the cache; false = own (--disable_golden_context)
    chat_template: bool = True  # --use_chat_template (the official scripts'); false = the plain templates

    def check(self) -> None:
        count(self.n_samples, "n_samples")
        count(self.max_length, "max_length")
        count(self.max_turns, "max_turns")
        one_of(self.source, "source", ("official",))
        one_of(self.mode, "mode", MODES)
        if self.mode == "multi_request":  # the questions share the context: compressed once per row, never per question
            self.compress = "context"


def fields(dataset: str, turn: dict) -> dict[str, Any]:
    """The template fields of one turn: ``input``, ``question``, the options ``OPTION_A``–``D``, and ``scbench_mf``'s
    ``prefix`` (``What is <target>?``, ``<target>`` from ``The ... is`` in the input)."""
    out = {"input": turn["input"], "question": turn["input"]}
    out.update({f"OPTION_{c}": o for c, o in zip("ABCD", turn.get("options") or [])})
    if dataset == "scbench_mf":
        out["prefix"] = f"What is {re.findall(r'The .+ is', turn['input'])[0].lower()[:-3]}?"
    return out


def label_of(dataset: str, turn: dict) -> Any:
    """``get_ground_truth``: ``[answer, letter]`` (choice), ``[answer]`` (English QA), else the answer."""
    if dataset == "scbench_choice_eng":
        return [turn["answer"], "ABCD"[turn["options"].index(turn["answer"])]]
    return [turn["answer"]] if dataset == "scbench_qa_eng" else turn["answer"]


def middle_truncate(tokenizer: Any, text: str, limit: int) -> tuple[str, list[int] | None, int]:
    """``truncate_by_tokens``: ``ids = tokenizer.encode(text)`` (special tokens added); above ``limit`` (>= 0) the
    first and last ``limit // 2`` ids are kept. Returns the text of the kept ids (for the record; the tokens the
    tokenizer adds itself left out), the kept ids, which ``get_pred`` feeds as they are (None: not cut, the text's
    own ids), and the untruncated length in tokens."""
    ids = list(tokenizer(text).input_ids)
    if limit < 0 or len(ids) <= limit:
        return text, None, len(ids)
    kept, added = ids[:limit // 2] + ids[-(limit // 2):], len(tokenizer("").input_ids)
    return tokenizer.decode(kept[added:], clean_up_tokenization_spaces=False), kept, len(ids)


class SCBenchTask(SuiteTask):
    """SCBench's 12 tasks (``task.datasets``) in ``task.mode``; a sample per question (module docstring)."""

    name = "scbench"
    subsets = DATASETS
    official_hub = "microsoft/SCBench"
    what = "SCBench's <dataset>.jsonl files (huggingface.co/datasets/microsoft/SCBench, data/)"
    Config = SCBenchConfig

    def __init__(self, cfg: dict, tokenizer: Any = None, max_input_tokens: int | None = None, encode: Any = None,
                 resolved: dict | None = None):
        super().__init__(cfg, tokenizer, max_input_tokens, encode, resolved)
        self.needles: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (dataset, repo) -> [(name, code)]

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """:meth:`SuiteTask.validate`; TaskConfigError also when a RepoQA dataset is chosen without tree-sitter."""
        super().validate(cfg)
        if set(cfg.get("datasets") or DATASETS) & set(REPOQA):
            try:
                import tree_sitter_languages  # noqa: F401
            except ImportError:
                raise TaskConfigError("task.datasets: the RepoQA scorer (scbench_repoqa, scbench_repoqa_and_kv) needs "
                                      "tree-sitter-languages: pip install -e '.[scbench]'") from None

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        """The fields the protocol reads: ``context`` (or ``input``), ``multi_turns`` with ``input`` and ``answer``;
        choice: 4 ``options`` holding the answer; mixed: each turn's ``task``; RepoQA: ``lang``, ``repo``, ``name``."""
        require(row, where, multi_turns=list,
                **{"context" if "context" in row else "input": (list, str) if dataset == "scbench_mf" else str})
        if not row["multi_turns"] or not all(isinstance(t, dict) for t in row["multi_turns"]):
            raise TaskConfigError(f"{where}: field 'multi_turns' must be a non-empty list of objects")
        if dataset in REPOQA:
            require(row, where, lang=str, repo=str)
            one_of(row["lang"], f"data_dir: {where}: lang", tuple(FUNCTION_QUERY))
        for i, turn in enumerate(row["multi_turns"]):
            at = f"{where} multi_turns[{i}]"
            require(turn, at, input=str, answer=(str, int, float, list))
            if isinstance(MAX_NEW_TOKENS[dataset], dict):
                require(turn, at, task=str)
                one_of(turn["task"], f"data_dir: {at}: task", tuple(MAX_NEW_TOKENS[dataset]))
            if dataset == "scbench_choice_eng":
                require(turn, at, options=list)
                if len(turn["options"]) != 4 or turn["answer"] not in turn["options"]:
                    raise TaskConfigError(f"{at}: field 'options' must be 4 strings, the answer among them")
            if dataset == "scbench_mf" and not re.search(r"The .+ is", turn["input"]):
                raise TaskConfigError(f"{at}: field 'input' names no 'The ... is' target")
            if turn.get("task", dataset) == "scbench_repoqa":
                require(turn, at, name=str)

    def official_hub_file(self, dataset: str) -> Path:
        from huggingface_hub import hf_hub_download

        repo = self.cfg.get("hub_dataset") or self.official_hub
        return Path(self._hub(lambda: hf_hub_download(repo, f"data/{dataset}.jsonl", repo_type="dataset")))

    def tokens_needed(self, sample: Sample) -> int:
        """SCBench's ``max_seq_length``: the prompt budget leaves room for every turn's generation."""
        return self.max_length

    # ------------------------------------------------------------------ rendering

    def render(self, messages: list[dict], generation: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)

    def first_turn(self, dataset: str, context: Any, turn: dict) -> tuple[str, str]:
        """The first-turn prompt and its query part: what follows the context (rendered with a mark for it)."""
        values = fields(dataset, turn)
        text, marked = (FIRST_TURN[dataset].format(context=c, **values) for c in (context, MARK))
        if self.cfg["chat_template"]:
            text, marked = (self.render([{"role": "user", "content": t}]) for t in (text, marked))
        return text, marked.split(MARK, 1)[1]

    def follow_up(self, dataset: str, previous: dict, turn: dict, last: dict) -> str:
        """The segment appended before ``turn`` (after ``previous`` was answered); ``last``: the row's last turn."""
        values, golden = fields(dataset, turn), self.cfg["golden_context"]
        if not self.cfg["chat_template"]:
            return (FOLLOW_UP if golden else FOLLOW_UP_CHAT)[dataset].format(pre_ans=previous["answer"], **values)
        if dataset == "scbench_mf":
            values["prefix"] = fields(dataset, last)["prefix"]
        user = {"role": "user", "content": FOLLOW_UP_CHAT[dataset].format(**values)}
        system = [{"role": "system", "content": ""}]
        history = system + [{"role": "assistant", "content": str(previous["answer"])}] if golden else []
        text = self.render(history + [user]).replace(self.render(system, golden), "")
        return text + "This paper" * (dataset == "scbench_summary")

    def context_prompt(self, dataset: str, context: Any, first: dict) -> str:
        """``create_scdq_prompt``'s context prompt (``scbench_mf``: the first raw input as its prefix)."""
        text = CONTEXT[dataset].format(context=context, prefix=first["input"])
        if self.cfg["chat_template"]:
            text = self.render([{"role": "user", "content": text + SEP}]).split(SEP)[0]
        return text

    def query_prompt(self, dataset: str, turn: dict) -> str:
        text = FOLLOW_UP_CHAT[dataset].format(**fields(dataset, turn))
        if self.cfg["chat_template"]:
            text = self.render([{"role": "system", "content": ""}, {"role": "user", "content": SEP + text}])
            text = text.split(SEP)[1]
        return text

    # ------------------------------------------------------------------ samples

    @classmethod
    def documented(cls, cfg: dict) -> list[int] | None:
        """``max_turns`` questions (None when null) of each documented row (:data:`ROWS`; ``n_samples`` at most), each
        up to its task's limit (a mixed dataset's largest)."""
        if not cfg.get("max_turns"):
            return None
        limits = {d: max(t.values()) if isinstance(t := MAX_NEW_TOKENS[d], dict) else t for d in MAX_NEW_TOKENS}
        return [limits[d] for d in cfg.get("datasets") or DATASETS
                for _ in range(min(ROWS[d], cfg.get("n_samples") or ROWS[d]) * cfg["max_turns"])]

    def turns(self, rows: list[dict]) -> tuple[list[dict], int]:
        """Rows with ``max_turns`` applied as run_scbench.py does, and the turn count of its truncation budget."""
        n, cut = len(rows[0]["multi_turns"]), self.cfg.get("max_turns")
        if cut and cut < n:
            return [{**r, "multi_turns": r["multi_turns"][:cut]} for r in rows], cut
        return rows, n

    def samples(self) -> Iterator[Sample]:
        if self.max_length is None:
            raise TaskConfigError("task.max_length is not set and the model gives no max_input_length: "
                                  "set task.max_length")
        if self.cfg["chat_template"] and not getattr(self.tokenizer, "chat_template", None):
            raise TaskConfigError("task.chat_template=true: the tokenizer has no chat template; "
                                  "set task.chat_template=false")
        for dataset in self.datasets:
            rows, n_turns = self.turns(self.rows(dataset))
            table, total = MAX_NEW_TOKENS[dataset], self.max_length
            if isinstance(table, dict):
                limit = total - sum(table.values()) * n_turns // 2
            else:
                table = table if table < total else 500
                limit = total - table * n_turns
            limit -= 1000 * (self.cfg["mode"] == "multi_request")
            for repo in {row.get("repo") for row in rows}:  # repo_qa_utils' needle_by_repo, in row and turn order
                self.needles[(dataset, repo)] = [
                    (t["name"], t["answer"]) for row in rows if row.get("repo") == repo
                    for t in row["multi_turns"] if t.get("task", dataset) == "scbench_repoqa"]
            for index, row in enumerate(rows):
                yield from self.group(dataset, index, row, table, limit)

    def group(self, dataset: str, index: int, row: dict, table: Any, limit: int) -> Iterator[Sample]:
        """The samples of one row (one shared context), in turn order."""
        context, turns = row.get("context", row.get("input")), row["multi_turns"]
        multi_turn, golden = self.cfg["mode"] == "multi_turn", self.cfg["golden_context"]
        if multi_turn:
            head, query = self.first_turn(dataset, context, turns[0])
        else:
            head, query = self.context_prompt(dataset, context, turns[0]), ""
        head, ids, n = middle_truncate(self.tokenizer, head, limit)
        for i, turn in enumerate(turns):
            meta = {"label": label_of(dataset, turn), "task": turn.get("task", dataset)}
            meta.update({"lang": row["lang"], "repo": row["repo"], "name": turn["name"]} if "name" in turn else {})
            if i == 0 or not multi_turn:
                meta.update(prompt_tokens_full=n, truncated=n > limit >= 0)
            if not multi_turn:
                query = self.query_prompt(dataset, turn)
                prompt = head + query  # test_scdq: the context's kept ids, then the query's without special tokens
                fed = ids and ids + self.tokenizer(query, add_special_tokens=False).input_ids
            elif i:
                prompt, query, fed = self.follow_up(dataset, turns[i - 1], turn, turns[-1]), "", None
            else:
                prompt, fed = head, ids
            label = meta["label"]
            yield Sample(id=f"{dataset}/{index}/{i}", dataset=dataset, prompt=prompt, query=split(prompt, query)[1],
                         max_new_tokens=table[turn["task"]] if isinstance(table, dict) else table,
                         answers=[str(a) for a in label] if isinstance(label, list) else [str(label)], chat=False,
                         meta=meta, group=f"{dataset}/{index}", turn=i, follow_up=multi_turn and i > 0,
                         keep_answer=multi_turn and not golden, ids=fed)

    def score(self, sample: Sample, prediction: str) -> float:
        meta = sample.meta
        if meta["task"] == "scbench_repoqa":
            return score_repoqa(prediction, meta["lang"], meta["name"], self.needles[(sample.dataset, meta["repo"])])
        return float(SCORERS[meta["task"]](prediction, meta["label"]))

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Per dataset ×100 (all turns), their mean ``averages["scbench"]``, and ``averages["<dataset> turn <t>"]``
        and (mixed datasets) ``averages["<dataset> <task>"]``: SCBench's per-turn and per-task scores."""
        out = super().aggregate(records)
        parts: dict[str, list[float]] = {}
        for r in records:
            if r.get("error") is None and r.get("score") is not None:
                task = (r.get("meta") or {}).get("task", r["dataset"])
                keys = [f"{r['dataset']} turn {turn_of(r)}"] + [f"{r['dataset']} {task}"] * (task != r["dataset"])
                for key in keys:
                    parts.setdefault(key, []).append(float(r["score"]))
        out["averages"].update({k: round(100 * sum(v) / len(v), 2) for k, v in sorted(parts.items())})
        return out


def turn_of(record: dict) -> int:
    """A record's turn: its ``turn`` (shared-context runs), else the last part of its id (``<dataset>/<row>/<turn>``,
    a candidate suffix ``#k`` dropped)."""
    return int(record["turn"]) if record.get("turn") is not None else int(record["id"].split("#")[0].rsplit("/", 1)[1])
