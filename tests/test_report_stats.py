"""Statistics of the reports: standard errors and n per cell, paired bootstrap comparisons, the NIAH strict match.

Records are written as a job writes them (``predictions.jsonl``, ``summary.json``) by ``test_report.make_job``;
every expected value below is computed by hand from the per-sample scores.
"""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pandas as pd
import pytest
from test_report import make_job

from kvbench.report import build as report
from kvbench.report.tables import avg_se, paired_bootstrap

ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
RIGHT, WRONG = "Eat a sandwich, and sit in Dolores Park on a sunny day.", "Go to the park and eat a sandwich."


def niah_job(root, method, budget, scores, predictions):
    recs = [{"id": f"niah/1000/{i}", "dataset": "niah", "score": s, "prediction": p, "answers": [ANSWER],
             "error": None, "meta": {"context_length": 1000, "depth_percent": 10 * i}}
            for i, (s, p) in enumerate(zip(scores, predictions))]
    mean = round(100 * sum(scores) / len(scores), 2)
    job = make_job(root, task="niah", model="tiny", method=method, budget=budget, scores={"niah": mean}, records=recs)
    summary = json.loads((job / "summary.json").read_text())
    summary["datasets"]["niah"]["n"] = len(recs)
    (job / "summary.json").write_text(json.dumps(summary))
    return job


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Full cache, SnapKV (worse on every sample) and SelKV (equal to the full cache) on 4 NIAH samples."""
    root = tmp_path_factory.mktemp("stats")
    niah_job(root, "full", 1.0, [1.0, 1.0, 0.5, 0.5], [RIGHT, RIGHT, WRONG, "EAT A SANDWICH AND SIT IN DOLORES PARK "
                                                       "ON A SUNNY DAY"])
    niah_job(root, "snapkv", 0.25, [0.75, 0.5, 0.25, 0.0], [RIGHT, WRONG, WRONG, WRONG])
    niah_job(root, "selkv", 0.25, [1.0, 1.0, 0.5, 0.5], [RIGHT, RIGHT, WRONG, WRONG])
    return root


def test_standard_error_of_a_known_list(sweep):
    df = report.load_results(sweep).set_index("method")
    assert df.at["SnapKV", "se"] == pytest.approx(100 * np.std([0.75, 0.5, 0.25, 0.0], ddof=1) / 2)  # 16.14
    assert df.at["SnapKV", "strict"] == 25.0 and df.at["SnapKV", "strict_se"] == pytest.approx(25.0)  # [1, 0, 0, 0]
    assert df.at["Full Cache", "strict"] == 75.0  # upper case, punctuation: still the phrase
    assert avg_se(pd.Series([3.0, 4.0])) == pytest.approx(2.5) and math.isnan(avg_se(pd.Series([3.0, math.nan])))


def test_paired_bootstrap_on_a_sure_win_and_on_identical_methods():
    diff, low, high, p = paired_bootstrap({"a": np.array([10.0, 20.0, 30.0, 5.0, 15.0]), "b": np.array([40.0, 50.0])})
    # 7 pairs, all B > A: of the 2^7 sign patterns only this one and its mirror reach |Δ|: p ≈ 2 / 128
    assert diff == pytest.approx((16 + 45) / 2) and 16 <= low < diff < high <= 45 and p == 2 / 128  # exact
    assert paired_bootstrap({"a": np.zeros(6)}) == (0.0, 0.0, 0.0, 1.0)
    assert paired_bootstrap({"a": np.full(6, 5.0)})[3] == 2**-5  # six same-sign pairs: the floor 2^(1-k), no lower
    many = paired_bootstrap({"a": np.arange(1.0, 18.0)})  # 17 pairs: 10,000 random patterns, add-one
    assert many[3] == pytest.approx(1 / 10_001, abs=2 / 10_001) and many[3] >= 2**-16


def test_the_report_scores_only_the_samples_its_summary_selected(sweep, tmp_path):
    """A rerun on a smaller grid rewrites summary.json (its ``ids``); the older records stay stored but unscored."""
    root = tmp_path / "root"
    niah_job(root, "full", 1.0, [1.0, 1.0, 0.5, 0.5], [RIGHT, RIGHT, WRONG, WRONG])
    job = niah_job(root, "snapkv", 0.25, [0.75, 0.5, 0.25, 0.0], [RIGHT, WRONG, WRONG, WRONG])
    summary = json.loads((job / "summary.json").read_text())
    summary |= {"ids": ["niah/1000/0", "niah/1000/1"], "datasets": {"niah": {"score": 62.5, "n": 2}}}
    (job / "summary.json").write_text(json.dumps(summary))
    df = report.load_results(root).set_index("method")
    assert (df.at["SnapKV", "score"], df.at["SnapKV", "n"], df.at["SnapKV", "strict"]) == (62.5, 2, 50.0)
    assert df.at["SnapKV", "se"] == pytest.approx(12.5)  # std([0.75, 0.5]) / sqrt(2), not the four records'
    assert report.main([str(root), "--out", str(tmp_path / "rep"), "--only", "scores"]) == 0
    with open(tmp_path / "rep" / "paired_niah_tiny.csv") as f:
        snap = next(r for r in csv.DictReader(f) if r["Method"] == "SnapKV" and r["Over"] == "Avg")
    assert (snap["Pairs"], snap["Δ"]) == ("2", "-37.5")  # (0.75 - 1) and (0.5 - 1) on the two scored ids


def test_a_table_without_inputs_is_listed_as_such_not_a_crash(tmp_path):
    make_job(tmp_path / "root", method="selkv", scores={"multifieldqa_zh": 30.0})  # no English dataset: no Table 4
    assert report.main([str(tmp_path / "root"), "--out", str(tmp_path / "rep")]) == 0
    assert "- selkv_table4: no inputs in this results root" in (tmp_path / "rep" / "index.md").read_text()


def test_report_shows_se_n_strict_and_a_paired_comparison(sweep, tmp_path):
    assert report.main([str(sweep), "--out", str(tmp_path), "--only", "scores"]) == 0
    md = (tmp_path / "scores_niah_tiny.md").read_text()
    assert "| Method | Budget | niah | niah strict | Avg | n |" in md
    assert "| Full Cache | – | 75.00 ± 14.43 | 75.00 ± 25.00 | 75.00 ± 14.43 | 4 |" in md
    assert "| SnapKV | 25% | 37.50 ± 16.14 | 25.00 ± 25.00 | 37.50 ± 16.14 | 4 |" in md
    assert r"37.50 $\pm$ 16.14" in (tmp_path / "scores_niah_tiny.tex").read_text()
    with open(tmp_path / "scores_niah_tiny.csv") as f:
        row = list(csv.DictReader(f))[1]
    assert (row["niah"], row["niah SE"], row["niah strict"], row["n"]) == ("37.5", "16.14", "25.0", "4")
    with open(tmp_path / "paired_niah_tiny.csv") as f:
        rows = {(r["Method"], r["Over"]): r for r in csv.DictReader(f)}
    snap, sel = rows["SnapKV", "Avg"], rows["SelKV", "Avg"]
    assert (snap["Pairs"], snap["Δ"]) == ("4", "-37.5") and float(snap["CI high"]) < 0
    assert float(snap["p"]) == 2 / 16  # 4 pairs, all worse: exactly 2 of the 16 sign patterns reach |Δ|
    assert (sel["Δ"], sel["CI low"], sel["CI high"], sel["p"]) == ("0.0", "0.0", "0.0", "1.0000")
    assert rows["SnapKV", "niah strict"]["Δ"] == "-50.0"  # strict: 1,0,0,0 vs 1,1,0,1
    assert "paired bootstrap" in (tmp_path / "paired_niah_tiny.md").read_text()
    assert (tmp_path / "paired_niah_tiny.sources.txt").read_text().count("niah/tiny/") == 3
