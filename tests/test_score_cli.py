"""``kvbench score DIR``: the official eval.py over a folder of prediction files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.score import main

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
        [sys.executable, "-m", "kvbench.score", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
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
