"""Job isolation: the folder's identity (a different setting is a different folder, the sample
selection and run control are not) and per-sample isolation (a failing sample is stored with its
error, the job goes on and exits 1, a rerun retries it)."""

from __future__ import annotations

import json
import re
import math
import shutil

import pytest
import torch

from eval.base import Sample, Task
from kvbench.engine.generate import Engine
from kvbench.job.run import run_jobs, run_sample, run_samples, summarize
from kvbench.job.store import JobStore
from methods.full import FullCache
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import check, tiny_model_args


class CharTokenizer:
    """One token per character (ids modulo the tiny vocabulary); fails on NUL."""

    chat_template = None
    unk_token_id = None
    eos_token_id = None

    def __call__(self, text, **kwargs):
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


# ---- per-sample isolation (in process) -------------------------------------------------------

def test_a_good_sample_is_scored(loaded):
    rec = run_sample(engine_for(loaded), loaded, ConstTask(), sample("ok", prompt="héllo wörld"))
    assert rec["error"] is None and rec["score"] == 1.0 and rec["generated_tokens"] == 3
    # sha256 of the UTF-8 prompt text (printf 'héllo wörld' | sha256sum)
    assert rec["prompt_sha256"] == "a1003f7d04a4115711d0b48a2eaf1359ce565d2d2a6fd65098dfcffadeeef59f"


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_logits_from_the_model_are_never_scored(poison):
    model = tiny_model("llama", layers=2, seed=3)
    with torch.no_grad():
        model.model.norm.weight[5] = poison  # every hidden state, hence every logit, turns non-finite
    lm = loaded_for(model)
    lm.tokenizer = CharTokenizer()
    for method, budget in ((FullCache(layout=lm.layout), 1.0), (SnapKV(SnapKVConfig(window_size=4, kernel_size=3), lm.layout), 0.5)):
        rec = run_sample(Engine(lm, method, budget), lm, ConstTask(), sample("poisoned"))
        assert rec["error"]["type"] == "NonFiniteLogitsError" and rec["score"] is None


@pytest.mark.parametrize("case,error_type", [("nan-score", "FloatingPointError"), ("empty", "ValueError"),
                                             ("nul", "UnicodeError")])
def test_a_failing_sample_is_an_error_record_not_a_crash(loaded, case, error_type, caplog):
    task = ConstTask(math.nan if case == "nan-score" else 1.0)
    prompt = {"nan-score": "some text", "empty": "", "nul": "bad \x00 text"}[case]
    rec = run_sample(engine_for(loaded), loaded, task, sample(case, prompt=prompt))
    assert rec["error"]["type"] == error_type and rec["score"] is None and rec["prediction"] is None
    # the traceback is stored, its last frame is in the record and the log line
    err = rec["error"]
    assert err["traceback"].startswith("Traceback") and err["traceback"].rstrip().splitlines()[-1].startswith(error_type)
    place, function = err["where"].rsplit(" in ", 1)
    if case != "nul":
        assert (place.rsplit("/", 1)[-1].split(":")[0], function) == {
            "nan-score": ("runner.py", "scored"), "empty": ("generate.py", "prefill")}[case]
    assert f"(at {err['where']})" in caplog.text


def test_loop_goes_on_after_failures_and_summary_counts_them(loaded, tmp_path, monkeypatch):
    generate, calls = Engine.decode, []

    def flaky(self, *args, **kwargs):
        calls.append(1)
        if len(calls) in (2, 4):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode", flaky)
    store = JobStore(tmp_path)
    samples = [sample(f"s/{i}") for i in range(5)]
    run_samples([engine_for(loaded)], loaded, ConstTask(), samples, [store], quiet=True)
    records = store.records()
    assert {r["id"]: (r["error"] or {}).get("type") for r in records} == {
        "s/0": None, "s/1": "OutOfMemoryError", "s/2": None, "s/3": "OutOfMemoryError", "s/4": None}
    cfg = {"task": {"name": "const"}, "model": {"name": "tiny"}, "method": {"name": "full"}, "budget": 1.0,
           "shard": {"index": 0, "count": 1}}
    summary = summarize(cfg, ConstTask(), records, [s.id for s in samples], "job")
    assert (summary["n_samples"], summary["n_failed"], summary["complete"]) == (3, 2, False)
    assert [f["id"] for f in summary["failed"]] == ["s/1", "s/3"]
    assert summary["datasets"]["d"] == {"score": 100.0, "n": 3}


# ---- the job folder's identity (config.check only, no model) ---------------------------------

@pytest.fixture
def base(tiny_model_dir, haystack_dir, tmp_path):
    return [*tiny_model_args(tiny_model_dir), f"task.haystack_dir={haystack_dir}", f"output_root={tmp_path / 'out'}",
            "task.context_lengths=[300]", "task.depth_percents=[0,50]", "task.max_new_tokens=3", "quiet=true",
            "threads=1"]


def relpath(args: list[str]) -> str:
    return check(args).relpath


def test_a_setting_that_changes_a_result_changes_the_folder(base, tiny_model_dir, haystack_dir, tmp_path):
    hay = shutil.copytree(haystack_dir, tmp_path / "hay2")
    before = relpath(base + [f"task.haystack_dir={hay}"])
    (hay / "c.txt").write_text("Another essay, about lighthouses. " * 20)  # same folder, other contents
    assert relpath(base + [f"task.haystack_dir={hay}"]) != before
    model_copy = shutil.copytree(tiny_model_dir, tmp_path / "model_copy")
    changed = {
        "method.alpha": ["method.alpha=0.25"],
        "seed": ["seed=1"],
        "budget": ["budget=0.5"],
        "haystack contents": [f"task.haystack_dir={hay}"],
        "model.source": [f"model.source={model_copy}"],
        "task.max_new_tokens": ["task.max_new_tokens=5"],
    }
    reference = relpath(base)
    assert reference.startswith("niah/tiny/selkv/b0.25-")
    paths = {what: relpath(base + extra) for what, extra in changed.items()}
    assert reference not in paths.values() and len(set(paths.values())) == len(paths)
    assert paths["budget"].startswith("niah/tiny/selkv/b0.5-")


def test_the_sample_selection_and_run_control_keep_the_folder(base, tmp_path):
    reference = relpath(base)
    for extra in (["task.context_lengths=[300,400]"], ["task.depth_percents=[50]"], ["max_samples=1"], ["threads=2"],
                  ["quiet=false"], ["lock_wait_s=5"], ["shard.count=2", "shard.index=1"]):
        assert relpath(base + extra) == reference, extra
    assert check(base + [f"output_root={tmp_path / 'other'}"]).relpath == reference


def test_the_full_cache_is_one_folder_for_every_budget(base):
    full = relpath(base + ["method=full", "budget=0.25"])
    assert full == relpath(base + ["method=full", "budget=128"])
    assert full == relpath(base + ["method=full", "budget=0.25", "decode.interval=16"])  # nothing to cut while decoding
    assert full.startswith("niah/tiny/full/") and re.fullmatch(r"[0-9a-f]{8}", full.split("/")[-1])  # no b<budget>


def test_an_integral_float_token_budget_is_that_token_budget(base):
    job = check(base + ["budget=64.0"])
    assert job.cfg["budget"] == 64 and type(job.cfg["budget"]) is int and job.relpath == relpath(base + ["budget=64"])
    assert check(base + ["budget=1.0"]).cfg["budget"] == 1.0  # the ratio 1.0 stays a ratio


def test_run_tag_and_run_name_name_the_folder_before_the_hash(base):
    digest = relpath(base).rsplit("-", 1)[1]
    assert relpath(base + ["run_tag=try2"]) == f"niah/tiny/selkv/b0.25-try2-{digest}"
    assert relpath(base + ["run_name=mine/first"]) == f"mine/first-{digest}"


def test_identity_json_holds_the_resolved_inputs(base, haystack_dir):
    job = check(base)
    assert job.identity["inputs"]["haystack"] == "dir"  # the essays' text counts (its hash), not their folder
    assert len(job.identity["inputs"]["haystack_sha256"]) == 64
    assert job.identity["budget"] == 0.25 and job.identity["seed"] == 42


# ---- runs on the tiny model (in process) ------------------------------------------------------

def run(args: list[str]) -> tuple[int, JobStore]:
    job = check(args)
    (code,) = run_jobs([job])
    return code, JobStore(job.cfg["output_root"] + "/" + job.relpath)


def test_a_wider_selection_resumes_and_runs_only_the_new_samples(base, caplog):
    code, store = run(base + ["max_samples=1"])
    assert code == 0 and [r["id"] for r in store.records()] == ["niah/300/0"]
    code, again = run(base + ["task.context_lengths=[300,400]"])
    assert code == 0 and again.path == store.path
    assert [r["id"] for r in store.records()] == ["niah/300/0", "niah/300/50", "niah/400/0", "niah/400/50"]
    summary = json.loads((store.path / "summary.json").read_text())
    assert (summary["n_samples"], summary["complete"]) == (4, True)
    assert json.loads((store.path / "identity.json").read_text()) == check(base).identity
    with caplog.at_level("WARNING", logger="kvbench"):  # the smaller selection again: scored, nothing lost, said so
        assert run(base + ["max_samples=1"])[0] == 0
    summary = json.loads((store.path / "summary.json").read_text())
    assert (summary["n_samples"], len(store.records())) == (1, 4)
    assert any("summary.json now scores 1 samples" in r.getMessage() for r in caplog.records)


def test_a_failing_sample_is_stored_exit_1_and_the_rerun_retries_it(base, monkeypatch):
    generate, calls = Engine.decode, []

    def fails_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom (test)")
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode", fails_second)
    code, store = run(base)
    assert code == 1
    assert [(r["id"], (r["error"] or {}).get("type")) for r in store.records()] == [
        ("niah/300/0", None), ("niah/300/50", "RuntimeError")]
    summary = json.loads((store.path / "summary.json").read_text())
    assert (summary["n_failed"], summary["complete"]) == (1, False)
    monkeypatch.setattr(Engine, "decode", generate)
    code, store = run(base)
    assert code == 0 and [r["id"] for r in store.records()] == ["niah/300/0", "niah/300/50", "niah/300/50"]
    assert store.done_ids() == {"niah/300/0", "niah/300/50"}


def test_a_finished_job_frees_its_model_before_the_next_job_loads_one(base, monkeypatch):
    """Issue #32.3: a local sweep runs its jobs in one process; nothing of a finished job may keep
    its model alive (two 8B models would not fit on one GPU)."""
    import gc
    import weakref

    import kvbench.engine.models

    models, real = [], kvbench.engine.models.load_model

    def load(cfg, device, *resolved):
        loaded = real(cfg, device)
        models.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(kvbench.engine.models, "load_model", load)
    assert run(base + ["max_samples=1"])[0] == 0
    gc.collect()
    assert len(models) == 1 and models[0]() is None


def test_a_finished_job_whose_records_were_removed_computes_them_again(base):
    code, store = run(base)
    assert code == 0 and len(store.done_ids()) == 2
    first = store.predictions.read_text().splitlines()[0]
    store.predictions.write_text(first + "\n")  # a record lost after the summary was written
    code, again = run(base)
    assert code == 0 and again.done_ids() == {"niah/300/0", "niah/300/50"}
