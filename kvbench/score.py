"""``kvbench score DIR``: the official LongBench ``eval.py`` over a folder of prediction files.

Each ``<dataset>.jsonl`` in DIR (the dataset is the file name up to its first dot, as in the
official script) holds one JSON object per line with ``pred``, ``answers``, ``all_classes``
and ``length`` (the official ``pred.py`` format). The result is written as the official
``result.json``: ``{dataset: score}``, or with ``--e`` (LongBench-E) ``{dataset: {"0-4k": s,
"4-8k": s, "8k+": s}}`` where an empty bucket is ``null`` (the official script writes NaN).
As officially, a file's last line gives the dataset's ``all_classes``. Unlike the official
script (whose last file read wins), two files of one dataset (``qasper.jsonl`` and
``qasper.old.jsonl``) are refused, and so is an empty file or a line with a wrongly typed field.

Usage: ``kvbench score DIR [--e] [--out PATH]`` or ``python -m kvbench.score DIR``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from eval.metrics import dataset2metric, score_dataset

from .cli_parser import OneLineParser
from .store import output_file_refusal, replace_keeping

REQUIRED = ("pred", "answers", "all_classes")


class ScoreInputError(ValueError):
    """A prediction folder or file the scorer cannot read (one line: file, line, what is wrong)."""


def read_predictions(path: Path, need_length: bool) -> tuple[list[str], list[list[str]], list | None, list[int]]:
    """(predictions, answers, all_classes of the last line, lengths) of one prediction file.

    Raises:
        ScoreInputError: a line is not JSON or lacks ``pred``/``answers``/``all_classes``
            (or ``length`` when ``need_length``).
    """
    preds, answers, lengths, all_classes = [], [], [], None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ScoreInputError(f"{path} line {lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ScoreInputError(f"{path} line {lineno}: not a JSON object")
            missing = [k for k in REQUIRED + (("length",) if need_length else ()) if k not in row]
            if missing:
                hint = ("; this is kvbench's own predictions.jsonl (its job folder's summary.json holds the scores): "
                        "kvbench score reads the official pred.py format" if "prediction" in row else "")
                raise ScoreInputError(f"{path} line {lineno}: missing field {', '.join(map(repr, missing))}{hint}")
            if not isinstance(row["pred"], str):
                raise ScoreInputError(f"{path} line {lineno}: 'pred' must be a string, not {type(row['pred']).__name__}")
            if not isinstance(row["answers"], list) or not all(isinstance(a, str) for a in row["answers"]):
                raise ScoreInputError(f"{path} line {lineno}: 'answers' must be a list of strings")
            if need_length and (isinstance(row["length"], bool) or not isinstance(row["length"], (int, float))):
                raise ScoreInputError(f"{path} line {lineno}: 'length' must be a number (the context's length in "
                                      "words, LongBench's field), not " + repr(row["length"]))
            preds.append(row["pred"])
            answers.append(row["answers"])
            all_classes = row["all_classes"]
            if "length" in row:
                lengths.append(row["length"])
    return preds, answers, all_classes, lengths


def score_dir(folder: Path, longbench_e: bool = False) -> dict:
    """Official scores of every ``*.jsonl`` prediction file in ``folder`` (sorted by name).

    Raises:
        ScoreInputError: no such folder, no jsonl file, an unknown dataset name or a bad line.
    """
    if not folder.is_dir():
        raise ScoreInputError(f"{folder}: no such directory")
    from .store import is_job_folder

    if is_job_folder(folder):
        raise ScoreInputError(f"{folder}: a kvbench job folder (its summary.json holds the scores, "
                              "`kvbench report` tabulates them); kvbench score reads a folder of the official "
                              "pred.py files <dataset>.jsonl")
    files = sorted(p for p in folder.iterdir() if p.name.endswith("jsonl") and p.is_file())
    if not files:
        raise ScoreInputError(f"{folder}: no prediction files (<dataset>.jsonl)")
    scores, seen = {}, {}
    for path in files:
        dataset = path.name.split(".")[0]
        if dataset not in dataset2metric:
            raise ScoreInputError(
                f"{path}: unknown LongBench dataset {dataset!r}; file names must be one of {', '.join(dataset2metric)}"
            )
        if dataset in seen:  # the official eval.py keeps whichever it reads last
            raise ScoreInputError(f"{path}: {seen[dataset].name} in the same folder is dataset {dataset!r} too (the "
                                  "name up to its first dot); move one of them out")
        seen[dataset] = path
        preds, answers, all_classes, lengths = read_predictions(path, need_length=longbench_e)
        if not preds:
            raise ScoreInputError(f"{path}: no prediction lines")
        try:
            scores[dataset] = score_dataset(dataset, preds, answers, all_classes, lengths if longbench_e else None)
        except (ValueError, TypeError) as e:
            raise ScoreInputError(f"{path}: {e}") from None
    return scores


def main(argv: list[str] | None = None) -> int:
    """Score DIR and write ``result.json`` (``--out`` to write elsewhere); print the scores.

    Returns:
        0 on success, 2 on a user error (printed as one line on stderr).
    """
    parser = OneLineParser(prog="kvbench score", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="folder of <dataset>.jsonl prediction files")
    parser.add_argument("--e", action="store_true", help="LongBench-E: score by length bucket")
    parser.add_argument("--out", default=None, help="output file (default: DIR/result.json; a path ending in / is a "
                        "folder: result.json inside it)")
    args = parser.parse_args(argv)
    if args.out is not None:  # "new/" names a folder (Path would drop the slash and write a file "new")
        args.out = Path(args.out) / "result.json" if args.out.endswith(("/", os.sep)) else Path(args.out)
    try:
        scores = score_dir(args.dir, longbench_e=args.e)
    except ScoreInputError as e:  # one line, worded as the argument errors (OneLineParser.error)
        print(f"kvbench score: error: {e}", file=sys.stderr)
        return 2
    out = args.out or args.dir / "result.json"
    why = _out_refusal(out, args.dir)
    if why:
        parser.error(f"--out {str(out)!r}: {why}")
    text = json.dumps(scores, ensure_ascii=False, indent=4)
    from methods.base import ConfigError

    from .validate import check_creatable

    try:
        check_creatable(f"--out {str(out)!r}", out.parent)
    except ConfigError as e:
        parser.error(str(e))
    kept = replace_keeping(out, text)
    print(text)
    print(f"wrote {out}" + (f" (the earlier scores are kept as {kept.name})" if kept else ""), file=sys.stderr)
    return 0


def _out_refusal(out: Path, pred_dir: Path) -> str:
    """Why the scores must not be written to ``out`` (``""`` when they may): a folder, one of the
    prediction files scored, a results-store file or a path inside a job folder
    (:func:`kvbench.store.output_file_refusal`), or an existing file that is not a score file."""
    if out.suffix == ".jsonl" and out.absolute().parent == pred_dir.absolute():
        return "is a prediction file of DIR; pass another file (default: DIR/result.json)"
    return output_file_refusal(out, "a scores file (a JSON object)", lambda old: isinstance(old, dict),
                               "DIR/result.json")


if __name__ == "__main__":
    sys.exit(main())
