"""Per-head variable-length packing: layout, validity mask, statistics."""

import torch

from methods.base import pack_kept


def _keep(rows):
    return torch.tensor(rows, dtype=torch.bool).unsqueeze(0)  # (1, H, n)


def test_pack_pads_to_longest_head_and_masks_padding():
    n, d = 6, 3
    keys = torch.arange(3 * n * d, dtype=torch.float32).view(1, 3, n, d)
    values = -keys
    keep = _keep([[0, 1, 0, 0, 0, 1], [1, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 1]])  # 2, 4, 1 kept
    p = pack_kept(keys, values, keep)
    assert p.keys.shape == (1, 3, 4, d) and p.values.shape == (1, 3, 4, d)
    assert p.valid.tolist() == [[[True, True, False, False], [True, True, True, True], [True, False, False, False]]]
    # valid slots hold each head's kept positions in ascending order
    assert p.kept_indices[0, 0, :2].tolist() == [1, 5]
    assert p.kept_indices[0, 1].tolist() == [0, 1, 2, 4]
    assert p.kept_indices[0, 2, :1].tolist() == [5]
    # and the rows of those positions (head 1, position 4 -> row 1*6+4)
    assert torch.equal(p.keys[0, 1, 3], torch.arange(d, dtype=torch.float32) + (1 * n + 4) * d)
    assert torch.equal(p.values[0, 0, 1], -(torch.arange(d, dtype=torch.float32) + 5 * d))


def test_packing_stats_count_valid_and_stored_slots():
    keep = _keep([[1, 0, 0, 1], [1, 1, 1, 0]])
    p = pack_kept(torch.zeros(1, 2, 4, 2), torch.zeros(1, 2, 4, 2), keep)
    assert p.stats == {"kept_tokens": 5.0, "stored_tokens": 6.0}


def test_uniform_keep_needs_no_padding():
    keep = torch.zeros(2, 2, 10, dtype=torch.bool)
    keep[..., 3:7] = True
    p = pack_kept(torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4), keep)
    assert p.valid.all() and p.keys.shape[2] == 4
    assert p.kept_indices[1, 1].tolist() == [3, 4, 5, 6]


def test_packed_tensors_own_exactly_their_slots():
    # the result outlives compression: no view into an n-sized sort (B·H·n indices held during decode)
    keep = torch.zeros(1, 2, 50, dtype=torch.bool)
    keep[..., ::10] = True
    p = pack_kept(torch.randn(1, 2, 50, 4), torch.randn(1, 2, 50, 4), keep)
    for t in (p.keys, p.values, p.valid, p.kept_indices):
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
