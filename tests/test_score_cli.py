"""``kvbench score DIR``: the official eval.py over a folder of prediction files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.job.score import main

ROOT = Path(__file__).resolve().parents[1]


def write(folder: Path, name: str, rows: list[dict]) -> None:
    (folder / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def pred(p, answers, classes=None, length=100):
    return {"pred": p, "answers": answers, "all_classes": classes, "length": length}


def make_dir(folder: Path) -> None:
    classes = ["Person", "Location", "Date"]
    # trec: first line "Person" → 1; "Location" → 0; "Person Date" → 1/2  → 50.0
    write(folder, "trec.jsonl", [pred("\nPerson\nDate", ["Person"], classes, 100),
                                 pred("Location", ["Person"], classes, 5000),
                                 pred("Person Date", ["Person"], classes, 9000)])  # fmt: skip
    # passage_count: 1, 0, 1/2 → 50.0 ; all short
    write(folder, "passage_count.jsonl", [pred("3", ["3"]), pred("4", ["3"]), pred("3 or 4", ["3"])])
    # zh retrieval: max over answers → 1, 0 → 50.0
    write(folder, "passage_retrieval_zh.jsonl", [pred("段落5", ["段落4", "段落5"]), pred("", ["段落1"], length=4000)])


def test_score_dir_writes_official_result_json(tmp_path, capsys):
    make_dir(tmp_path)
    assert main([str(tmp_path)]) == 0
    result = json.loads((tmp_path / "result.json").read_text(encoding="utf-8"))
    assert result == {"passage_count": 50.0, "passage_retrieval_zh": 50.0, "trec": 50.0}
    assert json.loads(capsys.readouterr().out) == result


def test_score_dir_longbench_e_buckets(tmp_path):
    make_dir(tmp_path)
    out = tmp_path / "sub" / "e.json"
    out.parent.mkdir()
    assert main([str(tmp_path), "--e", "--out", str(out)]) == 0
    assert json.loads(out.read_text(encoding="utf-8")) == {
        "passage_count": {"0-4k": 50.0, "4-8k": None, "8k+": None},  # empty buckets are null
        "passage_retrieval_zh": {"0-4k": 100.0, "4-8k": 0.0, "8k+": None},
        "trec": {"0-4k": 100.0, "4-8k": 0.0, "8k+": 50.0},
    }
    assert not (tmp_path / "result.json").exists()


def test_score_dir_errors_are_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "preds.jsonl").write_text("")
    assert main([str(tmp_path / "preds.jsonl")]) == 2  # a file without --task
    assert "--task" in capsys.readouterr().err
    (tmp_path / "preds.jsonl").unlink()
    assert main([str(tmp_path)]) == 2
    assert "no prediction files" in capsys.readouterr().err
    write(tmp_path, "qa.jsonl", [pred("x", ["x"])])
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown LongBench dataset 'qa'" in err and err.count("\n") == 1
    (tmp_path / "qa.jsonl").unlink()
    write(tmp_path, "qasper.jsonl", [pred("x", ["x"]), {"pred": "y", "answers": ["y"]}])
    assert main([str(tmp_path)]) == 2
    assert "qasper.jsonl line 2: missing field 'all_classes'" in capsys.readouterr().err
    write(tmp_path, "qasper.jsonl", [{"pred": "y", "answers": ["y"], "all_classes": None}])
    assert main([str(tmp_path), "--e"]) == 2
    assert "missing field 'length'" in capsys.readouterr().err
    for rows, message in (([{"pred": None, "answers": ["y"], "all_classes": None, "length": 1}], "line 1: 'pred' must be a string"),
                          ([pred("y", [1])], "line 1: 'answers' must be a list of strings"),
                          ([pred("y", ["y"], length="long")], "line 1: 'length' must be a number"),
                          ([{"prediction": "y", "answers": ["y"], "length": 1}], "this is kvbench's own predictions.jsonl"),
                          ([], "qasper.jsonl: no prediction lines")):
        write(tmp_path, "qasper.jsonl", rows)
        assert main([str(tmp_path), "--e"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    write(tmp_path, "qasper.jsonl", [pred("y", ["y"])])
    write(tmp_path, "qasper.old.jsonl", [pred("n", ["y"])])  # the official script: the last file read wins
    assert main([str(tmp_path)]) == 2
    assert "qasper.jsonl in the same folder is dataset 'qasper' too" in capsys.readouterr().err


def test_python_dash_m(tmp_path):
    write(tmp_path, "lcc.jsonl", [pred("# c\nreturn x + 1", ["return x + 1"]), pred("", ["return x + 1"])])
    done = subprocess.run(
        [sys.executable, "-m", "kvbench.job.score", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "result.json").read_text(encoding="utf-8")) == {"lcc": 50.0}


def test_out_is_a_file_or_a_folder_and_os_errors_are_one_line(tmp_path, capsys):
    make_dir(tmp_path)
    out = tmp_path / "new" / "deeper" / "scores.json"
    assert main([str(tmp_path), "--out", str(out)]) == 0  # parents made
    assert json.loads(out.read_text(encoding="utf-8"))["trec"] == 50.0
    assert main([str(tmp_path), "--out", str(tmp_path / "new")]) == 0  # a folder: result.json in it
    assert json.loads((tmp_path / "new" / "result.json").read_text(encoding="utf-8"))["trec"] == 50.0
    (tmp_path / "afile").write_text("x")
    capsys.readouterr()
    assert main([str(tmp_path), "--out", str(tmp_path / "afile" / "r.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvbench score: error:") and err.count("\n") == 1


def test_score_task_file_official_fields_candidates_and_scorer(tmp_path, capsys):
    """MATH-500 rows (prediction beside the official ``answer``); rows sharing ``problem`` are one problem's
    candidates: a: 2 of 2 correct, b: 1 of 2 → pass@1 75, SE 25, pass@2 100; kvpress's rule reads \\frac{1."""
    write(tmp_path, "m.jsonl", [
        {"prediction": "\\boxed{\\dfrac{1}{2}}", "answer": "\\frac{1}{2}", "problem": "a", "generated_tokens": 10},
        {"prediction": "\\boxed{0.5}", "answer": "\\frac{1}{2}", "problem": "a", "generated_tokens": 20},
        {"prediction": "no idea", "answer": "3", "problem": "b", "generated_tokens": 30},
        {"prediction": "\\boxed{3}", "answer": "3", "problem": "b", "generated_tokens": 40}])
    assert main(["--task", "math500", str(tmp_path / "m.jsonl")]) == 0
    result = json.loads((tmp_path / "m.math500.result.json").read_text())
    assert result["datasets"] == {"math500": {"score": 75.0, "n": 2}}
    assert result["pass_at_k"]["math500"] | {} == {"pass@1": 75.0, "pass@1_se": 25.0, "pass@k": {"1": 75.0, "2": 100.0},
                                                   "answered": 75.0, "generated_tokens": 25.0, "problems": 2,
                                                   "candidates": 4}
    assert main(["--task", "math500", str(tmp_path / "m.jsonl"), "task.scorer=kvpress", "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "result.json").read_text())["datasets"]["math500"]["score"] == 25.0  # only "3"
    write(tmp_path, "g.jsonl", [{"prediction": "\\boxed{2000}", "answer": "1,000 * 2\n#### 2,000"}])
    assert main(["--task", "gsm8k", str(tmp_path / "g.jsonl")]) == 0
    assert json.loads((tmp_path / "g.gsm8k.result.json").read_text())["datasets"] == {"gsm8k": {"score": 100.0, "n": 1}}
    assert main(["--task", "math500", str(tmp_path / "g.jsonl")]) == 0  # a second task: its own file, the first kept
    assert json.loads((tmp_path / "g.gsm8k.result.json").read_text())["task"] == "gsm8k"
    assert json.loads((tmp_path / "g.math500.result.json").read_text())["task"] == "math500"


def test_score_task_file_other_tasks(tmp_path):
    """LongBench-v2's official fields; kvbench's own record fields (answers, dataset) for LongBench."""
    write(tmp_path, "v2.jsonl", [{"prediction": "The correct answer is (B)", "answer": "B", "difficulty": "hard",
                                  "length": "short"},
                                 {"prediction": "The correct answer is A", "answer": "C", "difficulty": "easy",
                                  "length": "long"}])
    assert main(["--task", "longbench_v2", str(tmp_path / "v2.jsonl")]) == 0
    out = json.loads((tmp_path / "v2.longbench_v2.result.json").read_text())
    assert out["datasets"] == {"longbench_v2": {"score": 50.0, "n": 2}}
    assert (out["averages"]["hard"], out["averages"]["easy"], out["averages"]["long"]) == (100.0, 0.0, 0.0)
    write(tmp_path, "lb.jsonl", [{"prediction": "3", "answers": ["3"], "dataset": "passage_count"},
                                 {"prediction": "4", "answers": ["3"], "dataset": "passage_count"}])
    assert main(["--task", "longbench", str(tmp_path / "lb.jsonl")]) == 0
    assert json.loads((tmp_path / "lb.longbench.result.json").read_text())["datasets"] == {"passage_count": {"score": 50.0, "n": 2}}


@pytest.mark.parametrize("args, rows, key", [
    (["--task", "math5"], [{"prediction": "x", "answer": "1"}], "--task 'math5'"),
    (["--task", "math500"], [{"answer": "1"}], "line 1: field 'prediction'"),
    (["--task", "math500"], [{"prediction": "x", "answer": ["1"]}], "line 1: field 'answer'"),
    (["--task", "longbench"], [{"prediction": "x"}], "line 1: field 'answers'"),
    (["--task", "math500", "task.scorer=exact"], [{"prediction": "x", "answer": "1"}], "task.scorer="),
    (["task.scorer=kvpress"], [{"prediction": "x", "answer": "1"}], "task.KEY=VALUE, with --task only"),
])
def test_score_task_file_errors_are_one_line(tmp_path, capsys, args, rows, key):
    write(tmp_path, "p.jsonl", rows)
    path = str(tmp_path / "p.jsonl")
    argv = args[:2] + [path] + args[2:] if args[0] == "--task" else [path, *args]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and key in err and len(err.strip().splitlines()) == 1
