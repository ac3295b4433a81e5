"""A-shape and Tri-shape: the prefill masks against MInference's definitions, and a run on a tiny model.

Reference: microsoft/MInference at commit fb56c917f618e8645f1cfc37535afd7424d78f0d, ``minference/ops/streaming_kernel.py``:
``a_shape_kernel`` appends the local stage (``_attn_fwd_inner``'s ``SLIDING_WINDOW``: dist = row − col + offset,
0 ≤ dist < n_local, offset = k_len − q_len) and, when k_len > n_local, the first n_init keys with the complement
(dist ≥ n_local); ``tri_shape_kernel`` runs that on the first q − n_last queries over keys[:−n_last] and lets the last
n_last = min(n_last, q − 1) queries attend every key, causally among themselves. Transcribed in :func:`minference_mask`.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.engine.generate import Engine
from methods import build_method
from methods.ashape import AShape, AShapeConfig, pattern
from tests.conftest import loaded_for, tiny_model


def a_shape_mask(q_len: int, k_len: int, n_init: int, n_local: int) -> torch.Tensor:
    dist = torch.arange(q_len).unsqueeze(1) - torch.arange(k_len) + (k_len - q_len)
    mask = (dist >= 0) & (dist < n_local)
    if k_len > n_local:
        mask[:, :n_init] |= dist[:, :n_init] >= n_local
    return mask


def minference_mask(q_len, k_len, n_init, n_local, n_last):
    if not n_last:
        return a_shape_mask(q_len, k_len, n_init, n_local)
    n_last = min(n_last, q_len - 1)
    top = torch.zeros(q_len - n_last, k_len, dtype=torch.bool)
    top[:, : k_len - n_last] = a_shape_mask(q_len - n_last, k_len - n_last, n_init, n_local)
    bottom = torch.ones(n_last, k_len, dtype=torch.bool)
    bottom[:, k_len - n_last :] = torch.ones(n_last, n_last, dtype=torch.bool).tril()
    return torch.cat([top, bottom])


@pytest.mark.parametrize("q_len, k_len", [(300, 300), (40, 300), (7, 7)])
@pytest.mark.parametrize("n_init, n_local, n_last", [(4, 32, 0), (4, 32, 10), (0, 64, 0), (16, 512, 100), (8, 16, 3)])
def test_masks_equal_minference(q_len, k_len, n_init, n_local, n_last):
    assert torch.equal(pattern(q_len, k_len, n_init, n_local, n_last), minference_mask(q_len, k_len, n_init, n_local, n_last))


def test_prefill_attention_is_masked_attention_in_blocks(monkeypatch):
    import methods.ashape as ashape

    monkeypatch.setattr(ashape, "_BLOCK", 64)  # several blocks
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 200, 16, generator=gen) for h in (4, 2, 2))
    out = AShape(AShapeConfig(n_init=4, n_last=10)).prefill_attention(q, k, v, 0.25, 36)
    mask = minference_mask(200, 200, 4, 32, 10)
    logits = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, logits.softmax(-1) @ v.repeat_interleave(2, 1), atol=1e-5, rtol=1e-5)


def test_engine_keeps_the_whole_cache_and_changes_only_the_prefill():
    loaded = loaded_for(tiny_model("llama", layers=1))
    ids = torch.randint(0, 128, (120,), generator=torch.Generator().manual_seed(2)).tolist()
    recs = {}
    for name in ("ashape", "trishape", "full"):
        node = {"name": "ashape", "n_init": 4, "n_last": 10 if name == "trishape" else 0} if name != "full" else {"name": "full"}
        eng = Engine(loaded, build_method(node, loaded.layout), 32)
        eng.record_logits = True
        recs[name] = eng.generate(ids, 3, stop_ids=[]).record(), eng.last_logits[0]
    for name in ("ashape", "trishape"):
        assert recs[name][0]["stored_tokens"]["mean"] == 120 and recs[name][0]["read_tokens"]["mean"] == 121.5
    assert (recs["ashape"][1] - recs["full"][1]).abs().max() > 1e-3  # the last prompt token saw only sinks + window
    # one layer: Tri-shape's last query attends every key, as the full prefill's does
    torch.testing.assert_close(recs["trishape"][1], recs["full"][1], atol=1e-5, rtol=1e-5)
