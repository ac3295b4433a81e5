"""Tests of the report's overview score tables (``scores_<task>_<model>``, :func:`report_tables.score_tables`).

The fixture is a small sweep as a researcher would run it (``python run.py -m method=snapkv,selkv
budget=0.25,256 task=...``): two methods × two budgets (a retention ratio and a token budget) on
NIAH, and the same on a LongBench-like task with two datasets, plus a full-cache job; the
SelKV job at 256 tokens lacks hotpotqa (and is incomplete). Job folders are written by
``tests/test_report.py``'s ``make_job`` (config.yaml + summary.json, as the engine writes them).
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pandas as pd
import pytest
from test_report import make_job

from kvbench.report import build as report
from kvbench.report.tables import score_tables

NIAH = {("snapkv", 0.25): 40.0, ("snapkv", 256): 62.5, ("selkv", 0.25): 55.0, ("selkv", 256): 75.0}
LONGBENCH = {  # {(method, budget): {dataset: score}}; selkv @256 lacks hotpotqa
    ("full", 1.0): {"hotpotqa": 45.0, "qasper": 35.0},
    ("snapkv", 0.25): {"hotpotqa": 40.0, "qasper": 30.0},
    ("snapkv", 256): {"hotpotqa": 41.0, "qasper": 32.5},
    ("selkv", 0.25): {"hotpotqa": 44.0, "qasper": 31.25},
    ("selkv", 256): {"qasper": 33.0},
}


def build_sweep(root: Path) -> Path:
    """The fixture results root (see module docstring); summaries say n = 5 per dataset."""
    for (method, budget), score in NIAH.items():
        make_job(root, task="niah", model="tiny", method=method, budget=budget, scores={"niah": score})
    for (method, budget), scores in LONGBENCH.items():
        make_job(root, task="longbench", model="tiny", method=method, budget=budget, scores=scores,
                 complete=(method, budget) != ("selkv", 256))
    return root


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    return build_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="module")
def tables(sweep) -> dict:
    return {t.name: t for t in score_tables(report.load_results(sweep))}


def scores_only(df, root=None) -> list:
    return [t for t in score_tables(df, root) if t.name.startswith("scores_")]


def records(table) -> list[dict]:
    return table.data.to_dict("records")


def test_one_table_per_task_and_model(tables):
    assert list(tables) == ["scores_longbench_tiny", "scores_niah_tiny"]


def test_niah_table_rows_budget_labels_and_bold(tables):
    t = tables["scores_niah_tiny"]
    assert list(t.data.columns) == ["Method", "Budget", "niah", "Avg", "n"]
    assert [(r["Method"], r["Budget"], r["niah"], r["Avg"], r["n"]) for r in records(t)] == [
        ("SnapKV", "25%", 40.0, 40.0, "5"), ("SnapKV", "256", 62.5, 62.5, "5"),
        ("SelKV", "25%", 55.0, 55.0, "5"), ("SelKV", "256", 75.0, 75.0, "5")]
    assert t.bold == {(3, "niah"), (3, "Avg")}
    assert "tiny" in t.caption and "niah" in t.caption and "round(100·mean, 2)" in t.caption
    assert "budget ≤ 1: retention ratio ρ of the prompt tokens (task.compress=prompt); budget > 1: tokens per" in t.caption
    assert sorted(t.sources) == sorted(f"niah/tiny/{m}/b{b}" for m, b in NIAH) and not t.notes


def test_longbench_table_cells_missing_avg_and_bold(tables):
    t = tables["scores_longbench_tiny"]
    assert list(t.data.columns) == ["Method", "Budget", "qasper", "hotpotqa", "Avg", "n"]  # LongBench order
    assert t.headers["qasper"] == "Qasp" and t.headers["hotpotqa"] == "HpQA"
    rows = records(t)
    assert [(r["Method"], None if pd.isna(r["Budget"]) else r["Budget"]) for r in rows] == [
        ("Full Cache", None), ("SnapKV", "25%"), ("SnapKV", "256"), ("SelKV", "25%"), ("SelKV", "256")]
    assert [(r["qasper"], r["hotpotqa"], r["Avg"], r["n"]) for r in rows[:4]] == [
        (35.0, 45.0, 40.0, "5"), (30.0, 40.0, 35.0, "5"), (32.5, 41.0, 36.75, "5"), (31.25, 44.0, 37.625, "5")]
    assert rows[4]["qasper"] == 33.0 and math.isnan(rows[4]["hotpotqa"]) and math.isnan(rows[4]["Avg"])
    assert rows[4]["n"] == "5"  # samples per cell of the datasets it has
    # best complete compressed configuration per column: the full cache is the reference and the
    # incomplete SelKV b256 job (33.00 on qasper, the highest) is never bold
    assert t.bold == {(2, "qasper"), (3, "hotpotqa"), (3, "Avg")}
    assert t.notes == ["unfinished: longbench/tiny/selkv/b256 (5 samples scored); not bold"]


def test_a_budget_that_kept_every_prompt_whole_is_never_bold(tmp_path):
    """snapkv at 4096 tokens on 512-token prompts compresses nothing (records ``compressed: false``): it
    scores like the full cache, so a "not bold" note names it and the best compressing row is bold."""
    for budget, score, compressed in ((0.25, 40.0, True), (4096, 100.0, False)):
        recs = [{"id": f"niah/512/{i}", "dataset": "niah", "score": score / 100, "error": None, "compressed": compressed,
                 "prompt_tokens": 512} for i in range(2)]
        make_job(tmp_path, task="niah", model="tiny", method="snapkv", budget=budget, scores={"niah": score},
                 records=recs)
    (t,) = scores_only(report.load_results(tmp_path))
    assert [(r["Budget"], r["niah"]) for r in records(t)] == [("25%", 40.0), ("4096", 100.0)]
    assert t.bold == {(0, "niah"), (0, "Avg")}
    assert t.notes == ["not bold: SnapKV at budget 4096 kept every prompt whole"]
    # the summary (its run's samples) decides over records of an earlier, longer grid that compressed
    job = tmp_path / "niah/tiny/snapkv/b4096"
    (job / "predictions.jsonl").write_text("".join(
        json.dumps({"id": f"niah/{n}/0", "dataset": "niah", "score": 1.0, "error": None, "compressed": n > 4096}) + "\n"
        for n in (512, 8192)))
    summary = json.loads((job / "summary.json").read_text())
    summary["cache"]["compressed_fraction"] = 0.0
    (job / "summary.json").write_text(json.dumps(summary))
    (t,) = scores_only(report.load_results(tmp_path))
    assert t.bold == {(0, "niah"), (0, "Avg")} and len(t.notes) == 1


def test_cli_only_scores_writes_only_them(sweep, tmp_path):
    from kvbench.cli import main as kvbench_cli

    out = tmp_path / "report"
    assert kvbench_cli(["report", str(sweep), "--out", str(out), "--only", "scores"]) == 0
    assert {p.name for p in out.iterdir()} == {"index.md"} | {
        f"scores_{t}_tiny.{ext}" for t in ("longbench", "niah") for ext in ("md", "tex", "csv", "sources.txt")}
    index = (out / "index.md").read_text()
    assert "- scores_longbench_tiny: scores_longbench_tiny.md, scores_longbench_tiny.tex, scores_longbench_tiny.csv" \
        " (5 job(s), 1 note(s): unfinished)" in index
    assert "- scores_niah_tiny: " in index and "selkv_table1" not in index
    md = (out / "scores_longbench_tiny.md").read_text()
    assert "| Method | Budget | Qasp | HpQA | Avg | n |" in md
    assert "| Full Cache | – | 35.00 | 45.00 | 40.00 | 5 |" in md  # summaries only: no SE, no paired table
    assert "| SelKV | 25% | 31.25 | **44.00** | **37.63** | 5 |" in md  # 37.625 rounds half-up
    assert "| SnapKV | 256 | **32.50** | 41.00 | 36.75 | 5 |" in md
    assert "| SelKV | 256 | 33.00 | – | – | 5 |" in md  # incomplete: not bold
    with open(out / "scores_longbench_tiny.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows[0] == {"Method": "Full Cache", "Budget": "", "qasper": "35.0", "hotpotqa": "45.0", "Avg": "40.0",
                       "n": "5"}
    assert rows[4] == {"Method": "SelKV", "Budget": "256", "qasper": "33.0", "hotpotqa": "", "Avg": "", "n": "5"}
    tex = (out / "scores_longbench_tiny.tex").read_text()
    assert r"SelKV & 256 & 33.00 & -- & -- & 5 \\" in tex and r"25\%" in tex
    srcs = (out / "scores_niah_tiny.sources.txt").read_text()
    assert "niah/tiny/selkv/b0.25\n" in srcs and "longbench" not in srcs.split("\n", 2)[2]


def test_full_report_lists_scores_next_to_paper_artifacts(sweep, tmp_path):
    out = tmp_path / "all"
    assert report.main([str(sweep), "--out", str(out)]) == 0
    index = (out / "index.md").read_text()
    assert "- scores_niah_tiny: " in index and "- selkv_fig3: no inputs in this results root" in index


def test_variants_and_reruns(tmp_path):
    """A W sweep of one label is told apart by a Variant column (the preset's W=32 first, then W in
    numeric order); a rerun with the default's fields fills the default's missing dataset."""
    make_job(tmp_path, method="selkv", budget=0.25, params={"window_size": 32}, scores={"qasper": 30.0})
    make_job(tmp_path, method="selkv", budget=0.25, params={"window_size": 32}, folder_tag="rerun",
             scores={"qasper": 99.0, "hotpotqa": 40.0})
    for w, score in [(16, 28.0), (4, 27.0)]:
        make_job(tmp_path, method="selkv", budget=0.25, params={"window_size": w}, folder_tag=f"w{w}",
                 scores={"qasper": score, "hotpotqa": 39.0})
    (t,) = scores_only(report.load_results(tmp_path))
    assert list(t.data.columns) == ["Method", "Variant", "Budget", "qasper", "hotpotqa", "Avg", "n"]
    assert [(r["Variant"], r["qasper"], r["hotpotqa"]) for r in records(t)] == [  # the job with more datasets first
        ("window_size=32", 99.0, 40.0), ("window_size=4", 27.0, 39.0), ("window_size=16", 28.0, 39.0)]
    assert "longbench/llama31/selkv/b0.25-rerun" in t.sources and "longbench/llama31/selkv/b0.25" not in t.sources


def test_a_lone_variant_is_marked_against_its_preset_file(tmp_path):
    """``method.alpha=1.5`` alone in a results root (no default SelKV job beside it) still shows
    its field in the Variant column: the reference is ``conf/method/selkv.yaml`` (alpha 0.5);
    a job whose fields equal the preset's has no Variant column."""
    make_job(tmp_path, task="niah", model="tiny", method="selkv", params={"alpha": 0.5, "window_size": 32},
             scores={"niah": 50.0})
    (t,) = scores_only(report.load_results(tmp_path))
    assert "Variant" not in t.data.columns
    job = make_job(tmp_path / "b", task="niah", model="tiny", method="selkv", params={"alpha": 1.5, "window_size": 32},
                   folder_tag="c289d2ea", scores={"niah": 25.0})
    (t,) = score_tables(report.load_results(tmp_path / "b"))
    assert [(r["Method"], r["Variant"]) for r in records(t)] == [("SelKV", "alpha=1.5")]
    assert "method variant" in t.caption
    # with the default job beside it both rows say their alpha, the default first
    job.rename(tmp_path / "niah/tiny/selkv" / job.name)
    (t,) = scores_only(report.load_results(tmp_path))
    assert [(r["Variant"], r["niah"]) for r in records(t)] == [("alpha=0.5", 50.0), ("alpha=1.5", 25.0)]
    # without the preset's own job, variants go in numeric order
    for alpha, tag in ((2, "aaaa1111"), (1.0, "bbbb2222")):
        make_job(tmp_path / "c", task="niah", model="tiny", method="selkv", params={"alpha": alpha, "window_size": 32},
                 folder_tag=tag, scores={"niah": 10.0 * alpha})
    (t,) = score_tables(report.load_results(tmp_path / "c"))
    assert [r["Variant"] for r in records(t)] == ["alpha=1.0", "alpha=2"]


def test_no_scored_job_means_no_inputs(tmp_path):
    make_job(tmp_path, task="niah", model="tiny", method="snapkv", summary=False,
             records=[{"id": "niah/256/10", "dataset": "niah", "score": None, "error": {"type": "X"}}])
    assert score_tables(report.load_results(tmp_path)) == []
    assert report.main([str(tmp_path), "--out", str(tmp_path / "r"), "--only", "scores"]) == 0
    assert "- scores: no inputs in this results root" in (tmp_path / "r" / "index.md").read_text()


def test_niah_jobs_on_different_grids_are_noted(tmp_path):
    """Scores of NIAH jobs run on different length × depth grids are not comparable: the table
    names the grids (from each summary's ``selection``) and bolds nothing; one grid: no note."""
    import json

    root = build_sweep(tmp_path / "root")
    grids = {("snapkv", 0.25): ([512], [50]), ("snapkv", 256): ([512], [50]), ("selkv", 0.25): ([512], [50]),
             ("selkv", 256): ([2048], [10, 90])}
    for (method, budget), (lengths, depths) in grids.items():
        path = root / "niah" / "tiny" / method / f"b{budget}" / "summary.json"
        summary = json.loads(path.read_text())
        summary["selection"] = {"task.context_lengths": lengths, "task.depth_percents": depths}
        path.write_text(json.dumps(summary))
    table = {t.name: t for t in score_tables(report.load_results(root), root)}["scores_niah_tiny"]
    assert table.notes == ["not comparable: rows scored on different sample sets or NIAH grids (lengths [2048] × "
                           "depths [10, 90]; lengths [512] × depths [50]); no bold"]
    assert table.bold == set()
    summary_path = root / "niah" / "tiny" / "selkv" / "b256" / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["selection"] = {"task.context_lengths": [512, 512], "task.depth_percents": [50.0]}  # the same grid
    summary_path.write_text(json.dumps(summary))
    table = {t.name: t for t in score_tables(report.load_results(root), root)}["scores_niah_tiny"]
    assert table.notes == []
    summary["selection"] = {"task.context_lengths": [2048, 512], "task.depth_percents": [90, 10.5, 10.5]}
    summary_path.write_text(json.dumps(summary))
    table = {t.name: t for t in score_tables(report.load_results(root), root)}["scores_niah_tiny"]
    assert "lengths [512, 2048] × depths [10.5, 90]" in table.notes[0]  # sorted, distinct


def test_jobs_over_part_of_each_dataset_are_noted_in_score_and_paper_tables(tmp_path):
    import yaml

    from kvbench.report.tables import grid as score_grid
    from kvbench.report.tables import job_notes

    for method, budget in (("full", 1.0), ("snapkv", 0.25)):
        job = make_job(tmp_path, task="longbench", model="tiny", method=method, budget=budget,
                       scores={"multi_news": 12.35})
        if method == "snapkv":  # run with task.n_samples=1
            cfg = yaml.safe_load((job / "config.yaml").read_text())
            cfg["task"]["n_samples"] = 1
            (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    df = report.load_results(tmp_path)
    note = ("subset: longbench/tiny/snapkv/b0.25 scored part of each dataset (task.n_samples=1); "
            "not comparable to whole-dataset scores")
    (table,) = score_tables(df)
    assert table.notes == [note, "not comparable: rows scored on different sample sets or NIAH grids "
                                 "(task.n_samples=1; whole datasets); no bold"]
    assert job_notes(score_grid(df, "longbench", 0.25).used) == [note]
    assert "Notes (a missing cell is shown as –):\n- " + note in report.to_markdown(table)
    # the summary's selection (its run) wins over config.yaml (the first run): rerun on whole datasets
    summary_path = tmp_path / "longbench/tiny/snapkv/b0.25/summary.json"
    summary = json.loads(summary_path.read_text())
    summary_path.write_text(json.dumps({**summary, "selection": {"task.n_samples": None, "max_samples": None}}))
    assert score_tables(report.load_results(tmp_path))[0].notes == []
    # the job's own subset (it knows whether n_samples left rows out) wins over the selection keys:
    # task.n_samples=200 on datasets of at most 200 rows scored all of them
    summary_path.write_text(json.dumps({**summary, "selection": {"task.n_samples": 200}, "subset": ""}))
    assert score_tables(report.load_results(tmp_path))[0].notes == []
    summary_path.write_text(json.dumps({**summary, "selection": {"task.n_samples": 200}, "subset": "task.n_samples=200"}))
    assert score_tables(report.load_results(tmp_path))[0].notes == [
        note.replace("n_samples=1", "n_samples=200"), "not comparable: rows scored on different sample sets or NIAH "
        "grids (task.n_samples=200; whole datasets); no bold"]


def _edit_config(job: Path, **task_keys) -> None:
    import yaml

    cfg = yaml.safe_load((job / "config.yaml").read_text())
    cfg["task"].update(task_keys)
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_jobs_of_other_settings_get_their_own_model_key_and_full_cache_reference(tmp_path):
    """A full-cache job run with task.max_new_tokens=64 (folder b0.25) next to the default one
    (b1.0): the 64-token SnapKV job is compared with the 64-token full cache only, and the
    model keys name the key that differs."""
    for method, budget, new, scores in [("full", 1.0, 32, {"qasper": 30.0}), ("full", 0.25, 64, {"qasper": 50.0}),
                                        ("snapkv", 0.25, 64, {"qasper": 45.0}), ("snapkv", 0.5, 32, {"qasper": 20.0})]:
        job = make_job(tmp_path, model="tiny", method=method, budget=budget, scores=scores)
        _edit_config(job, max_new_tokens=new, data_dir="/data/lb")
        if method == "snapkv" and new == 64:
            (job / "env.json").write_text(json.dumps({"device": "cpu", "dtype": "float32"}))
    df = report.load_results(tmp_path)
    keys = dict(zip(df["job"], df["model_key"]))
    assert keys == {"longbench/tiny/full/b1.0": "tiny [task.max_new_tokens=32]",
                    "longbench/tiny/full/b0.25": "tiny [task.max_new_tokens=64]",
                    "longbench/tiny/snapkv/b0.25": "tiny [task.max_new_tokens=64]",  # env.json: in no other job
                    "longbench/tiny/snapkv/b0.5": "tiny [task.max_new_tokens=32]"}
    tabs = {t.name: t for t in score_tables(df)}
    assert set(tabs) == {"scores_longbench_tiny_task_max_new_tokens_32", "scores_longbench_tiny_task_max_new_tokens_64"}
    pairs = {}
    for t in tabs.values():
        rows = {r["Method"]: r for r in records(t)}
        pairs[rows["SnapKV"]["Budget"]] = (rows["Full Cache"]["qasper"], rows["SnapKV"]["qasper"])
    assert pairs == {"25%": (50.0, 45.0), "50%": (30.0, 20.0)}  # before: one table, one full row (30 or 50) for both


def test_env_dtype_splits_model_keys_and_keys_missing_in_older_jobs_do_not(tmp_path):
    a = make_job(tmp_path, model="tiny", method="full", budget=1.0, scores={"qasper": 30.0})
    b = make_job(tmp_path, model="tiny", method="snapkv", budget=0.25, scores={"qasper": 20.0})
    c = make_job(tmp_path, model="tiny", method="snapkv", budget=0.5, scores={"qasper": 25.0})
    (a / "env.json").write_text(json.dumps({"device": "cuda:0", "dtype": "bfloat16"}))
    (b / "env.json").write_text(json.dumps({"device": "cpu", "dtype": "float32"}))
    _edit_config(c, max_new_tokens=32)  # an older job: no env.json; the only job with this key
    keys = dict(zip(*[report.load_results(tmp_path)[k] for k in ("job", "model_key")]))
    assert keys["longbench/tiny/full/b1.0"] == "tiny [env.device_type=cuda, env.dtype=bfloat16]"
    assert keys["longbench/tiny/snapkv/b0.25"] == "tiny [env.device_type=cpu, env.dtype=float32]"
    assert keys["longbench/tiny/snapkv/b0.5"] == "tiny"  # no env.json; task.max_new_tokens: in no other job


def test_english_and_chinese_headers_are_all_abbreviated(tmp_path):
    make_job(tmp_path, method="snapkv", scores={"qasper": 30.0, "dureader": 20.0, "passage_retrieval_zh": 10.0})
    (t,) = scores_only(report.load_results(tmp_path))
    assert [t.headers.get(c, c) for c in t.data.columns if c in ("qasper", "dureader", "passage_retrieval_zh")] == [
        "Qasp", "DuRd", "PRet-zh"]


def test_a_tagged_job_does_not_rename_the_untagged_jobs_table(tmp_path):
    """Untagged jobs of the truncation length every job shares keep the plain model key (and the
    table name scores_<task>_<model>) when a run_tag job joins; only the tagged job is suffixed.
    With another truncation length in play the untagged jobs say theirs (llama31 [3500 tok])."""
    make_job(tmp_path, model="tiny", method="full", budget=1.0, scores={"qasper": 30.0}, ctx=7500)
    make_job(tmp_path, model="tiny", method="snapkv", scores={"qasper": 20.0}, ctx=7500)
    make_job(tmp_path, model="tiny", method="snapkv", scores={"qasper": 25.0}, ctx=7500, run_tag="t1")
    keys = dict(zip(*[report.load_results(tmp_path)[k] for k in ("job", "model_key")]))
    assert keys == {"longbench/tiny/full/b1.0": "tiny", "longbench/tiny/snapkv/b0.25": "tiny",
                    "longbench/tiny/snapkv/b0.25-t1": "tiny [t1]"}
    assert {t.name for t in score_tables(report.load_results(tmp_path))} == {"scores_longbench_tiny",
                                                                             "scores_longbench_tiny_t1"}


def test_a_ratio_the_method_raised_is_named_and_never_bold(tmp_path):
    """budget=0.001 on 511-token prompts: SelKV keeps its 16-token window (3.1 %), not 0.1 %."""
    for budget, score, kept in ((0.001, 80.0, 16), (0.25, 60.0, 127)):
        recs = [{"id": f"niah/512/{i}", "dataset": "niah", "score": score / 100, "error": None, "compressed": True,
                 "prompt_tokens": 511, "kept_tokens": {"mean": kept, "min": kept, "max": kept}} for i in range(2)]
        make_job(tmp_path, task="niah", model="tiny", method="selkv", budget=budget, scores={"niah": score},
                 records=recs)
    (t,) = scores_only(report.load_results(tmp_path))
    assert [(r["Budget"], r["niah"]) for r in records(t)] == [("0.1%", 80.0), ("25%", 60.0)]
    assert t.bold == {(1, "niah"), (1, "Avg")}  # the honest 25 % row, not the raised one
    assert t.notes == ["not bold: SelKV at budget 0.1% kept 3.1 % of the prompt tokens"]


def test_a_long_model_key_makes_a_short_file_name():
    """A model key naming a source path can pass the file system's 255 bytes: cut, with its hash (names stay apart)."""
    from kvbench.report.tables import slug

    long = "tiny [model.source=/tmp/pytest-of-root/" + "x" * 300 + "]"
    assert slug("llama31 [ctx31500]") == "llama31_ctx31500" and len(slug(long)) == 99
    assert slug(long) != slug(long + "y") and slug(long).startswith("tiny_model_source_tmp_pytest_of_root_x")
