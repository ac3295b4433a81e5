"""Tests of kvbench.report.build on a hand-made results tree.

The fixture tree (built in tmp_path) holds jobs for a full cache and three compressed methods
on two models (LongBench, 6 datasets), with some jobs and datasets missing, ablation presets,
W × K variants, a long-context setting, CompressKV-style token budgets, NIAH jobs and a
latency file. Every expected number below is computed by hand from the fixture's scores.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from notebook_runner import execute_figures_notebook

from kvbench.report import build as report
from kvbench.job.run import heatmap
from kvbench.job.plots import niah_grid
from kvbench.report.tables import (
    compresskv_table1,
    compresskv_table2b,
    selkv_ratio_tables,
    selkv_table1,
    selkv_table4,
    sensitivity_table,
    staged_table,
)

COLUMNS = ["job", "task", "model", "model_key", "method", "method_name", "budget", "variant", "default", "dataset",
           "score", "n", "n_failed", "complete", "subset", "prefill_s", "decode_tok_s", "kept_tokens",
           "cache_bytes_after", "compressed_fraction"]


def selkv_table3(df):
    return sensitivity_table(df, "selkv_table3", "selkv", 0.25)


def compresskv_table3b(df):
    return sensitivity_table(df, "compresskv_table3b", "compresskv", 256, per_dataset=False,
                                    preset="compresskv_uniform")


def selkv_table2(df):
    return staged_table(df, "selkv_table2", 0.25)


def compresskv_table3a(df):
    return staged_table(df, "compresskv_table3a", 256)


def selkv_table7(df):
    return selkv_table1(df, long=True)

REPO = Path(__file__).resolve().parents[1]
DS = ["qasper", "hotpotqa", "musique", "multi_news", "trec", "lcc"]
SELKV = {"gate": "soft", "compensation": "global", "window_size": 32, "kernel_size": 5}
MAX_INPUT = {"llama31": 3500, "gemma2": 3500, "mistral": 31500, "smollm2": 7500}

# Table 1 scores at budget 0.25 (per dataset, order DS); None = dataset not scored.
LLAMA = {
    "full": [40.0, 50.0, 20.0, 25.0, 70.0, 60.0],
    "snapkv": [38.0, 49.0, 19.0, 24.0, 68.0, None],  # job incomplete: lcc missing
    "pyramidkv": [38.0, 47.0, 21.0, 23.0, 68.0, 59.0],
    "selkv": [39.0, 49.0, 20.5, 22.0, 68.0, 58.0],
}
GEMMA = {  # no pyramidkv job at all
    "full": [30.0, 45.0, 15.0, 22.0, 60.0, 55.0],
    "snapkv": [29.0, 44.0, 15.5, 21.0, 60.0, 54.0],  # predictions.jsonl only (no summary yet)
    "selkv": [29.5, 44.0, 14.0, 21.5, 59.0, 55.0],
}
LABELS = {"full": "Full Cache", "snapkv": "SnapKV", "pyramidkv": "PyramidKV", "selkv": "SelKV",
          "streamingllm": "StreamingLLM", "compresskv": "CompressKV"}


def make_job(root: Path, *, task="longbench", model="llama31", method="snapkv", preset=None, label=None,
             budget=0.25, scores: dict | None = None, params: dict | None = None, run_tag=None, ctx=None,
             folder_tag="", summary=True, complete=True, records: list | None = None) -> Path:
    """Write one job folder (docs/RESULTS.md) under <task>/<model>/<preset>/b<budget>[-tag]; the report reads
    its identity from config.yaml only."""
    name = f"b{budget}" + (f"-{run_tag or folder_tag}" if (folder_tag or run_tag) else "")
    job = root / task / model / (preset or method) / name
    job.mkdir(parents=True)
    cfg = {"model": {"name": model, "max_input_length": MAX_INPUT.get(model, 7500)},
           "method": {"name": method, "label": label or LABELS[method], **(params or {})},
           "task": {"name": task, "max_length": ctx}, "budget": budget, "run_tag": run_tag}
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    scores = {d: s for d, s in (scores or {}).items() if s is not None}
    recs = records
    if recs is None and not summary:
        recs = [{"id": f"{d}/{i}", "dataset": d, "score": s / 100, "error": None, "prefill_s": 1.0, "compress_s": 0.1,
                 "decode_s": 2.0, "decode_tok_s": 10.0, "prompt_tokens": 3000, "kept_tokens": {"mean": 750.0},
                 "cache_bytes_before": 4000, "cache_bytes_after": 1000} for d, s in scores.items() for i in range(2)]
    if recs:
        (job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if summary:
        (job / "summary.json").write_text(json.dumps({
            "job": str(job.relative_to(root)), "task": task, "model": model, "method": method, "budget": budget,
            "complete": complete, "n_failed": 0, "n_expected": 10,
            "datasets": {d: {"score": s, "n": 5} for d, s in scores.items()},
            "timings": {"prefill_s": 0.5, "compress_s": 0.01, "decode_s": 1.0, "decode_tok_s": 20.0},
            "cache": {"prompt_tokens": 3000.0, "kept_tokens": 750.0, "cache_bytes_before": 4.0e6,
                      "cache_bytes_after": 1.0e6}}))
    return job


def shifted(values, delta):
    return [None if v is None else v + delta for v in values]


def build_tree(root: Path) -> Path:
    """The fixture results tree (see module docstring)."""
    for method, vals in LLAMA.items():
        make_job(root, model="llama31", method=method, scores=dict(zip(DS, vals)), complete=method != "snapkv",
                 params=SELKV if method == "selkv" else None)
    for method, vals in GEMMA.items():
        make_job(root, model="gemma2", method=method, scores=dict(zip(DS, vals)), summary=method != "snapkv",
                 params=SELKV if method == "selkv" else None)
    # ablation presets (llama31, 0.25): offsets from SelKV's scores
    for preset, label, gate, delta in [("selkv_evict", "SelKV (evict only)", "off", -0.3),
                                       ("selkv_merge_all", "SelKV (merge all)", "none", -1.0),
                                       ("selkv_gate", "SelKV (+ gate)", "soft", -0.2)]:
        make_job(root, model="llama31", method="selkv", preset=preset, label=label,
                 params={**SELKV, "gate": gate, "compensation": "off"},
                 scores=dict(zip(DS, shifted(LLAMA["selkv"], delta))))
    make_job(root, model="llama31", method="selkv", preset="selkv_gate_comp", label="SelKV (+ gate + comp)",
             params=SELKV, scores=dict(zip(DS, LLAMA["selkv"])))  # same fields as selkv: one configuration
    # W × K variants of SelKV on gemma2 (tagged folders), next to the default job
    for w, k, delta in [(16, 5, -0.5), (32, 3, 0.25)]:
        make_job(root, model="gemma2", method="selkv", params={**SELKV, "window_size": w, "kernel_size": k},
                 folder_tag=f"w{w}k{k}", scores=dict(zip(DS, shifted(GEMMA["selkv"], delta))))
    # retention-ratio sweep on llama31: 10% (snapkv, selkv) and 50% (selkv only)
    make_job(root, model="llama31", method="snapkv", budget=0.1, scores=dict(zip(DS, shifted(LLAMA["full"], -3))))
    make_job(root, model="llama31", method="selkv", budget=0.1, params=SELKV,
             scores=dict(zip(DS, shifted(LLAMA["selkv"], -2))))
    make_job(root, model="llama31", method="selkv", budget=0.5, params=SELKV,
             scores=dict(zip(DS, shifted(LLAMA["full"], -0.5))))
    # long context (Table 7): llama31 at 31,500 tokens, 2 datasets
    for method, vals in {"full": [50.0, 60.0], "snapkv": [49.0, 58.0], "selkv": [49.5, 59.0]}.items():
        make_job(root, model="llama31", method=method, scores=dict(zip(DS[:2], vals)), run_tag="ctx31500", ctx=31500,
                 params=SELKV if method == "selkv" else None)
    # CompressKV-style token budgets on mistral (2 datasets); streamingllm @1024 absent
    ck = {"full": {None: [40.0, 30.0]}, "snapkv": {256: [36.0, 26.0], 1024: [39.0, 29.0]},
          "streamingllm": {256: [30.0, 20.0]}, "compresskv": {256: [37.0, 27.5], 1024: [39.5, 29.0]}}
    for method, by_budget in ck.items():
        for b, vals in by_budget.items():
            make_job(root, model="mistral", method=method, budget=b or 1.0, scores=dict(zip(DS[:2], vals)),
                     params={"num_heads": 4} if method == "compresskv" else None)
    make_job(root, model="mistral", method="compresskv", preset="compresskv_uniform", budget=256,
             label="SnapKV + SRH", params={"num_heads": 4, "layer_allocation": "uniform"},
             scores=dict(zip(DS[:2], [36.5, 27.0])))
    make_job(root, model="mistral", method="compresskv", preset="compresskv_uniform", budget=256, label="SnapKV + SRH",
             params={"num_heads": 2, "layer_allocation": "uniform"}, folder_tag="h2",
             scores=dict(zip(DS[:2], [36.0, 27.0])))
    make_job(root, model="mistral", method="compresskv", preset="compresskv_trh", budget=256, label="CompressKV-TRH",
             params={"num_heads": 4, "selection": "trh", "layer_allocation": "uniform"},
             scores=dict(zip(DS[:2], [36.0, 26.5])))
    # NIAH on smollm2: full + snapkv at two token budgets, 2 lengths x 3 depths
    for method, b, hits in [("full", 1.0, 1.0), ("snapkv", 128, 0.0), ("snapkv", 256, 0.5)]:
        recs = [{"id": f"niah/{n}/{d}", "dataset": "niah", "score": hits if d != 10 else 1.0, "error": None,
                 "meta": {"context_length": n, "depth_percent": d}} for n in (256, 512) for d in (10, 50, 90)]
        make_job(root, task="niah", model="smollm2", method=method, budget=b, records=recs,
                 scores={"niah": round(100 * sum(r["score"] for r in recs) / len(recs), 2)})
    (root / "latency.json").write_text(json.dumps([
        {"model": "llama31", "method": m, "budget": 0.25, "prompt_tokens": n, "prefill_s": 0.1 * n / 512,
         "compress_s": 0.0 if m == "Full Cache" else 0.01, "decode_s": 2.0, "generated_tokens": 32,
         "decode_tok_s": 16.0, "peak_mem_bytes": 1e9} for m in ("Full Cache", "SelKV") for n in (512, 1024)]))
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return build_tree(tmp_path_factory.mktemp("results"))


@pytest.fixture(scope="module")
def df(tree):
    return report.load_results(tree)


def rows_by(table, *keys):
    return {tuple(r[k] for k in keys): r for r in table.data.to_dict("records")}


def test_load_results_columns_and_values(df):
    assert set(COLUMNS) <= set(df.columns)
    r = df[(df["model"] == "gemma2") & (df["method"] == "SnapKV") & (df["dataset"] == "musique")].iloc[0]
    assert r["score"] == 15.5 and r["n"] == 2 and not r["complete"]  # from predictions.jsonl
    assert r["prefill_s"] == 1.0 and r["kept_tokens"] == 750.0 and r["cache_bytes_after"] == 1000
    r = df[(df["model_key"] == "llama31 [3500 tok]") & (df["method"] == "PyramidKV") & (df["dataset"] == "lcc")].iloc[0]
    assert r["score"] == 59.0 and r["decode_tok_s"] == 20.0 and r["max_input_tokens"] == 3500 and r["budget"] == 0.25
    assert set(df.loc[df["model"] == "llama31", "model_key"]) == {"llama31 [3500 tok]", "llama31 [ctx31500]"}
    assert set(df.loc[df["model"] == "gemma2", "model_key"]) == {"gemma2"}


def test_an_unlabelled_method_is_named_by_its_registry_name(tmp_path):
    job = make_job(tmp_path, method="selkv", preset="selkv_evict", params={"gate": "off"}, scores={"qasper": 1.0})
    cfg = yaml.safe_load((job / "config.yaml").read_text())
    del cfg["method"]["label"]
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    row = report.load_results(tmp_path).iloc[0]
    assert (row["method"], row["method_name"], row["variant"]) == ("selkv", "selkv", "")


def test_selkv_table1_numbers(df):
    (t,) = selkv_table1(df)
    rows = rows_by(t, "Model", "Method")
    L, G = "llama31 [3500 tok]", "gemma2"
    assert list(t.data.columns[2:8]) == DS
    assert rows[(L, "Full Cache")]["Avg"] == pytest.approx(265 / 6)
    assert rows[(L, "PyramidKV")]["Avg"] == pytest.approx(256 / 6)
    assert rows[(L, "PyramidKV")]["Δ"] == pytest.approx(256 / 6 - 265 / 6)
    assert rows[(L, "SelKV")]["Δ"] == pytest.approx(256.5 / 6 - 265 / 6)
    # dense ranks among compressed methods: pyr 2,2,1,2,1,1 ; sel 1,1,2,3,1,2 ; snapkv lacks lcc
    assert rows[(L, "PyramidKV")]["Avg Rank"] == pytest.approx(9 / 6)
    assert rows[(L, "SelKV")]["Avg Rank"] == pytest.approx(10 / 6)
    assert math.isnan(rows[(L, "SnapKV")]["Avg"]) and math.isnan(rows[(L, "SnapKV")]["lcc"])
    assert math.isnan(rows[(L, "SnapKV")]["Avg Rank"])
    assert rows[(G, "SnapKV")]["Avg"] == pytest.approx(223.5 / 6)
    assert rows[(G, "SnapKV")]["Avg Rank"] == pytest.approx(9 / 6)
    assert rows[(G, "SelKV")]["Avg Rank"] == pytest.approx(8 / 6)
    assert rows[(G, "SelKV")]["Δ"] == pytest.approx(223 / 6 - 227 / 6)
    assert all(math.isnan(rows[(G, "PyramidKV")][c]) for c in [*DS, "Avg", "Δ", "Avg Rank"])  # absent job
    assert "SelKV (evict only)" not in set(t.data["Method"])  # ablation presets stay out
    pos = {(r["Model"], r["Method"]): i for i, r in enumerate(t.data.to_dict("records"))}
    assert (pos[(L, "SelKV")], "qasper") in t.bold and (pos[(L, "PyramidKV")], "musique") in t.bold
    # gemma2 SnapKV ties SelKV on hotpotqa, but its job is unfinished (no summary): never bold
    assert (pos[(G, "SnapKV")], "hotpotqa") not in t.bold and (pos[(G, "SelKV")], "hotpotqa") in t.bold
    assert any(n.startswith("unfinished: longbench/gemma2/snapkv/b0.25 (") for n in t.notes)
    assert (pos[(G, "SelKV")], "Avg Rank") in t.bold
    assert "longbench/gemma2/snapkv/b0.25" in t.sources and "gemma2/selkv/b0.25-w16k5" not in " ".join(t.sources)


def test_main_table_shows_an_ablation_preset_standing_in_for_the_main_one(tmp_path):
    """Only SelKV's Table 2 presets ran: the shortest label fills the SelKV row (named in the Method
    column); once selkv ran, its label is the row."""
    scores = {"qasper": 30.0}
    make_job(tmp_path, method="full", scores={"qasper": 40.0})
    make_job(tmp_path, method="selkv", preset="selkv_gate", label="SelKV (+gate)", params=SELKV, scores=scores)
    make_job(tmp_path, method="selkv", preset="selkv_evict", label="SelKV (evict only)", params={"gate": "off"},
             scores={"qasper": 20.0})
    (t,) = selkv_table1(report.load_results(tmp_path))
    assert list(t.data["Method"]) == ["Full Cache", "SelKV (+gate)"] and list(t.data["qasper"]) == [40.0, 30.0]
    make_job(tmp_path, method="selkv", params=SELKV, scores={"qasper": 35.0})
    (t,) = selkv_table1(report.load_results(tmp_path))
    assert list(t.data["Method"]) == ["Full Cache", "SelKV"] and list(t.data["qasper"]) == [40.0, 35.0]


def test_paper_table1_ranks_reproduced(tmp_path):
    """The SelKV paper's Gemma-2 block of Table 1: Avg and Avg Rank as printed (42.16, 2.06, ...)."""
    paper = {
        "full": "22.93 40.79 46.68 47.25 48.74 22.84 27.63 19.47 24.81 67.50 91.92 43.56 7.00 33.50 72.78 70.33",
        "snapkv": "22.22 40.01 46.78 46.90 46.54 22.00 24.63 19.28 22.30 66.50 91.92 42.62 7.00 33.50 72.62 69.75",
        "lookm": "22.66 36.75 45.93 46.97 46.05 22.34 23.98 19.18 22.73 55.50 92.17 42.25 7.00 33.50 72.07 69.84",
        "pyramidkv": "22.43 39.70 46.71 46.37 47.30 22.41 24.46 18.94 22.12 66.50 91.92 42.36 7.00 33.50 72.53 69.10",
        "selkv": "23.32 40.01 46.44 46.67 46.84 22.90 24.94 19.33 22.79 67.00 91.76 42.89 7.00 33.50 72.24 69.35",
    }
    from kvbench.report.data import DATASET_ORDER
    for m, text in paper.items():
        make_job(tmp_path, model="gemma2", method=m, label=m, scores=dict(zip(DATASET_ORDER, map(float, text.split()))))
    (t,) = selkv_table1(report.load_results(tmp_path))
    got = {r["Method"]: (report.fmt(r["Avg"]), report.fmt(r["Δ"], True), report.fmt(r["Avg Rank"]))
           for r in t.data.to_dict("records")}
    assert got == {"full": ("42.98", None, None), "snapkv": ("42.16", "-0.82", "2.06"),
                   "lookm": ("41.18", "-1.80", "2.56"), "pyramidkv": ("42.08", "-0.90", "2.50"),
                   "selkv": ("42.31", "-0.67", "1.69")}


def test_selkv_table2_ablation(df):
    (t,) = selkv_table2(df)
    rows = [r for r in t.data.to_dict("records") if r["Model"] == "llama31 [3500 tok]"]
    assert [r["Configuration"] for r in rows] == ["Full Cache", "SelKV (evict only)", "SelKV (merge all)",
                                                  "SelKV (+ gate)", "SelKV (+ gate + comp)"]
    assert [(r["Gate"], r["Comp"], r["Merge"]) for r in rows[1:]] == [
        ("–", "–", "–"), ("–", "–", "✓"), ("✓", "–", "✓"), ("✓", "✓", "✓")]
    sel = 256.5 / 6
    assert [r["Avg"] for r in rows] == pytest.approx([265 / 6, sel - 0.3, sel - 1.0, sel - 0.2, sel])
    assert math.isnan(rows[1]["Δ prev"])
    assert [r["Δ prev"] for r in rows[2:]] == pytest.approx([-0.7, 0.8, 0.2])
    assert rows[1]["Δ full"] == pytest.approx(sel - 0.3 - 265 / 6)
    assert t.caption.startswith("Ablation of SelKV on LongBench")  # the paper's name, not the registry's


def test_selkv_table3_wk_sensitivity(df):
    (t,) = selkv_table3(df)
    rows = t.data.to_dict("records")
    assert [(r["kernel_size"], r["window_size"], r["Default"]) for r in rows] == [
        ("3", "32", ""), ("5", "16", ""), ("5", "32", "✓")]
    assert [r["Avg"] for r in rows] == pytest.approx([223 / 6 + 0.25, 223 / 6 - 0.5, 223 / 6])
    assert [r["Δ default"] for r in rows] == pytest.approx([0.25, -0.5, 0.0])
    assert rows[0]["qasper"] == 29.75
    assert t.caption.startswith("Sensitivity of SelKV to ")


def test_selkv_table4_category_means(df):
    (t,) = selkv_table4(df)
    rows = rows_by(t, "Model", "Category")
    multi = rows[("llama31 [3500 tok]", "Multi-Doc QA")]
    assert (multi["Full Cache"], multi["SnapKV"], multi["PyramidKV"], multi["SelKV"]) == (35.0, 34.0, 34.0, 34.75)
    code = rows[("llama31 [3500 tok]", "Code")]
    assert math.isnan(code["SnapKV"]) and code["PyramidKV"] == 59.0
    assert "Synthetic" not in {c for _m, c in rows}  # no synthetic dataset in the fixture
    assert math.isnan(rows[("gemma2", "Few-shot Learning")]["PyramidKV"])
    assert "mean over the category's datasets present" in t.caption


def test_ratio_table(df):
    tables = {t.name: t for t in selkv_ratio_tables(df)}
    t = tables["selkv_table5"]  # llama31 [3500 tok]: 10%, 25%, 50%
    assert list(t.data.columns) == ["Method", "10%", "25%", "50%"]
    rows = rows_by(t, "Method")
    assert [rows[("Full Cache",)][c] for c in ("10%", "25%", "50%")] == pytest.approx([265 / 6] * 3)
    assert rows[("SnapKV",)]["10%"] == pytest.approx(265 / 6 - 3)
    assert math.isnan(rows[("SnapKV",)]["25%"]) and math.isnan(rows[("SnapKV",)]["50%"])
    sel = [rows[("SelKV",)][c] for c in ("10%", "25%", "50%")]
    assert sel == pytest.approx([256.5 / 6 - 2, 256.5 / 6, 265 / 6 - 0.5])
    assert math.isnan(rows[("PyramidKV",)]["10%"]) and rows[("PyramidKV",)]["25%"] == pytest.approx(256 / 6)
    assert "selkv_table6" not in tables  # gemma2 has one ratio only


def test_selkv_table7_long_context(df):
    (t,) = selkv_table7(df)
    rows = rows_by(t, "Method")
    assert rows[("Full Cache",)]["Avg"] == 55.0 and rows[("SnapKV",)]["Δ"] == -1.5 and rows[("SelKV",)]["Δ"] == -0.75
    assert set(t.data["Model"]) == {"llama31 [ctx31500]"}


def test_compresskv_tables(df):
    (t,) = compresskv_table1(df)
    rows = rows_by(t, "Method")
    assert list(t.data.columns) == ["Method", "mistral @256", "mistral @1024"]
    assert rows[("Full Cache",)]["mistral @256"] == 35.0 and rows[("Full Cache",)]["mistral @1024"] == 35.0
    assert rows[("CompressKV",)]["mistral @256"] == 32.25 and rows[("SnapKV",)]["mistral @1024"] == 34.0
    assert rows[("StreamingLLM",)]["mistral @256"] == 25.0 and math.isnan(rows[("StreamingLLM",)]["mistral @1024"])
    assert [r["Method"] for r in t.data.to_dict("records")] == ["Full Cache", "StreamingLLM", "SnapKV", "CompressKV"]
    (a,) = compresskv_table3a(df)
    assert [(r["Method"], r["Avg"]) for r in a.data.to_dict("records")] == [
        ("SnapKV", 31.0), ("SnapKV + SRH", 31.75), ("CompressKV", 32.25)]  # no TRH row
    assert list(a.data["Δ prev"])[1:] == pytest.approx([0.75, 0.5])
    (b,) = compresskv_table3b(df)  # SRH selection, uniform budgets (the "SnapKV + SRH" preset's variants)
    assert [(r["num_heads"], r["Avg"], r["Δ default"]) for r in b.data.to_dict("records")] == [
        ("2", 31.5, -0.25), ("4", 31.75, 0.0)]
    (c,) = compresskv_table2b(df)
    assert [(r["Heads"], r["Avg"], r["Δ"]) for r in c.data.to_dict("records")] == [("TRH", 31.25, 0.0),
                                                                                    ("SRH", 31.75, 0.5)]
    assert c.bold == {(1, "Avg")} and len(c.sources) == 2  # the TRH and SRH jobs, not the full cache


def test_report_cli_writes_artifacts(tree, tmp_path):
    out = tmp_path / "report"
    assert report.main([str(tree), "--out", str(out)]) == 0
    for name in ["selkv_table1", "selkv_table2", "selkv_table3", "selkv_table4", "selkv_table5", "selkv_table7",
                 "compresskv_table1", "compresskv_table2b", "compresskv_table3a", "compresskv_table3b"]:
        for ext in ("md", "tex", "csv", "sources.txt"):
            assert (out / f"{name}.{ext}").stat().st_size > 0, (name, ext)
    for name in ["selkv_fig2", "selkv_fig3", "selkv_fig4", "selkv_fig5", "compresskv_fig4", "compresskv_fig5",
                 "niah_panel_smollm2"]:
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000, name
        assert (out / f"{name}.pdf").stat().st_size > 0
    # missing cells are missing, not zero
    with open(out / "selkv_table1.csv") as f:
        rows = {(r["Model"], r["Method"]): r for r in csv.DictReader(f)}
    assert rows[("llama31 [3500 tok]", "SnapKV")]["lcc"] == "" and rows[("llama31 [3500 tok]", "SnapKV")]["Avg"] == ""
    assert rows[("gemma2", "PyramidKV")]["Avg Rank"] == ""
    assert rows[("llama31 [3500 tok]", "PyramidKV")]["Avg Rank"] == "1.5"
    md = (out / "selkv_table1.md").read_text()
    assert "| gemma2 | PyramidKV | – | – |" in md
    assert "**1.33**" in md  # best Avg Rank on gemma2 (SelKV) in bold
    srcs = (out / "selkv_table1.sources.txt").read_text()
    assert "longbench/llama31/pyramidkv/b0.25\n" in srcs
    assert r"\textbf{" in (out / "selkv_table1.tex").read_text()
    assert "selkv_table1" in (out / "index.md").read_text()


def test_report_only_and_partial_tree(tree, tmp_path):
    from kvbench.cli import main as kvbench_cli

    out = tmp_path / "only"
    assert kvbench_cli(["report", str(tree), "--out", str(out), "--only", "selkv_table1", "niah_panel_*"]) == 0
    assert {p.name for p in out.glob("*.md") if p.name != "index.md"} == {"selkv_table1.md"}
    assert (out / "niah_panel_smollm2.png").exists() and not (out / "niah").exists()
    assert kvbench_cli(["report", "--out", str(out), "--only", "selkv_table2", str(tree)]) == 0  # root last
    index = (out / "index.md").read_text()
    assert "- selkv_table2: selkv_table2.md" in index and "selkv_table1" not in index


def test_report_on_a_folder_without_jobs_is_one_line_and_exit_1(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        report.main([str(tmp_path), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.splitlines()
    assert stop.value.code == 1 and len(err) == 1 and f"no job folders under {tmp_path}" in err[0]
    assert not (tmp_path / "r").exists()


def test_a_folder_that_is_not_a_job_is_skipped_and_symlinked_jobs_are_read(tmp_path, capsys):
    """A config.yaml that is valid YAML but no job's: one warning naming the folder, no row; a job folder reached
    through a symbolic link is read once (a link back up the tree does not loop)."""
    real = make_job(tmp_path / "elsewhere", task="niah", model="tiny", method="snapkv", scores={"niah": 40.0})
    root = tmp_path / "root"
    (root / "runs").mkdir(parents=True)
    (root / "runs" / "mine").symlink_to(real.parent)  # the job's parent folder, linked
    (root / "runs" / "loop").symlink_to(root)
    notes = root / "notes"
    notes.mkdir()
    (notes / "config.yaml").write_text("title: my notes\nitems: [1, 2]\n")
    (notes / "summary.json").write_text("{}")
    df = report.load_results(root)
    assert list(df["job"]) == ["runs/mine/b0.25"] and list(df["score"]) == [40.0]
    assert df.attrs["unreadable"] == ["notes: ValueError: config.yaml is not a kvbench job's config (task.name, "
                                      "model.name and method.name)"]
    assert report.main([str(root), "--out", str(tmp_path / "r"), "--only", "scores"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: job folder notes: ")
    assert "scores_niah_tiny.md" in (tmp_path / "r" / "index.md").read_text()


def test_plot_niah_heatmap(tmp_path):
    recs = [{"score": s, "error": None, "meta": {"context_length": n, "depth_percent": d}}
            for n, d, s in [(256, 10, 1.0), (256, 50, 0.0), (512, 10, 0.5), (512, 10, 1.0)]]
    recs.append({"score": None, "error": {"type": "X"}, "meta": {"context_length": 512, "depth_percent": 50}})
    lengths, depths, grid = niah_grid(recs)
    assert lengths == [256, 512] and depths == [10, 50]
    assert grid[0].tolist() == [100.0, 75.0] and grid[1, 0] == 0.0 and math.isnan(grid[1, 1])
    cfg = {"model": {"name": "smollm2"}, "method": {"name": "snapkv"}, "budget": 0.25}
    heatmap(SimpleNamespace(path=tmp_path), recs, cfg)  # a job's own heatmap.png and .pdf
    path = tmp_path / "heatmap.png"
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 5000 and (tmp_path / "heatmap.pdf").exists()


def test_notebook_executes_on_fixture(tree, tmp_path):
    execute_figures_notebook(tree, tmp_path / "nb", figures=["selkv_fig4", "niah_panel_*"])
    assert (tmp_path / "nb" / "selkv_fig4.png").stat().st_size > 5000
    assert (tmp_path / "nb" / "niah_panel_smollm2.png").exists() and not (tmp_path / "nb" / "selkv_fig2.png").exists()


class FakeResult:
    def __init__(self, n, budget):
        kept = n if budget >= 1 else int(n * budget)
        self.prefill_s, self.compress_s, self.decode_s = n / 1000, 0.0 if budget >= 1 else 0.01, 1.0
        self.generated_tokens, self.decode_tok_s = 8, 8.0
        self.cache_bytes_before, self.cache_bytes_after, self.peak_prefill_bytes = 10 * n, 10 * kept, 123
        self.peak_decode_bytes = 123


class FakeEngine:
    """Stands in for kvbench.engine.generate.Engine (generate(prompt_ids, max_new_tokens, stop_ids))."""

    calls: list = []

    def __init__(self, method_cfg, budget=0.25):
        self.budget = 1.0 if method_cfg["name"] == "full" else budget
        self.model = type("M", (), {"config": type("C", (), {"vocab_size": 500, "max_position_embeddings": 1000})()})()

    def generate(self, prompt_ids, max_new_tokens, stop_ids=None):
        FakeEngine.calls.append((len(prompt_ids), max_new_tokens, stop_ids, max(prompt_ids) < 500))
        return FakeResult(len(prompt_ids), self.budget)


def test_latency_records_feed_figure3(tmp_path, monkeypatch):
    from kvbench.engine import generate as engine
    from kvbench.tools import latency
    from kvbench.report.tables import selkv_fig3

    resets = []  # each timed generation's peak starts afresh (not the process's peak so far)
    monkeypatch.setattr(engine, "reset_peak_rss", lambda: resets.append(len(FakeEngine.calls)) or True)
    FakeEngine.calls = []
    out = tmp_path / "latency.json"
    recs = latency.run_latency({"name": "tiny"},
                               {"full": {"name": "full", "label": "Full Cache"}, "snapkv": {"name": "snapkv"}},
                               0.25, [256, 512, 1024], max_new_tokens=8, repeats=2, out=out,
                               make_engine=FakeEngine, log=lambda _m: None)
    assert json.loads(out.read_text()) == recs
    assert [(r["method"], r["prompt_tokens"]) for r in recs[::2]] == [
        ("Full Cache", 256), ("Full Cache", 512), ("snapkv", 256), ("snapkv", 512)]  # 1024 + 8 > 1000: skipped
    assert recs[-1]["cache_bytes_after"] == 1280 and recs[-1]["peak_mem_bytes"] == 123 and recs[-1]["budget"] == 0.25
    assert recs[0]["budget"] == 1.0  # the full cache keeps every token, whatever budget= says
    assert resets == [1, 2, 3, 4, 6, 7, 8, 9]  # before each timed call (after each method's warm-up)
    timed = [c for c in FakeEngine.calls if c[1] == 8]
    assert len(timed) == 8 and all(stop == [] and in_vocab for _n, _m, stop, in_vocab in timed)
    (fig,) = selkv_fig3(recs, str(out))
    report.write(fig, tmp_path)
    assert (tmp_path / "selkv_fig3.png").stat().st_size > 5000


def test_a_root_with_only_a_latency_file_draws_figure3_without_warning(tmp_path, capsys):
    root = tmp_path / "latency_root"
    root.mkdir()
    recs = [{"model": "tiny", "method": m, "prompt_tokens": n, "budget": b, "prefill_s": 0.1 * n / 256,
             "decode_s": 0.2, "decode_tok_s": 40.0, "generated_tokens": 8, "cache_bytes_after": 1000 * n * b,
             "peak_mem_bytes": 10**6} for m, b in (("Full Cache", 1.0), ("snapkv", 0.25)) for n in (256, 512)]
    (root / "latency.json").write_text(json.dumps(recs))
    assert report.main([str(root), "--only", "selkv_fig3", "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "no job folders" not in err and (tmp_path / "r" / "selkv_fig3.png").stat().st_size > 5000
    assert report.main([str(root), "--out", str(tmp_path / "r2")]) == 0
    assert f"warning: no job folders under {root}" in capsys.readouterr().err


def test_report_cli_rejects_unknown_artifact(tree, capsys):
    with pytest.raises(SystemExit) as e:
        report.main([str(tree), "--only", "selkv_tabel1"])
    assert e.value.code == 2 and "no such artifact" in capsys.readouterr().err


def test_niah_heatmap_records_follow_the_summarys_grid(tmp_path):
    """After a rerun with a smaller grid, summary.json counts that grid: the report's heatmap too."""
    import json

    from kvbench.report.data import niah_grid_records

    job = tmp_path / "job"
    job.mkdir()
    recs = [{"id": f"niah/{n}/{d}", "meta": {"context_length": n, "depth_percent": d}, "score": 1.0}
            for n in (512, 1024) for d in (10, 50, 90)]
    (job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert niah_grid_records(job) == (recs, "")  # no summary: every record, no grid
    (job / "summary.json").write_text(json.dumps({"selection": {"task.context_lengths": [512, 100000],
                                                                "task.depth_percents": [50]}}))
    records, grid = niah_grid_records(job)
    assert [r["id"] for r in records] == ["niah/512/50"] and grid == "lengths [512, 100000] × depths [50]"


def test_selkv_fig2_marks_the_bar_of_an_unfinished_job(df):
    """gemma2's SnapKV job is unfinished (no summary): its bar is hatched and pale, the caption
    says so; finished jobs' bars are plain."""
    from kvbench.report.tables import selkv_fig2

    (fig,) = selkv_fig2(df)
    ax = fig.fig.axes[0]
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_alpha() == 0.5
    assert "Hatched, pale bars: an unfinished job" in fig.caption
    assert ax.get_title() == "Gap to the full cache\n(closer to 0 is better)"


def test_jobs_of_one_setting_the_report_leaves_out(tmp_path):
    """Two finished jobs of one setting: the one with more scored samples fills the row and is the
    source; an unfinished duplicate does not keep a finished row out of bold."""
    from kvbench.report.data import load_results
    from kvbench.report.tables import score_tables

    for root, n in ((tmp_path / "exp2", 2), (tmp_path / "exp3", 4)):
        job = make_job(root, task="niah", model="smollm2", method="streamingllm", scores={"niah": 5.0 * n})
        summary = json.loads((job / "summary.json").read_text())
        summary["datasets"]["niah"]["n"] = n
        (job / "summary.json").write_text(json.dumps(summary))
    make_job(tmp_path / "exp2", task="niah", model="smollm2", method="snapkv", scores={"niah": 30.0})
    make_job(tmp_path / "exp2", task="niah", model="smollm2", method="snapkv", scores={"niah": 5.0},
             folder_tag="x", complete=False)  # an interrupted duplicate under another folder name
    make_job(tmp_path / "exp2", task="niah", model="smollm2", method="snapkv", budget=0.5, scores={"niah": 20.0})
    df = load_results(tmp_path)
    (table,) = score_tables(df, tmp_path)
    rows = table.data.to_dict("records")
    row = {r["Method"] + r["Budget"]: r for r in rows}
    assert row["StreamingLLM25%"]["niah"] == 20.0 and row["StreamingLLM25%"]["n"] == "4"
    assert "exp3/niah/smollm2/streamingllm/b0.25" in table.sources
    assert not {"exp2/niah/smollm2/streamingllm/b0.25", "exp2/niah/smollm2/snapkv/b0.25-x"} & set(table.sources)
    assert not any(n.startswith("unfinished:") for n in table.notes)
    assert row["SnapKV25%"]["niah"] == 30.0
    snap25 = next(i for i, r in enumerate(rows) if r["Method"] == "SnapKV" and r["Budget"] == "25%")
    assert (snap25, "niah") in table.bold  # the best finished compressed row (30 > 20), the duplicate aside


def test_only_takes_commas_as_the_other_tools(tree, tmp_path, capsys):
    assert report.main([str(tree), "--only", "scores,niah", "--out", str(tmp_path / "r")]) == 0
    assert report.main([str(tree), "--only", "scores", "niah", "--out", str(tmp_path / "r2")]) == 0
    names = lambda d: sorted(p.name for p in d.rglob("*") if p.is_file() and p.name != "index.md")  # noqa: E731
    assert names(tmp_path / "r") == names(tmp_path / "r2") and names(tmp_path / "r")


def test_bad_report_inputs_are_one_line_and_an_unreadable_job_is_left_out(tmp_path, capsys):
    """--out under or at a file: exit 1 (I/O) naming the option and the reason; a --latency file that is not JSON
    records, an unknown --only: exit 2 naming the option.
    A job folder whose config.yaml cannot be parsed is left out with a warning and an index.md line."""
    make_job(tmp_path / "root", method="full", scores={"qasper": 40.0})
    bad = make_job(tmp_path / "root", method="snapkv", scores={"qasper": 30.0})
    (tmp_path / "afile").write_text("x")
    (tmp_path / "lat.json").write_text("{not json")
    for argv, code, key in ([["--out", str(tmp_path / "afile" / "rep")], 1, "afile/rep': Not a directory"],
                            [["--out", str(tmp_path / "afile")], 1, "afile': Not a directory"],
                            [["--latency", str(tmp_path / "lat.json")], 2, "--latency"], [["--only", "nosuch"], 2, "--only"]):
        with pytest.raises(SystemExit) as stop:
            report.main([str(tmp_path / "root"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == code and len(err) == 1 and key in err[0], err
    with pytest.raises(SystemExit) as stop:
        report.main([str(tmp_path / "nosuch")])
    assert stop.value.code == 2 and "RESULTS_ROOT" in capsys.readouterr().err
    (bad / "config.yaml").write_text("budget: [unclosed\n")
    assert report.main([str(tmp_path / "root"), "--out", str(tmp_path / "rep")]) == 0
    err = capsys.readouterr().err
    assert "warning: job folder longbench/llama31/snapkv/b0.25: ParserError: " in err and "line 1" in err
    index = (tmp_path / "rep" / "index.md").read_text()
    assert "1 job folder(s) read." in index and "Left out (unreadable): longbench/llama31/snapkv/b0.25" in index


def test_budget_one_is_the_full_retention_ratio_not_one_token():
    from kvbench.report.data import budget_semantics, budget_text

    assert budget_text(1.0) == "100%" and budget_text(0.25) == "25%" and budget_text(256.0) == "256"
    assert (budget_text(1e-9), budget_text(2e-5), budget_text(0.125)) == ("0.0000001%", "0.002%", "12.5%")
    assert budget_semantics([0.25, 1.0]) == "budget = retention ratio ρ of prompt tokens"
    assert budget_semantics([64.0, 256.0]).startswith("budget = tokens kept")


def test_a_niah_panel_cell_names_its_variant_and_an_unfinished_job(tmp_path):
    from kvbench.report.tables import niah_figures

    recs = [{"id": f"niah/{n}/50", "dataset": "niah", "score": 1.0, "error": None,
             "meta": {"context_length": n, "depth_percent": 50}} for n in (256, 512)]
    make_job(tmp_path, task="niah", model="smollm2", method="full", budget=1.0, records=recs, scores={"niah": 100.0})
    make_job(tmp_path, task="niah", model="smollm2", method="selkv", params={"alpha": 2}, records=recs,
             scores={"niah": 100.0}, complete=False)
    panel = next(f for f in niah_figures(report.load_results(tmp_path), tmp_path) if f.name == "niah_panel_smollm2")
    titles = [ax.get_title() for ax in panel.fig.axes if ax.get_title()]
    assert titles == ["Full Cache", "SelKV, budget 25%\nalpha=2 (unfinished)"]
    assert any(n.startswith("unfinished: niah/smollm2/selkv/b0.25 (5 samples scored)") for n in panel.notes)


def test_a_job_killed_before_its_first_sample_is_listed_as_started_no_samples(tmp_path):
    """Folders with config.yaml, env.json, identity.json and no (or an empty) predictions.jsonl are read and listed."""
    make_job(tmp_path / "root", method="full", scores={"qasper": 40.0})
    for budget, preds in ((0.1, None), (0.2, "")):
        job = make_job(tmp_path / "root", method="snapkv", budget=budget, summary=False)
        for name in ("env.json", "identity.json"):
            (job / name).write_text("{}")
        if preds is not None:
            (job / "predictions.jsonl").write_text(preds)
    assert report.main([str(tmp_path / "root"), "--out", str(tmp_path / "rep")]) == 0
    index = (tmp_path / "rep" / "index.md").read_text()
    assert "3 job folder(s) read." in index
    assert [line for line in index.splitlines() if line.startswith("Started, no samples")] == [
        f"Started, no samples: longbench/llama31/snapkv/b{b}" for b in (0.1, 0.2)]


def test_context_and_prompt_protocol_jobs_never_share_a_row_and_captions_name_the_protocol(tmp_path):
    """task.compress=context: the budget counts context tokens; a job without the key ran under ``prompt``."""
    for method, score in (("full", 50.0), ("snapkv", 40.0)):
        make_job(tmp_path, method=method, scores={"qasper": score})
    ctx = make_job(tmp_path, method="snapkv", scores={"qasper": 30.0}, folder_tag="ctx")
    cfg = yaml.safe_load((ctx / "config.yaml").read_text())
    (ctx / "config.yaml").write_text(yaml.safe_dump(cfg | {"task": cfg["task"] | {"compress": "context"}}))
    df = report.load_results(tmp_path)
    keys = df.set_index("job")["model_key"]
    assert keys["longbench/llama31/snapkv/b0.25-ctx"] == "llama31 [task.compress=context]"
    assert keys["longbench/llama31/snapkv/b0.25"] == "llama31 [task.compress=prompt]"
    caption = selkv_table1(df)[0].caption
    assert "ρ of the context tokens (task.compress=context) or ρ of the prompt tokens (task.compress=prompt)" in caption
    assert "(task.compress=prompt)" in selkv_table1(df[df["compress"] == "prompt"])[0].caption


def test_an_all_zero_budget_sweep_keeps_a_readable_y_range_inside_markers_and_the_reference_on_top(tmp_path):
    from kvbench.report.tables import budget_sweep_figure

    make_job(tmp_path, method="full", budget=1.0, scores={"qasper": 0.0})
    for m in ("snapkv", "pyramidkv", "selkv"):
        for b in (0.1, 0.5):
            make_job(tmp_path, method=m, budget=b, scores={"qasper": 0.0})
    fig = budget_sweep_figure(report.load_results(tmp_path), "f", "longbench", True, "t")[0].fig
    ax = fig.axes[0]
    assert ax.get_ylim() == (0.0, 5.0)
    ref = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(ref) == 1 and ref[0].get_zorder() > max(line.get_zorder() for line in ax.lines if line not in ref)
    fig.canvas.draw()
    box = ax.get_window_extent()
    xs = [x for line in ax.lines if line.get_marker() == "o"
          for x, _ in line.get_transform().transform(line.get_xydata())]
    assert len(xs) == 6 and box.x0 < min(xs) and max(xs) < box.x1
    assert "(task.compress=prompt)" in fig.texts[-1].get_text().replace("\n", " ")


def test_a_started_job_beside_scored_ones_fails_no_artifact(tmp_path, capsys):
    """An in-flight sweep: a LongBench job with no sample yet is listed, and every table and figure reads the rest."""
    for method, budget, scores in (("full", 0.25, {"qasper": 40.0}), ("snapkv", 0.25, {"qasper": 30.0}),
                                   ("snapkv", 0.1, None)):
        make_job(tmp_path / "root", method=method, budget=budget, scores=scores, summary=bool(scores))
    assert report.main([str(tmp_path / "root"), "--out", str(tmp_path / "rep")]) == 0
    assert "FAILED" not in capsys.readouterr().out
    assert (tmp_path / "rep" / "selkv_table1.md").is_file()
