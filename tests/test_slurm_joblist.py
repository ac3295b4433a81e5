"""slurm/make_joblist.py and the line handling of slurm/array.sbatch (no SLURM needed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "slurm"))

from make_joblist import SweepSpecError, expand, main  # noqa: E402
from shlex import join as format_line  # noqa: E402 - the job-list line format


def test_expand_is_the_cartesian_product_in_hydra_multirun_order():
    jobs = expand(["method=snapkv,selkv", "budget=0.1,0.25", "task=niah"])
    assert jobs == [
        ["method=snapkv", "budget=0.1", "task=niah"],
        ["method=snapkv", "budget=0.25", "task=niah"],
        ["method=selkv", "budget=0.1", "task=niah"],
        ["method=selkv", "budget=0.25", "task=niah"],
    ]


def test_expand_keeps_lists_and_plain_overrides_and_expands_range_and_choice():
    jobs = expand(["task.context_lengths=[256,512]", "+seed=range(1,3)", "model=choice(smollm2,gemma3_270m)"])
    assert jobs == [
        ["task.context_lengths=[256,512]", "+seed=1", "model=smollm2"],
        ["task.context_lengths=[256,512]", "+seed=1", "model=gemma3_270m"],
        ["task.context_lengths=[256,512]", "+seed=2", "model=smollm2"],
        ["task.context_lengths=[256,512]", "+seed=2", "model=gemma3_270m"],
    ]
    # a key given twice keeps its first place and its last value, as in Hydra's multirun
    assert expand(["budget=0.1", "method=full", "budget=0.25,0.5"]) == [["budget=0.25", "method=full"],
                                                                        ["budget=0.5", "method=full"]]


def test_shards_split_every_job_and_stay_next_to_each_other():
    jobs = expand(["method=full,snapkv"], shards=3)
    assert jobs == [
        ["method=full", "shard.index=0", "shard.count=3"],
        ["method=full", "shard.index=1", "shard.count=3"],
        ["method=full", "shard.index=2", "shard.count=3"],
        ["method=snapkv", "shard.index=0", "shard.count=3"],
        ["method=snapkv", "shard.index=1", "shard.count=3"],
        ["method=snapkv", "shard.index=2", "shard.count=3"],
    ]


@pytest.mark.parametrize("bad", ["budget=interval(0,1)", "method=glob(*)", "budget=[0.1,"])
def test_unexpandable_sweeps_are_rejected_with_the_override_named(bad):
    with pytest.raises(SweepSpecError):
        expand([bad])


def test_zero_shards_is_rejected():
    with pytest.raises(SweepSpecError, match="--shards=0"):
        expand(["method=full"], shards=0)


def test_flags_are_checked_and_overrides_may_follow_options(tmp_path, capsys):
    jobs = tmp_path / "jobs.txt"
    assert main(["method=full", "-o", str(jobs), "budget=0.5"]) == 0
    assert jobs.read_text() == "method=full budget=0.5\n"
    assert main(["method=full", "--shards", "0"]) == 2
    assert main(["method=full,snapkv", "budget=0.1,0.5", "-o", str(jobs)]) == 0  # the full cache: one folder, one line
    assert jobs.read_text().splitlines() == ["method=full budget=0.1", "method=snapkv budget=0.1", "method=snapkv budget=0.5"]
    assert "--shards=0" in capsys.readouterr().err
    for argv, flag in ((["method=full", "--parallel", "0"], "--parallel 0"),
                       (["method=full", "shard.count=3", "--shards", "2"], "shard.count=3"),
                       (["method=snapkv,selkv", "sweep.share_prefill=true"], "sweep.share_prefill")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        assert stop.value.code == 2 and flag in capsys.readouterr().err


def test_format_line_quotes_only_what_the_shell_would_mangle():
    assert format_line(["method=snapkv", "task.depth_percents=[10,50]", "run_tag=a b"]) == (
        "method=snapkv 'task.depth_percents=[10,50]' 'run_tag=a b'"
    )


def test_main_writes_one_line_per_job(tmp_path, capsys):
    out = tmp_path / "jobs.txt"
    assert main(["method=full,snapkv", "budget=0.5", "-o", str(out)]) == 0
    assert out.read_text() == "method=full budget=0.5\nmethod=snapkv budget=0.5\n"
    assert "sbatch --array=1-2%16 slurm/array.sbatch" in capsys.readouterr().err
    assert main(["method=full,snapkv"]) == 0 and capsys.readouterr().out == "method=full\nmethod=snapkv\n"
    assert main(["budget=interval(0,1)"]) == 2
    assert capsys.readouterr().err.startswith("make_joblist: 'budget=interval(0,1)'")
    (tmp_path / "afile").write_text("x")  # -o under a file: one line, exit 2
    assert main(["method=full", "-o", str(tmp_path / "afile" / "jobs.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("make_joblist: ") and err.count("\n") == 1


def test_a_preset_contributes_its_own_sweep(tmp_path, capsys):
    """+experiment=NAME sweeps the preset's hydra.sweeper.params (one line per method), first, as Hydra's
    multirun does; keys given on the command line win."""
    out = tmp_path / "jobs.txt"
    assert main(["experiment=selkv_table2_smoke", "output_root=r", "-o", str(out)]) == 0
    assert out.read_text().splitlines() == [f"method={m} +experiment=selkv_table2_smoke output_root=r"
                                            for m in ("full", "selkv_evict", "selkv_merge_all", "selkv_gate",
                                                      "selkv_gate_comp")]
    assert main(["+experiment=selkv_table2_smoke", "method=full,selkv_gate", "-o", str(out)]) == 0
    assert out.read_text().splitlines() == ["method=full +experiment=selkv_table2_smoke",
                                            "method=selkv_gate +experiment=selkv_table2_smoke"]
    capsys.readouterr()
    assert main(["+experiment=nope", "-o", str(out)]) == 2
    assert "experiment/nope" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash not found")
@pytest.mark.parametrize("task_id", [1, 2])
def test_array_sbatch_runs_run_py_with_the_overrides_of_its_line(tmp_path, task_id):
    # A stand-in run.py that records its argv, run by array.sbatch outside SLURM.
    (tmp_path / "run.py").write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    jobs = [["method=full", "task.depth_percents=[10,50]"], ["method=snapkv", "run_tag=a b", "+note='x y'"]]
    joblist = tmp_path / "jobs.txt"
    joblist.write_text("".join(format_line(job) + "\n" for job in jobs))
    env = dict(
        os.environ, SLURM_ARRAY_TASK_ID=str(task_id), SLURM_SUBMIT_DIR=str(tmp_path), KVBENCH_PYTHON=sys.executable
    )
    env.pop("SLURM_CPUS_PER_TASK", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "array.sbatch"), str(joblist)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == jobs[task_id - 1]


def test_array_sbatch_rejects_a_task_id_past_the_end_of_the_list(tmp_path):
    joblist = tmp_path / "jobs.txt"
    joblist.write_text("method=full\n")
    env = dict(os.environ, SLURM_ARRAY_TASK_ID="2", SLURM_SUBMIT_DIR=str(tmp_path), KVBENCH_PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "array.sbatch"), str(joblist)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "has no line 2" in proc.stderr


def _stored_run(root: Path, model: str, records: list[dict], load_s: tuple = ()) -> Path:
    job = root / "niah" / model / "snapkv" / "b0.25-abc"
    job.mkdir(parents=True)
    (job / "config.yaml").write_text(f"model:\n  name: {model}\n")
    (job / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for i, s in enumerate(load_s):
        (job / f"env{'.%d' % i if i else ''}.json").write_text(json.dumps({"load_s": s}))
    return job


def test_cost_fits_prefill_over_prompt_lengths_plus_load_and_compile(tmp_path, monkeypatch, capsys):
    import make_joblist

    # prefill + compression = 1e-6 n^2 s: 1 s at 1000 tokens, 9 s at 3000; decode 10 tok/s; one sample compiled 4 s
    rec = dict(error=None, compress_s=0.5, compile_s=0.0)
    _stored_run(tmp_path, "smollm2", [dict(rec, prompt_tokens=1000, prefill_s=0.5, generated_tokens=10, decode_s=1.0, compile_s=4.0),
                                      dict(rec, prompt_tokens=3000, prefill_s=8.5, generated_tokens=30, decode_s=3.0),
                                      dict(rec, prompt_tokens=9, prefill_s=9, generated_tokens=0, decode_s=0, error={"type": "X"})],
                load_s=(6.0, 2.0))  # env.json and a rerun's env.1.json
    _stored_run(tmp_path / "other", "llama31", [dict(rec, prompt_tokens=1, prefill_s=1, generated_tokens=1, decode_s=1)])
    fit = make_joblist.measure(tmp_path / "niah", "smollm2")
    assert (fit["a"], fit["p"]) == (pytest.approx(1e-6), pytest.approx(2.0))
    assert (fit["decode_tok_s"], fit["load_s"], fit["compile_s"]) == (10.0, 4.0, 4.0) and "2 prompt lengths" in fit["note"]
    latency = tmp_path / "latency.json"  # one prompt length: linear in n, and said
    latency.write_text(json.dumps([dict(rec, model="smollm2", prompt_tokens=900, prefill_s=0.4, generated_tokens=20,
                                        decode_s=4.0, load_s=3.0)]))
    one = make_joblist.measure(latency, "smollm2")
    assert (one["a"], one["p"], one["decode_tok_s"], one["load_s"]) == (pytest.approx(1e-3), 1.0, 5.0, 3.0)
    assert "one prompt length" in one["note"]
    # 4 samples of 2000 prompt tokens, at most 50 new tokens each; two shards of a job get 2 each:
    # per shard 4 s load + 2 * 4 s prefill + 100 / 10 s decode = 22 s, and 4 s more compiled
    monkeypatch.setattr(make_joblist, "job_samples", lambda cfg: [(2000, 50)] * 4)
    assert main(["method=snapkv,selkv", "--shards", "2", "--cost", str(tmp_path / "niah")]) == 0
    out = capsys.readouterr().out
    assert f"4 jobs, 8 samples, {4 * 22 / 3600:.2f} hours on RUN's device" in out and out.count(f"{22 / 3600:.2f}") >= 4
    assert "smollm2: prefill s = 1e-06·n^2.00 fitted at 2 prompt lengths (1000-3000)" in out
    compiled = make_joblist.cost(make_joblist.unique_jobs(expand(["compile=true", "max_samples=1"])), tmp_path / "niah")
    assert compiled.samples.tolist() == [1] and compiled.hours.tolist() == [pytest.approx((4 + 4 + 4 + 5) / 3600)]
    # the full cache at three budgets is one job folder, costed once; snapkv's two budgets are two jobs
    assert len(make_joblist.cost(make_joblist.unique_jobs(expand(["method=full,snapkv", "budget=0.1,0.25,0.5"])), tmp_path / "niah")) == 4


def test_cost_counts_the_task_samples_with_the_model_tokenizer(tmp_path):
    import make_joblist
    from tests.kvbench.cli_util import make_haystack_dir, make_tiny_model_dir

    tiny_model_dir, haystack_dir = make_tiny_model_dir(tmp_path / "m"), make_haystack_dir(tmp_path / "h")

    _stored_run(tmp_path, "smollm2", [dict(error=None, prompt_tokens=400, prefill_s=1.0, compress_s=0.0,
                                           generated_tokens=4, decode_s=1.0)])
    table = make_joblist.cost(make_joblist.unique_jobs(expand([
        f"model.source={tiny_model_dir}", "model.gguf_file=null", "model.chat_template=none", "task.context_lengths=[400,600]",
        "task.depth_percents=[10,50,90]", f"task.haystack_dir={haystack_dir}", "task.max_new_tokens=4"], shards=2)), tmp_path)
    assert table.samples.tolist() == [3, 3] and table.new_tokens.tolist() == [12, 12]
    assert table.prompt_tokens.tolist() == [400 + 400 + 600, 400 + 600 + 600]  # samples 0, 2, 4 and 1, 3, 5
    assert table.hours.sum() == pytest.approx((table.prompt_tokens.sum() / 400 + 24 / 4) / 3600)


def test_cost_without_a_record_of_the_model_is_one_line(tmp_path, capsys):
    assert main(["method=snapkv", "--cost", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--cost" in err and "smollm2" in err and "\n" not in err


PLAN = ["method=full,snapkv", "budget=64", "task=math500", "task.data_dir=tests/data/math500", "task.max_new_tokens=16",
        "sampling.n=4", "sampling.temperature=0.6", "batch_size=2"]


def test_plan_counts_samples_candidates_tokens_and_hours_from_the_data(capsys):
    """kvbench plan: 2 jobs x 3 problems x 4 candidates x 16 new tokens at most; hours at each batch size's rate."""
    assert main(["--plan", *PLAN, "--rate", "1:10,2:16"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs (0 unknown: no data here, no documented size), 6 samples, 24 candidates, 384 new tokens" in out
    assert f"{384 / 10 / 3600:.3g} device-hours at batch 1, {384 / 16 / 3600:.3g} at batch_size" in out


def test_plan_without_data_uses_documented_sizes_and_the_stored_rates(monkeypatch):
    import make_joblist

    def offline(cfg):
        raise OSError("no data")

    monkeypatch.setattr(make_joblist, "job_samples", offline)
    jobs = make_joblist.unique_jobs(expand(["method=snapkv", *PLAN[1:2], "task=aime24", *PLAN[4:], "max_samples=20"]))
    table = make_joblist.plan(jobs)
    assert table.samples.tolist() == [20] and table["from"].tolist() == ["documented"]  # AIME 2024's 30, capped
    assert table["new tokens <="].tolist() == [20 * 4 * 16]
    rates = json.loads((ROOT / "benchmarks" / "rates.json").read_text())["smollm2 on cpu"]["tok_s"]
    assert table["hours at 1"].tolist() == [pytest.approx(20 * 4 * 16 / rates["1"] / 3600)]
    assert table["hours at batch"].tolist() == [pytest.approx(20 * 4 * 16 / rates["2"] / 3600)]
    assert "smollm2 on cpu" in table.attrs["rates"]["smollm2"]
    scbench = make_joblist.plan(make_joblist.unique_jobs(expand(["task=scbench", "task.max_turns=2", "task.n_samples=3",
                                                                 "task.datasets=[scbench_kv,scbench_mf]"])))
    assert scbench["new tokens <="].tolist() == [3 * 2 * (150 + 5)]  # 3 rows x 2 turns, 150 and 5 new tokens
    unknown = make_joblist.plan(make_joblist.unique_jobs(expand(["task=scbench", "task.max_turns=null"])))
    assert unknown["from"].tolist() == ["unknown"] and unknown.samples.isna().all()


def test_plan_of_only_unknown_sizes_prints_its_totals(capsys, monkeypatch):
    """A job whose size is unknown (no data, none documented) is NaN, also when every job is unknown."""
    import make_joblist

    monkeypatch.setattr(make_joblist, "job_samples", lambda cfg: (_ for _ in ()).throw(OSError("no data")))
    assert main(["--plan", "task=scbench", "task.max_turns=null", "--rate", "10"]) == 0
    assert "1 jobs (1 unknown: no data here, no documented size), 0 samples" in capsys.readouterr().out


@pytest.mark.parametrize("argv, key", [(["sampling.n=0"], "sampling.n"), (["batch_size=0"], "batch_size"),
                                       (["--rate", "fast"], "--rate"), (["--rate", "8:5"], "--rate")])
def test_plan_bad_input_is_one_line_naming_the_key_exit_2(argv, key):
    run = subprocess.run([sys.executable, "-m", "kvbench.cli", "plan", *argv], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 2 and key in run.stderr and run.stderr.startswith("kvbench plan")
    assert run.stderr.count("\n") == 1
