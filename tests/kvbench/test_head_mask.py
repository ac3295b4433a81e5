"""HeadMask on tiny random models: each mode equals the same model with the head's weights zeroed."""

from __future__ import annotations

import copy

import pytest
import torch

from kvbench.engine.models import attention_modules
from kvbench.tools.mask_heads import HeadMask
from kvbench.engine.models import head_layout
from methods.base import ConfigError
from tests.conftest import tiny_model

HEADS = [(0, 1), (1, 3), (1, 0)]


def _ids(n: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _zeroed(model, heads, where: str):
    """A copy of ``model`` whose masked heads are removed in the weights: o_proj input columns
    (``where="o"``) or q_proj output rows and bias (``where="q"``) of each head."""
    ref = copy.deepcopy(model)
    d = ref.config.head_dim
    mods = attention_modules(ref)
    with torch.no_grad():
        for layer, h in heads:
            if where == "o":
                mods[layer].o_proj.weight[:, h * d : (h + 1) * d] = 0
            else:
                mods[layer].q_proj.weight[h * d : (h + 1) * d] = 0
                if mods[layer].q_proj.bias is not None:
                    mods[layer].q_proj.bias[h * d : (h + 1) * d] = 0
    return ref


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("mode,where", [("zero", "o"), ("uniform", "q")])
@torch.no_grad()
def test_mode_equals_the_heads_weights_zeroed(family, mode, where):
    """zero = o_proj input columns of the heads zeroed; uniform = their q_proj rows (and bias) zeroed."""
    model = tiny_model(family, n_kv=2, n_q=4)
    ids = _ids()
    expected = _zeroed(model, HEADS, where)(input_ids=ids).logits
    plain = model(input_ids=ids).logits
    with HeadMask(model, head_layout(model.config), HEADS, mode=mode):
        masked = model(input_ids=ids).logits
    torch.testing.assert_close(masked, expected, rtol=1e-5, atol=1e-5)
    assert (masked - plain).abs().max() > 1e-3  # the heads did contribute
    torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)  # hooks removed on exit


@torch.no_grad()
def test_zero_mode_single_head_changes_only_its_columns_of_o_proj_input():
    model = tiny_model("llama", n_kv=2, n_q=4)
    attn = attention_modules(model)[1]
    seen = {}
    # a forward hook sees the input o_proj really got (after every pre-hook)
    hook = attn.o_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("x", a[0].clone()))
    with HeadMask(model, head_layout(model.config), [(1, 2)], mode="zero"):
        model(input_ids=_ids())
    masked_in = seen["x"]
    model(input_ids=_ids())
    hook.remove()
    plain_in = seen["x"]  # (1, q, H_q·d): head 2 is columns 32..47 (d = 16)
    assert masked_in[..., 32:48].abs().max() == 0 and plain_in[..., 32:48].abs().max() > 0
    torch.testing.assert_close(masked_in[..., :32], plain_in[..., :32], rtol=0, atol=0)
    torch.testing.assert_close(masked_in[..., 48:], plain_in[..., 48:], rtol=0, atol=0)


@torch.no_grad()
def test_uniform_head_output_is_the_mean_of_visible_values():
    model = tiny_model("llama", n_kv=2, n_q=4)
    attn = attention_modules(model)[0]
    d, g = 16, 2
    seen = {}
    attn.o_proj.register_forward_pre_hook(lambda m, a: seen.__setitem__("x", a[0].clone()))
    attn.v_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out.clone()))
    with HeadMask(model, head_layout(model.config), [(0, 3)], mode="uniform"):
        model(input_ids=_ids(10))
    v = seen["v"][0].view(10, 2, d)[:, 3 // g]  # (q, d): the KV head of query head 3 (layer 0: no RoPE on values)
    running_mean = v.cumsum(0) / torch.arange(1, 11).unsqueeze(1)  # causal: position i sees 0..i
    torch.testing.assert_close(seen["x"][0, :, 3 * d : 4 * d], running_mean, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,where", [("zero", "o"), ("uniform", "q")])
@torch.no_grad()
def test_decode_phase_equals_unmasked_prefill_then_masked_last_token(mode, where):
    """Wu et al.'s procedure: prefill prompt[:-1] unmasked, feed the last prompt token masked."""
    model = tiny_model("llama", n_kv=2, n_q=4)
    ids = _ids(14)
    past = model(input_ids=ids[:, :-1], use_cache=True).past_key_values
    expected = _zeroed(model, HEADS, where)(input_ids=ids[:, -1:], past_key_values=past, use_cache=True).logits[0, -1]
    plain = model(input_ids=ids).logits[0]
    with HeadMask(model, head_layout(model.config), HEADS, mode=mode, phase="decode"):
        out = model(input_ids=ids).logits[0]
    torch.testing.assert_close(out[-1], expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[:-1], plain[:-1], rtol=0, atol=0)  # earlier positions untouched


@torch.no_grad()
def test_no_heads_is_the_unmasked_model():
    model = tiny_model("llama", n_kv=2, n_q=4)
    ids = _ids()
    plain = model(input_ids=ids).logits
    for mode in ("zero", "uniform"):
        with HeadMask(model, head_layout(model.config), [], mode=mode):
            torch.testing.assert_close(model(input_ids=ids).logits, plain, rtol=0, atol=0)


def test_engine_generation_with_mask_uses_kvbench_attention():
    """Through the engine (kvbench attention, preallocated cache): masked ≠ plain, mask-less = plain."""
    from kvbench.engine.generate import Engine
    from methods.full import FullCache
    from tests.conftest import loaded_for

    loaded = loaded_for(tiny_model("llama", n_kv=2, n_q=4))
    engine = Engine(loaded, FullCache(None, loaded.layout), budget=1.0)
    engine.record_logits = True
    prompt = _ids(20)[0].tolist()
    engine.generate(prompt, 4, stop_ids=[])
    plain = torch.stack(engine.last_logits)
    with HeadMask(loaded.model, loaded.layout, HEADS, mode="zero"):
        engine.generate(prompt, 4, stop_ids=[])
    masked = torch.stack(engine.last_logits)
    engine.generate(prompt, 4, stop_ids=[])
    torch.testing.assert_close(torch.stack(engine.last_logits), plain, rtol=0, atol=0)
    expected = _zeroed(loaded.model, HEADS, "o")(input_ids=torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(masked[0], expected, rtol=1e-5, atol=1e-5)


def test_bad_heads_mode_phase_are_one_line_errors():
    model = tiny_model("llama", n_kv=2, n_q=4)
    layout = head_layout(model.config)
    for kwargs, text in (
        (dict(heads=[(2, 0)]), "head 2-0: outside the model's 2 layers x 4 query heads"),
        (dict(heads=[(0, 4)]), "head 0-4"),
        (dict(heads=[], mode="eager"), "--mode='eager': accepted values are zero, uniform"),
        (dict(heads=[], phase="prefill"), "--phase='prefill': accepted values are all, decode"),
    ):
        with pytest.raises(ConfigError) as e:
            HeadMask(model, layout, **kwargs)
        assert text in str(e.value) and "\n" not in str(e.value)
