"""Methods from anywhere (issue 57): ``method=plugin method.target=module:Class`` from a module outside the package, its
source in the job identity, the engine's contract check, ``kvbench check-method``, AdaKV around a plugin scorer,
kvpress's registry keys and a required press."""

from __future__ import annotations

import re
import textwrap

import pytest
import torch

import methods
from methods.base import ContractError, HeadLayout, LayerContext
from tests.conftest import loaded_for, tiny_model
from tests.kvbench.cli_util import check

PLUGIN = '''
from dataclasses import dataclass

import torch

from methods.base import CompressResult, Method, MethodConfig, ScoreMethod


@dataclass
class VNormConfig(MethodConfig):
    recent_window: int = 4


class VNorm(ScoreMethod):
    """Keep the tokens whose values have the largest norm."""
    Config = VNormConfig

    def score(self, ctx):
        return torch.linalg.vector_norm(ctx.values.float(), dim=-1)


class KeepAll(Method):
    def compress(self, ctx):
        return CompressResult(ctx.keys, ctx.values)


class BadShape(ScoreMethod):
    def score(self, ctx):
        return ctx.keys[..., 0][..., :-1]
'''
SHORT = ["task.context_lengths=[200]", "task.depth_percents=[50]"]


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """The plugin module ``my_methods`` in a folder outside the repository, on sys.path."""
    (tmp_path / "my_methods.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path / "my_methods.py"
    methods.schema.cache_clear()


def test_a_plugin_class_is_a_job_whose_identity_holds_its_source(plugin):
    job = check(["method=plugin", "method.target=my_methods:VNorm", "method.recent_window=2", *SHORT])
    assert job.method.config.recent_window == 2 and type(job.method).__name__ == "VNorm"
    assert job.relpath.startswith("niah/smollm2/VNorm/b0.25-") and job.cfg["method"]["label"] == "VNorm"
    assert len(job.identity["inputs"]["method_source_sha256"]) == 64
    plugin.write_text(PLUGIN + "\n# edited\n")
    assert check(["method=plugin", "method.target=my_methods:VNorm", "method.recent_window=2", *SHORT]).relpath != job.relpath
    assert "method_source_sha256" not in check(["method=snapkv", *SHORT]).identity["inputs"]  # built-in: as before


@pytest.mark.parametrize("args, key", [
    (["method.target=my_methods:Nope"], "method.target='my_methods:Nope': cannot import it"),
    (["method.target=my_methods:VNormConfig"], "method.target=.my_methods:VNormConfig.: names no Method class"),
    (["method.target=my_methods:VNorm", "method.foo=1"], "method.foo: unknown key; accepted keys are label, name, "
                                                         "recent_window, target"),
    ([], "method.target: missing"),
    (["method.target=my_methods:VNorm", "budget=2"], "budget=2: smaller than the 4 tokens method VNorm always keeps"),
])
def test_a_bad_plugin_is_one_line_naming_the_key(plugin, args, key):
    with pytest.raises(methods.ConfigError, match="^" + key.replace("(", r"\(").replace("[", r"\[")):
        check(["method=plugin", *args, *SHORT])


@pytest.mark.parametrize("override, key", [("bugdet=0.3", "Could not override 'bugdet': unknown key"),
                                           ("method=nosuch", "In 'config': Could not find 'method/nosuch'")])
def test_kvbench_run_raises_config_error_naming_the_key_as_run_py_prints_it(override, key, monkeypatch):
    import kvbench
    from kvbench.engine import models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(methods.ConfigError, match="^" + re.escape(key)):
        kvbench.run([override])


def test_kvpress_needs_its_press_and_takes_its_registry_keys():
    with pytest.raises(methods.ConfigError, match=r"^method\.press: missing"):
        check(["method=kvpress", *SHORT])
    pytest.importorskip("kvpress")
    from methods.kvpress_press import registry_node

    assert registry_node("snap_think") == {"press": "ComposedPress", "press_kwargs": {"presses": [
        {"press": "SnapKVPress", "press_kwargs": {}}, {"press": "ThinKPress", "press_kwargs": {}}]}}
    job = check(["method=kvpress", "method.press=chunkkv", *SHORT])
    assert type(job.method.config.built).__name__ == "ChunkKVPress" and job.method.config.built.chunk_length == 20
    job = check(["method=kvpress", "method.press=decoding_knorm", "budget=64", *SHORT])  # kvpress's DecodingPress defaults
    assert type(job.method.config.built).__name__ == "KnormPress"
    assert (job.top.decode.interval, job.top.decode.prefill, job.top.decode.schedule) == (512, False, "steps")
    assert job.cfg["decode"]["interval"] == 512 and job.relpath != check(["method=kvpress", "method.press=knorm",
                                                                           "budget=64", *SHORT]).relpath
    job = check(["method=kvpress", "method.press=decoding_knorm", "budget=64", "decode.interval=16", *SHORT])
    assert (job.top.decode.interval, job.top.decode.prefill) == (16, True)  # given decode.* wins


@pytest.mark.parametrize("target, clause", [
    ("KeepAll", "method KeepAll, layer 0 (prefill, n=40): keeps 40 tokens per KV head, over the layer budget of 10"),
    ("BadShape", r"method BadShape, layer 0 (prefill, n=40): score(ctx) must be (B, H_kv, n) = (1, 2, 40)"),
])
def test_the_engine_refuses_a_result_that_breaks_the_contract(plugin, target, clause):
    from kvbench.engine.generate import Engine

    loaded = loaded_for(tiny_model())
    method = methods.build_method({"name": "plugin", "target": f"my_methods:{target}"}, loaded.layout)
    with pytest.raises(ContractError) as e:
        Engine(loaded, method, 0.25).open(list(range(3, 43)), 4)
    assert str(e.value).startswith(clause)


def test_check_method_tables_what_holds(plugin, capsys):
    from kvbench.testing import CASES, main

    assert main(["method=plugin", "method.target=my_methods:VNorm"]) == 0
    assert capsys.readouterr().out.split() == [w for c in CASES for w in (*c.split(), "ok")]
    assert main(["method=plugin", "method.target=my_methods:KeepAll"]) == 1
    rows = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines())
    assert rows["decoding"].strip() == "n/a (does not decode)"
    assert rows["prefill GQA"].strip().startswith("ContractError: method KeepAll, layer 0 (prefill, n=160): keeps 160")
    assert main(["method=plugin", "method.target=my_methods:Nope"]) == 2


def test_adakv_around_a_plugin_scorer_keeps_the_budget_per_head_on_average(plugin):
    layout = HeadLayout(2, 4, 2, 16, (0, 1))
    method = methods.build_method({"name": "adakv", "scorer": "my_methods:VNorm", "window_size": 4, "kernel_size": 1},
                                  layout)
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 100, 16), torch.randn(1, 2, 100, 16)
    values[:, 0] *= 3  # head 0's value norms are the larger: the global top-k gives it more of the layer's budget
    result = method.compress(LayerContext(0, layout, keys, values, torch.randn(1, 4, 4, 16), 0.25, budget=20))
    counts = result.valid.sum(-1)[0].tolist()
    assert sum(counts) == 2 * 20 and counts[0] > 20 > counts[1]
    assert (result.kept_indices[0, 1, counts[1] - 4:counts[1]] == torch.arange(96, 100)).all()  # the window kept
    with pytest.raises(methods.ConfigError, match=r"^method\.scorer='full': must name a ScoreMethod"):
        methods.build_method({"name": "adakv", "scorer": "full"})


def test_the_fixture_runs_in_a_users_own_tests(plugin, tmp_path):
    (tmp_path / "test_mine.py").write_text(textwrap.dedent("""
        def test_mine(check_method):
            assert check_method(["method=plugin", "method.target=my_methods:VNorm"])["decoding"] == "ok"
    """))
    assert pytest.main([str(tmp_path / "test_mine.py"), "-p", "kvbench.testing", "-q", "-n", "0", "-p",
                        "no:cacheprovider"]) == 0


def test_a_task_class_from_anywhere_is_a_task_whose_source_is_in_the_identity(tmp_path, monkeypatch):
    import eval as tasks

    (tmp_path / "my_tasks.py").write_text("from eval.niah import NIAHTask\n\n\nclass MyNIAH(NIAHTask):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert tasks.get_task_class("my_tasks:MyNIAH").__name__ == "MyNIAH"
    job = check(["task.name=my_tasks:MyNIAH", *SHORT])
    assert len(job.identity["inputs"]["task_source_sha256"]) == 64
    assert "task_source_sha256" not in check(SHORT).identity["inputs"]
    with pytest.raises(tasks.TaskConfigError, match=r"^task\.name='my_tasks:Nope': unknown task"):
        tasks.get_task_class("my_tasks:Nope")


def test_check_method_imports_without_pytest():
    """A command-1 install has no pytest: ``kvbench check-method`` must still import (the fixture needs pytest)."""
    import subprocess
    import sys

    code = "import sys; sys.modules['pytest'] = None; import kvbench.testing as t; print(t.pytest, callable(t.main))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["None", "True"], out.stderr
