"""The suite's table, JSON and PASS/FAIL logic on synthetic numbers, its command line, and one
measured run on a tiny model."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.__main__ import parse_args, render
from benchmarks.common import BenchResult, Context, Settings, Target, table
from benchmarks.compression import fit_exponent, targets
from benchmarks.decode import judge
from benchmarks.memory import decode_phase_bytes, drop_suffices
from benchmarks.overhead import alternate


def test_fit_exponent_recovers_power_laws():
    lengths = [1024, 2048, 4096]
    assert fit_exponent(lengths, [1e-6 * n for n in lengths]) == pytest.approx(1.0)
    assert fit_exponent(lengths, [3e-9 * n**2 for n in lengths]) == pytest.approx(2.0)
    assert fit_exponent([1024], [1.0]) is None and fit_exponent(lengths, [0.0, 0.0, 1.0]) is None


def test_compression_targets_judge_the_longest_length_and_the_exponent():
    lengths, prefill = [1024, 2048, 4096], {1024: 1.0, 2048: 2.0, 4096: 4.0}
    linear = targets("snapkv", lengths, {n: 0.01 * prefill[n] for n in lengths}, prefill)
    assert [(t.measured, t.verdict) for t in linear] == [("1.00 %", "PASS"), ("1.00", "PASS")]
    quadratic = targets("lookm", lengths, {1024: 0.004, 2048: 0.016, 4096: 0.064}, prefill)
    assert [t.verdict for t in quadratic] == ["PASS", "FAIL"] and quadratic[0].measured == "1.60 %"
    slow = targets("x", lengths, {1024: 0.075, 2048: 0.15, 4096: 0.3}, prefill)
    assert [(t.measured, t.verdict) for t in slow] == [("7.50 %", "FAIL"), ("1.00", "PASS")]
    assert "4096 tokens" in slow[0].name


def test_decode_speedup_is_the_median_of_rounds_against_the_bytes_ratio():
    def one(ms, cache):
        return {"decode_step_ms": ms, "weight_bytes": 500, "cache_bytes_after": cache, "prompt_tokens": 4096}

    rounds = [{"full": one(50, 200), "25%": one(40, 50)}, {"full": one(60, 200), "25%": one(40, 50)},
              {"full": one(44, 200), "25%": one(40, 50)}]
    speedup, bytes_ratio, ratios, target = judge(rounds)
    assert ratios == [1.25, 1.5, 1.1] and speedup == 1.25
    assert bytes_ratio == pytest.approx(700 / 550) and target.verdict == "FAIL"  # 1.25 < 1.27
    rounds[2]["full"]["decode_step_ms"] = 56
    assert judge(rounds)[3].verdict == "PASS"  # median 1.4


def test_memory_drop_covers_the_saved_bytes_within_two_percent_or_one_megabyte():
    assert decode_phase_bytes({"decode_mem_bytes": 1500, "rss_after_load_bytes": 1000}) == 500
    assert drop_suffices(98e6, 100e6) and not drop_suffices(97.9e6, 100e6)
    assert drop_suffices(1.5e6, 2e6) and not drop_suffices(0.9e6, 2e6)  # 1 MB floor at small savings


def test_summary_shows_every_target_verdict_and_table():
    res = BenchResult("overhead", "Harness overhead", headers=["path", "s"], rows=[["kvbench", 1.5], ["hf", None]],
                      targets=[Target("ratio", "0.9×", "≤ 1.05×", True), Target("other", "2×", "≤ 1×", False),
                               Target("kvpress", "-", "≤ 0.95×", None, "not installed")], notes=["a note"])
    skipped = BenchResult("kvpress", "Against kvpress", skipped="kvpress is not importable")
    page = render({"date": "today", "cpu": "x", "wall_s": 60}, [res, skipped], "python -m benchmarks", ["hello"])
    assert page.startswith("# Performance")
    for text in ("| PASS", "| FAIL", "| SKIP", "| kvbench | 1.5", "| hf      | -", "- a note", "- hello",
                 "Skipped: kvpress is not importable", "`python -m benchmarks --only overhead`"):
        assert text in page, text
    data = json.loads(json.dumps(res.to_json()))
    assert [t["verdict"] for t in data["targets"]] == ["PASS", "FAIL", "SKIP"]
    assert table(["a"], [[0.12345], [123.4], [1.5], [0.0]]).splitlines()[2:] == ["| 0.123 |", "| 123   |", "| 1.5   |", "| 0     |"]


def test_alternate_flips_the_order_every_repetition():
    calls = []
    alternate({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then AB, BA, AB


def test_settings_lengths_and_target_length():
    assert Settings().lengths == [1024, 2048, 4096, 8000] and Settings().long == 4096
    assert Settings(quick=True).long == 512 and Settings(quick=True).new_tokens == 8
    assert Settings(prompt_lengths=[3000, 700]).lengths == [700, 3000] and Settings(prompt_lengths=[3000]).long == 3000
    assert Settings(methods=["lookm"]).selected(["snapkv", "lookm"]) == ["lookm"]


@pytest.mark.parametrize("argv, key", [
    (["--only", "decod"], "--only decod"), (["--only", ""], "--only ''"), (["--methods", "snapkvv"], "--methods snapkvv"),
    (["--lengths", "10"], "--lengths 10"), (["--lengths", "1k"], "--lengths 1k"), (["--model", "nope"], "--model nope"),
    (["--threads", "0"], "--threads 0"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, key, capsys):
    with pytest.raises(SystemExit) as stop:
        parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()
    flag, value = key.split(" ", 1)
    assert stop.value.code == 2 and len(err) == 1 and flag in err[0] and value in err[0]


def test_list_flags_take_spaces_commas_or_repeats():
    for argv in (["--only", "decode,memory"], ["--only", "memory", "decode"], ["--only", "decode", "--only", "memory"]):
        assert parse_args(argv).names == ["decode", "memory"] or parse_args(argv).names == ["memory", "decode"]
    args = parse_args(["--methods", "lookm,selkv", "--lengths", "512", "256,512"])
    assert args.method_names == ["lookm", "selkv"] and args.prompt_lengths == [256, 512]


def test_runs_are_memoised(monkeypatch):
    import benchmarks.common as common
    from tests.conftest import loaded_for, tiny_model

    ctx = Context(Settings(quick=True))
    ctx.__dict__["loaded"] = loaded_for(tiny_model("llama", layers=2, n_kv=2, n_q=4))
    monkeypatch.setattr(common, "build_prompt", lambda tok, n: ("", list(range(3, 3 + n))))
    first = ctx.worker([("full", "full", 1.0), ("s", "snapkv", 0.5)], 100, rounds=2)
    assert ctx.worker([("full", "full", 1.0), ("s", "snapkv", 0.5)], 100, rounds=2) is first
    assert [sorted(r) for r in first] == [["full", "s"], ["full", "s"]]
    assert first[0]["full"]["prompt_tokens"] == 100 and first[0]["s"]["kept_tokens_mean"] == 50
    assert first[0]["full"]["generated_tokens"] == 8  # --quick: 8 new tokens, stop tokens off


def test_worker_measures_decode_steps_and_memory_on_a_tiny_model():
    from benchmarks.common import measure, release_freed_memory
    from kvbench.engine.generate import Engine
    from methods.snapkv import SnapKV, SnapKVConfig
    from tests.conftest import loaded_for, tiny_model

    release_freed_memory()
    loaded = loaded_for(tiny_model("llama", layers=2, n_kv=2, n_q=4))
    engine = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 0.5)
    r = measure(engine, list(range(3, 43)), 6)  # 40 prompt tokens, 20 kept per head
    assert r["generated_tokens"] == 6 and r["kept_tokens_mean"] == 20 and r["stored_tokens_mean"] == 20
    assert r["decode_step_ms"] > 0 and math.isfinite(r["decode_step_ms"])
    assert r["decode_mem_bytes"] > 0 and r["peak_bytes"] >= r["rss_after_load_bytes"] > 0
    assert r["weight_bytes"] == sum(p.numel() * 4 for p in loaded.model.parameters())


def test_the_kvpress_target_is_parity_on_cpu_and_a_lead_on_a_gpu():
    from benchmarks.vs_kvpress import target

    assert target(Context(Settings(device="cpu"))) == 1.05
    assert target(Context(Settings(device="cuda:1"))) == target(Context(Settings(device="cuda"))) == 0.95
