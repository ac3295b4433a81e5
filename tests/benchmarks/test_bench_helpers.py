"""Pure helpers of the benchmark suite (no model, no timing)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest

from benchmarks.__main__ import parse_args
from benchmarks.common import BenchResult, Settings, Target, table
from benchmarks.compression import fit_exponent, lookm_score_flops, prefill_flops
from benchmarks.memory import decode_phase_bytes, drop_suffices
from benchmarks.report import contention_note, render
from benchmarks.vs_kvpress import paired_ratios
from benchmarks.worker import release_freed_memory


def test_fit_exponent_recovers_power_laws():
    lengths = [2048, 4096, 8000]
    assert math.isclose(fit_exponent(lengths, [3e-6 * n for n in lengths]), 1.0, abs_tol=1e-9)
    assert math.isclose(fit_exponent(lengths, [1e-9 * n**2 for n in lengths]), 2.0, abs_tol=1e-9)
    assert fit_exponent([4096], [0.1]) is None


def test_decode_phase_bytes_is_above_the_process_baseline():
    assert decode_phase_bytes({"decode_mem_bytes": 1_500, "rss_after_load_bytes": 1_000}) == 500


def test_memory_tolerance_is_two_percent_or_one_megabyte():
    assert drop_suffices(276e6 * 0.981, 276e6) and not drop_suffices(276e6 * 0.979, 276e6)  # 2 % at 8k
    assert drop_suffices(17.7e6 - 0.9e6, 17.7e6) and not drop_suffices(17.7e6 - 1.1e6, 17.7e6)  # 1 MB at 512


def test_table_and_report_show_every_target_verdict():
    text = table(["a", "b"], [["x", 1.23456], ["yy", None]])
    assert text.splitlines()[0] == "| a  | b     |" and "| yy | -     |" in text
    res = BenchResult("decode", "Decode", headers=["n"], rows=[[1]], targets=[
        Target("speed-up", "1.20×", "≥ 1.5×", False), Target("floor", "1.4×", "≤ 2×", True),
        Target("kvpress", "-", "≤ 0.9×", None, "kvpress not importable"),
    ])
    machine = {"date": "today", "cpu": "cpu", "cores": 2, "ram_bytes": 2**31, "device": "cpu", "torch": "t",
               "transformers": "tf", "python": "3", "torch_threads": 2, "omp_wait_policy": "PASSIVE",
               "load_average_start": [7.0, 0, 0], "load_average_end": [1.0, 0, 0], "model": "smollm2", "wall_s": 60}
    page = render(machine, [res], "python -m benchmarks", ["a note"])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines() if line.startswith("| decode")]
    assert rows == [
        ["decode", "speed-up", "1.20×", "≥ 1.5×", "FAIL", ""],
        ["decode", "floor", "1.4×", "≤ 2×", "PASS", ""],
        ["decode", "kvpress", "-", "≤ 0.9×", "SKIP", "kvpress not importable"],
    ]
    assert "`python -m benchmarks --only decode` (0 s)" in page
    res.runs_reused, res.seconds = 8, 0.2  # every worker run memoised from the engine benchmark
    assert ("`python -m benchmarks --only decode` (0 s: its 8 worker runs were made by an earlier benchmark of this "
            "invocation (alone it runs them))") in render(machine, [res], "python -m benchmarks", [])
    res.runs_started = 2
    assert "(0 s; 8 of its 10 worker runs were made by an earlier benchmark)" in render(machine, [res], "c", [])
    assert "CPU contention" in page and "- a note" in page
    assert "JSON for every benchmark under `benchmarks/out/`" in page
    assert "under `/tmp/elsewhere/`" in render(machine, [res], "python -m benchmarks --out /tmp/elsewhere", [],
                                              "/tmp/elsewhere/")
    assert contention_note(dict(machine, load_average_start=[1.0], load_average_end=[1.5])) is None


def test_a_new_run_keeps_the_earlier_outputs(tmp_path, capsys):
    """JSON and a summary outside docs/ are kept as <stem>.<time><suffix> before a rerun
    replaces them (nothing measured is lost); an unchanged file is not copied."""
    from benchmarks.common import save
    from benchmarks.report import write

    save(tmp_path / "decode.json", "{}")
    save(tmp_path / "decode.json", "{}")
    assert [p.name for p in tmp_path.iterdir()] == ["decode.json"]
    save(tmp_path / "decode.json", '{"a": 1}')
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name != "decode.json")
    assert len(kept) == 1 and kept[0].startswith("decode.") and (tmp_path / kept[0]).read_text() == "{}"
    assert (tmp_path / "decode.json").read_text() == '{"a": 1}'
    machine = {"date": "today", "cpu": "cpu", "cores": 2, "ram_bytes": 2**31, "device": "cpu", "torch": "t",
               "transformers": "tf", "python": "3", "torch_threads": 2, "omp_wait_policy": "",
               "load_average_start": [1.0], "load_average_end": [1.0], "model": "smollm2", "wall_s": 60}
    doc = tmp_path / "PERFORMANCE.md"
    write(doc, machine, [], "python -m benchmarks", ["first"])
    write(doc, machine, [], "python -m benchmarks", ["second"])
    earlier = [p for p in tmp_path.glob("PERFORMANCE.*.md")]
    assert len(earlier) == 1 and "- first" in earlier[0].read_text() and "- second" in doc.read_text()
    write(doc, machine, [], "python -m benchmarks", ["third"], keep=False)  # docs/PERFORMANCE.md: git keeps it
    assert len(list(tmp_path.glob("PERFORMANCE.*.md"))) == 1 and "- third" in doc.read_text()


def test_methods_and_lengths_options_restrict_the_run():
    args = parse_args(["--only", "compression", "--methods", "lookm,selkv", "--lengths", "4096", "--lengths", "2048"])
    assert args.names == ["compression"] and args.method_names == ["lookm", "selkv"]
    assert args.prompt_lengths == [2048, 4096]
    settings = Settings(methods=args.method_names, prompt_lengths=args.prompt_lengths)
    assert settings.lengths == [2048, 4096]
    assert settings.selected(["snapkv", "selkv", "lookm"]) == ["selkv", "lookm"]
    assert Settings.from_json(settings.to_json()) == settings  # workers get the same settings
    assert Settings().selected(["a", "b"]) == ["a", "b"] and Settings(quick=True).lengths == [256, 512]
    for bad in (["--methods", "h2o"], ["--lengths", "32"], ["--lengths", "4k"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_flop_counts_by_hand():
    # one layer, one head, d = 2, hidden 2, MLP 3, vocab 5, n = 2 tokens (3 causal pairs)
    cfg = SimpleNamespace(hidden_size=2, intermediate_size=3, num_hidden_layers=1, num_attention_heads=1,
                          num_key_value_heads=1, head_dim=2, vocab_size=5)
    per_token = 2 * 2 * 2 + 2 * 2 * 2 + 3 * 2 * 3  # q+o, k+v, gate/up/down (MACs)
    assert prefill_flops(cfg, 2) == 2 * (per_token * 2 + 2 * 2 * 3 + 2 * 5)  # + QK^T, PV over 3 pairs, LM head
    assert lookm_score_flops(cfg, 2) == 2 * 2 * 3  # QK^T over 3 pairs
    smol = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=64, vocab_size=49152)
    assert lookm_score_flops(smol, 4096) / prefill_flops(smol, 4096) == pytest.approx(0.20, abs=0.005)


def test_release_freed_memory_runs_anywhere():
    assert release_freed_memory() in (True, False)


def test_worker_runs_are_memoised_and_bandwidth_is_measured_only_when_asked(tmp_path, monkeypatch):
    import json
    import subprocess

    from benchmarks import context as context_mod
    from benchmarks.worker import MARKER

    calls = []

    def fake_run(cmd, **kwargs):
        spec = json.loads(cmd[-1])
        calls.append(spec["bandwidth"])
        result = {"method": spec["method"], **({"read_bandwidth_Bps": 1.0} if spec["bandwidth"] else {})}
        return subprocess.CompletedProcess(cmd, 0, stdout=MARKER + json.dumps(result) + "\n")

    monkeypatch.setattr(context_mod, "local_model_config", lambda settings: None)
    monkeypatch.setattr(context_mod.subprocess, "run", fake_run)
    ctx = context_mod.Context(Settings(out=str(tmp_path)))
    assert "read_bandwidth_Bps" not in ctx.engine_run("snapkv", 0.25, 512, bandwidth=False)
    ctx.engine_run("snapkv", 0.25, 512, bandwidth=False)  # memoised
    assert ctx.engine_run("snapkv", 0.25, 512)["read_bandwidth_Bps"] == 1.0  # rerun: the floor needs it
    ctx.engine_run("snapkv", 0.25, 512, bandwidth=False)  # served by the run with bandwidth
    assert calls == [False, True]
    assert (ctx.runs_started, ctx.runs_reused) == (2, 2)  # the summary's per-benchmark counts


def test_memory_workers_run_without_mkls_buffer_pool_and_are_memoised_apart(tmp_path, monkeypatch):
    import json
    import subprocess

    from benchmarks import context as context_mod
    from benchmarks.worker import MARKER

    envs = []

    def fake_run(cmd, **kwargs):
        envs.append(kwargs["env"].get("MKL_DISABLE_FAST_MM"))
        return subprocess.CompletedProcess(cmd, 0, stdout=MARKER + json.dumps({"read_bandwidth_Bps": 1.0}) + "\n")

    monkeypatch.delenv("MKL_DISABLE_FAST_MM", raising=False)
    monkeypatch.setattr(context_mod, "local_model_config", lambda settings: None)
    monkeypatch.setattr(context_mod.subprocess, "run", fake_run)
    ctx = context_mod.Context(Settings(out=str(tmp_path)))
    ctx.engine_run("snapkv", 0.25, 512)
    ctx.engine_run("snapkv", 0.25, 512, bandwidth=False, mkl_pool=False)  # not served by the pooled run
    ctx.engine_run("snapkv", 0.25, 512, bandwidth=False, mkl_pool=False)  # memoised
    assert envs == [None, "1"]


def test_peak_rss_is_the_processs_own_and_restarts(tmp_path):
    """``ru_maxrss`` starts a child at its parent's resident size; VmHWM does not."""
    import subprocess
    import sys

    import torch

    from kvbench.engine import peak_rss_bytes, reset_peak_rss

    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc (not Linux)")
    big = torch.ones(256 << 20)  # 1 GiB, touched: this process's resident set is above it
    assert peak_rss_bytes() >= big.numel() * 4
    code = (
        "import resource; from kvbench.engine import peak_rss_bytes; "
        "print(peak_rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    child_peak, _child_maxrss = map(int, out.stdout.split())
    assert child_peak < big.numel() * 4  # importing torch takes far less than the parent's 1 GiB
    del big
    assert reset_peak_rss()
    from benchmarks.common import rss_now

    assert peak_rss_bytes() < rss_now() + (256 << 20)  # the freed GiB no longer counts


def test_targets_measured_off_their_length_are_reported_not_judged():
    from benchmarks.common import off_target_length

    assert off_target_length(4096, 4096) == ""
    off = off_target_length(512, 4096)
    assert "4096" in off and "512" in off
    failing = Target("x at 512 tokens", "8.3 %", "≤ 5%", False, off_target=off)
    assert failing.verdict == "INFO" and failing.note.startswith("not judged: ") and "outside the bound" in failing.note
    assert Target("x", "1 %", "≤ 5%", True, note="n", off_target=off).verdict == "INFO"
    assert Target("x", "-", "≤ 5%", None, off_target=off).verdict == "SKIP"
    assert Target("x", "8.3 %", "≤ 5%", False).verdict == "FAIL"
    # a scaling exponent fitted over other lengths than the target's (--quick: 256, 512) is not judged
    from benchmarks.common import off_target_lengths

    assert off_target_lengths([2048, 4096, 8000], [2048, 4096, 8000]) == ""
    off = off_target_lengths([256, 512], [2048, 4096, 8000])
    assert "256, 512" in off and "2048, 4096, 8000" in off
    assert Target("exponent", "-0.00", "≈ 1 (≤ 1.2)", True, off_target=off).verdict == "INFO"


def test_step_read_pattern_reads_each_storage_once_and_the_filled_cache():
    """The read-pattern floor reads every parameter storage once (fused buffers, tied
    embeddings) plus each layer's filled keys and values, not the reserved slots."""
    import torch

    from benchmarks.common import step_read_pattern, weight_bytes
    from kvbench.engine import Engine
    from methods.snapkv import SnapKV, SnapKVConfig
    from tests.conftest import loaded_for, tiny_model

    model = tiny_model("llama", layers=2, n_kv=2, n_q=4)
    loaded = loaded_for(model)
    engine = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 0.5)
    engine.generate(list(range(3, 43)), 5, stop_ids=[])  # 40 prompt tokens, 20 kept per head, 4 decoded
    cache = engine.last_state.cache
    filled = sum(lay.keys.numel() * 4 + lay.values.numel() * 4 for lay in cache.layers)
    reserved = sum(lay._key_buf.numel() * 4 for lay in cache.layers)
    assert cache.layers[0].keys.shape[-2] == 20 + 4 and reserved > filled / 2
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert len(storages) < len(list(model.parameters()))  # fused q/k/v and gate/up share storages
    out = step_read_pattern(model, cache, reps=1)
    assert out["bytes"] == sum(storages.values()) + filled == weight_bytes(model) + filled
    assert out["seconds"] > 0


def test_bandwidth_probe_is_four_times_the_last_level_cache(tmp_path, monkeypatch):
    import benchmarks.common as common

    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "491520K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert common.last_level_cache_bytes("cpu", tmp_path) == 480 << 20
    assert common.last_level_cache_bytes("cpu", tmp_path / "missing") == 0

    monkeypatch.setattr(common, "_available_bytes", lambda device: 64 << 30)
    monkeypatch.setattr(common, "last_level_cache_bytes", lambda device: 480 << 20)
    assert common.probe_bytes() == 1920 << 20  # 4 × LLC, beyond the 256 MiB minimum
    monkeypatch.setattr(common, "last_level_cache_bytes", lambda device: 32 << 20)
    assert common.probe_bytes() == 256 << 20  # small caches: the minimum
    monkeypatch.setattr(common, "last_level_cache_bytes", lambda device: 480 << 20)
    monkeypatch.setattr(common, "_available_bytes", lambda device: 4 << 30)
    assert common.probe_bytes() == 1 << 30  # capped at a quarter of free memory
    monkeypatch.setattr(common, "_available_bytes", lambda device: 256 << 20)
    assert common.probe_bytes() == 256 << 20  # never below the minimum


def test_kvpress_paired_ratios_pair_each_repetition():
    times = {"kvbench": [5.0, 4.5, 6.0], "kvpress": [5.5, 5.0, 5.0]}
    assert paired_ratios(times) == pytest.approx([5.0 / 5.5, 0.9, 1.2])


def test_kvpress_result_reports_the_ratio_of_medians_and_each_repetition(monkeypatch, tmp_path):
    import subprocess

    from benchmarks import vs_kvpress

    data = {"times_s": {"kvbench": [5.0, 4.5, 6.0], "kvpress": [5.5, 5.0, 5.0]},
            "median_s": {"kvbench": 5.0, "kvpress": 5.0}, "new_tokens": 32,
            "prompt_tokens": {"kvbench": 2048, "kvpress": 2048}, "kept": {"kvbench": 512, "kvpress": 510},
            "answers": {}, "same_answer": True, "setting": {}}

    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 0, stdout="kvpress 0.5.5 transformers 5.2.0", stderr="")

    monkeypatch.setattr(vs_kvpress.subprocess, "run", fake_run)
    monkeypatch.setattr(vs_kvpress, "_alternate", lambda ctx, pythons, reps: data)
    ctx = SimpleNamespace(settings=Settings(out=str(tmp_path)), logs=tmp_path)
    res = vs_kvpress.run(ctx)
    assert res.targets[0].passed is False and res.targets[0].measured == "1.000×"  # 5.0 / 5.0 > 0.9
    assert res.data["paired_ratios"] == pytest.approx([5.0 / 5.5, 0.9, 1.2])
    assert "own ratios (kvbench / the adjacent kvpress run): 0.900–1.200, median 0.909" in " ".join(res.notes)


def test_kvpress_sides_run_in_their_own_processes_alternately(monkeypatch, tmp_path):
    from benchmarks import vs_kvpress

    events = []

    class FakeSide:
        def __init__(self, ctx, name, python):
            self.name, self.runs = name, 0
            events.append(("start", name, python))

        def reply(self):  # the ready line
            events.append(("ready", self.name))
            return {"ready": self.name, "answer": " same ", "prompt_tokens": 2048,
                    "kept": 512.0 if self.name == "kvbench" else 510}

        def run(self):
            self.runs += 1
            events.append(("run", self.name))
            seconds = {"kvbench": 4.0, "kvpress": 5.0}[self.name] + self.runs / 10
            return {"seconds": seconds, "answer": "same"}

        def close(self):
            events.append(("close", self.name))

    monkeypatch.setattr(vs_kvpress, "_Side", FakeSide)
    ctx = SimpleNamespace(settings=Settings(out=str(tmp_path)), logs=tmp_path)
    data = vs_kvpress._alternate(ctx, {"kvbench": "/py/ours", "kvpress": "/py/theirs"}, reps=3)
    # Loads one after the other (each waits for the previous one's ready line), then A B, B A, A B.
    assert events[:4] == [("start", "kvbench", "/py/ours"), ("ready", "kvbench"),
                          ("start", "kvpress", "/py/theirs"), ("ready", "kvpress")]
    assert [e[1] for e in events if e[0] == "run"] == ["kvbench", "kvpress", "kvpress", "kvbench", "kvbench", "kvpress"]
    assert events[-2:] == [("close", "kvbench"), ("close", "kvpress")]
    assert data["times_s"] == {"kvbench": pytest.approx([4.1, 4.2, 4.3]), "kvpress": pytest.approx([5.1, 5.2, 5.3])}
    assert data["median_s"] == {"kvbench": pytest.approx(4.2), "kvpress": pytest.approx(5.2)}
    assert data["kept"] == {"kvbench": 512.0, "kvpress": 510} and data["same_answer"] is True


def test_kvpress_side_that_dies_names_its_log(tmp_path):
    import sys as _sys

    from benchmarks import vs_kvpress

    ctx = SimpleNamespace(settings=Settings(out=str(tmp_path)), logs=tmp_path)
    side = vs_kvpress._Side(ctx, "kvpress", _sys.executable)
    side.proc.kill()  # whatever it was doing: it never answers
    with pytest.raises(RuntimeError, match=r"the kvpress process failed .*\(log: .*kvpress\.log\)"):
        side.reply()
    side.close()


def test_out_and_doc_never_write_into_a_job_folder(tmp_path, capsys):
    job = tmp_path / "niah" / "m" / "full" / "b1"
    job.mkdir(parents=True)
    for name in ("config.yaml", "predictions.jsonl"):
        (job / name).write_text("kept\n")
    (tmp_path / "notes.md").write_text("# My notes\n")
    for argv, message in ((["--out", str(job)], f"--out {str(job)!r}: inside the job folder {job}"),
                          (["--doc", str(job / "predictions.jsonl")], "predictions.jsonl is a job folder's own file"),
                          (["--doc", str(tmp_path / "notes.md")], "exists and is not a performance summary")):
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    assert (job / "predictions.jsonl").read_text() == "kept\n"


def test_a_busy_cpu_is_named_before_the_suite_starts():
    from benchmarks.__main__ import busy_warning

    assert busy_warning(0.4, 2, "cpu") is None and busy_warning(0.9, 2, "cpu") is None
    assert busy_warning(3.1, 2, "cpu").startswith("warning: the CPU is busy (1-minute load average 3.1 on 2 cores)")
    assert busy_warning(1.0, 2, "auto") and not busy_warning(3.1, 2, "cuda")  # a GPU suite times the GPU
    assert busy_warning(3.0, 16, "cpu") is None and busy_warning(8.0, 16, "cpu")


def test_device_and_threads_are_checked_before_anything_runs(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    for argv, message in ((["--device", "gpu"], "--device gpu: accepted values are auto, cpu, cuda, cuda:<index>, mps"),
                          (["--threads", "0"], "--threads 0: must be an integer >= 1"),
                          (["--model", "nomodel"], "--model=nomodel: no such model config; accepted values are "),
                          (["--out", str(tmp_path / "afile")], "a file, not a folder"),
                          (["--lengths", "100000"], "--lengths 100000: over the context window 8192 of "
                                                    "--model=smollm2 minus 32 generated tokens (at most 8160)")):
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():  # this tool's own flag syntax in the advice, not run.py's
        with pytest.raises(SystemExit):
            parse_args(["--device", "cuda"])
        assert ("--device cuda: CUDA is not available on this machine; use --device auto or --device cpu"
                in capsys.readouterr().err)


def _decode_run(step_ms, pattern_ms, cache_mb, bandwidth=10e9):
    return {"prompt_tokens": 8000, "decode_step_median_ms": step_ms, "step_read_pattern_s": pattern_ms / 1000,
            "weight_bytes": 538e6, "cache_bytes_after": cache_mb * 1e6, "read_bandwidth_Bps": bandwidth,
            "decode_mem_bytes": 1e9, "peak_bytes": 2e9}


def _decode_suite(runs, rounds):
    """The decode benchmark on recorded worker results: ``runs`` per method (separate processes),
    ``rounds``: ``[(full, 25 %), ...]`` of the in-process A/B."""
    from benchmarks import decode

    def paired_run(configs, n, n_rounds):
        assert [c[0] for c in configs] == ["full", "25%"] and n == 8000 and n_rounds == 3
        return {"weight_bytes": 538e6, "rounds": [
            {"full": {k: v for k, v in f.items() if k != "weight_bytes"}, "25%": c} for f, c in rounds]}

    ctx = SimpleNamespace(settings=Settings(prompt_lengths=[8000]),
                          engine_run=lambda method, budget, n: runs[method], paired_run=paired_run)
    return decode.run(ctx)


def test_empty_lists_unmakeable_out_and_a_missing_kvpress_python_stop_before_anything_runs(capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    for argv, message in ((["--only", ""], "--only '': empty; name at least one value"),
                          (["--lengths", " "], "--lengths ' ': empty"),
                          (["--out", str(tmp_path / "afile" / "x")], f"cannot create the folder {tmp_path / 'afile' / 'x'} "
                                                                      f"({tmp_path / 'afile'} is a file)"),
                          (["--only", "kvpress", "--kvpress-python", str(tmp_path / "nope")],
                           "not an executable file; pass the python of an environment with kvpress installed")):
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        assert stop.value.code == 2 and message in capsys.readouterr().err


def test_list_flags_take_spaces_commas_or_repeats():
    for argv in (["--lengths", "256", "512", "--only", "decode", "memory"], ["--lengths", "256,512", "--only",
                                                                             "decode,memory"],
                 ["--lengths", "512", "--lengths", "256", "--only", "memory", "--only", "decode"]):
        args = parse_args(argv)
        assert args.prompt_lengths == [256, 512] and args.names == ["decode", "memory"]


def test_lengths_leave_room_for_the_tokens_a_sample_generates(capsys):
    """32 generated tokens in a full run, 8 with --quick: 8180 + 8 fits SmolLM2's 8192-token window."""
    assert parse_args(["--quick", "--lengths", "8180"]).prompt_lengths == [8180]
    with pytest.raises(SystemExit) as stop:
        parse_args(["--lengths", "8180"])
    assert stop.value.code == 2 and "minus 32 generated tokens (at most 8160)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--quick", "--lengths", "8190"])
    assert "minus 8 generated tokens (at most 8184)" in capsys.readouterr().err


def test_decode_targets_are_judged_on_the_alternating_rounds():
    """Speed-up = median of the rounds' own ratios; step / floor = median over the rounds. The
    separate processes (here a 1.25× "speed-up" from a slow 25 % process) are reported, not judged."""
    runs = {"full": _decode_run(150.0, 120.0, 369), "snapkv": _decode_run(120.0, 80.0, 92)}
    # floors at 10 GB/s: full (538 + 369) MB -> 90.7 ms, 25 % (538 + 92) MB -> 63.0 ms
    rounds = [(_decode_run(160.0, 120.0, 369), _decode_run(100.0, 80.0, 92)),  # 1.60×
              (_decode_run(170.0, 120.0, 369), _decode_run(110.0, 80.0, 92)),  # 1.545×
              (_decode_run(190.0, 120.0, 369), _decode_run(140.0, 80.0, 92))]  # 1.357×
    res = _decode_suite(runs, rounds)
    speedup, full, comp = res.targets
    assert speedup.measured == "1.55× (median of 3 alternating rounds: 1.60, 1.55, 1.36)"
    assert speedup.verdict == "PASS" and "separate worker processes (table above): 1.25×" in speedup.note
    assert full.measured == "1.87× (medians of 3 rounds: 170.0 ms vs 90.7 ms)" and full.verdict == "PASS"
    assert comp.measured == "1.75× (medians of 3 rounds: 110.0 ms vs 63.0 ms)" and comp.verdict == "PASS"
    (extra,) = res.tables
    assert [row[:2] for row in extra["rows"]] == [[1, "full"], [1, "25%"], [2, "full"], [2, "25%"], [3, "full"],
                                                 [3, "25%"]]
    assert [row[-1] for row in extra["rows"]][1::2] == pytest.approx([1.6, 170 / 110, 190 / 140])
    # slower rounds: speed-ups 1.60, 1.538, 1.357 (median 1.538); medians 190 ms (2.09×) and 130 ms (2.06×)
    rounds[1] = (_decode_run(200.0, 120.0, 369), _decode_run(130.0, 80.0, 92))
    res = _decode_suite(runs, rounds)
    assert [t.verdict for t in res.targets] == ["PASS", "FAIL", "FAIL"]


def test_decode_steps_below_their_floor_are_reported_not_judged():
    """A step faster than (weights + cache) / measured bandwidth is a measurement under changing
    CPU load, not a result: the targets at that length become INFO with a note."""
    runs = {"full": _decode_run(150.0, 120.0, 369), "snapkv": _decode_run(100.0, 80.0, 92)}
    good = [(_decode_run(150.0, 120.0, 369), _decode_run(100.0, 80.0, 92))] * 3
    res = _decode_suite(runs, good)
    assert not any(n.startswith("unreliable") for n in res.notes)
    assert [t.verdict for t in res.targets] == ["PASS", "PASS", "PASS"]
    res = _decode_suite({"full": runs["full"], "snapkv": _decode_run(57.8, 36.0, 92)}, good)
    (note,) = [n for n in res.notes if n.startswith("unreliable")]
    assert "8000 tokens 25%: step 0.92× the floor, read pattern 0.57× the floor" in note
    assert [t.verdict for t in res.targets] == ["INFO", "INFO", "INFO"]
    res = _decode_suite(runs, good[:2] + [(_decode_run(150.0, 120.0, 369), _decode_run(57.8, 80.0, 92))])
    (note,) = [n for n in res.notes if n.startswith("unreliable")]
    assert note.startswith("unreliable: measured below the memory-traffic floor or faster than its own reads (8000 "
                           "tokens 25%, round 3 in one process: step 0.92× the floor, step 0.72× its read pattern)")
    assert [t.verdict for t in res.targets] == ["INFO", "INFO", "INFO"]
    assert all("not judged: unreliable: a step at 8000 tokens measured below the floor" in t.note for t in res.targets)
    # only the read pattern below its floor (the step itself 1.65× above it): named as such; then a step
    # above its floor but faster than a bare read of its own tensors (the read pattern, 1.5× its step)
    for pattern_ms, named, off in [
        (80.0, "read pattern 0.88× the floor", "a step's read pattern at 8000 tokens measured below the floor"),
        (225.0, "step 0.67× its read pattern", "a step at 8000 tokens measured faster than reading its own tensors"),
    ]:
        res = _decode_suite(runs, good[:2] + [(_decode_run(150.0, pattern_ms, 369), _decode_run(100.0, 80.0, 92))])
        (note,) = [n for n in res.notes if n.startswith("unreliable")]
        assert f"8000 tokens full, round 3 in one process: {named})" in note
        assert [t.verdict for t in res.targets] == ["INFO", "INFO", "INFO"]
        assert all(f"not judged: unreliable: {off}" in t.note for t in res.targets)


def test_compression_builds_lookms_kernels_before_it_times_anything(monkeypatch):
    """A first use compiles the kernels: the benchmark loads them before its timed passes, for LOOK-M on CPU only."""
    import torch

    from benchmarks.compression import prepare_kernels
    from methods import cpu_kernels

    calls = []
    monkeypatch.setattr(cpu_kernels, "load", lambda: calls.append(1) or object())
    assert not prepare_kernels({"snapkv": None}, torch.device("cpu")) and not calls
    assert not prepare_kernels({"lookm": None}, torch.device("cuda")) and not calls
    assert prepare_kernels({"snapkv": None, "lookm": None}, torch.device("cpu")) and calls == [1]
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # no compiler: LOOK-M uses PyTorch operations
    assert not prepare_kernels({"lookm": None}, torch.device("cpu"))


def test_compression_names_the_methods_it_does_not_time():
    from benchmarks import compression

    ctx = SimpleNamespace(settings=Settings(methods=["streamingllm"]))  # no model: it must not load one
    res = compression.run(ctx)
    assert res.skipped == ("--methods streamingllm: not measured by this benchmark (it times the score-based "
                           "methods: snapkv, pyramidkv, adakv, headkv, lookm, selkv, compresskv)")


@pytest.mark.parametrize("fused", ["on", "off"])
def test_compression_counts_lookms_score_inside_the_prefill_attention(fused):
    """LOOK-M fused: the recorded layers' column sums are computed and their extra time is added."""
    import torch

    from benchmarks.compression import _compress_all, _in_prefill_scores
    from methods.base import HeadLayout, LayerContext
    from methods.lookm import LookM, LookMConfig, cumulative_attention

    layout = HeadLayout(num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8, compressible_layers=(0, 1))
    g = torch.Generator().manual_seed(3)
    contexts = {i: LayerContext(layer_idx=i, layout=layout, keys=torch.randn(1, 2, 40, 8, generator=g),
                                values=torch.randn(1, 2, 40, 8, generator=g),
                                window_queries=torch.randn(1, 4, 40, 8, generator=g), scaling=0.35, budget=40)
                for i in range(2)}
    method = LookM(LookMConfig(fused_score=fused), layout)
    sums, extra = _in_prefill_scores(method, contexts)
    total, in_prefill = _compress_all(method, contexts, 40, layout, reserve=2)
    if fused == "off":
        assert (sums, extra, in_prefill) == ({}, 0.0, 0.0) and total > 0
        return
    assert sorted(sums) == [0, 1] and isinstance(extra, float) and total >= in_prefill
    for i, ctx in contexts.items():
        assert torch.equal(sums[i], cumulative_attention(ctx.window_queries, ctx.keys, 0.35, None, 512))
