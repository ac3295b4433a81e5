"""The accuracy-vs-bytes figure and its points (kvbench/report/cost.py) on a hand-made sweep with and without cache.bits."""

import csv
import json

import yaml
from test_report import make_job

from kvbench.report import build as report
from kvbench.report.cost import accuracy_vs_bytes, job_points

# (method, budget, cache.bits, score, cache_bytes_after of 4000 before)
JOBS = [("full", 1.0, None, 80.0, 4000), ("full", 1.0, 4, 78.0, 1250), ("full", 1.0, 2, 60.0, 750),
        ("snapkv", 0.25, None, 70.0, 1000), ("snapkv", 0.5, None, 75.0, 2000), ("snapkv", 0.25, 4, 66.0, 320),
        ("snapkv", 0.5, 4, 72.0, 630), ("snapkv", 0.25, 2, 40.0, 190)]


def make_sweep(root, jobs=JOBS, residual=128):
    for method, budget, bits, score, after in jobs:
        recs = [{"id": f"niah/{i}", "dataset": "niah", "score": score / 100, "error": None, "cache_bytes_before": 4000,
                 "cache_bytes_after": after} for i in range(2)]
        job = make_job(root, task="niah", model="smollm2", method=method, budget=budget, records=recs, summary=False,
                       folder_tag=f"q{bits}r{residual}" if bits else "")
        cfg = yaml.safe_load((job / "config.yaml").read_text())
        (job / "config.yaml").write_text(yaml.safe_dump({**cfg, "cache": {"bits": bits, "group_size": 32, "residual": residual}}))
        (job / "env.json").write_text(json.dumps({"device": "cuda:0", "dtype": "bfloat16"}))
    return root


def test_one_curve_per_method_and_width_at_the_stored_bytes(tmp_path):
    df = report.load_results(make_sweep(tmp_path))
    assert set(df["model_key"]) == {"smollm2", "smollm2 [cache.bits=4]", "smollm2 [cache.bits=2]"}  # tables never mix them
    fig, points = accuracy_vs_bytes(df)
    (ax,) = fig.fig.axes
    curves = {ln.get_label(): (ln.get_xdata().tolist(), ln.get_ydata().tolist()) for ln in ax.lines
              if not ln.get_label().startswith("_")}
    assert curves == {"Full Cache · 16-bit": ([100.0], [80.0]), "Full Cache · 4-bit": ([31.25], [78.0]),
                      "Full Cache · 2-bit": ([18.75], [60.0]), "SnapKV · 16-bit": ([25.0, 50.0], [70.0, 75.0]),
                      "SnapKV · 4-bit": ([8.0, 15.75], [66.0, 72.0]), "SnapKV · 2-bit": ([4.75], [40.0])}
    assert ax.get_xscale() == "log" and ax.get_title() == "niah — smollm2"
    assert "cache_bytes_after / cache_bytes_before" in fig.caption and len(fig.sources) == len(JOBS)
    rows = points.data.to_dict("records")
    assert {"Task": "niah", "Model": "smollm2", "Method": "SnapKV", "Bits": "4 (G32, R128)", "Budget": "25%", "Cache %": 8.0,
            "Score": 66.0} in rows
    assert {"Task": "niah", "Model": "smollm2", "Method": "Full Cache", "Bits": "16 (dtype)", "Budget": "–",
            "Cache %": 100.0, "Score": 80.0} in rows


def test_kvbench_report_writes_the_figure(tmp_path):
    out = tmp_path / "report"
    assert report.main([str(make_sweep(tmp_path / "results")), "--out", str(out), "--only", "accuracy_vs_bytes"]) == 0
    png = out / "accuracy_vs_bytes.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    with open(out / "accuracy_vs_bytes_points.csv") as f:
        assert len(list(csv.DictReader(f))) == len(JOBS)
    assert report.main([str(tmp_path / "results" / "niah" / "smollm2" / "snapkv"), "--out", str(tmp_path / "r2")]) == 0


def test_two_residuals_at_one_width_are_two_curves(tmp_path):
    make_sweep(make_sweep(tmp_path, JOBS[5:7]), JOBS[5:6], residual=32)
    (ax,) = accuracy_vs_bytes(report.load_results(tmp_path))[0].fig.axes
    assert sorted(ln.get_label() for ln in ax.lines if not ln.get_label().startswith("_")) == [
        "SnapKV · 4-bit (G32, R128)", "SnapKV · 4-bit (G32, R32)"]


def test_read_bytes_figure_puts_sparse_reading_beside_eviction(tmp_path):
    # (method, budget, score, stored after of 4000, read per step): eviction reads what it stores, Quest stores all
    for method, budget, score, after, read in [("full", 1.0, 80.0, 4000, 4100), ("snapkv", 0.25, 70.0, 1000, 1100),
                                                ("quest", 0.25, 76.0, 4000, 1200)]:
        recs = [{"id": f"niah/{i}", "dataset": "niah", "score": score / 100, "error": None, "cache_bytes_before": 4000,
                 "cache_bytes_after": after, "read_bytes": read} for i in range(2)]
        make_job(tmp_path, task="niah", model="smollm2", method=method, budget=budget, records=recs, summary=False,
                 label=method.capitalize())
    make_job(tmp_path, task="niah", model="smollm2", method="knorm", budget=0.5, summary=False, label="Knorm",  # no reads
             records=[{"id": "niah/0", "dataset": "niah", "score": 0.5, "error": None, "cache_bytes_before": 4000,
                       "cache_bytes_after": 2000}])
    df = report.load_results(tmp_path)
    for read, want in ((False, {"full": 100.0, "snapkv": 25.0, "quest": 100.0, "knorm": 50.0}),
                       (True, {"full": 102.5, "snapkv": 27.5, "quest": 30.0})):
        fig, points = accuracy_vs_bytes(df, read=read)
        assert fig.name == ("accuracy_vs_read_bytes" if read else "accuracy_vs_bytes")
        sizes = {r.method_name: r.size for r in job_points(df, "read_bytes" if read else "cache_bytes_after").itertuples()}
        assert sizes == want
        assert ("read_bytes / cache_bytes_before" in fig.caption) == read and "hollow: an unfinished job" in fig.caption
        colors = {ln.get_label(): ln.get_color() for ln in fig.fig.axes[0].lines}
        assert colors["Full · model dtype"] == "black" and colors["Snapkv · model dtype"] == "C0"  # score_vs_budget's colours
    out = tmp_path / "report"
    assert report.main([str(tmp_path), "--out", str(out), "--only", "accuracy_vs_bytes"]) == 0
    assert (out / "accuracy_vs_read_bytes.png").stat().st_size > 5000 and (out / "accuracy_vs_bytes.png").is_file()
