"""A KV cache whose full-attention layers are preallocated buffers, written in place.

transformers' ``DynamicLayer`` appends each decoded token with ``torch.cat``: every decode step
copies every layer's whole cache into a new tensor. :class:`PreallocatedLayer` keeps keys and
values in buffers ``(B, H_kv, T + reserve, width)`` and exposes the filled part as views
``[:, :, :T]``; a decode step writes one row in place. Attention sees the same numbers.
A compressed layer whose KV heads keep different numbers of tokens is a :class:`RaggedLayer`.

Logit bias as key columns: a layer with a decode logit bias b (SelKV) stores ``b / scaling`` in
``bias_rows`` extra key columns after the d channels (1 column for a per-KV-head bias, G for a
per-query-head one), zero for decoded tokens, and zero-pads keys and values to ``width`` (a
multiple of 8 on CUDA, as the flash kernels need; d + bias_rows elsewhere). The decode query gets
the matching extra component 1 (one-hot over the G columns), so ``scaling·q'·k' = scaling·q·k + b``
exactly and attention needs no mask (:mod:`kvbench.attention`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` backed by buffers with room for ``reserve`` more tokens.

    ``keys``/``values`` are views ``(B, H_kv, T, d)`` of buffers ``(B, H_kv, capacity, d)``. If
    other code assigns ``keys``/``values`` directly, the next :meth:`update` copies them into new
    buffers; :meth:`replace` does that eagerly. Running out of reserve grows the buffers.

    Args:
        reserve: free token slots kept after the filled part (the decode budget, tokens).
    """

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = max(1, int(reserve))
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def _rebuffer(self, keys: torch.Tensor, values: torch.Tensor, capacity: int, width: int | None = None) -> None:
        """Copy ``keys``/``values`` ``(B, H, T, d)`` into new zeroed buffers of ``capacity`` ≥ T tokens
        and ``width`` ≥ d channels (default d)."""
        b, h, t, _ = keys.shape
        self._key_buf = keys.new_zeros((b, h, capacity, width or keys.shape[-1]))
        self._value_buf = values.new_zeros((b, h, capacity, width or values.shape[-1]))
        self._key_buf[:, :, :t, : keys.shape[-1]].copy_(keys)
        self._value_buf[:, :, :t, : values.shape[-1]].copy_(values)
        self.keys, self.values = self._key_buf[:, :, :t], self._value_buf[:, :, :t]

    def replace(self, keys: torch.Tensor, values: torch.Tensor, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the content by ``keys``/``values`` ``(B, H_kv, m, d)`` (e.g. the compressed cache),
        zero-padded to ``width`` channels (default d).

        Returns the new views ``(B, H_kv, m, width)`` of the layer's own buffers (the inputs may be freed).
        """
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buf = self._value_buf = None  # free the old buffers before allocating new ones
        self._rebuffer(keys, values, keys.shape[-2] + self.reserve, width)
        return self.keys, self.values

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``key_states``/``value_states`` ``(B, H_kv, q, d)`` in place; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.keys.dim() < 4:  # the first update (prefill): buffers of q + reserve tokens
            self._rebuffer(key_states[:, :, :0], value_states[:, :, :0], key_states.shape[-2] + self.reserve)
        t, q = self.keys.shape[-2], key_states.shape[-2]
        owned = self._key_buf is not None and self.keys.data_ptr() == self._key_buf.data_ptr() \
            and self.values.data_ptr() == self._value_buf.data_ptr()
        if not owned or t + q > self._key_buf.shape[-2]:
            self._rebuffer(self.keys, self.values, t + q + self.reserve)
        self._key_buf[:, :, t : t + q, : key_states.shape[-1]].copy_(key_states)
        self._value_buf[:, :, t : t + q, : value_states.shape[-1]].copy_(value_states)
        self.keys, self.values = self._key_buf[:, :, : t + q], self._value_buf[:, :, : t + q]
        return self.keys, self.values


def preallocated_cache(config: Any, reserve: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer`
    with ``reserve`` free slots (``max_new_tokens + 1``); sliding-window layers (Gemma 2/3) keep
    transformers' own class."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class RaggedLayer(DynamicLayer):
    """A compressed layer whose KV heads keep different numbers of tokens (AdaKV, HeadKV, CompressKV
    head budgets), flattened as AdaKV's own code stores it: no padding to the longest head.

    Head i of the B·H_kv heads (batch-major) owns the slots ``[cu[i], cu[i + 1])`` of the flat
    buffers ``keys``/``values`` ``(S, 1, width)``: its ``lengths[i]`` kept tokens, then ``reserve``
    free slots that decoded tokens fill. Per-head room rather than a uniform tail buffer merged by
    log-sum-exp: each head's tokens stay one contiguous run, so decode is one flash varlen call
    (``cu_seq_k = cu``, ``seqused_k = lengths``) or one SDPA call per head, with no merge step.
    Stored prompt bytes equal the kept tokens'; the reserve (the same for every method) is
    B·H_kv·reserve slots, not counted by :meth:`filled_bytes` until written.

    Args:
        keys, values: ``(B, H_kv, m, d)`` padded per head; valid: ``(B, H_kv, m)`` bool, the kept slots.
        reserve: free slots per head (tokens); width: stored channels ≥ d (bias columns).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, reserve: int, width: int):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.shape, self.reserve, self.decoded = valid.shape[:2], reserve, 0
        lens = valid.sum(-1).flatten()
        self.cu = F.pad((lens + reserve).cumsum(0), (1, 0)).int()  # (B·H_kv + 1,) segment starts
        self.lengths = lens.int()  # (B·H_kv,) filled slots per head, on the device
        self.cu_q = torch.arange(len(self.cu), device=keys.device, dtype=torch.int32)  # one query row per head
        self.lens_host, self.cu_host = lens.tolist(), self.cu.tolist()
        self.keys = keys.new_zeros((self.cu_host[-1], 1, width))
        self.values = values.new_zeros((self.cu_host[-1], 1, width))
        slots = self.slots(valid)
        self.keys[slots, 0, : keys.shape[-1]] = keys[valid]
        self.values[slots, 0, : values.shape[-1]] = values[valid]

    def slots(self, valid: torch.Tensor) -> torch.Tensor:
        """Flat slot of each True entry of ``valid`` ``(B, H_kv, m)``, in ``valid[valid]`` order."""
        return (self.cu[:-1].view(*self.shape, 1) + valid.cumsum(-1) - 1)[valid]

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``(B, H_kv, q, d)`` to every head in place; return the flat buffers ``(S, 1, width)``.

        Raises:
            RuntimeError: more decoded tokens than the reserve.
        """
        q = key_states.shape[-2]
        if self.decoded + q > self.reserve:
            raise RuntimeError(f"RaggedLayer: {self.decoded + q} decoded tokens exceed the reserve of {self.reserve}")
        idx = ((self.cu[:-1] + self.lengths).unsqueeze(1) + torch.arange(q, device=self.cu.device)).flatten()
        self.keys[idx, 0, : key_states.shape[-1]] = key_states.reshape(-1, key_states.shape[-1])
        self.values[idx, 0, : value_states.shape[-1]] = value_states.reshape(-1, value_states.shape[-1])
        self.lengths += q
        self.decoded += q
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """The longest head's filled slots (tokens)."""
        return max(self.lens_host) + self.decoded

    def filled_bytes(self) -> int:
        """Bytes of the filled slots of keys and values (the free reserve not counted)."""
        slots = sum(self.lens_host) + len(self.lens_host) * self.decoded
        return slots * (self.keys.shape[-1] * self.keys.element_size() + self.values.shape[-1] * self.values.element_size())

    def padded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The reference layout: keys, values ``(B, H_kv, T, width)`` padded with zeros to the longest head,
        and the validity mask ``(B, H_kv, T)`` (T = :meth:`get_seq_length`)."""
        lens = [n + self.decoded for n in self.lens_host]
        pad = lambda buf: pad_sequence([buf[s : s + n, 0] for s, n in zip(self.cu_host, lens)],  # noqa: E731
                                       batch_first=True).view(*self.shape, max(lens), -1)
        valid = torch.arange(max(lens), device=self.keys.device) < torch.tensor(lens, device=self.keys.device).unsqueeze(1)
        return pad(self.keys), pad(self.values), valid.view(*self.shape, -1)


def bias_width(d: int, bias_rows: int, device: torch.device) -> int:
    """Stored channels of a layer with ``bias_rows`` bias columns: d + bias_rows, rounded up to a
    multiple of 8 on CUDA (flash kernels take head dims in multiples of 8); d without bias."""
    return d if not bias_rows else d + bias_rows if device.type != "cuda" else -(-(d + bias_rows) // 8) * 8


def store_layer(cache: Any, idx: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None,
                bias_rows: int = 0, scaling: float = 1.0, reserve: int = 1) -> Any:
    """Write a compressed layer's ``keys``/``values`` ``(B, H_kv, m, d)`` as ``cache.layers[idx]``; return the layer.

    With ``valid`` ``(B, H_kv, m)`` the layer becomes a :class:`RaggedLayer` (kept slots only); with
    ``bias_rows`` > 0 a :class:`PreallocatedLayer` with bias columns (``bias_scale = scaling``, filled
    by :func:`write_bias`); else a :class:`PreallocatedLayer` keeps its buffers' reserve and any other
    layer holds contiguous copies. ``reserve``: free slots per head for new layers (tokens).
    """
    layer, width = cache.layers[idx], bias_width(keys.shape[-1], bias_rows, keys.device)
    if valid is not None:
        layer = RaggedLayer(keys, values, valid, reserve, width)
    elif bias_rows or isinstance(layer, PreallocatedLayer):
        layer = layer if isinstance(layer, PreallocatedLayer) else PreallocatedLayer(reserve)
        layer.replace(keys, values, width)
    else:
        layer.keys, layer.values = keys.contiguous(), values.contiguous()
    cache.layers[idx], layer.bias_rows, layer.bias_scale = layer, bias_rows, scaling
    return layer


def write_bias(layer: Any, bias: torch.Tensor, d: int, valid: torch.Tensor | None = None) -> None:
    """Write a method's logit bias ``(B, H_kv · bias_rows, m)`` into the bias columns ``[d, d + bias_rows)``
    of a layer made by :func:`store_layer`, as ``bias / bias_scale``; slots where ``valid``
    ``(B, H_kv, m)`` is False (not stored by a :class:`RaggedLayer`) are dropped."""
    r = layer.bias_rows
    cols = (bias.float() / layer.bias_scale).view(bias.shape[0], -1, r, bias.shape[-1]).transpose(-1, -2)
    if isinstance(layer, RaggedLayer):
        layer.keys[layer.slots(valid), 0, d : d + r] = cols[valid].to(layer.keys.dtype)
    else:
        layer.keys[:, :, : cols.shape[2], d : d + r] = cols.to(layer.keys.dtype)
