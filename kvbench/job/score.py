"""``kvbench score DIR``: LongBench's official ``eval.py`` over ``pred.py`` files into ``result.json``
(docs/LONGBENCH.md); ``kvbench score --task NAME FILE``: a task's own metric (docs/REASONING.md)."""

import json
import sys
from pathlib import Path

import eval as tasks
from eval.base import TaskConfigError, read_jsonl
from eval.metrics import dataset2metric, score_dataset

from kvbench.cli import ArgParser
from kvbench.job.store import atomic_write


def _check_row(row: dict, where: str, need_length: bool = False) -> None:
    """TaskConfigError naming ``where`` if one ``pred.py`` line is wrong; ``length`` is needed when ``need_length``."""
    missing = [k for k in ("pred", "answers", "all_classes", *(["length"] if need_length else [])) if k not in row]
    if missing:
        hint = "; this is kvbench's own predictions.jsonl, not the official pred.py format" if "prediction" in row else ""
        raise TaskConfigError(f"{where}: missing field {', '.join(map(repr, missing))}{hint}")
    if not isinstance(row["pred"], str):
        raise TaskConfigError(f"{where}: 'pred' must be a string, not {type(row['pred']).__name__}")
    if not isinstance(row["answers"], list) or not all(isinstance(a, str) for a in row["answers"]):
        raise TaskConfigError(f"{where}: 'answers' must be a list of strings")
    if need_length and (isinstance(row["length"], bool) or not isinstance(row["length"], (int, float))):
        raise TaskConfigError(f"{where}: 'length' must be a number (the context's length in words), "
                              f"not {row['length']!r}")


def score_dir(folder: Path, longbench_e: bool = False) -> dict:
    """Official scores of the ``*.jsonl`` prediction files in ``folder`` by dataset (TaskConfigError, one line)."""
    if not folder.is_dir():
        raise TaskConfigError(f"{folder}: " + ("a file; give --task NAME to score it with a task's metric"
                                               if folder.is_file() else "no such directory"))
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
        rows = read_jsonl(path, lambda row, where: _check_row(row, where, longbench_e))
        if not rows:
            raise TaskConfigError(f"{path}: no prediction lines")
        scores[dataset] = score_dataset(dataset, [r["pred"] for r in rows], [r["answers"] for r in rows],
                                        rows[-1]["all_classes"], [r["length"] for r in rows] if longbench_e else None)
    return scores


def score_file(path: Path, name: str, overrides: list[str]) -> dict:
    """``{"task", "n", **task.aggregate(records)}`` of the ``prediction`` lines of ``path`` scored by task ``name``
    (TaskConfigError, one line)."""
    from omegaconf import OmegaConf

    from kvbench.job.config import compose

    if name not in tasks.available():
        raise TaskConfigError(f"--task {name!r}: accepted values are {', '.join(tasks.available())}")
    try:
        node = compose([f"task={name}", *overrides]).task
        OmegaConf.to_object(node)  # the task Config's __post_init__ checks the values
        cfg = OmegaConf.to_container(node, resolve=True)
    except TaskConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, one line
        raise TaskConfigError(f"{' '.join(overrides)}: {str(e).strip().splitlines()[0]}") from None
    task = tasks.get_task_class(name)(cfg)
    records = []
    for i, row in enumerate(read_jsonl(path), start=1):
        where = f"{path} line {i}"
        if not isinstance(row.get("prediction"), str):
            raise TaskConfigError(f"{where}: field 'prediction' must be a string")
        sample = task.scoring_sample(row, where)
        records.append({"id": str(row.get("id", where)), "dataset": sample.dataset, "problem": row.get("problem"),
                        "score": float(task.score(sample, row["prediction"])), "error": None, "meta": sample.meta,
                        "generated_tokens": row.get("generated_tokens"),
                        "scores": task.extra_scores(sample, row["prediction"]) if hasattr(task, "extra_scores") else {}})
    if not records:
        raise TaskConfigError(f"{path}: no prediction lines")
    return {"task": name, "n": len(records), **task.aggregate(records)}


def main(argv: list[str] | None = None) -> int:
    """Score DIR (or FILE with ``--task``), write and print ``result.json``; 2 on a user error (one line)."""
    parser = ArgParser(prog="kvbench score", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, metavar="DIR|FILE",
                        help="folder of <dataset>.jsonl prediction files, or with --task one JSONL file")
    parser.add_argument("overrides", nargs="*", metavar="task.KEY=VALUE", help="with --task: task settings")
    parser.add_argument("--task", help="score FILE with this task's official metric (conf/task/NAME.yaml)")
    parser.add_argument("--e", action="store_true", help="LongBench-E: score by length bucket")
    parser.add_argument("--out", default=None, help="output file (default DIR/result.json; a folder: result.json in it)")
    args = parser.parse_args(argv)
    if args.overrides and not args.task or any(not o.startswith("task.") for o in args.overrides):
        parser.error(f"{args.overrides[0]!r}: settings are task.KEY=VALUE, with --task only")
    out = Path(args.out or (args.dir.with_name(f"{args.dir.stem}.{args.task}.result.json") if args.task else args.dir / "result.json"))
    out = out / "result.json" if args.out and (out.is_dir() or args.out.endswith("/")) else out
    try:
        scores = score_file(args.dir, args.task, args.overrides) if args.task else score_dir(args.dir, longbench_e=args.e)
        text = json.dumps(scores, ensure_ascii=False, indent=4)
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
