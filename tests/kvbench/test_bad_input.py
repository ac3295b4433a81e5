"""Bad input through the real command line: one line ``error: ...`` naming the key, exit code 2,
before any model loads (offline; no case reads model weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.kvbench.cli_util import run_cli, run_cli_forked

# (id, command-line arguments, the key the error line names); {tmp} is the module's temporary folder
CASES = [
    ("unknown-model", ["model=mistral99"], "model"),
    ("unknown-method", ["method=snapkvv"], "method"),
    ("unknown-experiment", ["experiment=table99"], "experiment"),
    ("unknown-launcher", ["hydra/launcher=nope"], "launcher"),
    ("unknown-top-key", ["budgett=0.1"], "budgett"),
    ("preset-sweep-without-m", ["+experiment=compresskv_table1_smoke"], "experiment"),
    ("unknown-method-key", ["method=snapkv", "method.window=8"], "method.window"),
    ("added-existing-key", ["+budget=3"], "budget"),
    ("unparsable-override", ["budget=[1"], "budget"),
    ("sweep-without-m", ["budget=0.1,0.2"], "budget"),
    ("budget-zero", ["budget=0"], "budget"),
    ("ratio-over-one", ["budget=1.5"], "budget"),
    ("budget-text", ["budget=abc"], "budget"),
    ("budget-bool", ["budget=true"], "budget=True: must be"),
    ("budget-one-token", ["method=snapkv", "budget=1"], "budget"),
    ("budget-below-window", ["method=snapkv", "budget=16"], "budget"),
    ("sweep-first-job-bad", ["-m", "budget=-1,0.5"], "budget"),
    ("window-zero", ["method=snapkv", "method.window_size=0"], "method.window_size"),
    ("window-text", ["method=snapkv", "method.window_size=wide"], "method.window_size"),
    ("pooling", ["method=snapkv", "method.pooling=median"], "method.pooling"),
    ("label-empty", ["method.label="], "method.label"),
    ("press-kwargs-key-without-plus", ["method=kvpress", "method.press_kwargs.window_size=8"],
     "+method.press_kwargs.window_size="),
    ("bad-artifact-file", ["method=compresskv", "budget=64", "method.layer_score_path={tmp}/afile"],
     "method.layer_score_path"),
    ("max-samples-zero", ["max_samples=0"], "max_samples"),
    ("shard-out-of-range", ["shard.index=2", "shard.count=2"], "shard.index"),
    ("device", ["device=gpu"], "device"),
    ("seed-over-64-bits", ["seed=18446744073709551616"], "seed"),
    ("threads-zero", ["threads=0"], "threads"),
    ("threads-10000", ["threads=10000"], "threads"),
    ("compile", ["compile=maybe"], "compile"),
    ("batch-size-zero", ["batch_size=0"], "batch_size=0"),
    ("batch-size-text", ["batch_size=foo"], "batch_size=foo"),
    ("batch-size-auto-on-cpu", ["batch_size=auto", "device=cpu"], "batch_size=auto"),  # without cache.max_bytes
    ("cache-max-bytes-negative", ["cache.max_bytes=-1"], "cache.max_bytes=-1"),
    ("cache-max-bytes-text", ["cache.max_bytes=lots"], "cache.max_bytes"),
    ("decode-with-a-ratio-budget", ["method=snapkv", "decode.interval=16"], "decode.interval"),
    ("decode-compiled", ["method=snapkv", "budget=64", "decode.interval=16", "compile=true"], "decode.interval"),
    ("quest-compiled", ["method=quest", "budget=64", "compile=true"], "compile=true: method quest"),
    ("quest-page", ["method=quest", "method.page_size=0"], "method.page_size"),
    ("quest-keep", ["method=quest", "method.keep=8"], "method.keep"),
    ("ashape-budget", ["method=trishape", "budget=64"], "budget"),
    ("decode-only-without-interval", ["decode.prefill=false"], "decode.prefill"),
    ("decode-method-that-cannot", ["method=headkv", "budget=64", "decode.interval=16"], "decode.interval"),
    ("decode-budget-below-press-window", ["method=kvpress", "method.press=SnapKVPress", "decode.interval=16", "budget=48"],
     "budget=48"),  # SnapKVPress's window is 64
    ("decode-time-method-without-decode", ["method=rkv"], "decode.interval=0"),
    ("sampling-n-greedy", ["sampling.n=4"], "sampling.n"),
    ("sampling-n-zero", ["sampling.n=0"], "sampling.n=0"),
    ("sampling-top-p", ["sampling.top_p=0"], "sampling.top_p=0"),
    ("decode-schedule-misspelled", ["decode.schedule=stepz"], "decode.schedule=stepz"),
    ("cache-group-size-not-dividing-the-residual", ["cache.bits=4", "cache.group_size=48"], "cache.group_size=48"),
    ("cache-residual-not-a-multiple", ["cache.bits=4", "cache.residual=100"], "cache.residual=100"),
    ("run-name-escapes", ["run_name=../../elsewhere"], "run_name"),
    ("model-deleted", ["~model"], "model"),
    ("niah-length-scalar", ["task.context_lengths=512"], "task.context_lengths"),
    ("niah-lengths-over-budget", ["task.max_length=100"], "task.context_lengths"),
    ("niah-depth-over-100", ["task.depth_percents=[50,150]"], "task.depth_percents"),
    ("niah-max-new-tokens", ["task.max_new_tokens=0"], "task.max_new_tokens"),
    ("niah-needle-without-answer", ["task.needle=The secret code is 4711."], "task.answer"),
    ("unknown-task-key", ["+task.foo=1"], "task.foo"),
    ("unknown-top-key-added", ["+budgt=0.1"], "budgt"),
    ("ruler-outputs-a-string", ["task=ruler", "task.data_dir={tmp}/ruler_str", "task.subtasks=[vt]", "task.context_lengths=[4096]"],
     "vt_4096.jsonl line 2"),
    ("ruler-empty-file", ["task=ruler", "task.data_dir={tmp}/ruler_empty", "task.subtasks=[vt]", "task.context_lengths=[4096]"],
     "vt_4096.jsonl holds no samples"),
    ("unknown-task-key-without-plus", ["task.foo=1"], "task.foo"),
    ("task-compress", ["task.compress=both"], "task.compress"),
    ("longbench-n-samples-text", ["task=longbench", "task.n_samples=many"], "task.n_samples"),
    ("ruler-max-length", ["task=ruler", "task.max_length=100"], "task.max_length"),
    ("haystack-missing", ["task.haystack_dir={tmp}/nope"], "task.haystack_dir"),
    ("haystack-empty", ["task.haystack_dir={tmp}/empty"], "task.haystack_dir"),
    ("longbench-empty-data-dir", ["task=longbench", "task.data_dir={tmp}/empty"], "task.data_dir"),
    ("longbench-data-file-is-a-folder", ["task=longbench", "task.datasets=[multi_news]", "task.data_dir={tmp}/folders"],
     "multi_news.jsonl is not a file"),
    ("infinitebench-data-file-is-a-folder", ["task=infinitebench", "task.datasets=[kv_retrieval]",
                                             "task.data_dir={tmp}/folders"], "kv_retrieval.jsonl is not a file"),
    ("not-gguf", ["model.source={tmp}/fake.gguf"], "model.source"),
    ("model-file-named-nothing", ["model.source={tmp}/weights"], "model.source"),
    ("gguf-file-not-in-folder", ["model.source={tmp}/empty"], "model.gguf_file"),
    ("missing-model-path", ["model.source={tmp}/no_model"], "model.source"),
    ("hub-id-offline", ["model.source=nobody/no-such-model", "model.gguf_file=null"], "model.source"),
    ("dtype", ["model.dtype.cpu=float64"], "model.dtype.cpu"),
    ("group-null", ["method=null"], "method=null"),
    ("group-null-in-sweep", ["-m", "task=null", "budget=0.1,0.5"], "task=null"),
    ("control-character", ["max_samples=1", "budget=0.5\r"], "budget=0.5\\r"),
    ("control-character-in-key", ["bud\x1bget=0.5"], "bud\\x1bget"),
    ("override-as-option", ["--budget", "0.25"], "--budget 0.25: no such option; a config key is set by an override, "
                                                 "key=value without dashes: budget=0.25"),
    ("override-as-option-with-equals", ["--method=snapkv"], ": method=snapkv"),
    ("override-as-option-after-overrides", ["max_samples=1", "--task", "ruler"], ": task=ruler"),
    ("multirun-and-cfg", ["-m", "--cfg", "job"], "Only one of --run, --multirun, --cfg"),
    ("ruler-generate-qa-offline", ["task=ruler", "task.generate=true", "task.context_lengths=[1500]", "max_samples=3"],
     "task.qa_files.squad: not set"),
    ("ruler-generate-qa-file-missing", ["task=ruler", "task.generate=true", "task.subtasks=[qa_2]",
                                        "task.qa_files.hotpotqa={tmp}/nope.json"], "task.qa_files.hotpotqa="),
    ("ruler-generate-too-short", ["task=ruler", "task.generate=true", "task.context_lengths=[200,4096]",
                                  "task.subtasks=[fwe]"], "task.context_lengths=200: RULER's fwe needs at least"),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_input")
    (root / "empty").mkdir()
    (root / "empty" / "notes.md").write_text("neither a .txt nor a .jsonl file")
    for name in ("multi_news.jsonl", "kv_retrieval.jsonl"):  # folders where data files are expected
        (root / "folders" / name).mkdir(parents=True)
    (root / "fake.gguf").write_bytes(b"PK\x03\x04 this is a zip file, not GGUF")
    (root / "afile").write_text("a file where a folder or JSON is expected")
    for name, text in (("ruler_str", '{"input": "x", "outputs": ["y"]}\n{"input": "x", "outputs": "notalist"}\n'),
                       ("ruler_empty", "")):
        (root / name).mkdir()
        (root / name / "vt_4096.jsonl").write_text(text)
    (root / "weights").write_bytes(b"\x10\0\0\0\0\0\0\0{\"a\": {}}      ")  # a safetensors header, no extension
    return root


@pytest.fixture(scope="module")
def refused(tmp) -> dict[str, tuple[int | None, str]]:
    """Every case's ``(exit code, stderr)``; a job that starts instead of being refused is stopped after 60 s."""
    cases = [[a.format(tmp=tmp) for a in args] + [f"output_root={tmp / 'out' / case_id}"] for case_id, args, _ in CASES]
    (tmp / "stderr").mkdir()
    return dict(zip([c[0] for c in CASES], run_cli_forked(cases, tmp / "stderr")))


@pytest.mark.parametrize("case_id,args,key", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_key_and_exit_2(tmp, refused, case_id, args, key):
    code, stderr = refused[case_id]
    assert code is not None, "not refused: the job started"
    lines = stderr.splitlines()
    assert (code, len(lines)) == (2, 1), stderr[-3000:]
    assert lines[0].startswith("error: ") and key in lines[0]
    out_root = tmp / "out" / case_id
    assert not any(out_root.rglob("predictions.jsonl")) and not any(out_root.rglob("env.json"))


#: cases whose line must begin with the key (a check names exactly its own key, never a neighbour's)
OWN_KEY = ("sampling-n-zero", "sampling-top-p", "decode-schedule-misspelled", "cache-group-size-not-dividing-the-residual",
           "cache-residual-not-a-multiple", "hub-id-offline")


@pytest.mark.parametrize("case_id", OWN_KEY)
def test_the_line_begins_with_the_key_it_blames(refused, case_id):
    code, stderr = refused[case_id]
    key = dict((c[0], c[2]) for c in CASES)[case_id]
    assert code == 2 and stderr.startswith(f"error: {key}"), stderr[-2000:]
    others = {"sampling-n-zero": ("top_p", "top_k"), "decode-schedule-misspelled": ("decode.interval",)}
    assert not any(k in stderr for k in others.get(case_id, ()))
    if case_id == "hub-id-offline":  # not found locally, the Hub offline: no advice to download a misspelled id
        assert "HF_HUB_OFFLINE=1" in stderr and "download" not in stderr


def test_a_model_that_fails_to_load_leaves_no_job_folder(tmp, tiny_model_dir):
    from tests.kvbench.cli_util import tiny_model_args

    broken = tmp / "no_weights"
    broken.mkdir()
    for f in tiny_model_dir.iterdir():  # config and tokenizer pass the check; the weights are missing
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    out = run_cli([*tiny_model_args(broken), "task.context_lengths=[256]", f"output_root={tmp}/noweights"])
    errors = [ln for ln in out.stderr.splitlines() if " INFO " not in ln]  # the log's "loading model ..." before it
    assert out.returncode == 2 and len(errors) == 1 and "model.source" in errors[0], out.stderr[-2000:]
    assert not (tmp / "noweights").exists() or not any((tmp / "noweights").iterdir())


def test_cuda_device_on_a_machine_without_cuda(tmp):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = run_cli(["device=cuda", f"output_root={tmp}/out"])
    assert out.returncode == 2 and out.stderr.startswith("error: device=cuda") and len(out.stderr.splitlines()) == 1


def test_output_root_at_or_under_a_file_is_refused_before_the_model_loads(tmp):
    for root in (f"{tmp}/afile/results", f"{tmp}/afile"):
        out = run_cli([f"output_root={root}"])
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr[-2000:]
        assert out.stderr.startswith(f"error: output_root='{root}': ")


def test_sbatch_refusing_a_slurm_sweep_is_its_one_line_and_exit_1(tmp):
    fake = tmp / "bin"
    fake.mkdir(exist_ok=True)
    (fake / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Unable to contact slurm controller' >&2\nexit 1\n")
    (fake / "sbatch").chmod(0o755)
    out = run_cli(["-m", "budget=0.1,0.5", "hydra/launcher=slurm", f"output_root={tmp}/slurm"],
                  PATH=f"{fake}:{os.environ['PATH']}")
    assert (out.returncode, out.stderr.splitlines()) == (1, ["sbatch: error: Unable to contact slurm controller"])


def test_parallel_launcher_without_its_plugin_says_what_to_install(tmp):
    from tests.kvbench.cli_util import ROOT, cli_env

    hide = ("import runpy, sys; sys.modules['hydra_plugins.hydra_joblib_launcher'] = None; "  # not installed
            "sys.argv = ['run.py', *sys.argv[1:]]; runpy.run_path('run.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", hide, "-m", "hydra/launcher=parallel", "budget=0.2,0.5",
                          f"output_root={tmp}/parallel"], cwd=ROOT, env=cli_env(), capture_output=True, text=True,
                         timeout=120)
    lines = out.stderr.splitlines()
    assert (out.returncode, len(lines)) == (2, 1), out.stderr[-2000:]
    assert "hydra/launcher/parallel" in lines[0] and 'pip install -e ".[sweeps]"' in lines[0]


def test_help_and_cfg_still_work():
    out = run_cli(["--help"])
    assert out.returncode == 0 and "budget" in out.stdout
    out = run_cli(["--cfg", "job", "budget=0.5", "method=streamingllm"])
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["budget"] == 0.5 and cfg["method"]["name"] == "streamingllm"
    out = run_cli(["--cfg", "job", "budgett=0.5"])  # --cfg composes, so a typo is one line too
    assert out.returncode == 2 and out.stderr.startswith("error: ") and "budgett" in out.stderr


def test_an_option_between_overrides_works():
    out = run_cli(["budget=0.5", "--cfg", "job", "method=streamingllm"])
    assert out.returncode == 0, out.stderr
