"""Bad input to ``python -m kvbench.latency`` is one line and exit 2, before any model loads."""

from __future__ import annotations

import json

import pytest

from kvbench import latency


@pytest.mark.parametrize("argv, line", [
    (["--methods", "full", "snapkvv"], "--methods snapkvv: unknown method preset; accepted values are adacompresskv"),
    (["modle=smollm2"], "modle=smollm2: unknown config key (did you mean model?); accepted keys are budget, "),
    (["--lengths", "512", "-5"], "--lengths -5: must be an integer >= 1"),
    (["--new-tokens", "0"], "--new-tokens 0: must be an integer >= 1"),
    (["--repeats", "0"], "--repeats 0: must be an integer >= 1"),
    # the job runner's validation, per method config, before the model loads
    (["budget=0", "--methods", "full", "snapkv"], "method=full: budget=0: must be > 0"),
    (["budget=abc", "--methods", "snapkv"], "method=snapkv: budget='abc': must be a retention ratio"),
    (["budget=16", "--methods", "full", "snapkv"], "method=snapkv: budget=16: smaller than the 32 tokens"),
    (["budget=0.25", "method.window_size=0"], "method=selkv: method.window_size=0: must be an integer >= 1"),
    # overrides after the options are overrides, not presets or lengths
    (["--methods", "full", "snapkv", "budget=0"], "method=full: budget=0: must be > 0"),
    (["--lengths", "512", "1024", "budget=16", "--methods", "snapkv"], "method=snapkv: budget=16: smaller than"),
    (["method.window_size=8", "--methods", "full", "streamingllm"], "method=streamingllm: method.window_size=8: "
                                                                   "unknown key for method streamingllm; accepted "),
])
def test_bad_input_is_one_line(argv, line, capsys):
    with pytest.raises(SystemExit) as exc:
        latency.main(argv)
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"python -m kvbench.latency: error: {line}")


def test_out_never_replaces_stored_files(tmp_path, capsys):
    """--out that is a job's file, lies in a job folder, is a folder or is another kind of file:
    one line, exit 2, before any model loads; nothing written."""
    job = tmp_path / "results" / "niah" / "m" / "full" / "b1"
    job.mkdir(parents=True)
    for name in ("config.yaml", "predictions.jsonl", "summary.json"):
        (job / name).write_text("kept\n")
    (tmp_path / "notes.json").write_text('{"a": 1}')
    for out, message in ((job / "summary.json", "summary.json is a job folder's own file"),
                         (job / "latency.json", f"inside the job folder {job}"),
                         (tmp_path / "results", "is a folder; pass a file path"),
                         (tmp_path / "notes.json", "exists and is not a latency record list")):
        with pytest.raises(SystemExit) as exc:
            latency.main(["--methods", "full", "--out", str(out), "budget=0.5"])
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and f"--out {str(out)!r}: {message}" in last, last
    assert all((job / n).read_text() == "kept\n" for n in ("config.yaml", "predictions.jsonl", "summary.json"))
    assert not (job / "latency.json").exists()


def test_an_earlier_latency_file_is_kept(tmp_path):
    """A second run to the same --out keeps the first run's records as latency.<time>.json."""
    from types import SimpleNamespace

    class Engine:
        model = SimpleNamespace(config=SimpleNamespace(vocab_size=100, max_position_embeddings=4096))

        def __init__(self, _cfg):
            pass

        def generate(self, ids, n, stop_ids):
            return SimpleNamespace(prefill_s=0.1, compress_s=0.0, decode_s=0.2, generated_tokens=n,
                                   decode_tok_s=n / 0.2, peak_rss_bytes=1, cache_bytes_before=8,
                                   cache_bytes_after=8)

    out = tmp_path / "latency.json"
    first = latency.run_latency({"name": "tiny"}, {"full": {"name": "full"}}, 0.25, [64], 4, 1, out,
                                make_engine=Engine, log=lambda _m: None)
    logged = []
    latency.run_latency({"name": "tiny"}, {"full": {"name": "full"}}, 0.25, [128], 4, 1, out,
                        make_engine=Engine, log=logged.append)
    (kept,) = tmp_path.glob("latency.*.json")
    assert json.loads(kept.read_text()) == first and json.loads(out.read_text())[0]["prompt_tokens"] == 128
    assert f"{out} of an earlier run is kept as {kept.name}" in logged


def test_lengths_over_the_context_window_are_refused_before_loading(tmp_path, capsys, monkeypatch):
    """The context window comes from the model's config alone: a run that would skip every
    length is refused up front (it used to load the model, then exit 1)."""
    from transformers import LlamaConfig

    LlamaConfig(max_position_embeddings=1000).save_pretrained(tmp_path / "m")
    monkeypatch.setattr(latency, "run_latency", lambda *a, **k: pytest.fail("would load the model"))
    src = f"model.source={tmp_path / 'm'}"
    for argv, line in ((["--lengths", "900", "2000", "--methods", "full"],
                        "--lengths 900 2000: every prompt length is over the context window 1000 of model=smollm2 "
                        "minus 256 new tokens (at most 744)"),
                       (["--new-tokens", "1000", "--methods", "full"],
                        "--new-tokens 1000: not below the context window 1000 of model=smollm2")):
        with pytest.raises(SystemExit) as exc:
            latency.main([src, "model.gguf_file=null", *argv])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"python -m kvbench.latency: error: {line}"


def test_lengths_and_methods_take_spaces_or_commas(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(latency, "run_latency", lambda model, methods, budget, lengths, *a, **k:
                        seen.append((list(methods), lengths)) or [{"x": 1}])
    for argv in (["--methods", "full,snapkv", "--lengths", "256,300"], ["--methods", "full", "snapkv", "--lengths",
                                                                          "256", "300"],
                 ["--methods", "full", "--methods", "snapkv", "--lengths", "256", "--lengths", "300"]):
        assert latency.main([*argv, "--out", str(tmp_path / "lat.json")]) == 0
    assert seen == [(["full", "snapkv"], [256, 300])] * 3


def test_threads_key_sets_torchs_threads_before_measuring(tmp_path, monkeypatch):
    """threads=1 is validated and applied, as in a job (it was accepted and ignored)."""
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


def test_ctrl_c_in_the_tools_is_one_line_and_exit_130(capsys, monkeypatch):
    """latency, mask-heads, benchmarks and calibration end a Ctrl-C with one line saying what is
    kept (they printed a KeyboardInterrupt traceback)."""
    import benchmarks.__main__ as bench
    import methods.calibrate as calibrate
    from kvbench import mask_heads
    from kvbench.signals import Terminated

    def stop(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(latency, "compose", stop)
    assert latency.main(["--methods", "full"]) == 130
    assert capsys.readouterr().err.strip() == ("interrupted: the records measured so far are in the output file "
                                               "(rewritten after each one); an earlier file is kept as "
                                               "latency.<time>.json")
    monkeypatch.setattr(mask_heads, "build_parser", stop)
    assert mask_heads.main([]) == 130
    assert capsys.readouterr().err.strip().startswith("interrupted: the conditions that finished are kept in")
    monkeypatch.setattr(bench, "parse_args", stop)
    assert bench.main([]) == 130
    assert "no summary page (--doc, default docs/PERFORMANCE.md) was written" in capsys.readouterr().err

    def term(*_a, **_k):
        raise Terminated

    monkeypatch.setattr(calibrate, "build_parser", term)
    assert calibrate.main([]) == 143
    assert capsys.readouterr().err.strip().startswith("terminated (SIGTERM): nothing was written")


def test_empty_lists_and_an_out_that_cannot_exist_are_refused_before_loading(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    for argv, message in ((["--methods", ""], "--methods '': empty; name at least one value"),
                          (["--methods", "full", "--lengths", ","], "--lengths ',': empty"),
                          (["--methods", "full", "--out", str(tmp_path / "afile" / "l.json")],
                           f"cannot create the folder {tmp_path / 'afile'} ({tmp_path / 'afile'} is a file)")):
        with pytest.raises(SystemExit) as stop:
            latency.main(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_sigterm_in_a_tool_is_the_same_one_line_stop(capsys):
    import os
    import signal

    from kvbench.signals import one_line_stop

    @one_line_stop("the records so far are kept")
    def tool() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    assert tool() == 143
    assert capsys.readouterr().err.strip() == "terminated (SIGTERM): the records so far are kept"
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
