"""``kvbench score DIR [--e] [--out PATH]``: the official LongBench ``eval.py`` over prediction files.

Each ``<dataset>.jsonl`` in DIR (dataset = the name up to its first dot) holds the official
``pred.py`` lines (``pred``, ``answers``, ``all_classes``, ``length``; the last line's
``all_classes`` counts). Writes ``result.json``: ``{dataset: score}``, or with ``--e`` ``{dataset:
{"0-4k": s, "4-8k": s, "8k+": s}}`` with ``null`` for an empty bucket (officially NaN). Two files
of one dataset, an empty file or a wrongly typed field are errors (officially: the last file wins).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from eval.base import TaskConfigError, read_jsonl
from eval.metrics import dataset2metric, score_dataset

from .cli import ArgParser
from .store import atomic_write


def _check_row(row, need_length: bool) -> str:
    """What is wrong with one prediction line (``""`` when nothing)."""
    missing = [k for k in ("pred", "answers", "all_classes", *(["length"] if need_length else [])) if k not in row]
    if missing:
        hint = "; this is kvbench's own predictions.jsonl, not the official pred.py format" if "prediction" in row else ""
        return f"missing field {', '.join(map(repr, missing))}{hint}"
    if not isinstance(row["pred"], str):
        return f"'pred' must be a string, not {type(row['pred']).__name__}"
    if not isinstance(row["answers"], list) or not all(isinstance(a, str) for a in row["answers"]):
        return "'answers' must be a list of strings"
    if need_length and (isinstance(row["length"], bool) or not isinstance(row["length"], (int, float))):
        return f"'length' must be a number (the context's length in words), not {row['length']!r}"
    return ""


def read_predictions(path: Path, need_length: bool) -> list[dict]:
    """The prediction lines of one file (TaskConfigError, one line naming the file and line: a line that is not
    JSON, lacks a field or has a wrongly typed one; ``length`` is needed when ``need_length``)."""
    def check(row: dict, where: str) -> None:
        if why := _check_row(row, need_length):
            raise TaskConfigError(f"{where}: {why}")

    return read_jsonl(path, check)


def score_dir(folder: Path, longbench_e: bool = False) -> dict:
    """Official scores of the ``*.jsonl`` prediction files in ``folder`` by dataset (TaskConfigError, one line:
    no such folder or file, an unknown or repeated dataset, an empty file or a bad line)."""
    if not folder.is_dir():
        raise TaskConfigError(f"{folder}: no such directory")
    files = sorted(p for p in folder.glob("*jsonl") if p.is_file())
    if not files:
        raise TaskConfigError(f"{folder}: no prediction files (<dataset>.jsonl)")
    scores, seen = {}, {}
    for path in files:
        dataset = path.name.split(".")[0]
        if dataset not in dataset2metric:
            raise TaskConfigError(f"{path}: unknown LongBench dataset {dataset!r}; accepted: {', '.join(dataset2metric)}")
        if dataset in seen:  # the official eval.py keeps whichever it reads last
            raise TaskConfigError(f"{path}: {seen[dataset].name} in the same folder is dataset {dataset!r} too")
        seen[dataset] = path
        rows = read_predictions(path, need_length=longbench_e)
        if not rows:
            raise TaskConfigError(f"{path}: no prediction lines")
        scores[dataset] = score_dataset(dataset, [r["pred"] for r in rows], [r["answers"] for r in rows],
                                        rows[-1]["all_classes"], [r["length"] for r in rows] if longbench_e else None)
    return scores


def main(argv: list[str] | None = None) -> int:
    """Score DIR, write ``result.json`` (DIR/result.json or ``--out``) and print it. Returns 0, or 2
    on a user error (one line on stderr)."""
    parser = ArgParser(prog="kvbench score", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, help="folder of <dataset>.jsonl prediction files")
    parser.add_argument("--e", action="store_true", help="LongBench-E: score by length bucket")
    parser.add_argument("--out", default=None, help="output file (default DIR/result.json; a folder: result.json in it)")
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else args.dir / "result.json"
    if args.out and (out.is_dir() or args.out.endswith("/")):
        out = out / "result.json"
    try:
        text = json.dumps(score_dir(args.dir, longbench_e=args.e), ensure_ascii=False, indent=4)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, text)
    except (TaskConfigError, OSError) as e:
        print(f"kvbench score: error: {e}", file=sys.stderr)
        return 2
    print(text)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
