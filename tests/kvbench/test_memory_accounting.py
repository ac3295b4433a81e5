"""What the engine keeps alive after compression, by tensor sizes (no timing, no RSS).

A compressed sample must hold its compressed cache and O(m) bookkeeping per layer, nothing of
size n per query head (scores) or n² (attention), and no earlier sample's cache.
"""

from __future__ import annotations

import weakref

import torch

from kvbench.engine.generate import Engine
from kvbench.engine.kvcache import PreallocatedLayer
from methods.lookm import LookM, LookMConfig
from tests.conftest import loaded_for, tiny_model

N, BUDGET, NEW = 200, 0.1, 3  # m = 20 kept tokens per KV head
H_Q, H_KV, D = 4, 2, 16
PROMPT = [1 + i % 120 for i in range(N)]  # the tiny model has 128 token ids


def _tensors(obj, seen=None):
    """Every tensor reachable from ``obj`` through attributes, dicts, lists and tuples."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from _tensors(v, seen)


def _lookm_engine():
    loaded = loaded_for(tiny_model("llama", n_kv=H_KV, n_q=H_Q, layers=2))
    return Engine(loaded, LookM(LookMConfig(), loaded.layout), BUDGET), loaded


def test_lookm_sample_holds_only_its_compressed_cache():
    engine, loaded = _lookm_engine()
    res = engine.generate(PROMPT, NEW, stop_ids=[])
    state = engine.last_state
    m = int(BUDGET * N)
    assert res.compressed and sorted(state.results) == list(loaded.layout.compressible_layers)
    buffers = set()
    for i in state.results:
        layer = state.cache.layers[i]
        assert isinstance(layer, PreallocatedLayer)
        # the prefill's n-token buffers were replaced by m + reserve slots (the merged cache's copy)
        assert layer._key_buf.shape == layer._value_buf.shape == (1, H_KV, m + NEW + 1, D)
        buffers |= {layer._key_buf.untyped_storage().data_ptr(), layer._value_buf.untyped_storage().data_ptr()}
    # results, plan: besides the cache buffers, nothing larger than O(H_q·(m + new))
    others = [t for t in _tensors({"results": state.results, "plan": state.plan})
              if t.untyped_storage().data_ptr() not in buffers]
    assert others, "expected the kept indices at least"
    for t in others:
        assert t.untyped_storage().nbytes() <= H_Q * (m + NEW + 1) * 8, tuple(t.shape)
    for r in state.results.values():
        assert r.kept_indices.shape == (1, H_KV, m) and r.logit_bias is None and r.valid is None


def test_generate_releases_the_previous_sample_before_prefill():
    engine, _ = _lookm_engine()
    alive_at_compress = []

    class Probe(LookM):
        def compress(self, ctx):
            alive_at_compress.append(previous() is not None)
            return super().compress(ctx)

    engine.generate(PROMPT, NEW, stop_ids=[])
    previous = weakref.ref(engine.last_state.cache)
    engine.method = Probe(LookMConfig(), engine.loaded.layout)
    engine.generate(PROMPT, NEW, stop_ids=[])
    assert alive_at_compress == [False, False]  # the first sample's cache was gone before the second prefill


def test_lookm_fused_score_equals_the_separate_pass():
    """fused_score on (score from the prefill attention) and off (a second pass) decode the same."""
    loaded = loaded_for(tiny_model("llama", n_kv=H_KV, n_q=H_Q, layers=2))
    seen = {}

    class Spy(LookM):
        def compress(self, ctx):
            seen.setdefault(self.config.fused_score, []).append(ctx.prompt_attention)
            return super().compress(ctx)

    runs = {}
    for fused in ("on", "off"):
        engine = Engine(loaded, Spy(LookMConfig(fused_score=fused), loaded.layout), BUDGET)
        res = engine.generate(PROMPT, NEW, stop_ids=[])
        runs[fused] = (res.tokens, {i: r.kept_indices for i, r in engine.last_state.results.items()})
    assert all(s is not None and s.shape == (1, H_Q, N) for s in seen["on"])
    assert seen["off"] == [None, None]
    assert runs["on"][0] == runs["off"][0]
    assert all(torch.equal(runs["on"][1][i], runs["off"][1][i]) for i in runs["off"][1])


class FakeCuda:
    """torch.cuda's peak counters for two fake devices: ``use`` sets the current bytes of each."""

    def __init__(self):
        self.now, self.peak, self.resets = {0: 0, 1: 0}, {0: 0, 1: 0}, []

    def use(self, **per_device):
        for d, b in per_device.items():
            i = int(d[-1])
            self.now[i] = b
            self.peak[i] = max(self.peak[i], b)

    def reset_peak_memory_stats(self, device):
        self.resets.append(device.index)
        self.peak[device.index] = self.now[device.index]

    def max_memory_allocated(self, device):
        return self.peak[device.index]


def test_prefill_and_decode_peaks_are_apart_and_summed_over_devices(monkeypatch):
    """A model on two GPUs (device_map): the prefill peak (compression included) and the decode-phase peak
    (restarted after compression) each sum both devices; the decode peak does not carry the prefill's."""
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    loaded = loaded_for(tiny_model("llama", n_kv=H_KV, n_q=H_Q, layers=2))

    class Spy(LookM):
        def compress(self, ctx):  # prefill + compression at its largest: 100 + 60 MB
            fake.use(d0=100, d1=60)
            out = super().compress(ctx)
            fake.use(d0=20, d1=10)  # the compressed caches
            return out

    engine = Engine(loaded, Spy(LookMConfig(), loaded.layout), BUDGET)
    engine.devices = [torch.device("cuda:0"), torch.device("cuda:1")]
    engine.on_decode_step = lambda step: fake.use(d0=20 + step, d1=10 + 2 * step)  # the cache grows while decoding
    res = engine.generate(PROMPT, NEW, stop_ids=[])
    assert res.peak_prefill_bytes == 160
    assert res.peak_decode_bytes == (20 + NEW - 1) + (10 + 2 * (NEW - 1))
    assert fake.resets == [0, 1, 0, 1]  # before prefill, after compression
    rec = res.record()
    assert (rec["peak_prefill_bytes"], rec["peak_decode_bytes"]) == (160, res.peak_decode_bytes)
