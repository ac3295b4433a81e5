"""Bad input through the real command line: one line ``error: ...`` on stderr, exit code 2.

Every case runs ``python run.py ...`` in a subprocess (offline) and asserts the exact stderr
and the exit code. Validation happens before any model loads, so no case reads weights (the
GGUF check reads 4 bytes); cases that name a method import it (torch), the others do not.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.kvbench.cli_util import ROOT, run_cli
from kvbench.values import did_you_mean

CONF = ROOT / "conf"


def options(group: str) -> str:
    """The accepted values of a config group as the error lists them (file names, sorted)."""
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    return ", ".join(names) if names else f"(none: conf/{group}/ holds no .yaml file)"


def top_keys(experiment: str | None = None) -> str:
    """config.yaml's keys and the three nodes; with ``experiment``, also the top-level helper keys
    that preset defines (accepted only when the preset is selected)."""
    keys = {"model", "method", "task"}
    for path in [CONF / "config.yaml", *([CONF / "experiment" / f"{experiment}.yaml"] if experiment else [])]:
        keys |= set(yaml.safe_load(path.read_text())) - {"defaults", "hydra"}
    return ", ".join(sorted(keys))


SNAPKV_KEYS = "gqa_aggregation, kernel_size, label, pooling, window_size"
BUDGET_RULE = "a retention ratio must be in (0, 1] and a token budget must be an integer >= 2"

# (id, command-line arguments, expected stderr line); {tmp} is the test's temporary folder.
# Cases about SnapKV's fields name method=snapkv (the default method is selkv).
CASES = [
    ("unknown-model", ["model=mistral99"],
     f"model=mistral99: unknown model{did_you_mean('mistral99', options('model').split(', '))}; "
     f"accepted values are {options('model')}"),
    ("unknown-method", ["method=snapkvv"],
     f"method=snapkvv: unknown method (did you mean snapkv?); accepted values are {options('method')}"),
    ("method-case", ["method=SnapKV"],
     f"method=SnapKV: unknown method (did you mean snapkv?); accepted values are {options('method')}"),
    ("unknown-task", ["task=longbenchh"],
     f"task=longbenchh: unknown task (did you mean longbench?); accepted values are {options('task')}"),
    ("unknown-experiment", ["experiment=table99"],  # run.py accepts experiment=NAME as +experiment=NAME
     f"+experiment=table99: unknown experiment; accepted values are {options('experiment')}"),
    ("unknown-experiment-plus", ["+experiment=table99"],
     f"+experiment=table99: unknown experiment; accepted values are {options('experiment')}"),
    ("unknown-launcher", ["hydra/launcher=nope"],
     "hydra/launcher=nope: unknown launcher; accepted values are "
     + ", ".join(sorted({"basic", "joblib", "submitit_local", "submitit_slurm"}  # the plugins' (joblib: test extra)
                        | {p.stem for p in (CONF / "hydra" / "launcher").glob("*.yaml")}))),
    ("unknown-top-key", ["budgett=0.1"], f"budgett=0.1: unknown config key (did you mean budget?); accepted keys are {top_keys()}"),
    ("added-top-key", ["+foo=1"], f"foo=1: unknown config key; accepted keys are {top_keys()}"),
    # a preset's helper key (the latency table of selkv_fig3) is not a key of a plain run ...
    ("preset-key-without-preset", ["+latency=1"], f"latency=1: unknown config key; accepted keys are {top_keys()}"),
    # ... and the preset's own helper keys are listed when it is selected
    ("preset-sweep-without-m", ["+experiment=compresskv_table1_smoke"],
     "experiment=compresskv_table1_smoke sweeps method, budget (hydra.sweeper.params): add --multirun (-m) to run "
     "its jobs, or set each on the command line for one job"),
    ("added-top-key-in-preset", ["+experiment=selkv_fig3_smoke", "+foo=1"],
     f"foo=1: unknown config key; accepted keys are {top_keys('selkv_fig3_smoke')}"),
    ("unknown-method-key", ["method=snapkv", "method.window=8"],
     f"method.window=8: unknown key for method snapkv (did you mean window_size?); accepted keys are {SNAPKV_KEYS}"),
    ("added-method-key", ["method=snapkv", "+method.foo=1"], f"method.foo=1: unknown key for method snapkv; accepted keys are {SNAPKV_KEYS}"),
    ("added-existing-key", ["+budget=3"], "+budget=3: budget already exists; write budget=3 (without the leading +)"),
    ("unparsable-override", ["budget=[1"],
     "budget=[1: cannot parse this override (no viable alternative at input '[1'); write key=value, see python run.py --help"),
    ("sweep-without-m", ["budget=0.1,0.2"],
     "budget=0.1,0.2: several values need --multirun (-m) to sweep; for a list value write budget=[...]"),
    ("budget-zero", ["budget=0"], "budget=0: must be > 0 (a retention ratio in (0, 1] or an integer token count >= 2)"),
    ("budget-negative", ["budget=-0.5"], "budget=-0.5: must be > 0 (a retention ratio in (0, 1] or an integer token count >= 2)"),
    ("ratio-over-one", ["budget=1.5"], f"budget=1.5: {BUDGET_RULE}"),
    ("fractional-tokens", ["budget=100.5"], f"budget=100.5: {BUDGET_RULE}"),
    ("budget-text", ["budget=abc"], "budget='abc': must be a retention ratio in (0, 1] or an integer token count >= 2"),
    ("budget-inf", ["budget=inf"], "budget=inf: must be a retention ratio in (0, 1] or an integer token count >= 2"),
    ("budget-nan", ["budget=nan"], "budget=nan: must be a retention ratio in (0, 1] or an integer token count >= 2"),
    ("budget-below-window", ["method=snapkv", "budget=16"],
     "budget=16: smaller than the 32 tokens method snapkv always keeps (the windows and attention sinks it is configured with); "
     "use budget >= 32"),
    ("budget-one-token", ["method=snapkv", "budget=1"],
     "budget=1: an integer budget counts tokens, and a 1-token cache is not a configuration a report can tell from "
     "the 100 % ratio; use budget=1.0 to keep every token, or an integer >= 2 for a token budget"),
    ("budget-one-token-streaming", ["method=streamingllm", "method.n_sinks=0", "budget=1"],
     "budget=1: an integer budget counts tokens, and a 1-token cache is not a configuration a report can tell from "
     "the 100 % ratio; use budget=1.0 to keep every token, or an integer >= 2 for a token budget"),
    ("niah-max-length-below-grid", ["task.max_length=100"],  # a key of niah.yaml: no leading + needed
     "task.context_lengths=[512, 1024, 2048]: every length exceeds the prompt budget of 100 tokens "
     "(model.max_input_length / task.max_length); use lengths <= 100 or raise model.max_input_length"),
    ("launcher-without-multirun", ["hydra/launcher=slurm"],
     "hydra/launcher=slurm: a launcher runs the jobs of a sweep only; add --multirun (-m) (without it this command "
     "would run the one job here, on this machine)"),
    ("budget-below-sinks", ["method=streamingllm", "budget=3"],
     "budget=3: smaller than the 5 tokens method streamingllm always keeps (the windows and attention sinks it is configured with); "
     "use budget >= 5"),
    ("parallel-zero-jobs", ["-m", "hydra/launcher=parallel", "hydra.launcher.n_jobs=0", "budget=0.25,0.5"],
     f"hydra.launcher.n_jobs=0: must be the number of jobs run at once (>= 1) or between -{os.cpu_count()} and -1 "
     "(joblib's -k: CPU cores + 1 - k; -1 runs one job per core)"),
    ("sweep-bad-value", ["-m", "budget=0.5,-1"], "budget=-1: must be > 0 (a retention ratio in (0, 1] or an integer token "
     "count >= 2); no job of the sweep was started (no job with budget=-1 can run: drop that value)"),
    ("window-zero", ["method=snapkv", "method.window_size=0"], "method.window_size=0: must be an integer >= 1"),
    ("window-text", ["method=snapkv", "method.window_size=wide"], "method.window_size=wide: must be an integer"),
    ("kernel-even", ["method=snapkv", "method.kernel_size=4"], "method.kernel_size=4: must be an odd integer >= 1"),
    ("pooling", ["method=snapkv", "method.pooling=median"], "method.pooling='median': accepted values are avg, max"),
    ("gqa-aggregation", ["method=snapkv", "method.gqa_aggregation=sum"], "method.gqa_aggregation='sum': accepted values are mean, max"),
    ("n-sinks", ["method=streamingllm", "method.n_sinks=-1"], "method.n_sinks=-1: must be an integer >= 0"),
    ("max-samples-zero", ["max_samples=0"], "max_samples=0: must be an integer >= 1 or null"),
    ("max-samples-negative", ["max_samples=-3"], "max_samples=-3: must be an integer >= 1 or null"),
    ("max-samples-fraction", ["max_samples=2.5"], "max_samples=2.5: must be an integer or null"),
    ("shard-out-of-range", ["shard.index=2", "shard.count=2"],
     "shard.index=2: out of range for shard.count=2; accepted values are 0 to 1"),
    ("shard-count-zero", ["shard.count=0"], "shard.count=0: must be an integer >= 1"),
    ("lock-wait-negative", ["lock_wait_s=-1"], "lock_wait_s=-1: must be a number of seconds >= 0"),
    ("device", ["device=gpu"], "device=gpu: accepted values are auto, cpu, cuda, cuda:<index>, mps"),
    ("niah-negative-length", ["task.context_lengths=[-5]"],
     "task.context_lengths=[-5]: must be a non-empty list of positive integers (tokens)"),
    ("niah-length-scalar", ["task.context_lengths=512"],
     "task.context_lengths=512: must be a non-empty list of positive integers (tokens) (a list: "
     "task.context_lengths=[512])"),
    ("niah-all-lengths-over-budget", ["task.context_lengths=[9000,16000]"],
     "task.context_lengths=[9000, 16000]: every length exceeds the prompt budget of 7500 tokens "
     "(model.max_input_length / task.max_length); use lengths <= 7500 or raise model.max_input_length"),
    ("niah-empty-needle", ["task.needle="], "task.needle='': must be a non-empty string"),
    ("niah-needle-without-answer", ["task.needle=The secret code is 4711."],
     "task.answer='eat a sandwich and sit in Dolores Park on a sunny day': eat, a, sandwich, and, sit, in, dolores, "
     "park, on, sunny, day not in task.needle, so repeating the needle word for word scores below 100; set "
     "task.answer to the needle's fact (both keys change together)"),
    ("niah-answer-unscorable", ["task.needle='密码是四七一一'", "task.answer='四七一一'"],
     "task.answer='四七一一': has no word ROUGE-1 can score (rouge-score keeps the letters a-z and digits 0-9 only); "
     "use an answer in those characters"),
    ("niah-depth-over-100", ["task.depth_percents=[50,150]"],
     "task.depth_percents=[50, 150]: must be a non-empty list of numbers in [0, 100]"),
    ("niah-max-new-tokens", ["task.max_new_tokens=0"], "task.max_new_tokens=0: must be an integer >= 1"),
    ("niah-duplicate-length", ["task.context_lengths=[512,512]"],
     "task.context_lengths=[512, 512]: 512 given more than once; list each value once"),
    ("niah-duplicate-depth", ["task.depth_percents=[50,50.0,10]"],
     "task.depth_percents=[50, 50.0, 10]: 50 given more than once; list each value once"),
    ("niah-prompt-style", ["task.prompt_style=xml"], "task.prompt_style='xml': accepted values are kvcf, chat"),
    ("unknown-task-key", ["+task.foo=1"], None),  # message built in the test (lists the niah keys)
    ("haystack-missing", ["task.haystack_dir={tmp}/nope"], "task.haystack_dir={tmp}/nope: no such folder"),
    ("haystack-empty", ["task.haystack_dir={tmp}/empty"], "task.haystack_dir={tmp}/empty: holds no non-empty .txt files"),
    ("bad-artifact-file", ["method=compresskv", "budget=64", "method.layer_score_path={tmp}/afile"],
     "method.layer_score_path='{tmp}/afile': line 1 is not valid JSON (Expecting value)"),
    ("not-gguf", ["model.source={tmp}/fake.gguf"], "model.source='{tmp}/fake.gguf': not a GGUF file (bad magic bytes)"),
    ("missing-model-path", ["model.source={tmp}/no_model"], "model.source='{tmp}/no_model': no such file or folder"),
    ("hub-id-offline", ["model.source=nobody/no-such-model", "model.gguf_file=null"],
     "model.source=nobody/no-such-model: no such file or folder, and not in the Hugging Face cache while offline "
     "(HF_HUB_OFFLINE=1); download it where the Hub is reachable (`hf download nobody/no-such-model --local-dir DIR`) "
     "and pass model.source=DIR"),
    ("dtype", ["model.dtype.cpu=float64"], "model.dtype.cpu=float64: accepted values are float32, bfloat16, float16"),
    ("gguf-cache", ["model.gguf_cache=maybe"], "model.gguf_cache=maybe: accepted values are auto, true, false"),
    ("device-map", ["model.device_map=foo"],
     "model.device_map=foo: accepted values are null, auto, balanced, balanced_low_0, sequential, a device (cpu, "
     "cuda, cuda:1, a GPU index) or a mapping of module names to devices"),
    ("seed-over-64-bits", ["seed=18446744073709551616"],
     "seed=18446744073709551616: must be an integer from -2**63 to 2**64 - 1 (torch.manual_seed's range)"),
    ("threads-zero", ["threads=0"], "threads=0: must be an integer >= 1 or null"),
    ("output-root-in-code", ["output_root=methods/results"],
     "output_root=methods/results: inside kvbench's own methods/ folder; pass a folder for results (default: results)"),
    ("int-as-float", ["max_samples=2.0"], "max_samples=2.0: must be an integer or null (write 2, not 2.0)"),
    ("niah-max-length", ["task.max_length=-5"],
     "task.max_length=-5: must be null (the model's max_input_length) or an integer >= 2 (tokens)"),
    ("stop-ids", ["model.stop_ids=abc"], "model.stop_ids=abc: must be a list of token ids (integers >= 0), e.g. [2, 32000]"),
    ("stop-tokens", ["model.stop_tokens=[123]"],
     "model.stop_tokens=[123]: must be a list of token strings, e.g. ['<|im_end|>']"),
    ("label-empty", ["method.label="],
     "method.label='': must be a non-empty text (the method's name in reports), or null for the preset's name"),
    ("output-root-under-file", ["output_root={tmp}/afile/results"],
     "output_root={tmp}/afile/results: not writable ({tmp}/afile is a file, not a folder); pass a writable folder"),
    ("run-name-escapes", ["run_name=../../elsewhere"],
     "run_name=../../elsewhere: must be a relative folder path inside output_root (no '..', not absolute)"),
    ("model-deleted", ["~model"], "model: missing; it is required (see conf/config.yaml)"),
]


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_input")
    (root / "empty").mkdir()
    (root / "empty" / "notes.md").write_text("not a .txt file")
    (root / "fake.gguf").write_bytes(b"PK\x03\x04 this is a zip file, not GGUF")
    (root / "afile").write_text("a file where a folder is expected")
    return root


def _task_keys() -> str:
    data = yaml.safe_load((CONF / "task" / "niah.yaml").read_text())
    return ", ".join(sorted(set(data) | {"max_length"}))


@pytest.mark.parametrize("case_id,args,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp, case_id, args, expected):
    if expected is None:
        expected = f"task.foo=1: unknown key for task niah; accepted keys are {_task_keys()}"
    args = [a.format(tmp=tmp) for a in args]
    has_output_root = any(a.startswith("output_root=") for a in args)
    out = run_cli(args + ([] if has_output_root else [f"output_root={tmp}/out"]))
    assert out.stderr == f"error: {expected.format(tmp=tmp)}\n"
    assert out.returncode == 2
    assert out.stdout == ""
    assert not (tmp / "out").exists() or not any((tmp / "out").rglob("predictions.jsonl"))


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a CUDA machine accepts device=cuda")
def test_cuda_device_on_a_cpu_machine(tmp):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    out = run_cli(["device=cuda", f"output_root={tmp}/out"])
    assert out.stderr == "error: device=cuda: CUDA is not available on this machine; use device=auto or device=cpu\n"
    assert out.returncode == 2
    # model.device_map naming a GPU is checked the same way, before anything is written
    advice = "CUDA is not available on this machine; use model.device_map=auto or model.device_map=cpu"
    for value, shown in (("cuda:1", "cuda:1"), ("0", "0 (cuda:0)")):
        out = run_cli([f"model.device_map={value}", f"output_root={tmp}/map"])
        assert (out.returncode, out.stderr) == (2, f"error: model.device_map={shown}: {advice}\n")
    assert not (tmp / "map").exists()


def test_bad_input_table_is_large_enough():
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


def test_help_and_cfg_still_work(tmp):
    out = run_cli(["--help"])
    assert out.returncode == 0 and "budget" in out.stdout
    out = run_cli(["--cfg", "job", "budget=0.5", "method=streamingllm"])
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["budget"] == 0.5 and cfg["method"]["name"] == "streamingllm"
    out = run_cli(["--cfg", "job", "budgett=0.5"])  # --cfg composes, so a typo is still one line
    assert out.returncode == 2 and out.stderr.startswith("error: budgett=0.5: unknown config key")
    # options after (or between) the overrides work as before them (argparse alone refused them)
    out = run_cli(["budget=0.5", "--cfg", "job", "method=streamingllm"])
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["method"]["name"] == "streamingllm"
    out = run_cli(["budgett=0.5", "-m"])
    assert out.returncode == 2 and out.stderr.startswith("error: budgett=0.5: unknown config key")


def test_hydra_options_move_before_the_overrides():
    from kvbench.cli_guard import normalize_argv

    assert normalize_argv(["budget=0.3", "-m", "method=a,b"]) == ["-m", "budget=0.3", "method=a,b"]
    assert normalize_argv(["x=1", "-p", "hydra.launcher", "--cfg=hydra", "experiment=e"]) == [
        "-p", "hydra.launcher", "--cfg=hydra", "x=1", "+experiment=e"]
    assert normalize_argv(["x=1", "--info", "plugins", "y=2"]) == ["--info", "plugins", "x=1", "y=2"]
    assert normalize_argv(["--info", "y=2"]) == ["--info", "y=2"]  # y=2 is no --info topic
    assert normalize_argv(["x=1", "--bogus"]) == ["x=1", "--bogus"]  # argparse names what it does not know


def test_help_into_a_closed_pipe_is_quiet():
    """`python run.py --help | head -1`: the reader closes early; the command ends with 141
    (128 + SIGPIPE, as a shell tool) and no BrokenPipeError traceback."""
    import os
    import subprocess
    import sys

    from tests.kvbench.cli_util import cli_env

    for cmd in ([str(ROOT / "run.py"), "--help"], ["-m", "kvbench.cli", "--help"]):
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the command writes
        proc = subprocess.run([sys.executable, *cmd], cwd=ROOT, env=cli_env(), stdout=w, stderr=subprocess.PIPE,
                              text=True, timeout=120)
        os.close(w)
        assert (proc.returncode, proc.stderr) == (141, ""), cmd


def test_parallel_launcher_without_its_plugin(monkeypatch, capsys):
    """Without hydra-joblib-launcher (an optional extra; the test extra installs it), composing
    hydra/launcher=parallel misses its `joblib` base config: the pre-check says what to install.
    The plugin's absence is simulated: Hydra's compose cannot load hydra/launcher/joblib and the
    launcher group lists no `joblib` option."""
    import hydra
    from hydra.errors import MissingConfigException

    from kvbench import cli_guard

    real_compose, real_options = hydra.compose, cli_guard._Composer.options

    def compose(config_name=None, overrides=(), **kwargs):
        if "hydra/launcher=parallel" in overrides:
            raise MissingConfigException("In 'hydra/launcher/parallel': Could not load 'hydra/launcher/joblib'.",
                                         missing_cfg_file="hydra/launcher/joblib")
        return real_compose(config_name, overrides=overrides, **kwargs)

    monkeypatch.setattr(hydra, "compose", compose)
    monkeypatch.setattr(cli_guard._Composer, "options", lambda self, group: [
        o for o in real_options(self, group) if (group, o) != ("hydra/launcher", "joblib")])
    with pytest.raises(SystemExit) as stop:
        cli_guard.precheck_argv(["-m", "hydra/launcher=parallel", "budget=0.1,0.2"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("error: hydra/launcher=parallel: needs the joblib launcher plugin; run "
                                       "`pip install hydra-joblib-launcher`\n")


@pytest.mark.parametrize("sinfo, expected", [
    ("echo 'sinfo: error: Unable to contact slurm controller (connect failure)' >&2; exit 1",
     "hydra/launcher=slurm: cannot reach the SLURM controller (sinfo: sinfo: error: Unable to contact slurm "
     "controller (connect failure)); check it with `scontrol ping`"),
    (None, "hydra/launcher=slurm: sbatch/sinfo not found on PATH; submit from a SLURM login node, or drop "
           "hydra/launcher=slurm to run the sweep here"),
])
def test_slurm_sweep_without_a_reachable_controller_is_one_line(tmp_path, sinfo, expected):
    """Before submitting, a SLURM sweep asks the controller (sinfo); a fake sinfo that fails as a
    down slurmctld does, or no SLURM tools on PATH, is one line and exit 2, nothing submitted."""
    import os
    import sys

    tmp = tmp_path
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    if sinfo is not None:
        for tool, body in (("sbatch", "echo sbatch must not run >&2; exit 1"), ("sinfo", sinfo)):
            (bin_dir / tool).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / tool).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), "/usr/local/bin", "/bin"])
    if sinfo is None:
        path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent)])  # no SLURM tools at all
    out = run_cli(["-m", "hydra/launcher=slurm", "budget=0.1,0.2", f"output_root={tmp}/out"], PATH=path)
    assert (out.returncode, out.stderr) == (2, f"error: {expected}\n")
    assert not (tmp / "out").exists()


def test_preset_helper_keys_are_the_interpolated_or_tool_read_ones():
    """A preset's own top-level key is accepted only when the preset interpolates it or a kvbench
    tool reads it; a typo'd key in a preset file (``budjet: 0.1``) stays an unknown key."""
    from kvbench.validate import _is_helper_key, top_level_keys

    fig5 = top_level_keys("compresskv_fig5")
    assert {"niah_context_lengths", "niah_max_length"} <= set(fig5) and "latency" not in fig5
    assert "latency" in top_level_keys("selkv_fig3_smoke")
    assert "compresskv_max_length" not in top_level_keys("") and "budget" in top_level_keys("")
    text = "budjet: 0.1\ntable:\n  a: 1\ntask:\n  max_length: ${oc.select:table.${model.name},null}\n"
    assert _is_helper_key("table", text) and not _is_helper_key("budjet", text)


def test_uncached_hub_id_with_the_hub_unreachable_fails_at_once(monkeypatch):
    """Without HF_HUB_OFFLINE, an uncached Hub id on a machine that cannot reach the Hub is one
    line from the pre-check (one HEAD probe), not a minute of huggingface_hub retries in the job."""
    import httpx

    from kvbench import validate
    from methods.base import ConfigError

    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    calls = []

    def down(url, **kw):
        calls.append((url, kw["timeout"]))
        raise httpx.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(httpx, "head", down)
    cfg = {"name": "x", "source": "nobody/no-such-model"}
    from huggingface_hub import constants

    with pytest.raises(ConfigError) as err:
        validate.check_model_source(cfg)
    assert str(err.value).startswith(
        "model.source=nobody/no-such-model: no such file or folder, not in the Hugging Face cache, and the Hub is not "
        f"reachable ({constants.ENDPOINT} unreachable: ConnectError: [Errno -2] Name or service not known); ")
    assert calls == [(constants.ENDPOINT, validate.HUB_PROBE_TIMEOUT_S)]
    monkeypatch.setattr(httpx, "head", lambda url, **kw: None)  # reachable: the job downloads it
    assert validate.check_model_source(cfg) is None


@pytest.mark.parametrize("order", [("snapkv,streamingllm", "20,0.2"), ("streamingllm,snapkv", "0.2,20")])
def test_a_sweep_with_one_impossible_combination_runs_the_others_in_any_order(order, capsys):
    """snapkv cannot keep 20 tokens (its window is 32) but streamingllm can, and snapkv can keep 20 %:
    whichever order the values are listed in, the pre-check lets the sweep run and names the one job
    that will stop (before, a failing first combination refused the whole sweep)."""
    from kvbench.cli_guard import precheck_argv

    methods, budgets = order
    precheck_argv(["-m", f"method={methods}", f"budget={budgets}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: sweep job method=snapkv budget=20 will stop with a configuration error (the other jobs "
                   "run): budget=20: smaller than the 32 tokens method snapkv always keeps (the windows and "
                   "attention sinks it is configured with); use budget >= 32"]


def test_a_swept_value_no_job_can_run_refuses_the_sweep(capsys):
    """budget=20 is impossible for both swept methods: nothing with it can run, so the sweep is refused."""
    from kvbench.cli_guard import precheck_argv

    with pytest.raises(SystemExit) as stop:
        precheck_argv(["-m", "method=snapkv,pyramidkv", "budget=0.2,20"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "error: budget=20: smaller than the 32 tokens method snapkv always keeps")


@pytest.mark.parametrize("methods, budgets, accepted", [("snapkv,streamingllm", "20,0.2", True),
                                                        ("streamingllm,snapkv", "0.2,20", True),
                                                        ("snapkv,pyramidkv", "0.2,20", False)])
def test_a_sweep_too_large_to_check_job_by_job_gets_the_same_verdict_in_any_order(methods, budgets, accepted):
    """160 jobs (more than MAX_CHECKED_JOBS): budget=20 suits streamingllm, so the sweep runs whatever
    the order; with no swept method able to keep 20 tokens it is refused."""
    from kvbench.cli_guard import MAX_CHECKED_JOBS, precheck_argv

    argv = ["-m", f"method={methods}", f"budget={budgets}", "seed=range(0,40)"]
    assert 2 * 2 * 40 > MAX_CHECKED_JOBS
    if accepted:
        precheck_argv(argv)
    else:
        with pytest.raises(SystemExit) as stop:
            precheck_argv(argv)
        assert stop.value.code == 2


def test_sweep_jobs_that_would_share_a_job_folder_are_refused(capsys):
    """seed is not in the folder name: two seeds would write one folder (the second refused as another
    setting, or locked on SLURM); a run_tag per job, or shards of one job, are fine."""
    from kvbench.cli_guard import precheck_argv

    with pytest.raises(SystemExit) as stop:
        precheck_argv(["-m", "method=streamingllm", "budget=0.2", "seed=0,1"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: sweep jobs seed=0 and seed=1 write the same job folder niah/smollm2/streamingllm/b0.2 (its name holds "
        "task, model, method preset, budget, run_tag and the method.* overrides); list each value once, or give each "
        "job its own run_tag, e.g. 'run_tag=seed${seed}'")
    with pytest.raises(SystemExit) as stop:  # one value twice: two jobs would race for one folder's lock
        precheck_argv(["-m", "method=streamingllm", "budget=0.1,0.1"])
    assert stop.value.code == 2 and "sweep jobs budget=0.1 and budget=0.1 write the same job folder" in \
        capsys.readouterr().err
    precheck_argv(["-m", "method=streamingllm", "budget=0.2", "seed=0,1", "run_tag=seed${seed}"])
    precheck_argv(["-m", "method=streamingllm", "budget=0.2", "shard.index=0,1", "shard.count=2"])


def test_a_missing_relative_folder_names_where_it_was_looked_for(tmp):
    """A relative path resolves against the directory run.py was started in: the error says which."""
    out = run_cli(["task.haystack_dir=../no_such_essays", f"output_root={tmp}/out"], cwd=tmp)
    assert out.stderr == ("error: task.haystack_dir=../no_such_essays: no such folder "
                          f"(looked for {tmp.parent}/no_such_essays)\n")
    out = run_cli(["task=longbench", "task.data_dir=lb_data", f"output_root={tmp}/out"], cwd=tmp)
    assert out.stderr.startswith(f"error: task.data_dir=lb_data: no such directory (looked for {tmp}/lb_data); ")
    assert out.returncode == 2


def test_a_key_given_twice_warns_and_the_last_value_is_used(capsys):
    """Hydra keeps the last value of a repeated key (a script's defaults, then a change): a warning
    names both, so a typo'd command line does not run another setting silently."""
    from kvbench.cli_guard import precheck_argv

    precheck_argv(["method=streamingllm", "budget=0.25", "budget=0.5"])
    assert capsys.readouterr().err.strip() == ("warning: budget is given twice (budget=0.25, budget=0.5); the last "
                                               "one is used")
    precheck_argv(["method=streamingllm", "budget=0.5", "budget=0.5"])  # the same value twice: nothing to say
    assert capsys.readouterr().err == ""


def test_a_glob_sweep_over_a_group_is_accepted(capsys):
    """Hydra's basic sweeper expands glob() over a config group's options; the pre-check does too
    (it used to refuse it as an interval() sweep), and a glob matching nothing is one line."""
    from kvbench.cli_guard import precheck_argv

    precheck_argv(["-m", "method=glob(snap*)", "budget=0.1"])
    with pytest.raises(SystemExit) as stop:
        precheck_argv(["-m", "method=glob(zzz*)"])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(
        "error: method=glob(zzz*): matches no method option; accepted values are adacompresskv, ")


def test_kvbench_run_becomes_run_py_so_signals_reach_the_job(monkeypatch):
    """`kvbench run ...` from the shell replaces itself by `python run.py ...` (same pid): a
    child process would be orphaned by `kill` on the wrapper and keep the job's lock."""
    import os

    from kvbench import cli

    calls = []

    def execv(exe, args):  # the real one never returns
        calls.append((exe, args))
        raise SystemExit(0)

    monkeypatch.setattr(sys, "argv", ["kvbench", "run", "budget=0.5"])
    monkeypatch.setattr(os, "execv", execv)
    with pytest.raises(SystemExit):
        cli.main()
    assert calls == [(sys.executable, [sys.executable, str(ROOT / "run.py"), "budget=0.5"])]


def test_output_root_is_never_the_checkout_or_its_docs_or_hidden_folders(tmp_path, monkeypatch):
    """output_root=. would put job folders among the code and make the checkout a results root
    around results/; docs/, .git/, .venv/ and any hidden folder are code too."""
    from kvbench import validate
    from kvbench.validate import ConfigError, check_output_root

    monkeypatch.chdir(validate.CHECKOUT)
    for root, text in ((".", "output_root=.: the kvbench checkout itself"),
                       ("docs/res", "output_root=docs/res: inside kvbench's own docs/ folder"),
                       (".git/res", "output_root=.git/res: inside kvbench's own .git/ folder"),
                       (".venv-x/res", "output_root=.venv-x/res: inside kvbench's own .venv-x/ folder")):
        with pytest.raises(ConfigError, match="^" + re.escape(text)):
            check_output_root(root)
    assert check_output_root("results_smoke") == validate.CHECKOUT / "results_smoke"  # nothing is created
    assert not (validate.CHECKOUT / "results_smoke").exists() or (validate.CHECKOUT / "results_smoke").is_dir()
    # a job folder an earlier output_root=. left in a checkout: the message says to move it
    monkeypatch.setattr(validate, "CHECKOUT", tmp_path)
    job = tmp_path / "niah" / "m" / "full" / "b1"
    job.mkdir(parents=True)
    (job / "config.yaml").write_text("task: {name: niah}\nmodel: {name: m}\n")
    (job / "predictions.jsonl").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(f"output_root=results: the kvbench checkout {tmp_path} holds "
                                                    "the job folder niah/m/full/b1 (a run with output_root=.?); "
                                                    "move niah/ into a results folder")):
        check_output_root("results")
