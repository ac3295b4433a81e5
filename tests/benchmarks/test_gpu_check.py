"""benchmarks/gpu_check.py on CPU with tiny shapes (on an H200 it runs Llama-3.1-8B's shapes), also without kvpress."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from methods import available

ROOT = Path(__file__).resolve().parents[2]


def test_help():
    out = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--lengths" in out.stdout and "--no-compile" in out.stdout


def test_gpu_check_writes_every_figure_without_kvpress(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress raises ImportError, as on the offline GPU machine
    assert gpu_check.main(["--device", "cpu", "--lengths", "160", "--new-tokens", "5", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failures"] == [] and "all checks passed" in capsys.readouterr().out
    parts = {}
    for r in report["rows"]:
        parts.setdefault(r["part"], []).append(r)
    assert sorted(parts) == ["compiled", "engine", "lookm", "quant", "sdpa", "throughput", "varlen"]  # no kvpress row
    tput = {r["method"]: r for r in parts["throughput"]}
    assert all(tput[m]["rows"] > tput["full"]["rows"] for m in tput if m != "full")  # a cut cache fits more rows
    assert [(r["tokens"], r["bits"]) for r in parts["quant"]] == [(160, None), (160, 4), (160, 2)]
    assert all(r["ok"] and r["decode_tok_s"] > 0 for r in parts["quant"])
    assert parts["quant"][0]["stored_bytes"] == 2 * 2 * 2 * 160 * 32 * 4 > 3 * parts["quant"][2]["stored_bytes"]  # float32, 2 bits
    engine = {r["method"]: r for r in parts["engine"] if "skipped" not in r}
    skipped = {r["method"]: r["skipped"] for r in parts["engine"] if "skipped" in r}
    assert sorted([*engine, *skipped]) == available() and set(skipped) <= {"kvpress_press"}  # needs kvpress
    assert all("kvpress" in why for why in skipped.values())
    for r in engine.values():
        assert len(r["step_ms"]) == 4 and r["decode_ms_step_median"] > 0 and r["cache_bytes_after"] > 0
        assert r["peak_decode_bytes"] > 0 and r["sdpa_backends"]["prefill"] in ("flash_attention", "math", "blocked float32 (column sums)")
        assert r["ok"] and r["logits_rel_err"] <= 1e-4 and r["same_argmax_steps"] == r["steps_compared"] == 5
    assert engine["full"]["cache_bytes_after"] > 2 * engine["snapkv"]["cache_bytes_after"]
    assert engine["selkv"]["sdpa_backends"]["decode"] == {"bias columns": "flash_attention"}  # PyTorch's CPU choice
    assert engine["adakv"]["sdpa_backends"]["decode"] == {"per-head lengths": "flash_attention"}
    assert engine["full"]["sdpa_backends"]["decode"] == {"uniform": "flash_attention"}
    compiled = {r["method"]: r for r in parts["compiled"]}
    assert sorted(compiled) == ["adakv", "full", "selkv"]
    assert all(r["decode_compiled"] and r["compile_s"] > 0 and r["compile_error"] is None for r in compiled.values())
    assert not any(r["decode_compiled"] or r["compile_s"] or r["compile_error"] for r in engine.values())  # eager
    assert {(r["query_heads"], r["kv_heads"], r["head_dim"], r["rows"]) for r in parts["varlen"]} >= {
        (32, 8, 128, 1), (40, 8, 128, 1), (32, 32, 128, 1), (16, 4, 256, 1), (32, 8, 128, 4)}  # 4: a decode batch's call
    assert all(r["ms"] > 0 and r["rows_one_by_one_ms"] > 0 for r in parts["varlen"] if r["rows"] > 1)
    assert all(r["ok"] and r["backend"] == "sdpa per head" for r in parts["varlen"])
    (lookm,) = parts["lookm"]
    assert lookm["ok"] and lookm["rel_err"] <= 1e-5 and lookm["bf16_ms"] > 0 and lookm["float32_ms"] > 0
    assert all(r["default_choice"] and r["kvbench_choice"] and len(r["kvbench_step_ms"]) == 16 for r in parts["sdpa"])


@pytest.mark.skipif(importlib.util.find_spec("kvpress") is None, reason="kvpress not installed (optional extra)")
def test_kvpress_part_when_importable():
    import torch
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    before = dict(ALL_ATTENTION_FUNCTIONS)

    loaded = gpu_check.build(torch.device("cpu"), 2)
    (row,) = gpu_check.kvpress_part(loaded, 160, 3)
    assert row["part"] == "kvpress" and row["decode_ms_step_median"] > 0
    assert row["cache_bytes_after"] == 2 * 2 * 2 * 32 * 40 * 4  # 2 layers, K and V, 2 KV heads, d 32, 25 % of 160, fp32
    assert loaded.model.config._attn_implementation == "kvbench"  # restored
    assert dict(ALL_ATTENTION_FUNCTIONS) == before  # kvpress's import-time wrapping undone
