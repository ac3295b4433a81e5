"""Every supported family decodes what its Hugging Face modules compute: with ``method=full``
kvbench's greedy tokens equal ``model.generate``'s; a compressing method runs on each family."""

from __future__ import annotations

import copy

import pytest
import torch

from kvbench.engine.generate import Engine
from methods.full import FullCache
from methods.snapkv import SnapKV, SnapKVConfig
from tests.conftest import loaded_for, tiny_model

# family -> (H_q, H_kv): GQA where the family has it (Gemma 2/3 tiny configs too)
FAMILIES = {"llama": (4, 2), "mistral": (4, 2), "qwen2": (4, 2), "qwen3": (4, 2), "gemma2": (4, 2), "gemma3": (4, 2)}
NEW = 8


def _prompt(n=24, seed=1):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_full_cache_tokens_equal_model_generate(family):
    h_q, h_kv = FAMILIES[family]
    model = tiny_model(family, n_q=h_q, n_kv=h_kv, layers=2, seed=3)
    ids = _prompt()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ref.generation_config.eos_token_id = None  # no stop: exactly NEW tokens, as kvbench with stop_ids=[]
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), do_sample=False, num_beams=1, max_new_tokens=NEW, min_new_tokens=NEW,
                           pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    loaded = loaded_for(model)
    res = Engine(loaded, FullCache(layout=loaded.layout), 1.0).generate(ids, NEW, stop_ids=[])
    assert len(expected) == NEW
    assert res.tokens == expected
    assert not res.compressed and res.prompt_tokens == len(ids)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_snapkv_half_budget_runs_on_every_family(family):
    h_q, h_kv = FAMILIES[family]
    model = tiny_model(family, n_q=h_q, n_kv=h_kv, layers=2, seed=3)
    loaded = loaded_for(model)
    eng = Engine(loaded, SnapKV(SnapKVConfig(window_size=4, kernel_size=3), loaded.layout), 0.5)
    res = eng.generate(_prompt(40), NEW, stop_ids=[])
    assert res.compressed and res.generated_tokens == NEW
    assert res.stored_tokens["max"] == 20 and res.cache_bytes_after < res.cache_bytes_before
    for i in loaded.layout.compressible_layers:  # 20 kept + the NEW − 1 decoded tokens appended
        assert eng.last_state.cache.layers[i].keys.shape[-2] == 20 + NEW - 1
