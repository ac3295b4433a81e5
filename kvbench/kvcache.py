"""A KV cache whose full-attention layers are preallocated buffers, written in place.

transformers' ``DynamicLayer`` appends each decoded token with ``torch.cat``: every decode step
copies every layer's whole cache into a new tensor. :class:`PreallocatedLayer` keeps keys and
values in buffers ``(B, H_kv, T + reserve, d)`` and exposes the filled part as views
``[:, :, :T]``; a decode step writes one row in place. Attention sees the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch
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

    # keys/values assigned by other code are not views of the buffers: the next update copies them in
    keys = property(lambda self: self._k, lambda self, t: self.__dict__.update(_k=t, _key_buf=None))
    values = property(lambda self: self._v, lambda self, t: self.__dict__.update(_v=t, _value_buf=None))

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = max(1, int(reserve))
        self._len = 0  # filled slots: an int, so that a compiled decode step reads no view of a buffer it writes

    def _rebuffer(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Copy ``keys``/``values`` ``(B, H, T, d)`` into new buffers of ``capacity`` ≥ T tokens."""
        b, h, t, _ = keys.shape
        self._key_buf = keys.new_empty((b, h, capacity, keys.shape[-1]))
        self._value_buf = values.new_empty((b, h, capacity, values.shape[-1]))
        self._key_buf[:, :, :t].copy_(keys)
        self._value_buf[:, :, :t].copy_(values)
        self._len, self._k, self._v = t, self._key_buf[:, :, :t], self._value_buf[:, :, :t]

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the content by ``keys``/``values`` ``(B, H_kv, m, d)`` (e.g. the compressed cache).

        Returns the new views ``(B, H_kv, m, d)`` of the layer's own buffers (the inputs may be freed).
        """
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buf = self._value_buf = None  # free the old buffers before allocating new ones
        self._rebuffer(keys, values, keys.shape[-2] + self.reserve)
        return self.keys, self.values

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``key_states``/``value_states`` ``(B, H_kv, q, d)`` in place; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if self._key_buf is None or self._value_buf is None:  # the first update (prefill), or keys/values assigned
            old = (self.keys, self.values) if self.keys.dim() == 4 else (key_states[:, :, :0], value_states[:, :, :0])
            self._rebuffer(*old, old[0].shape[-2] + q + self.reserve)
        elif self._len + q > self._key_buf.shape[-2]:
            self._rebuffer(self.keys, self.values, self._len + q + self.reserve)
        t = self._len
        self._key_buf[:, :, t : t + q].copy_(key_states)
        self._value_buf[:, :, t : t + q].copy_(value_states)
        self._len, self._k, self._v = t + q, self._key_buf[:, :, : t + q], self._value_buf[:, :, : t + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self._key_buf is not None else super().get_seq_length()


def preallocated_cache(config: Any, reserve: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer`
    with ``reserve`` free slots (``max_new_tokens + 1``); sliding-window layers (Gemma 2/3) keep
    transformers' own class."""
    cache = DynamicCache(config=config)
    cache.layers = [PreallocatedLayer(reserve) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


def store_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` ``(B, H_kv, m, d)`` as a cache layer's content; return what it holds
    (views of a :class:`PreallocatedLayer`'s buffers, else contiguous tensors)."""
    if isinstance(layer, PreallocatedLayer):
        return layer.replace(keys, values)
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
    return layer.keys, layer.values
