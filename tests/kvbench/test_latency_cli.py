"""``python -m kvbench.tools.latency``: bad input is one line and exit 2 before any model loads; records."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvbench.tools import latency


@pytest.mark.parametrize("argv, key", [
    (["--methods", "full", "snapkvv"], "--methods snapkvv"),
    (["--methods", ""], "--methods"),
    (["modle=smollm2"], "modle=smollm2"),
    (["--lengths", "512", "-5"], "--lengths -5"),
    (["--lengths", ","], "--lengths"),
    (["--new-tokens", "0"], "--new-tokens 0"),
    (["--repeats", "0"], "--repeats 0"),
    (["budget=0", "--methods", "full", "snapkv"], "budget=0"),
    (["budget=abc", "--methods", "snapkv"], "budget='abc'"),
    (["budget=1.5", "--methods", "snapkv"], "budget=1.5"),
    (["method.window_size=8", "--methods", "full", "streamingllm"], "method=streamingllm"),
])
def test_bad_input_is_one_line_and_exit_2(argv, key, capsys, monkeypatch):
    monkeypatch.setattr(latency, "run_latency", lambda *a, **k: pytest.fail("would load the model"))
    with pytest.raises(SystemExit) as exc:
        latency.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and all(part in err[0] for part in key.split(" "))


def test_lengths_and_methods_take_spaces_or_commas_and_overrides_anywhere(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(latency, "run_latency", lambda model, methods, budget, lengths, *a, **k:
                        seen.append((list(methods), lengths, budget)) or [{"x": 1}])
    out = ["--out", str(tmp_path / "lat.json")]
    for argv in (["--methods", "full,snapkv", "--lengths", "256,300", "budget=0.5"],
                 ["--methods", "full", "snapkv", "budget=0.5", "--lengths", "256", "300"],
                 ["budget=0.5", "--methods", "full", "--methods", "snapkv", "--lengths", "256", "--lengths", "300"]):
        assert latency.main([*argv, *out]) == 0
    assert seen == [(["full", "snapkv"], [256, 300], 0.5)] * 3


def test_threads_key_sets_torchs_threads_before_measuring(tmp_path, monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(latency, "run_latency", lambda *a, **k: seen.append(torch.get_num_threads()) or [{"x": 1}])
    before = torch.get_num_threads()
    try:
        assert latency.main(["threads=1", "--methods", "full", "--lengths", "256",
                             "--out", str(tmp_path / "lat.json")]) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


class Engine:
    model = SimpleNamespace(config=SimpleNamespace(vocab_size=300, max_position_embeddings=1000))

    def __init__(self, cfg):
        self.cfg = cfg

    def generate(self, ids, n, stop_ids):
        assert stop_ids == [] and 100 <= min(ids) and max(ids) < 300
        return SimpleNamespace(prefill_s=0.1, compress_s=0.0, decode_s=0.2, generated_tokens=n, decode_tok_s=n / 0.2,
                               peak_prefill_bytes=1, peak_decode_bytes=1, cache_bytes_before=8, cache_bytes_after=8)


def test_records_are_rewritten_after_each_measurement_and_long_prompts_skipped(tmp_path):
    out, logged = tmp_path / "latency.json", []
    recs = latency.run_latency({"name": "tiny"}, {"full": {"name": "full", "label": "Full Cache"},
                                                  "snapkv": {"name": "snapkv"}}, 0.25, [64, 128, 995], 8, 2, out,
                               make_engine=Engine, log=logged.append)
    assert json.loads(out.read_text()) == recs and len(recs) == 8  # 995 + 8 > 1000: skipped
    assert [(r["method"], r["preset"], r["prompt_tokens"], r["repeat"], r["budget"]) for r in recs[::3]] == [
        ("Full Cache", "full", 64, 0, 1.0), ("Full Cache", "full", 128, 1, 1.0), ("snapkv", "snapkv", 128, 0, 0.25)]
    assert recs[0]["decode_tok_s"] == 40 and recs[0]["device"] == "unknown"
    assert any("skipping prompt lengths [995]" in m for m in logged)


def test_prompt_ids_are_deterministic_and_avoid_special_ids():
    ids = latency.prompt_ids(500, 300)
    assert ids == latency.prompt_ids(500, 300) and len(ids) == 500 and 100 <= min(ids) and max(ids) < 300
