"""The preallocated cache layer: same content as transformers' DynamicLayer, written in place."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers.cache_utils import DynamicLayer

from kvbench.engine.kvcache import PreallocatedLayer, preallocated_cache, store_layer
from tests.conftest import tiny_model


def _chunks(seed=0, lengths=(7, 1, 1, 1, 1)):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, q, 4, generator=gen), torch.randn(1, 2, q, 4, generator=gen)) for q in lengths]


def test_update_matches_concatenation_and_writes_in_place():
    layer = PreallocatedLayer(reserve=4)
    chunks = _chunks()
    ptrs = set()
    for k, v in chunks:
        keys, values = layer.update(k, v)
        ptrs.add(keys.data_ptr())
    torch.testing.assert_close(keys, torch.cat([k for k, _ in chunks], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([v for _, v in chunks], dim=2), rtol=0, atol=0)
    assert len(ptrs) == 1  # one buffer: 7 prompt tokens + 4 decoded within the reserve
    assert layer.get_seq_length() == 11


def test_growth_beyond_reserve_keeps_content():
    layer = PreallocatedLayer(reserve=1)
    chunks = _chunks(lengths=(3, 1, 1, 1))
    for k, v in chunks:
        keys, _ = layer.update(k, v)
    torch.testing.assert_close(keys, torch.cat([k for k, _ in chunks], dim=2), rtol=0, atol=0)


def test_replace_and_external_assignment_are_rebuffered():
    layer = PreallocatedLayer(reserve=3)
    (k0, v0), (k1, v1), (k2, v2) = _chunks(lengths=(6, 1, 1))
    layer.update(k0, v0)
    kept_k, kept_v = k0[:, :, [0, 2, 5]], v0[:, :, [0, 2, 5]]
    cache = SimpleNamespace(layers=[layer])
    assert store_layer(cache, 0, kept_k, kept_v) is layer and cache.layers == [layer]
    assert layer.keys.shape[2] == 3 and layer.get_seq_length() == 3
    keys, _ = layer.update(k1, v1)
    torch.testing.assert_close(keys, torch.cat([kept_k, k1], dim=2), rtol=0, atol=0)
    layer.keys, layer.values = kept_k.clone(), kept_v.clone()  # code that assigns tensors directly
    keys, values = layer.update(k2, v2)
    torch.testing.assert_close(keys, torch.cat([kept_k, k2], dim=2), rtol=0, atol=0)
    torch.testing.assert_close(values, torch.cat([kept_v, v2], dim=2), rtol=0, atol=0)


def test_store_layer_replaces_a_plain_dynamic_layer():
    layer = DynamicLayer()
    k, v = _chunks(lengths=(5,))[0]
    layer.update(k, v)
    cache = SimpleNamespace(layers=[layer])
    stored = store_layer(cache, 0, k[:, :, ::2], v[:, :, ::2], reserve=2)  # a compressed layer gets room to decode
    assert cache.layers == [stored] and isinstance(stored, PreallocatedLayer) and stored._key_buf.shape == (1, 2, 5, 4)
    torch.testing.assert_close(stored.keys, k[:, :, ::2], rtol=0, atol=0)


def test_preallocated_cache_keeps_sliding_layers():
    model = tiny_model("gemma3", layers=2)
    cache = preallocated_cache(model.config, reserve=8)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicSlidingWindowLayer", "PreallocatedLayer"]
