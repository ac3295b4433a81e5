"""Reports of sampled, decode-compressed reasoning jobs from hand-made job folders (records as ENGINE_CONTRACT.md writes
them: one per candidate with ``problem``/``candidate``, ``scores.found``, ``generated_tokens``, ``cache_trace``).
Every expected number is computed by hand from the fixture below."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from kvbench.report import build as report
from kvbench.report.data import load_results
from kvbench.report.reasoning import reasoning_reports

# per job: candidate scores of problems p0, p1, p2 (4 candidates each)
SCORES = {("full", 128): [[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]],
          ("rkv", 128): [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],
          ("rkv", 256): [[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]]}
LABELS = {"full": "Full Cache", "rkv": "R-KV"}
TRACE = {"full": [[0, 50, 5000], [200, 250, 25000]],
         "rkv": [[0, 50, 5000], [78, 128, 12800], [78, 64, 6400], [200, 114, 11400]]}


def make_job(root: Path, method: str, budget: int) -> Path:
    job = root / "math500" / "r1_llama8b" / method / f"b{budget}"
    job.mkdir(parents=True)
    cfg = {"model": {"name": "r1_llama8b", "max_input_length": 98304}, "method": {"name": method, "label": LABELS[method]},
           "task": {"name": "math500"}, "budget": budget, "run_tag": None,
           "sampling": {"n": 4, "temperature": 0.6, "top_p": 0.95, "top_k": 0},
           "decode": {"interval": 0 if method == "full" else 128, "prefill": True, "schedule": "length"}}
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = [{"id": f"math500/{p}#{k}", "problem": f"math500/{p}", "candidate": k, "dataset": "math500",
             "score": float(s), "scores": {"found": bool(s) or k % 2 == 0}, "error": None,
             "generated_tokens": 100 * (p + 1) + 10 * k, "cache_trace": TRACE[method] if p == 2 and k == 3 else
             [[0, 50, 5000], [100, 60, 6000]]}
            for p, cands in enumerate(SCORES[(method, budget)]) for k, s in enumerate(cands)]
    recs.append({**recs[0], "id": "math500/0#4", "candidate": 4, "score": None, "error": {"type": "OOM"}})
    recs.append({**recs[0], "id": "other/9#0", "problem": "other/9"})  # not in this run's selection (summary ids)
    (job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (job / "summary.json").write_text(json.dumps({"complete": True, "ids": [f"math500/{p}" for p in range(3)]}))
    return job


@pytest.fixture
def root(tmp_path):
    for method, budget in SCORES:
        make_job(tmp_path, method, budget)
    return tmp_path


def se(means):
    m = sum(means) / len(means)
    return math.sqrt(sum((x - m) ** 2 for x in means) / (len(means) - 1)) / math.sqrt(len(means))


def test_score_and_se_of_a_sampled_job_are_pass_at_1_over_problems(root):
    """What score tables and the score-against-budget figure plot: pass@1, SE over problems, n = problems."""
    df = load_results(root).set_index(["method", "budget"])
    row = df.loc[("R-KV", 256.0)]
    means = [0.75, 0.5, 0.0]
    assert row["score"] == round(100 * sum(means) / 3, 2) and row["n"] == 3
    assert row["se"] == pytest.approx(100 * se(means))
    assert set(row["samples"]) == {"math500/0", "math500/1", "math500/2"}  # paired tests pair problems
    assert df.loc[("Full Cache", 128.0), "n_failed"] == 1


def test_passk_table_by_hand(root):
    arts = {a.name: a for a in reasoning_reports(load_results(root), root)}
    table = arts["passk_math500_r1_llama8b"]
    data = table.data.set_index(["Method", "Budget"])
    full = data.loc[("Full Cache", None)]
    # full: means 1, 1/4, 0; pass@2 per problem: 1, 1 - C(3,2)/C(4,2) = 1/2, 0; pass@4: 1, 1, 0
    assert full["pass@1"] == round(100 * 1.25 / 3, 2)
    assert (full["pass@2"], full["pass@4"]) == (50.0, round(200 / 3, 2))
    rkv = data.loc[("R-KV", "128")]
    # rkv 128: p0 2/4 correct: pass@2 = 1 - C(2,2)/C(4,2) = 5/6; others 0
    assert (rkv["pass@1"], rkv["pass@2"], rkv["pass@4"]) == (round(100 * 0.5 / 3, 2), round(100 * 5 / 18, 2),
                                                             round(100 / 3, 2))
    assert table.se.loc[0, "pass@1"] == round(100 * se([1, 0.25, 0]), 2)
    # answered: a candidate found an answer when correct or even-numbered; rkv 128: p0 1,1,1,0 + p1, p2 1,0,1,0
    assert rkv["Answered %"] == round(100 * 7 / 12, 2)
    assert rkv["Gen. tokens"] == (sum(100 * (p + 1) + 10 * k for p in range(3) for k in range(4)) / 12)
    assert (rkv["Problems"], rkv["Candidates"]) == ("3", "12")
    # one model key: the full cache's decode.interval=0 is no setting of its own (it compresses nothing)
    assert list(zip(table.data["Method"], table.data["Budget"].fillna("–"))) == [("Full Cache", "–"), ("R-KV", "128"),
                                                                                ("R-KV", "256")]


def test_cache_trace_and_length_figures(root):
    arts = {a.name: a for a in reasoning_reports(load_results(root), root)}
    tokens, nbytes = arts["cache_trace_math500_r1_llama8b"].fig.axes[:2]
    lines = {ln.get_label(): ln for ln in tokens.get_lines()}
    assert max(lines["Full Cache"].get_ydata()) == 250                          # the full cache grows
    assert max(lines["R-KV b128"].get_ydata()) == 128                           # compressed: within its budget
    assert list(lines["R-KV b128"].get_xdata()) == [0, 78, 78, 200]             # the longest generation's trace
    assert max(nbytes.get_lines()[0].get_ydata()) == pytest.approx(25000 / 2**20)
    ax = arts["gen_length_math500_r1_llama8b"].fig.axes[0]
    full = [ln for ln in ax.get_lines() if ln.get_label() == "Full Cache"][0]
    assert full.get_ydata()[0] == pytest.approx(215.0)  # per-problem means 115, 215, 315 (the failed one left out)
    rkv = ax.containers[0]  # the errorbar of R-KV: budgets 128 and 256
    assert rkv.get_label() == "R-KV" and list(rkv.lines[0].get_xdata()) == [128, 256]


def test_report_cli_writes_the_reasoning_artifacts(root, tmp_path):
    out = tmp_path / "rep"
    assert report.main([str(root), "--out", str(out), "--only", "reasoning"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"passk_math500_r1_llama8b.md", "cache_trace_math500_r1_llama8b.png",
            "gen_length_math500_r1_llama8b.pdf"} <= names
    md = (out / "passk_math500_r1_llama8b.md").read_text()
    assert f"{round(100 * 1.25 / 3, 2):.2f} ± {round(100 * se([1, 0.25, 0]), 2):.2f}" in md


def test_the_full_cache_is_the_reference_of_every_decode_setting(root):
    """A prefill-only job beside decode-compressed ones splits the model key by decode.*; the full cache (it compresses
    nothing while decoding) joins both groups."""
    job = shutil.copytree(root / "math500" / "r1_llama8b" / "rkv" / "b128", root / "math500" / "r1_llama8b" / "snapkv" / "b128")
    cfg = yaml.safe_load((job / "config.yaml").read_text())
    cfg["method"], cfg["decode"]["interval"] = {"name": "snapkv", "label": "SnapKV"}, 0
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    df = load_results(root)
    keys = {m: set(df.loc[df["method"] == m, "model_key"]) for m in ("Full Cache", "R-KV", "SnapKV")}
    assert keys["R-KV"] == {"r1_llama8b [decode.interval=128]"} and keys["SnapKV"] == {"r1_llama8b [decode.interval=0]"}
    assert keys["Full Cache"] == keys["R-KV"] | keys["SnapKV"]
