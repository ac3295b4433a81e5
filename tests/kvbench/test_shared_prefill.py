"""Sweeps that prefill once (issue #33.3): every variant of a shared prefill generates exactly what it
generates alone, in the engine and through ``python run.py -m ... sweep.share_prefill=true``."""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generate import Engine, prefill
from methods import build_method
from methods.base import PromptFormat
from tests.conftest import loaded_for, tiny_model

VARIANTS = [("snapkv", {}, 0.5), ("selkv", {}, 0.3), ("pyramidkv", {}, 40), ("lookm", {}, 0.5),
            ("lookm", {"fused_score": "off"}, 0.25), ("streamingllm", {}, 0.5),
            ("kvzip", {"chunk_size": 32}, 0.3),  # reconstruction forwards on its own copy of the full cache
            ("full", {}, 1.0), ("snapkv", {}, 1.0),  # budget 1.0: a variant that keeps every layer whole
            ("ashape", {"n_init": 4}, 20), ("ashape", {"n_init": 4}, 40),  # sparse prefills: one each
            ("quest", {"dense_layers": 0, "page_size": 8}, 24)]


def engines(loaded):
    out = []
    for name, extra, budget in VARIANTS:
        cfg = {"name": name, **({"window_size": 4} if name in ("snapkv", "pyramidkv") else {}), **extra}
        out.append(Engine(loaded, build_method(cfg, loaded.layout), budget))
        out[-1].prompt_format = PromptFormat(lambda text: [ord(c) % 128 for c in text], (1, 2), (3,))
    return out


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding-window layers are copied, not compressed
def test_a_shared_prefill_generates_what_each_variant_generates_alone(family):
    loaded = loaded_for(tiny_model(family, layers=3))
    ids = torch.randint(0, 128, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    alone, shared_engines = engines(loaded), engines(loaded)
    for e in alone + shared_engines:
        e.record_logits = True
    parts = prefill(shared_engines, ids, 6)
    for e, p, lone in zip(shared_engines, parts, alone):
        ref, res = lone.generate(ids, 6, stop_ids=[]), e.generate(ids, 6, stop_ids=[], prefilled=p)
        assert res.tokens == ref.tokens and len(res.tokens) == 6
        assert all(torch.equal(a, b) for a, b in zip(e.last_logits, lone.last_logits))  # bit for bit
        assert (res.kept_tokens, res.stored_tokens, res.compressed) == (ref.kept_tokens, ref.stored_tokens, ref.compressed)
        assert (res.cache_bytes_before, res.cache_bytes_after, res.method_stats, res.read_tokens, res.read_bytes) == (
            ref.cache_bytes_before, ref.cache_bytes_after, ref.method_stats, ref.read_tokens, ref.read_bytes)
    assert [p.state.compressing for p in parts] == [True] * 7 + [False] * 5


# ---- through the command line: python run.py -m ... sweep.share_prefill=true -------------------

SWEEP = ["method=selkv,snapkv,lookm", "budget=0.5,64"]
TIMINGS = ("prefill_s", "compress_s", "reconstruct_s", "decode_s", "decode_tok_s", "compile_s", "peak_prefill_bytes", "peak_decode_bytes")


def folders(args):
    from tests.kvbench.cli_util import job_dir

    return [job_dir([*args, f"method={m}", f"budget={b}"]) for m in ("selkv", "snapkv", "lookm") for b in ("0.5", "64")]


def records(folder):
    from tests.kvbench.cli_util import read_lines

    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in read_lines(folder / "predictions.jsonl")]


def test_a_shared_sweep_stores_what_separate_jobs_store_resumes_and_respects_locks(tiny_model_dir, haystack_dir, tmp_path):
    from kvbench.job.run import run_jobs
    from kvbench.job.store import JobStore
    from tests.kvbench.cli_util import check, read_lines, run_cli, tiny_model_args

    common = [*tiny_model_args(tiny_model_dir), f"task.haystack_dir={haystack_dir}", "task.context_lengths=[300]",
              "task.depth_percents=[0,50]", "task.max_new_tokens=4", "quiet=true", "threads=1"]
    alone, shared = [*common, f"output_root={tmp_path / 'alone'}"], [*common, f"output_root={tmp_path / 'shared'}"]
    out = run_cli(["-m", *SWEEP, *alone])
    assert out.returncode == 0, out.stderr[-3000:]
    first, locked = folders(shared)[0], folders(shared)[3]
    assert run_jobs([check([*shared, "method=selkv", "budget=0.5", "max_samples=1"])]) == [0]  # one stored before
    with JobStore(locked).locked():  # another process runs snapkv, budget 64: the sweep leaves it out, exit 3
        out = run_cli(["-m", *SWEEP, *shared, "sweep.share_prefill=true"])
    assert out.returncode == 3 and "error: job folder" in out.stderr and str(locked) in out.stderr, out.stderr[-3000:]
    assert not (locked / "predictions.jsonl").exists()
    assert [r["id"] for r in records(first)] == ["niah/300/0", "niah/300/50"]  # resumed: the stored id is not rerun
    out = run_cli(["-m", *SWEEP, *shared, "sweep.share_prefill=true"])  # the rest: only the locked job runs
    assert out.returncode == 0, out.stderr[-3000:]
    for a, s in zip(folders(alone), folders(shared)):
        assert s.relative_to(tmp_path / "shared") == a.relative_to(tmp_path / "alone")
        assert records(s) == records(a) and len(records(a)) == 2  # prediction, score, kept and stored counts...
        for name in ("identity.json",) + (("config.yaml",) if s != first else ()):  # first's: max_samples=1
            assert (s / name).read_text() == (a / name).read_text().replace(str(tmp_path / "alone"), str(tmp_path / "shared"))
    prefill_s = [next(r["prefill_s"] for r in read_lines(f / "predictions.jsonl") if r["id"] == "niah/300/50")
                 for f in folders(shared)]  # one prefill per sample: selkv and snapkv alike, LOOK-M's (fused) apart
    assert prefill_s[0] == prefill_s[1] == prefill_s[2] != prefill_s[4] == prefill_s[5]
    assert len(list((tmp_path / "shared").rglob("env*.json"))) == 6 + 1  # the locked job ran in the second sweep only


def test_a_shared_sweep_refuses_other_launchers(tmp_path):
    from tests.kvbench.cli_util import run_cli

    out = run_cli(["-m", "hydra/launcher=parallel", "budget=0.25,0.5", "sweep.share_prefill=true", f"output_root={tmp_path}"])
    assert out.returncode == 2 and out.stderr.startswith("error: sweep.share_prefill") and len(out.stderr.splitlines()) == 1


def test_the_full_cache_twin_keeps_the_first_budget_shared_or_alone(tiny_model_dir, haystack_dir, tmp_path):
    import yaml

    from kvbench.job.run import run_jobs
    from tests.kvbench.cli_util import check, job_dir, tiny_model_args

    common = [*tiny_model_args(tiny_model_dir), f"task.haystack_dir={haystack_dir}", "task.context_lengths=[300]",
              "task.depth_percents=[50]", "task.max_new_tokens=2", "quiet=true", "threads=1", "method=full"]
    alone, shared = [*common, f"output_root={tmp_path / 'alone'}"], [*common, f"output_root={tmp_path / 'shared'}"]
    assert [run_jobs([check([*alone, f"budget={b}"])])[0] for b in (0.1, 0.5)] == [0, 0]  # the second finds it finished
    assert run_jobs([check([*shared, f"budget={b}"]) for b in (0.1, 0.5)]) == [0, 0]  # one job for both
    configs = [yaml.safe_load((job_dir([*args, "budget=0.5"]) / "config.yaml").read_text()) for args in (alone, shared)]
    assert [c["budget"] for c in configs] == [0.1, 0.1]
