"""Math reasoning: AIME 2024, AIME 2025, MATH-500 and GSM8K, as R-KV (Cai et al., 2025, ``run_math.py`` and
``evaluation/``) and kvpress (its ``aime25`` and ``math500`` benchmarks) run them.

Prompt: one user turn of the model's chat template, whose generation prompt opens the model's thinking format
(``<think>\\n`` for the DeepSeek-R1 distills, thinking on for Qwen3), holding ``task.prompt``'s template:
``r1`` (default): the problem, a newline and DeepSeek-R1's math directive "Please reason step by step, and put your
final answer within \\boxed{}." (R-KV's ``evaluation/utils.py``, template ``mathstral``); ``rkv``: ``run_math.py``'s
``prompt_template``, verbatim (``run_math.py`` feeds it as raw text: ``model.chat_template=false``). Up to
``task.max_new_tokens`` new tokens (default MATH-500 16,384, AIME 32,768, GSM8K 8,192), or ``task.max_total_tokens``
with the prompt (``run_math.py``'s ``dataset2max_length`` as ``max_length``: MATH 8,192, AIME 2024 16,384).

Score (``task.scorer``): ``math_verify`` (default): the content of the last ``\\boxed{...}`` (nested braces) is
equivalent to the reference by math-verify (:func:`equivalent`); ``kvpress``: kvpress's ``calculate_metrics``
(:func:`kvpress_answer`); ``rkv``: R-KV's ``evaluation/eval_math.py`` (:func:`rkv_answer`, :func:`rkv_equal`). Records carry ``scores.answer`` (the answer read, null when none) and ``scores.found``
(a final answer was given: a closed box; kvpress: ``"boxed{" in prediction``, its ``answered``).

Data (``task.source``): ``official``: the official files in ``task.data_dir`` or the official Hub dataset
(:data:`SPECS`: MATH-500's ``test.jsonl``; AIME 2024: AI-MO/aimo-validation-aime's rows of 2024, as R-KV's
``data/aime24.jsonl`` holds them; AIME 2025: opencompass's ``aime2025-I.jsonl`` and ``aime2025-II.jsonl``; GSM8K:
``test.jsonl`` of openai/grade-school-math, its answer after ``####``); ``kvpress``: kvpress's copies
(``alessiodevoto/aime25``, ``alessiodevoto/math500``: ``context``, ``question``, ``answer_prefix``, ``answer``,
``max_new_tokens``), prompted as kvpress's pipeline (:class:`eval.suite.SuiteTask`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .base import Sample, TaskConfigError, count, is_data_file, looked_for, one_of, read_jsonl
from .suite import SuiteConfig, SuiteTask, require

SCORERS = ("math_verify", "kvpress", "rkv")
PROMPTS = {  # {problem} is replaced by the problem's text
    "r1": "{problem}\nPlease reason step by step, and put your final answer within \\boxed{}.",
    "rkv": "You are given a math problem.\n\nProblem: {problem}\n\n You need to solve the problem step by step. First, "
           "you need to provide the chain-of-thought, then provide the final answer.\n\n Provide the final answer in "
           "the format: Final answer:  \\boxed{}",
}


@dataclass(frozen=True)
class Spec:
    """One dataset: its official files (in ``task.data_dir``), Hub dataset (configs, split), problem field, R-KV's
    generation limit, kvpress's copy and which ``boxed{`` kvpress's scorer reads (1: the first, as its ``math500``;
    -1: the last, as its ``aime25``), the year its ``url`` must name (AI-MO's set spans 2022-2024)."""

    files: tuple[str, ...]
    hub: str
    configs: tuple[Optional[str], ...]
    split: str
    question: str
    max_new_tokens: int
    kvpress_hub: str = ""
    kvpress_box: int = -1
    year: str = ""
    rows: int = 0  # the problems of the official set


SPECS = {
    "aime24": Spec(("aime24.jsonl",), "AI-MO/aimo-validation-aime", (None,), "train", "problem", 32768, year="2024",
                   rows=30),
    "aime25": Spec(("aime2025-I.jsonl", "aime2025-II.jsonl"), "opencompass/AIME2025", ("AIME2025-I", "AIME2025-II"),
                   "test", "question", 32768, "alessiodevoto/aime25", rows=30),
    "math500": Spec(("test.jsonl",), "HuggingFaceH4/MATH-500", (None,), "test", "problem", 16384,
                    "alessiodevoto/math500", kvpress_box=1, rows=500),
    "gsm8k": Spec(("test.jsonl",), "openai/gsm8k", ("main",), "test", "question", 8192, rows=1319),
}
META = ("unique_id", "subject", "level", "id", "url")  # official fields kept in a record's meta


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, nested braces kept, or of a
    ``\\boxed 5`` without braces (the word after it, a final period dropped); None when there is none or it is not
    closed (a generation cut short)."""
    boxes = list(re.finditer(r"\\(?:boxed|fbox)(?:\s*\{|\s+([^\s${}]+))", text))
    if not boxes or boxes[-1][1]:
        return boxes[-1][1].rstrip(".") if boxes else None
    depth, start = 1, boxes[-1].end()
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def equivalent(answer: str, reference: str) -> bool:
    """Whether the LaTeX ``answer`` equals ``reference`` by math-verify (``verify(parse(gold), parse(answer))``, each
    read as a ``\\boxed{}``, percent signs dropped): numbers, fractions (``\\frac``/``\\dfrac``), ``\\text{}``, units, intervals, sets and
    expressions compared symbolically; equal text also counts (an answer math-verify cannot parse)."""
    from math_verify import parse, verify

    answer, reference = (re.sub(r"\\?%", "", x) for x in (answer, reference))  # 50\% answers 50 (MATH drops the sign)
    if answer.strip() == reference.strip():
        return True
    return bool(verify(parse(f"\\boxed{{{reference}}}"), parse(f"\\boxed{{{answer}}}")))


def kvpress_answer(prediction: str, box: int = -1) -> str | None:
    """kvpress's ``extract_boxed``: the text after the first (``box=1``, ``math500``) or last (``box=-1``, ``aime25``)
    ``boxed{`` up to the first ``}`` (so ``\\boxed{\\frac{1}{2}}`` reads ``\\frac{1``); None where that split has no
    such part (``box=1`` without a box; with ``box=-1`` the text up to its first ``}`` is read)."""
    try:
        return str(prediction.split("boxed{")[box].split("}")[0])
    except IndexError:
        return None


# R-KV's evaluator (evaluation/parser.py, grader.py at commit d15c976; Qwen2.5-Math's toolkit): the unit words
# strip_string deletes where they stand alone (each also with an "s"); as there, read as regular expressions
RKV_UNITS = [*"""east|degree|mph|kmph|ft|m sqaure| m east|sq m|deg|mile|q .|monkey|prime|ratio|profit of rs|rd|o|gm|p . m|lb
|tile|per|dm|lt|gain|ab|way|west|a .|b .|c .|d .|e .|f .|g .|h .|t|a|h|no change|men|soldier|pie|bc|excess|st|inches|noon
|percent|by|gal|kmh|c|acre|rise|a . m|th|π r 2|sq|mark|l|toy|coin|sq . m|gallon|° f|profit|minw|yr|women|feet|am|pm|hr
|cu cm|square|v â € ™|are|rupee|rounds|cubic|cc|mtr|s|ohm|number|kmph|day|hour|minute|min|second|man|woman|sec|cube|mt
|sq inch|mp|∏ cm ³|hectare|more|sec|unit|cu . m|cm 2|rs .|rs|kg|g|month|km|m|cm|mm|apple|liter|loss|yard|pure|year
|increase|decrease|d|less|Surface|litre|pi sq m|s .|metre|meter|inch""".replace("\n", "").split("|")]
RKV_UNITS += [u + "s" for u in RKV_UNITS]
NUMBER_WORDS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                           "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}


def rkv_answer(prediction: str) -> str:
    """The answer R-KV's evaluator reads (``extract_answer``, then ``strip_string`` as ``run_execute`` applies it again):
    the last ``boxed`` (``\\boxed{..}`` with nested braces, an unclosed one to the end; ``\\boxed 5`` up to a ``$``),
    else the text after the last "he answer is" / "final answer is", else the last number; '' when none."""
    text = prediction.replace("\u043a\u0438", "")
    if "final answer is $" in text and "$. I hope" in text:
        answer = text.split("final answer is $", 1)[1].split("$. I hope", 1)[0]
    elif "boxed" in text:
        answer = text.split("boxed")[-1]
        if answer.startswith("{"):
            depth, end = 0, len(answer)
            for i, c in enumerate(answer):
                depth += {"{": 1, "}": -1}.get(c, 0)
                if depth == 0:
                    end = i
                    break
            answer = answer[1:end]
        else:
            answer = answer.split("$")[0]
    elif "he answer is" in text or "final answer is" in text:
        answer = text.split("he answer is" if "he answer is" in text else "final answer is")[-1]
    else:
        numbers = re.findall(r"-?\d*\.?\d+", text.replace(",", ""))
        answer = numbers[-1] if numbers else ""
    answer = re.sub(r"\n\s*", "", answer.strip()).removeprefix(":")
    answer = answer[:-1] if answer.endswith(".") else answer
    return rkv_normal(rkv_normal(answer[:-1] if answer.endswith("/") else answer))


def rkv_normal(s: str) -> str:
    """R-KV's ``strip_string``: LaTeX spellings unified (``\\dfrac`` → ``\\frac``, ``\\left``, ``$``, ``\\text{}``,
    degrees and ``%`` dropped), unit words dropped, ``x=`` prefixes and trailing ``.0`` removed, ``a/b`` → ``\\frac{a}{b}``."""
    s = str(s).strip().replace("\n", "").rstrip(".").replace("\\!", "")
    s = re.sub(r"\\begin\{array\}\{.*?\}", r"\\begin{pmatrix}", s)
    s = re.sub(r"\\end\{array\}", r"\\end{pmatrix}", s).replace("bmatrix", "pmatrix")
    for a, b in (("tfrac", "frac"), ("dfrac", "frac"), ("\\neq", "\\ne"), ("\\leq", "\\le"), ("\\geq", "\\ge"),
                 ("\\left", ""), ("\\right", ""), ("\\{", "{"), ("\\}", "}")):
        s = s.replace(a, b)
    s = re.sub(r"\\text{.*?}$", "", s).strip() or s  # a trailing unit
    for _ in range(2):
        for unit in RKV_UNITS:
            s = re.sub(r"(^|\W)" + unit + r"($|\W)", r"\1\2", s) or s
    for a in ("^{\\circ}", "^\\circ", "\\$", "$", "\\(", "\\)"):
        s = s.replace(a, "")
    words = s.lower().replace("-", " ").split()
    if s.isdigit() or words and all(w in NUMBER_WORDS for w in words):  # word2number's simple cases
        s = str(int(s)) if s.isdigit() else str(sum(NUMBER_WORDS[w] for w in words))
    s = re.sub(r"\\text\{(.*?)\}", r"\1", s)
    for key in ("x=", "y=", "z=", "x\\in", "y\\in", "z\\in", "x\\to", "y\\to", "z\\to"):
        s = s.replace(key, "")
    s = s.replace("\\emptyset", "{}").replace("(-\\infty,\\infty)", "\\mathbb{R}")
    s = s.replace("\\%", "").replace("%", "").replace(" .", " 0.").replace("{.", "{0.")
    if s.isalnum() and s[:1] + s[-1:] in ("{}", "()", "[]"):
        s = s[1:-1]
    s = s.replace("infinity", "\\infty")
    s = (s if "\\infty" in s else s.replace("inf", "\\infty")).replace("+\\inity", "\\infty")
    s = re.sub(r"\\mbox{.*?}", "", s.replace("and", "").replace("\\mathbf", ""))
    s = s.replace("j", "i") if "j" in s and "i" not in s else s
    s = re.sub(r"(\d+)\.0*$", r"\1", re.sub(r"(\d+)\.0*([^\d])", r"\1\2", s))
    s = "0" + s if s.startswith(".") else s
    if len(s.split("=")) == 2 and len(s.split("=")[0]) <= 2:
        s = s.split("=")[1]
    s = re.sub(r"\\sqrt(\w+)", r"\\sqrt{\1}", s).replace(" ", "")
    s = re.sub(r"\\frac(?=[^{])(\w)(\w)?", lambda m: "\\frac{%s}{%s}" % (m[1], m[2]) if m[2] else "\\frac{%s}" % m[1], s)
    parts = s.split("/")
    fraction = len(parts) == 2 and all("sqrt" in p or re.fullmatch(r"-?\d+", p) and str(int(p)) == p for p in parts)
    return "\\frac{%s}{%s}" % tuple(parts) if fraction else s


def rkv_number(s: str) -> float | None:
    """R-KV's ``parse_digits``: a float (commas dropped; a trailing ``%`` or ``\\%`` divides by 100), else None."""
    s = s.replace(",", "")
    for text, scale in ((s, 1.0), (s[:-1].removesuffix("\\") if s.endswith("%") else None, 0.01)):
        try:
            return float(text) * scale if text is not None else None
        except ValueError:
            pass
    return None


def rkv_equal(answer: str, reference: str) -> bool:
    """R-KV's ``math_equal`` on normalised strings: equal text (case ignored); numbers within relative 1e-4 of the
    reference, its hundredth or its hundredfold (a percentage); brackets and braces ignored; tuples and intervals
    element-wise; ``x = v`` against ``v``; else symbolic equality, here by math-verify (R-KV: sympy's parse_latex /
    latex2sympy, ``simplify``, numeric value within 1e-4)."""
    import math

    if answer.strip().lower() == reference.strip().lower():
        return True
    a, r = rkv_number(answer), rkv_number(reference)
    if a is not None and r is not None:
        return any(math.isclose(a, x, rel_tol=1e-4) for x in (r / 100, r, r * 100))
    if not answer:
        return False
    a, r = answer.strip(), reference.strip()
    if a[:1] + a[-1:] in ("[]", "()") and r[:1] != {"[": "(", "(": "["}[a[0]]:
        bare = [x.strip("[]()") for x in (a, r)]
    else:
        bare = [a, r]
    if re.sub(r"[{}()]", "", bare[0]).lower() == re.sub(r"[{}()]", "", bare[1]).lower():
        return True
    if all(re.match(r"(\(|\[).+(\)|\])", x) for x in (a, r)):
        parts = a[1:-1].split(","), r[1:-1].split(",")
        if len(parts[0]) == len(parts[1]) and all(rkv_equal(x, y) for x, y in zip(*parts)):
            return True
    if a.count("=") == 1 and "=" not in r and len(a.split("=")[0].strip()) <= 2:
        return rkv_equal(a.split("=")[1], r)
    if r.count("=") == 1 and "=" not in a and len(r.split("=")[0].strip()) <= 2:
        return rkv_equal(a, r.split("=")[1])
    try:
        return equivalent(a, r)
    except Exception:  # noqa: BLE001 - R-KV's symbolic step: an unparsable answer is not equal
        return False


@dataclass
class ReasoningConfig(SuiteConfig):
    """``conf/task/{aime24,aime25,math500,gsm8k}.yaml``: R-KV's protocol (module docstring)."""

    prompt: str = "r1"  # r1 (the problem + DeepSeek-R1's directive) | rkv (run_math.py's template)
    scorer: str = "math_verify"  # math_verify (last box, math-verify equivalence) | kvpress (kvpress's string match)
    # | rkv (R-KV's evaluation/eval_math.py: its answer extraction, normalisation and math_equal)
    max_new_tokens: Optional[int] = None  # null: the dataset's (SPECS; source=kvpress: the row's max_new_tokens)
    max_total_tokens: Optional[int] = None  # prompt + generation, as run_math.py's max_length; null: max_new_tokens

    def check(self) -> None:
        super().check()
        one_of(self.prompt, "prompt", tuple(PROMPTS))
        one_of(self.scorer, "scorer", SCORERS)
        count(self.max_new_tokens, "max_new_tokens")
        count(self.max_total_tokens, "max_total_tokens")


class ReasoningTask(SuiteTask):
    """One math dataset (``name``: a key of :data:`SPECS`), ids ``<name>/<row index>``, one sample per problem."""

    Config = ReasoningConfig

    @classmethod
    def spec(cls) -> Spec:
        return SPECS[cls.name]

    @classmethod
    def validate(cls, cfg: dict) -> None:
        """As :meth:`SuiteTask.validate`, the official files read whole. TaskConfigError: also ``source=kvpress`` for a
        dataset kvpress has no copy of (unless ``hub_dataset`` names one)."""
        if cfg.get("source") == "kvpress" and not (cls.kvpress_hub or cfg.get("hub_dataset")):
            raise TaskConfigError(f"task.source=kvpress: kvpress has no copy of {cls.name}; accepted values are "
                                  "official, or kvpress with task.hub_dataset naming a copy")
        if cfg.get("data_dir") and cfg.get("source") == "official":
            cls.read_dir(cfg["data_dir"])
        else:
            super().validate(cfg)

    @classmethod
    def data_files(cls, cfg: dict) -> list[Path]:
        return [Path(cfg["data_dir"]).expanduser() / f for f in cls.spec().files]

    @classmethod
    def check_row(cls, dataset: str, row: dict, where: str) -> None:
        require(row, where, **{cls.spec().question: str, "answer": (str, int, float)})

    @classmethod
    def keep(cls, rows: list[dict]) -> list[dict]:
        """The rows of the dataset's year (rows without ``url`` all)."""
        return [r for r in rows if f"/{cls.spec().year}_" in r.get("url", f"/{cls.spec().year}_")]

    @classmethod
    def read_dir(cls, data_dir: str) -> list[dict]:
        """The rows of the official files in ``data_dir``. TaskConfigError: no such folder, a file missing, a bad row."""
        root = Path(os.path.expanduser(str(data_dir)))
        if not root.is_dir():
            raise TaskConfigError(f"task.data_dir={data_dir}: no such directory{looked_for(root)}")
        if missing := [f for f in cls.spec().files if not is_data_file(root / f)]:
            raise TaskConfigError(f"task.data_dir={data_dir}: no {missing[0]} ({cls.what})")
        return cls.keep([r for f in cls.spec().files for r in read_jsonl(
            root / f, lambda row, where: cls.check_row(cls.name, row, where))])

    def rows(self, dataset: str) -> list[dict]:
        """The first ``n_samples`` problems: kvpress's copy, the official files or the official Hub dataset."""
        if self.cfg["source"] == "kvpress":
            return super().rows(dataset)
        if self.cfg.get("data_dir"):
            rows = self.read_dir(self.cfg["data_dir"])
        else:
            import datasets

            spec, repo = self.spec(), self.cfg.get("hub_dataset") or self.official_hub
            rows = [dict(r) for c in spec.configs
                    for r in self._hub(lambda c=c: datasets.load_dataset(repo, c, split=spec.split))]
            for i, r in enumerate(rows):
                self.check_row(dataset, r, f"{repo} row {i}")
            rows = self.keep(rows)
        n = self.cfg.get("n_samples")
        self.cut_datasets += [dataset] * (n is not None and len(rows) > n)
        return rows[:n]

    @classmethod
    def documented(cls, cfg: dict) -> list[int]:
        """:attr:`Spec.rows` problems (``n_samples`` at most), each up to ``max_total_tokens``, else ``max_new_tokens``
        or the dataset's limit (kvpress's copies: their rows' own limits, unknown without the data)."""
        spec = cls.spec()
        return [cfg.get("max_total_tokens") or cfg.get("max_new_tokens") or spec.max_new_tokens] * min(
            spec.rows, cfg.get("n_samples") or spec.rows)

    def kvpress_config(self, dataset: str) -> None:
        return None

    def limit(self, row: dict) -> int:
        return int(self.cfg.get("max_new_tokens") or row.get("max_new_tokens") or self.spec().max_new_tokens)

    def official_sample(self, dataset: str, index: int, row: dict) -> Sample:
        """One problem; with ``max_total_tokens`` T its new tokens are T minus the prompt's (run_math.py's
        ``generate(max_length=T)``; TaskConfigError when the prompt leaves none)."""
        prompt = PROMPTS[self.cfg.get("prompt") or "r1"].replace("{problem}", row[self.spec().question])
        sample = Sample(id=f"{dataset}/{index}", dataset=dataset, prompt=prompt, max_new_tokens=self.limit(row),
                        answers=[self.gold(row)], meta={k: row[k] for k in META if k in row})
        if total := self.cfg.get("max_total_tokens"):
            left = total - (len(self.encode(sample)) if self.encode else len(self.tokenizer.encode(prompt)))
            if left < 1:
                raise TaskConfigError(f"task.max_total_tokens={total}: problem {sample.id}'s prompt leaves no new token")
            sample.max_new_tokens = left
        return sample

    def kvpress_sample(self, dataset: str, index: int, row: dict) -> Sample:
        return Sample(id=f"{dataset}/{index}", dataset=dataset, prompt=row["context"] + row["question"],
                      query=row["question"], max_new_tokens=self.limit(row), answers=[str(row["answer"])])

    def scoring_sample(self, row: dict, where: str) -> Sample:
        """A row holding an official ``answer`` (the official files' fields, kvpress's copies), else
        :meth:`Task.scoring_sample`'s."""
        if "answer" not in row:
            return super().scoring_sample(row, where)
        require(row, where, answer=(str, int, float))
        return Sample(id=where, dataset=self.name, prompt="", max_new_tokens=0, answers=[self.gold(row)])

    def gold(self, row: dict) -> str:
        """The reference answer of an official row (GSM8K: after ``####``, thousands commas dropped, as R-KV's
        ``parse_ground_truth``; kvpress's rows: ``str(answer)`` as its scorer)."""
        if self.name == "gsm8k" and "context" not in row:
            return str(row["answer"]).split("####")[-1].strip().replace(",", "")
        return str(row["answer"])

    def tokens_needed(self, sample: Sample) -> int:
        """The prompt's tokens (as the engine encodes it) + ``max_new_tokens``."""
        return len(self.encode(sample)) + sample.max_new_tokens if self.encode else super().tokens_needed(sample)

    def extract(self, sample: Sample, prediction: str) -> tuple[str | None, bool]:
        """``(answer read, whether a final answer was given)`` by ``task.scorer``'s rule."""
        if self.cfg.get("scorer") == "kvpress":
            return kvpress_answer(prediction, self.spec().kvpress_box), "boxed{" in prediction
        if self.cfg.get("scorer") == "rkv":
            return rkv_answer(prediction), "boxed" in prediction
        answer = last_boxed(prediction)
        return answer, answer is not None

    def score(self, sample: Sample, prediction: str) -> float:
        """1.0 when the answer read equals the reference (kvpress: as strings; else :func:`equivalent`)."""
        answer, _ = self.extract(sample, prediction)
        if self.cfg.get("scorer") == "kvpress":
            return float(answer == sample.answers[0])
        if self.cfg.get("scorer") == "rkv":
            return float(rkv_equal(answer, rkv_normal(sample.answers[0])))
        return float(answer is not None and equivalent(answer, sample.answers[0]))

    def extra_scores(self, sample: Sample, prediction: str) -> dict[str, Any]:
        answer, found = self.extract(sample, prediction)
        return {"answer": answer, "found": found}

    def aggregate(self, records: list[dict]) -> dict[str, Any]:
        """Accuracy (pass@1 with sampled candidates) and ``pass_at_k`` (answer share, length) even for greedy jobs."""
        from .sampling import summary

        return super().aggregate(records) | {"pass_at_k": summary(records)}


class AIME24Task(ReasoningTask):
    name, subsets, official_hub = "aime24", ("aime24",), SPECS["aime24"].hub
    what = "R-KV's data/aime24.jsonl, or AI-MO/aimo-validation-aime's rows of 2024 as aime24.jsonl"


class AIME25Task(ReasoningTask):
    name, subsets, official_hub, kvpress_hub = "aime25", ("aime25",), SPECS["aime25"].hub, SPECS["aime25"].kvpress_hub
    what = "aime2025-I.jsonl and aime2025-II.jsonl of huggingface.co/datasets/opencompass/AIME2025"


class MATH500Task(ReasoningTask):
    name, subsets, official_hub, kvpress_hub = "math500", ("math500",), SPECS["math500"].hub, SPECS["math500"].kvpress_hub
    what = "test.jsonl of huggingface.co/datasets/HuggingFaceH4/MATH-500"


class GSM8KTask(ReasoningTask):
    name, subsets, official_hub = "gsm8k", ("gsm8k",), SPECS["gsm8k"].hub
    what = "grade_school_math/data/test.jsonl of github.com/openai/grade-school-math"
