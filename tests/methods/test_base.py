"""methods.base helpers: gather_tokens on every memory layout."""

import pytest
import torch

from methods.base import gather_tokens


def _expected(x, idx):
    b, h, m = idx.shape
    return torch.stack([torch.stack([x[i, j, idx[i, j]] for j in range(h)]) for i in range(b)])


@pytest.mark.parametrize(
    "layout",
    ["contiguous", "cache_view", "expanded_heads", "heads_inner", "tokens_inner"],
)
def test_gather_tokens_matches_row_by_row_indexing(layout):
    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 3, 10, 4
    x = {
        "contiguous": lambda: torch.randn(b, h, n, d, generator=g),
        "cache_view": lambda: torch.randn(b, h, n + 5, d, generator=g)[:, :, :n],  # preallocated cache
        "expanded_heads": lambda: torch.randn(1, 1, n, d, generator=g).expand(b, h, n, d),
        "heads_inner": lambda: torch.randn(b, n, h, d, generator=g).transpose(1, 2),  # falls back to gather
        "tokens_inner": lambda: torch.randn(b, h, d, n, generator=g).transpose(2, 3),  # falls back to gather
    }[layout]()
    idx = torch.randint(0, n, (b, h, 6), generator=g)
    out = gather_tokens(x, idx)
    assert torch.equal(out, _expected(x, idx))
    assert out.is_contiguous() and out.untyped_storage().nbytes() == out.numel() * 4


@pytest.mark.parametrize("bad", [-1, 10])
def test_gather_tokens_rejects_out_of_range_indices(bad):
    x = torch.randn(1, 2, 10, 4)
    idx = torch.zeros(1, 2, 3, dtype=torch.long)
    idx[0, 1, 2] = bad  # would silently read another head's row in a flat view
    with pytest.raises(IndexError, match="out of range for 10 tokens"):
        gather_tokens(x, idx)
