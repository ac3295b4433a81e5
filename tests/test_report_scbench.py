"""SCBench report artifacts from hand-written job folders: score per turn, multi-turn vs multi-request, cost per
question with and without context reuse."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from kvbench.report import build as report
from kvbench.report.data import load_results
from kvbench.report.scbench import scbench_records

#: (method, mode) -> per group, the turn scores (0/1)
SCORES = {("snapkv", "multi_turn"): [[1, 1, 0], [1, 0, 0]], ("snapkv", "multi_request"): [[1, 1, 1], [1, 1, 0]],
          ("streamingllm", "multi_turn"): [[1, 0, 0], [0, 0, 0]]}
LABELS = {"snapkv": "SnapKV", "streamingllm": "StreamingLLM"}


def make_job(root: Path, method: str, mode: str, golden: bool = True, with_turn: bool = True) -> Path:
    job = root / "scbench" / "llama31" / method / f"b4096-{mode}{'' if golden else '-own'}"
    job.mkdir(parents=True)
    cfg = {"model": {"name": "llama31"}, "method": {"name": method, "label": LABELS[method]}, "budget": 4096,
           "task": {"name": "scbench", "mode": mode, "golden_context": golden, "compress": "context"}}
    (job / "config.yaml").write_text(yaml.safe_dump(cfg))
    recs = []
    for g, scores in enumerate(SCORES[(method, mode)]):
        for t, s in enumerate(scores):  # the context's prefill and compression counted in the group's first answer
            recs.append({"id": f"scbench_kv/{g}/{t}", "dataset": "scbench_kv", "score": float(s), "error": None,
                         "meta": {"task": "scbench_kv"}, "prefill_s": 2.0 if t == 0 else 0.1,
                         "compress_s": 0.5 if t == 0 else 0.0, "decode_s": 1.0, "group_compressions": 1,
                         **({"turn": t, "group": f"scbench_kv/{g}"} if with_turn else {})})
    recs.append({"id": "scbench_repoqa_and_kv/0/1", "dataset": "scbench_repoqa_and_kv", "score": 0.5, "error": None,
                 "meta": {"task": "scbench_kv"}, "turn": 1, "group": "scbench_repoqa_and_kv/0"})
    (job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (job / "summary.json").write_text(json.dumps({"complete": True, "ids": [r["id"] for r in recs],
                                                  "datasets": {"scbench_kv": {"score": 0.0, "n": len(recs) - 1}}}))
    return job


@pytest.fixture
def root(tmp_path) -> Path:
    make_job(tmp_path, "snapkv", "multi_turn")
    make_job(tmp_path, "snapkv", "multi_request", with_turn=False)  # turn from the id
    make_job(tmp_path, "streamingllm", "multi_turn")
    return tmp_path


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_records_carry_mode_turn_and_the_mixed_sub_task(root):
    rec = scbench_records(load_results(root), root)
    assert set(rec["mode"]) == {"multi-turn", "multi-request"}
    assert sorted(rec["turn"].unique()) == [1, 2, 3]
    assert "scbench_repoqa_and_kv / scbench_kv" in set(rec["dataset"])


def test_report_writes_turns_modes_and_cost(root, tmp_path):
    out = tmp_path / "report"
    assert report.main([str(root), "--out", str(out), "--only", "scbench"]) == 0
    assert (out / "scbench_turns_fig.png").is_file() and (out / "scbench_turns_fig.pdf").is_file()
    turns = {(r["Method"], r["Mode"], r["Dataset"]): r for r in read_csv(out / "scbench_turns.csv")}
    snap = turns[("SnapKV", "multi-turn", "scbench_kv")]
    assert [snap["Turn 1"], snap["Turn 2"], snap["Turn 3"], snap["Avg"]] == ["100.0", "50.0", "0.0", "50.0"]
    assert turns[("SnapKV", "multi-request", "scbench_kv")]["Turn 3"] == "50.0"
    assert [r["Method"] for r in read_csv(out / "scbench_turns.csv") if r["Dataset"] == "scbench_kv"] == [
        "StreamingLLM", "SnapKV", "SnapKV"]  # paper method order, then mode
    modes = {(r["Method"], r["Dataset"]): r for r in read_csv(out / "scbench_modes.csv")}
    kv = modes[("SnapKV", "scbench_kv")]
    assert (kv["multi-turn"], kv["multi-request"], kv["Δ"]) == ("50.0", "83.33", "33.33")
    assert modes[("StreamingLLM", "scbench_kv")]["multi-request"] == ""
    cost = {r["Mode"]: r for r in read_csv(out / "scbench_cost.csv") if r["Method"] == "SnapKV"}
    mr = cost["multi-request"]  # per group: prefill+compress 2.5 + 0.1 + 0.1 as run, 3 × 2.5 each alone; decode 3 × 1
    assert (mr["Questions"], mr["Contexts"], mr["Compressions / context"]) == ("6", "2", "1.0")
    assert (mr["Prefill+compress s/q (reuse)"], mr["Prefill+compress s/q (each, est.)"], mr["Decode s/q"]) == (
        "0.9", "2.5", "1.0")
    assert mr["Saved (%)"] == "45.71"  # 1 - (0.9 + 1) / (2.5 + 1)
    index = (out / "index.md").read_text()
    assert "scbench_turns" in index and "scbench_cost" in index


def test_own_answer_runs_are_their_own_mode_and_no_scbench_jobs_no_artifacts(tmp_path):
    make_job(tmp_path, "snapkv", "multi_turn", golden=False)
    assert set(scbench_records(load_results(tmp_path), tmp_path)["mode"]) == {"multi-turn, own answers"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report.build(report.Context(empty, load_results(empty)), ["scbench"]) == {"scbench": []}
