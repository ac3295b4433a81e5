"""benchmarks/gpu_check.py runs on CPU with small sizes (on an H200 it runs the Llama-3.1-8B shapes)."""

import json

from benchmarks import gpu_check
from methods import available


def test_gpu_check_runs_every_method_on_cpu(tmp_path, capsys):
    assert gpu_check.main(["--device", "cpu", "--lengths", "160", "--new-tokens", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    methods = {r["method"]: r for r in report["rows"] if r["check"] == "method"}
    assert sorted(methods) == available() and report["failures"] == []
    assert all(r["first_step_same_token"] and r["cache_dtype"] == "float32" for r in methods.values())
    backends = {name: r["decode_attention"] for name, r in methods.items()}
    assert backends["selkv"] == "sdpa, bias columns" and backends["snapkv"] == backends["full"] == "sdpa"
    assert backends["adakv"] == backends["headkv"] == "sdpa per head"  # flat per-head lengths (CUDA: flash varlen)
    decode = [(r["method"], r["tokens"]) for r in report["rows"] if r["check"] == "decode"]
    assert decode == [("full", 160), ("snapkv", 160), ("selkv", 160), ("adakv", 160)]
    assert "all checks passed" in capsys.readouterr().out
