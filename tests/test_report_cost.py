"""The ``cost`` report artifact (kvbench/report/cost.py) on hand-made job folders: every expected number by hand."""

from __future__ import annotations

import math

from kvbench.report import build as report
from tests.test_report import make_job


def records(ids, prefill, compress, cache, reconstruct=None):
    return [{"id": i, "dataset": "niah", "score": 1.0, "error": None, "prefill_s": prefill, "compress_s": compress,
             "cache_bytes_after": cache, **({} if reconstruct is None else {"reconstruct_s": reconstruct})} for i in ids]


def test_cost_compares_each_job_with_the_full_cache_prefill_on_the_same_samples(tmp_path):
    root = tmp_path / "results"
    scores = {"niah": 100.0}
    make_job(root, task="niah", model="smollm2", method="full", budget=1.0, scores=scores,
             records=records(["a", "b", "c"], 1.0, 0.0, 4000))
    make_job(root, task="niah", model="smollm2", method="kvzip", label="KVzip", scores=scores,  # 2 of 3 samples
             records=records(["a", "b"], 1.0, 2.0, 1000, reconstruct=1.8))
    make_job(root, task="niah", model="smollm2", method="snapkv", scores=scores,  # records older than reconstruct_s
             records=records(["a", "b", "c"], 1.1, 0.1, 1000))
    make_job(root, task="niah", model="tiny", method="snapkv", scores=scores, records=records(["a"], 0.5, 0.5, 10))
    out = tmp_path / "report"
    assert report.main([str(root), "--out", str(out), "--only", "cost"]) == 0
    [table] = report.cost_table(report.load_results(root), root)
    rows = {(r["Model"], r["Method"]): r for r in table.data.to_dict("records")}
    assert list(rows) == [("tiny", "SnapKV"), ("smollm2", "Full Cache"), ("smollm2", "SnapKV"), ("smollm2", "KVzip")]
    alone, full, snap, kvzip = rows.values()
    assert (full["prefill + compress ÷ plain"], full["÷ full"], full["Budget"], full["n"]) == (1.0, 1.0, None, "3")
    assert kvzip["prefill + compress ÷ plain"] == 3.0 and kvzip["reconstruct ms"] == 1800.0 and kvzip["n"] == "2"
    assert kvzip["÷ full"] == 0.25 and kvzip["cache MiB"] == 1000 / 2**20 and kvzip["Budget"] == "25%"
    assert round(snap["prefill + compress ÷ plain"], 6) == 1.2 and snap["reconstruct ms"] == 0.0
    assert alone["prefill + compress ÷ plain"] == 2.0 and math.isnan(alone["÷ full"])  # its own prefill: no full job
    assert any(n.startswith("no full-cache job: niah tiny") for n in table.notes)
    assert "| KVzip | 25% | 2 | 1000.00 | 2000.00 | 1800.00 | 3.00 | 0.00 | 0.25 |" in (out / "cost.md").read_text()


def test_a_ratio_below_one_is_noted(tmp_path):
    """A compressed prefill timed faster than the full cache's (other load at another moment) gets a note."""
    scores = {"niah": 100.0}
    make_job(tmp_path, task="niah", model="smollm2", method="full", budget=1.0, scores=scores,
             records=records(["a", "b"], 2.0, 0.0, 4000))
    make_job(tmp_path, task="niah", model="smollm2", method="snapkv", scores=scores, records=records(["a", "b"], 0.5, 0.1, 1000))
    [table] = report.cost_table(report.load_results(tmp_path), tmp_path)
    assert table.data["prefill + compress ÷ plain"].tolist() == [1.0, 0.3]
    assert [n for n in table.notes if n.startswith("below 1 (SnapKV 25%)")]
