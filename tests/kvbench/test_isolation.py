"""Per-sample isolation: a failing sample is recorded with its error, the job goes on, exit code 1."""

from __future__ import annotations

import json
import math

import pytest
import torch

from eval.base import Sample, Task
from kvbench.engine import Engine
from kvbench.job import _loop, check_record, run_sample, summarize
from kvbench.store import JobStore
from methods.full import FullCache
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import read_lines, run_cli, tiny_model_args


class CharTokenizer:
    """One token per character (ids modulo the tiny vocabulary); fails on a marker, for tests."""

    chat_template = None
    unk_token_id = None
    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": self.encode(text)}

    def encode(self, text, add_special_tokens=False):
        if "\x00" in text:
            raise UnicodeError("tokenizer cannot handle NUL")
        return [ord(c) % 128 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)


class ConstTask(Task):
    """Scores every prediction with a fixed value."""

    name = "const"

    def __init__(self, value: float = 1.0):
        super().__init__({"name": "const"})
        self.value = value

    def score(self, sample, prediction):
        return self.value


def sample(sid: str, prompt: str = "the quick brown fox jumps over the lazy dog " * 2) -> Sample:
    return Sample(id=sid, dataset="d", prompt=prompt, max_new_tokens=3, answers=["x"], chat=False)


@pytest.fixture(scope="module")
def loaded():
    lm = loaded_for(tiny_model("llama", layers=2))
    lm.tokenizer = CharTokenizer()
    return lm


def engine_for(loaded, method=None, budget=1.0):
    return Engine(loaded, method or FullCache(layout=loaded.layout), budget)


def test_a_good_sample_is_scored(loaded):
    rec = run_sample(engine_for(loaded), loaded, ConstTask(), sample("ok", prompt="héllo wörld"))
    assert rec["error"] is None and rec["score"] == 1.0 and rec["generated_tokens"] == 3
    # sha256 of the UTF-8 prompt text (printf 'héllo wörld' | sha256sum)
    assert rec["prompt_sha256"] == "a1003f7d04a4115711d0b48a2eaf1359ce565d2d2a6fd65098dfcffadeeef59f"


@pytest.mark.parametrize(
    "kind,error_type",
    [("", "InjectedFailure"), (":error", "InjectedFailure"), (":oom", "OutOfMemoryError"), (":nan", "NonFiniteLogitsError")],
)
def test_injected_failures_are_recorded_with_type_and_message(loaded, monkeypatch, kind, error_type):
    monkeypatch.setenv("KVBENCH_FAIL_SAMPLES", f"other/1,bad/7{kind}")
    rec = run_sample(engine_for(loaded), loaded, ConstTask(), sample("bad/7"))
    assert rec["error"]["type"] == error_type
    assert rec["score"] is None and rec["prediction"] is None
    if error_type == "NonFiniteLogitsError":
        assert rec["error"]["message"] == "non-finite logits at decode step 0"
    else:
        assert "bad/7" in rec["error"]["message"]
    good = run_sample(engine_for(loaded), loaded, ConstTask(), sample("good/1"))
    assert good["error"] is None  # the hook was removed: the next sample is fine


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_logits_from_the_model_are_never_scored(poison):
    model = tiny_model("llama", layers=2, seed=3)
    with torch.no_grad():
        model.model.norm.weight[5] = poison  # every hidden state, hence every logit, turns non-finite
    lm = loaded_for(model)
    lm.tokenizer = CharTokenizer()
    for method, budget in ((FullCache(layout=lm.layout), 1.0), (SnapKV(SnapKVConfig(window_size=4, kernel_size=3), lm.layout), 0.5)):
        rec = run_sample(Engine(lm, method, budget), lm, ConstTask(), sample("poisoned"))
        assert rec["error"] == {"type": "NonFiniteLogitsError", "message": "non-finite logits at decode step 0"}
        assert rec["score"] is None


def test_non_finite_task_score_is_an_error(loaded):
    rec = run_sample(engine_for(loaded), loaded, ConstTask(math.nan), sample("nan-score"))
    assert rec["error"]["type"] == "FloatingPointError"
    assert rec["error"]["message"].startswith("non-finite score nan")


def test_empty_prompt_is_an_error_record_not_a_crash(loaded):
    rec = run_sample(engine_for(loaded), loaded, ConstTask(), sample("empty", prompt=""))
    assert rec["error"] == {"type": "ValueError", "message": "empty prompt: nothing to prefill"}


def test_tokenizer_failure_is_an_error_record(loaded):
    rec = run_sample(engine_for(loaded), loaded, ConstTask(), sample("nul", prompt="bad \x00 text"))
    assert rec["error"] == {"type": "UnicodeError", "message": "tokenizer cannot handle NUL"}


def test_check_record_names_the_non_finite_field():
    check_record({"score": 1.0, "scores": {"a": 2.0}, "method_stats": {"merged": 3.0}})
    with pytest.raises(FloatingPointError, match=r"non-finite value inf in method_stats\.merged"):
        check_record({"score": 1.0, "method_stats": {"merged": math.inf}})
    with pytest.raises(FloatingPointError, match=r"in scores\.rouge\[1\]"):
        check_record({"scores": {"rouge": [1.0, math.nan]}})


def test_loop_goes_on_after_failures_and_summary_counts_them(loaded, tmp_path, monkeypatch):
    monkeypatch.setenv("KVBENCH_FAIL_SAMPLES", "s/1,s/3:oom")
    store = JobStore(tmp_path)
    samples = [sample(f"s/{i}") for i in range(5)]
    failed = _loop(engine_for(loaded), loaded, ConstTask(), samples, store, quiet=True)
    assert failed == 2
    records = store.records()
    assert [r["id"] for r in records] == [f"s/{i}" for i in range(5)]
    assert {r["id"]: (r["error"] or {}).get("type") for r in records} == {
        "s/0": None, "s/1": "InjectedFailure", "s/2": None, "s/3": "OutOfMemoryError", "s/4": None,
    }
    cfg = {"task": {"name": "const"}, "model": {"name": "tiny"}, "method": {"name": "full"}, "budget": 1.0}
    summary = summarize(cfg, ConstTask(), records, [s.id for s in samples], "job")
    assert summary["n_samples"] == 3 and summary["n_failed"] == 2 and summary["complete"] is False
    assert [f["id"] for f in summary["failed"]] == ["s/1", "s/3"]
    assert summary["datasets"]["d"] == {"score": 100.0, "n": 3}


def test_cli_failed_samples_are_isolated_exit_1_then_retried(tiny_model_dir, haystack_dir, tmp_path):
    """Through run.py: three samples fail three ways, the other three are scored, exit code 1
    (the over-long length is skipped and reported); the same command without the injection
    redoes only the failed ones and exits 0."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300,400,1500]", "task.depth_percents=[0,50,100]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3", "quiet=true",
            f"output_root={tmp_path}", "run_name=job"]
    inject = "niah/300/0,niah/300/100:oom,niah/400/50:nan"
    out = run_cli(args, KVBENCH_FAIL_SAMPLES=inject)
    assert out.returncode == 1, out.stderr[-2000:]
    job = tmp_path / "job"
    lines = read_lines(job / "predictions.jsonl")
    errors = {r["id"]: r["error"]["type"] for r in lines if r["error"]}
    assert errors == {"niah/300/0": "InjectedFailure", "niah/300/100": "OutOfMemoryError", "niah/400/50": "NonFiniteLogitsError"}
    assert len(lines) == 6
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_failed"], summary["n_expected"], summary["complete"]) == (3, 3, 6, False)
    assert sorted(f["id"] for f in summary["failed"]) == sorted(errors)
    assert "failed: niah/300/0: InjectedFailure" in out.stdout
    # 1500 tokens > model.max_input_length=1000: skipped by the task's rule, reported, no exception
    assert summary["n_skipped"] == 3 and summary["skipped"][0]["context_length"] == 1500

    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = read_lines(job / "predictions.jsonl")
    assert len(lines) == 9 and [r["id"] for r in lines[6:]] == ["niah/300/0", "niah/300/100", "niah/400/50"]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_failed"], summary["complete"]) == (6, 0, True)
    # A rerun that differs only in run-control keys is the same finished job: no model load,
    # no second config file, nothing appended.
    rerun = [a for a in args if a != "quiet=true"] + ["quiet=false", "lock_wait_s=5"]
    out = run_cli(rerun)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "already complete" in out.stdout + out.stderr
    assert sorted(p.name for p in job.glob("config*.yaml")) == ["config.yaml"]
    assert len(read_lines(job / "predictions.jsonl")) == 9


def test_a_changed_setting_never_reuses_stored_samples(tiny_model_dir, haystack_dir, tmp_path):
    """A setting outside the folder name (here the generation limit) is refused before the model
    loads, naming the key; a smaller grid is summarised over its own samples only."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "job"
    before = (job / "predictions.jsonl").read_text()
    changed = [a for a in args if a != "task.max_new_tokens=3"] + ["task.max_new_tokens=5"]
    out = run_cli(changed)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (
        "error: task.max_new_tokens=5: job folder job already holds samples run with another setting "
        "(task.max_new_tokens: 3 -> 5); pass another run_name or another output_root to keep both\n"
    )
    assert (job / "predictions.jsonl").read_text() == before
    subset = [a for a in args if a != "task.depth_percents=[0,50]"] + ["task.depth_percents=[50]"]
    assert run_cli(subset).returncode == 0
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_expected"], summary["complete"]) == (1, 1, True)
    assert summary["datasets"]["niah"]["n"] == 1
    assert (job / "predictions.jsonl").read_text() == before  # nothing re-run, nothing lost
    snapshots = sorted(p.name for p in job.glob("config.*.yaml"))
    assert len(snapshots) == 1  # the changed grid's config, next to the first run's config.yaml
    # the changed grid once more: finished, so no model load, and no second snapshot of the same config
    out = run_cli(subset)
    assert "already complete (1 sample stored)" in out.stdout + out.stderr, out.stderr[-2000:]
    assert sorted(p.name for p in job.glob("config.*.yaml")) == snapshots
    # Back to the first grid (config.yaml's): the stored summary is the [50] run's, so the
    # finished-job shortcut must not take it; the summary is rebuilt over both samples.
    out = run_cli(args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "already complete" not in out.stdout + out.stderr
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_expected"], summary["complete"]) == (2, 2, True)
    assert summary["selection"]["task.depth_percents"] == [0, 50]
    # the same grid once more: now the shortcut applies (no model load), same summary
    out = run_cli(args)
    assert "already complete (2 samples stored)" in out.stdout + out.stderr
    assert (job / "predictions.jsonl").read_text() == before


@pytest.mark.parametrize("stored, key, message", [
    ({"device": "cuda:0", "dtype": "bfloat16"}, "device_type",
     "device_type=cpu: job folder job holds samples computed with device_type=cuda (device_type: cuda -> cpu, "
     "dtype: bfloat16 -> float32, as the stored env.json says; device=auto resolves otherwise here); run it where "
     "it resolves as before, or pass run_tag=NAME for a separate job folder"),
    ({"haystack_source": "hub:opencompass/NeedleBench"}, "haystack_source",
     "haystack_source=dir:{hay}: job folder job holds samples computed with haystack_source=hub:opencompass/NeedleBench "
     "(haystack_source: hub:opencompass/NeedleBench -> dir:{hay}, as the stored env.json says; "
     "task.haystack_source=auto resolves otherwise here); run it where it resolves as before, or pass run_tag=NAME "
     "for a separate job folder"),
])
def test_a_resume_whose_auto_settings_resolve_otherwise_is_refused(tiny_model_dir, haystack_dir, tmp_path, stored,
                                                                    key, message):
    """device=auto / task.haystack_source=auto are stored as 'auto': the resolved device type, dtype and
    haystack in env.json decide whether a resume computes like the stored samples."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli([*args, "max_samples=1"]).returncode == 0
    job = tmp_path / "job"
    env = json.loads((job / "env.json").read_text())
    (job / "env.json").write_text(json.dumps({**env, **stored}))
    before = (job / "predictions.jsonl").read_text()
    out = run_cli(args)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: " + message.format(hay=haystack_dir)
    assert (job / "predictions.jsonl").read_text() == before
    assert json.loads((job / "env.json").read_text())["dtype"] == stored.get("dtype", "float32")  # kept


def test_an_attempt_that_stored_no_sample_leaves_no_env_file(tiny_model_dir, haystack_dir, tmp_path):
    """env*.json describes stored samples: a shard killed before its first sample (e.g. a GPU
    attempt) writes none, so it cannot block a resume of another shard on a CPU; the shard's
    file appears with its first record."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job", "shard.count=2"]
    job = tmp_path / "job"
    assert run_cli([*args, "shard.index=1"]).returncode == 0
    assert sorted(p.name for p in job.glob("env*.json")) == ["env.shard1.json"]
    out = run_cli([*args, "shard.index=0"], KVBENCH_CRASH_AT="sample:1")  # killed before its first sample
    assert out.returncode == -9
    assert sorted(p.name for p in job.glob("env*.json")) == ["env.shard1.json"]
    out = run_cli([*args, "shard.index=0"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(p.name for p in job.glob("env*.json")) == ["env.shard0.json", "env.shard1.json"]
    assert json.loads((job / "summary.json").read_text())["complete"] is True


def test_a_finished_niah_job_redraws_a_heatmap_that_is_not_its_summarys(tiny_model_dir, haystack_dir, tmp_path):
    """A run of another grid that drew its heatmap and was killed before its summary left a heatmap
    newer than summary.json: the finished job's rerun (no model load) redraws it from the summary's
    grid, once; a missing heatmap is drawn the same way."""
    import os

    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "job"
    summary_ns = (job / "summary.json").stat().st_mtime_ns
    (job / "heatmap.png").write_bytes(b"another grid's heatmap")
    os.utime(job / "heatmap.png", ns=(summary_ns + 10**9, summary_ns + 10**9))
    out = run_cli(args)
    assert out.returncode == 0 and "already complete (2 samples stored)" in out.stdout + out.stderr
    png = (job / "heatmap.png").read_bytes()
    assert png.startswith(b"\x89PNG") and (job / "heatmap.png").stat().st_mtime_ns == summary_ns
    (job / "heatmap.pdf").unlink()
    (job / "heatmap.png").unlink()
    assert run_cli(args).returncode == 0
    assert (job / "heatmap.png").read_bytes().startswith(b"\x89PNG") and (job / "heatmap.pdf").exists()
    assert (job / "summary.json").stat().st_mtime_ns == summary_ns  # the summary itself is not rewritten


def test_a_run_that_stored_no_sample_does_not_pin_the_folder_setting(tiny_model_dir, haystack_dir, tmp_path):
    """A run stopped before its first sample (Ctrl-C while the model loads) leaves config.yaml and
    nothing else: a rerun with another setting takes the folder (the old config.yaml is kept as
    config.<time>.yaml) instead of being refused for samples that do not exist."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "job"
    for p in job.iterdir():  # as if that run had stopped before its first sample
        if p.name != "config.yaml" and p.is_file():
            p.unlink()
    out = run_cli([a for a in args if a != "task.max_new_tokens=3"] + ["task.max_new_tokens=5"])
    assert out.returncode == 0, out.stderr[-2000:]
    (kept,) = job.glob("config.*.yaml")
    assert "max_new_tokens: 3" in kept.read_text() and "max_new_tokens: 5" in (job / "config.yaml").read_text()
    assert json.loads((job / "summary.json").read_text())["n_samples"] == 1


def test_stored_samples_without_a_readable_config_are_never_resumed(tiny_model_dir, haystack_dir, tmp_path):
    """config.yaml deleted or garbled: the stored samples' setting is unknown, so a run (of any
    setting) is refused before the model loads instead of adding to them; with run_name the advice
    is another run_name, and a changed method is named by method.name."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job", "max_samples=1"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "job"
    before = (job / "predictions.jsonl").read_text()
    stored = (job / "config.yaml").read_text()
    for text in (None, "{{{ not yaml"):
        if text is None:
            (job / "config.yaml").unlink()
        else:
            (job / "config.yaml").write_text(text)
        out = run_cli([*args[:-1], "task.max_new_tokens=5"])
        assert out.returncode == 2
        what = "no config.yaml" if text is None else "an unreadable config.yaml"
        assert out.stderr.strip().splitlines()[-1] == (
            f"error: config.yaml: job folder job holds 1 stored sample but {what}, so their setting is unknown; "
            "restore its config.yaml (a config.<time>.yaml there may be a copy), or pass another run_name or another "
            "output_root")
        assert (job / "predictions.jsonl").read_text() == before
    (job / "config.yaml").write_text(stored)
    out = run_cli([*args, "method=snapkv"])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: method.name=snapkv: job folder job already holds")
    assert out.stderr.strip().endswith("pass another run_name or another output_root to keep both")


def test_a_setting_refused_before_any_sample_leaves_the_folder_usable(tiny_model_dir, haystack_dir, tmp_path):
    """A job that stops on a config error after its folder was made (here: the Hub haystack,
    offline, is read only after the model loads) leaves no config.yaml, so the corrected command is not refused
    as 'another setting'; a folder with stored samples still refuses one."""
    base = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[50]",
            "method=streamingllm", "budget=0.5", "task.max_new_tokens=2", "quiet=true",
            f"output_root={tmp_path}", "run_name=job"]
    bad = run_cli([*base, "task.haystack_source=hub"])  # offline (run_cli): refused when the haystack is read
    assert bad.returncode == 2 and "haystack_source" in bad.stderr, bad.stderr[-2000:]
    assert not (tmp_path / "job" / "config.yaml").exists()
    good = run_cli([*base, f"task.haystack_dir={haystack_dir}"])
    assert good.returncode == 0, good.stderr[-2000:]
    assert len(read_lines(tmp_path / "job" / "predictions.jsonl")) == 1
    other = run_cli([*base, f"task.haystack_dir={haystack_dir}", "task.max_new_tokens=3"])
    assert other.returncode == 2 and "already holds samples run with another setting" in other.stderr


def test_a_grid_the_task_skips_entirely_is_a_config_error(tiny_model_dir, tmp_path):
    """Lengths the template, question and needle alone fill are skipped; when nothing is left the
    job exits 2 with one line (not "complete; 0/0 samples") and leaves no config.yaml."""
    out = run_cli([*tiny_model_args(tiny_model_dir), "task.context_lengths=[5,6]", "task.depth_percents=[50]",
                   "method=streamingllm", "budget=0.5", "quiet=true", f"output_root={tmp_path}", "run_name=job"])
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: task.context_lengths=[5, 6]: every sample was skipped (context length 5 tokens "
                           "leaves no room for the haystack") and line.endswith("; 1 more skipped); nothing to run")
    assert not (tmp_path / "job").exists()  # the folder it made held only its lock file: removed
    # default naming: the folders it made (niah/tiny/streamingllm/b0.5) go; output_root and a folder
    # that existed before stay
    (tmp_path / "niah").mkdir()
    out = run_cli([*tiny_model_args(tiny_model_dir), "task.context_lengths=[5,6]", "task.depth_percents=[50]",
                   "method=streamingllm", "budget=0.5", "quiet=true", f"output_root={tmp_path}"])
    assert out.returncode == 2, out.stderr[-2000:]
    assert tmp_path.is_dir() and list((tmp_path / "niah").iterdir()) == []


def test_a_relative_input_path_is_stored_absolute_and_checked_by_what_it_reads(tiny_model_dir, tmp_path):
    """``task.haystack_dir=essays`` from two working directories names two folders: the job stores
    the absolute path, so the rerun from elsewhere (other essays) is refused as another setting,
    and the rerun from the first directory resumes."""
    import yaml

    from tests.kvbench.cli_util import make_haystack_dir

    first, second = tmp_path / "a", tmp_path / "b"
    make_haystack_dir(first / "essays")
    (second / "essays").mkdir(parents=True)
    (second / "essays" / "other.txt").write_text("A different essay about mountains and snow. " * 60)
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            "task.haystack_dir=essays", "method=streamingllm", "budget=0.5", "task.max_new_tokens=2", "quiet=true",
            f"output_root={tmp_path / 'out'}", "run_name=job", "max_samples=1"]
    assert run_cli(args, cwd=first).returncode == 0
    job = tmp_path / "out" / "job"
    stored = yaml.safe_load((job / "config.yaml").read_text())
    assert stored["task"]["haystack_dir"] == str((first / "essays").resolve())
    elsewhere = run_cli([a for a in args if a != "max_samples=1"], cwd=second)
    assert elsewhere.returncode == 2, elsewhere.stderr[-2000:]
    assert "task.haystack_dir" in elsewhere.stderr and "another setting" in elsewhere.stderr
    again = run_cli([a for a in args if a != "max_samples=1"], cwd=first)
    assert again.returncode == 0, again.stderr[-2000:]
    assert [r["id"] for r in read_lines(job / "predictions.jsonl")] == ["niah/300/0", "niah/300/50"]


def test_a_resume_after_the_haystack_files_changed_is_refused(tiny_model_dir, tmp_path):
    """Same config, edited haystack file: the stored sample's prompt_sha256 no longer matches the
    prompt this run builds, so the resume is refused (exit 2) and nothing is written."""
    from tests.kvbench.cli_util import make_haystack_dir

    hay = make_haystack_dir(tmp_path / "hay")
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={hay}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli([*args, "max_samples=1"]).returncode == 0
    job = tmp_path / "job"
    before = (job / "predictions.jsonl").read_text()
    (hay / "a.txt").write_text("Entirely different essay text about mountains and snow. " * 40)
    out = run_cli(args)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: task.haystack_dir={hay}: the stored sample niah/300/0 of job folder job was run "
                           "on another prompt (prompt_sha256 "), last
    assert last.endswith("the task's input files changed; pass run_tag=NAME for a separate job folder")
    assert (job / "predictions.jsonl").read_text() == before
    assert not list(job.glob("config.*.yaml"))  # the refused run left no config snapshot


def test_a_narrower_rerun_keeps_the_earlier_summary(tiny_model_dir, haystack_dir, tmp_path):
    """A rerun of a finished job with max_samples scores only its own selection; the summary of
    the whole grid is kept beside it and the run says so."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=2",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "job"
    whole = json.loads((job / "summary.json").read_text())
    out = run_cli([*args, "max_samples=1"])
    assert out.returncode == 0, out.stderr[-2000:]
    (kept,) = job.glob("summary.*.json")
    assert json.loads(kept.read_text()) == whole and whole["n_samples"] == 2
    assert json.loads((job / "summary.json").read_text())["n_samples"] == 1
    assert (f"predictions.jsonl holds 2 samples; this summary scores the 1 of this run's selection; the previous "
            f"summary.json (another selection) is kept as {kept.name}") in out.stdout
    assert run_cli([*args, "max_samples=1"]).returncode == 0
    assert len(list(job.glob("summary.*.json"))) == 1  # the same selection again: nothing more kept


def test_a_sharded_job_with_max_samples_completes(tiny_model_dir, haystack_dir, tmp_path):
    """max_samples caps each shard: the job expects each shard's first max_samples samples (it
    could never complete when it expected every sample)."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50,100]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=2",
            "quiet=true", f"output_root={tmp_path}", "run_name=job", "max_samples=1", "shard.count=2"]
    for index in (0, 1):
        out = run_cli([*args, f"shard.index={index}"])
        assert out.returncode == 0, out.stderr[-2000:]
        assert "another selection" not in out.stdout + out.stderr
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_expected"], summary["complete"]) == (2, 2, True)
    assert summary["subset"] == "max_samples=1"  # shard 0 had 2 samples (0 and 100), 1 was run
    # the shards of one job share its config.yaml and summary.json: no snapshot per shard
    assert "shard.index" not in summary["selection"] and summary["selection"]["shard.count"] == 2
    assert sorted(p.name for p in (tmp_path / "job").glob("*.yaml")) == ["config.yaml"]
    assert sorted(p.name for p in (tmp_path / "job").glob("summary*.json")) == ["summary.json"]


def test_another_shard_count_without_max_samples_is_the_same_selection(tiny_model_dir, haystack_dir, tmp_path):
    """Without max_samples the shard count does not change a job's samples: shard 0 of 2, then
    the job unsharded (it runs the rest), then again unsharded ('already complete', no model
    load): one config.yaml, one summary.json, no 'another selection'."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[0,50,100]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=2",
            f"output_root={tmp_path}", "run_name=job"]
    runs = [run_cli([*args, "shard.index=0", "shard.count=2"]), run_cli(args), run_cli(args)]
    for out in runs:
        assert out.returncode == 0, out.stderr[-2000:]
        assert "another selection" not in out.stdout + out.stderr
    assert "already complete (3 samples stored)" in runs[2].stdout + runs[2].stderr
    summary = json.loads((tmp_path / "job" / "summary.json").read_text())
    assert (summary["n_samples"], summary["n_expected"], summary["complete"]) == (3, 3, True)
    assert not any(k.startswith("shard.") for k in summary["selection"])
    assert sorted(p.name for p in (tmp_path / "job").glob("*.yaml")) == ["config.yaml"]
    assert sorted(p.name for p in (tmp_path / "job").glob("summary*.json")) == ["summary.json"]


def test_folder_names_count_only_overrides_that_change_the_preset(tiny_model_dir, haystack_dir, tmp_path):
    """Through run.py: ``method.n_sinks=4`` (StreamingLLM's own value) is the preset's job, in its
    folder without a hash; ``method.n_sinks=2`` gets a hashed folder; ``run_name`` with a
    ``run_tag`` warns that the tag is not part of the folder name."""
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[50]",
            f"task.haystack_dir={haystack_dir}", "method=streamingllm", "budget=0.5", "task.max_new_tokens=3",
            "quiet=true", f"output_root={tmp_path}"]
    out = run_cli([*args, "method.n_sinks=4"])
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_cli([*args, "method.n_sinks=2"])
    assert out.returncode == 0, out.stderr[-2000:]
    folders = sorted(p.name for p in (tmp_path / "niah/tiny/streamingllm").iterdir())
    assert folders[0] == "b0.5" and len(folders) == 2 and folders[1].startswith("b0.5-")
    out = run_cli([*[a for a in args if a != "quiet=true"], "run_name=mine/job", "run_tag=x"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("run_name=mine/job names the whole job folder, so run_tag=x is not part of its name (config.yaml keeps "
            "every key)") in out.stdout + out.stderr
    assert (tmp_path / "mine/job/summary.json").is_file()
    # a run_name above other jobs' folders, or inside one, would mix them: one line, exit 2
    out = run_cli([*args, "run_name=niah"])
    assert out.returncode == 2 and out.stderr == (
        "error: run_name=niah: the folder holds the job folder niah/tiny/streamingllm/b0.5; choose a run_name that "
        "is not above other jobs' folders (e.g. runs/NAME)\n")
    out = run_cli([*args, "run_name=mine/job/inner"])
    assert out.returncode == 2 and out.stderr.startswith("error: run_name=mine/job/inner: inside the job folder mine/job;")
    assert not (tmp_path / "niah/config.yaml").exists() and not (tmp_path / "mine/job/inner").exists()
    # an output_root inside a job folder, or a task/model/method folder of this results root, would
    # nest results roots (the report of the outer root reads the inner jobs as its own)
    base = [a for a in args if not a.startswith("output_root=")]
    for inner in ("niah", "niah/tiny", "niah/tiny/snapkv"):
        out = run_cli([*base, f"output_root={tmp_path}/{inner}"])
        assert out.returncode == 2 and out.stderr == (
            f"error: output_root={tmp_path}/{inner}: a folder inside the results root {tmp_path} (it holds the job "
            f"folder niah/tiny/streamingllm/b0.5); pass {tmp_path} or a folder outside it\n"), out.stderr
    out = run_cli([*base, f"output_root={tmp_path}/mine/job/sub"])
    assert out.returncode == 2 and out.stderr == (f"error: output_root={tmp_path}/mine/job/sub: inside the job folder "
                                                  f"{tmp_path}/mine/job; pass a folder outside it\n"), out.stderr
    out = run_cli([*args, "run_name=report/x"])  # kvbench report's default output folder
    assert out.returncode == 2 and out.stderr.startswith("error: run_name=report/x: report in output_root is kvbench report's default output folder")
    assert not (tmp_path / "niah/niah").exists() and not (tmp_path / "report").exists()


def test_lookms_kernel_choice_is_run_control_not_another_job(tiny_model_dir, haystack_dir, tmp_path):
    """``method.kernel`` (compiled CPU kernels or PyTorch operations, equal within float32
    rounding) is like ``threads``: no hashed folder, a rerun with another kernel resumes the job,
    and the report shows one LOOK-M row, not a ``kernel=torch`` variant."""
    from kvbench.report_data import load_results, preset_overrides, preset_params

    args = [*tiny_model_args(tiny_model_dir), f"task.haystack_dir={haystack_dir}", "method=lookm", "budget=0.5",
            "task.context_lengths=[300]", "task.max_new_tokens=3", "quiet=true", f"output_root={tmp_path}"]
    out = run_cli([*args, "task.depth_percents=[50]", "method.kernel=torch"])
    assert out.returncode == 0, out.stderr[-2000:]
    out = run_cli([*args, "task.depth_percents=[50,90]", "method.kernel=auto"])
    assert out.returncode == 0, out.stderr[-2000:]
    job = tmp_path / "niah/tiny/lookm"
    assert [p.name for p in job.iterdir()] == ["b0.5"]
    lines = (job / "b0.5/predictions.jsonl").read_text().splitlines()
    assert len(lines) == 2 and len({json.loads(x)["id"] for x in lines}) == 2  # the 50 % sample resumed, not rerun
    assert len(list((job / "b0.5").glob("env*.json"))) == 2  # each run's kernel is on record
    rows = load_results(tmp_path)
    assert len(rows) == 1 and "kernel" not in json.loads(rows["params"].iloc[0])
    assert preset_overrides({"kernel": "torch"}, preset_params("lookm")) == []


def test_samples_of_other_artifact_files_are_never_mixed_into_a_job_folder(tiny_model_dir, haystack_dir, tmp_path):
    """config.yaml names a head ranking by its path only; a recalibrated file behind the same path
    would mix two rankings in one folder. artifacts.json records what the samples read."""
    ranking = tmp_path / "srh.json"
    ranking.write_text(json.dumps({"0": [0, 1, 2, 3], "1": [3, 2, 1, 0]}))
    args = [*tiny_model_args(tiny_model_dir), "task.context_lengths=[300]", "task.depth_percents=[50]",
            f"task.haystack_dir={haystack_dir}", "method=compresskv", "method.layer_allocation=uniform",
            "method.num_heads=2", "method.window_size=4", f"method.head_idx_path={ranking}", "budget=64",
            "task.max_new_tokens=2", "quiet=true", f"output_root={tmp_path / 'out'}", "run_name=job"]
    assert run_cli(args).returncode == 0
    job = tmp_path / "out" / "job"
    recorded = json.loads((job / "artifacts.json").read_text())
    assert list(recorded) == [str(ranking.resolve())] and len(recorded[str(ranking.resolve())]) == 64
    assert json.loads((job / "env.json").read_text())["artifacts"] == recorded
    before = (job / "predictions.jsonl").read_text()
    ranking.write_text(json.dumps({"0": [3, 2, 1, 0], "1": [0, 1, 2, 3]}))  # recalibrated in place
    more = [a for a in args if not a.startswith("task.depth_percents")] + ["task.depth_percents=[0,50]"]
    out = run_cli(more)
    err = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and err.startswith(f"error: method artifacts: {ranking.resolve()} changed since the "
                                                  "samples in job folder job were computed (sha256 "), out.stderr
    assert (job / "predictions.jsonl").read_text() == before
    ranking.write_text(json.dumps({"0": [0, 1, 2, 3], "1": [3, 2, 1, 0]}))  # the file the samples read: resumes
    assert run_cli(more).returncode == 0
    assert len((job / "predictions.jsonl").read_text().splitlines()) == 2


def test_a_grid_skipped_entirely_leaves_a_job_with_samples_as_it_was(tiny_model_dir, tmp_path):
    """A rerun of a folder that holds samples with a grid the task skips entirely: exit 2, and
    neither its config snapshot nor anything else is left behind."""
    base = [*tiny_model_args(tiny_model_dir), "task.depth_percents=[50]", "method=streamingllm", "budget=0.5",
            "quiet=true", f"output_root={tmp_path}", "run_name=job"]
    good = run_cli([*base, "task.context_lengths=[320]"])
    assert good.returncode == 0, good.stderr[-2000:]
    job = tmp_path / "job"
    def files():  # the lock file holds the pid of the last run
        return {p.name: p.read_bytes() for p in job.iterdir() if p.is_file() and not p.name.startswith(".lock")}

    before = files()
    out = run_cli([*base, "task.context_lengths=[5,6]"])
    assert out.returncode == 2 and "every sample was skipped" in out.stderr, out.stderr[-2000:]
    assert files() == before
