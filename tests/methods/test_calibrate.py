"""Calibration attention probe on a tiny random Llama: query-only rows and the Eq. 4 error."""

from __future__ import annotations

import pytest
import torch

from methods.attention_probe import reserved_cache
from methods.calibrate import AttentionProbe, build_parser, main

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
def test_reserved_cache_gives_the_same_logits_and_rows_as_dynamic_cache(reserve):
    lm, cfg = _tiny("sdpa")
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(3))
    probe = AttentionProbe(cfg.num_hidden_layers)
    probe.install(lm)
    runs = []
    for cache in (None, reserved_cache(cfg, reserve=reserve)):
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
    assert type(past.layers[0]).__name__ == "ReservedLayer" and past.layers[0]._bufs[0].shape[-2] >= 21
    assert torch.equal(l0, l1) and all(torch.equal(a, b) for a, b in zip(r0, r1))


def test_cli_parses_both_commands():
    p = build_parser()
    a = p.parse_args(["heads", "--lengths", "1000,2000", "--kinds", "srh"])
    assert a.command == "heads" and a.lengths == [1000, 2000] and a.kinds == ["srh"] and a.name == "smollm2"
    assert a.depths == [0.0, 50.0, 100.0]  # the defaults go through the same parsing
    b = p.parse_args(["layers", "--data", "x.jsonl", "--budget", "32"])
    assert b.command == "layers" and b.data == ["x.jsonl"] and b.budget == 32


@pytest.mark.parametrize("argv, message", [
    (["heads", "--lengths", "1000,abc"], "argument --lengths: '1000,abc': comma-separated ints expected"),
    (["heads", "--lengths", "0"], "argument --lengths: '0': each value >= 1"),
    (["heads", "--depths", "50,101"], "argument --depths: '50,101': each value in [0, 100]"),
    (["heads", "--kinds", "srh,xx"], "argument --kinds: 'srh,xx': accepted values are trh, srh, r2"),
])
def test_cli_rejects_bad_lists_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


def test_bad_model_is_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """A missing path, a folder without a model and an uncached Hub id (offline) are one line, exit 2."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    data.mkdir()
    cases = {"/no/such/model": "--model='/no/such/model': no such file or folder",
             str(tmp_path): f"--model='{tmp_path}': not a model folder (no config.json in it)",
             "no-org/no-such-model-kvbench": "--model='no-org/no-such-model-kvbench': cannot load it from the "
                                             "Hugging Face Hub"}
    for model, message in cases.items():
        assert main(["heads", "--model", model, "--data-dir", str(data)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
