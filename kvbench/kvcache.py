"""A KV cache whose full-attention layers are preallocated buffers, written in place.

transformers' ``DynamicLayer`` appends each decoded token with ``torch.cat``: every decode
step copies the whole cache of every layer into a freshly allocated tensor. At 8k prompt
tokens that is the cache size (≈ 380 MB for SmolLM2-135M) of copies and page faults per
token, as much memory traffic as the attention itself. :class:`PreallocatedLayer` keeps
keys and values in a buffer ``(B, H_kv, T + reserve, d)`` and exposes the filled part as a
view ``[:, :, :T]``; a decode step writes one row in place.

The numbers are unchanged: attention sees the same keys and values, only their storage
differs (a strided view instead of a contiguous tensor).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` backed by a buffer with room for ``reserve`` more tokens.

    ``keys``/``values`` are views ``(B, H_kv, T, d)`` of buffers ``(B, H_kv, capacity, d)``.
    If something assigns ``keys``/``values`` directly (not a view of the buffers, e.g. a
    compressed cache written back by other code), the next :meth:`update` copies them into
    a new buffer with ``reserve`` free slots; :meth:`replace` does that eagerly.

    Args:
        reserve: free token slots kept after the filled part (the decode budget, tokens).
    """

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = max(1, int(reserve))
        self._key_buf: torch.Tensor | None = None
        self._value_buf: torch.Tensor | None = None

    def _owns_current(self) -> bool:
        return (
            self._key_buf is not None
            and self.keys is not None
            and self.keys.data_ptr() == self._key_buf.data_ptr()
            and self.values.data_ptr() == self._value_buf.data_ptr()
        )

    def _rebuffer(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        """Copy ``keys``/``values`` ``(B, H, T, d)`` into new buffers of ``capacity`` ≥ T tokens."""
        b, h, t, d = keys.shape
        kbuf = keys.new_empty((b, h, capacity, d))
        vbuf = values.new_empty((b, h, capacity, values.shape[-1]))
        kbuf[:, :, :t].copy_(keys)
        vbuf[:, :, :t].copy_(values)
        self._key_buf, self._value_buf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :t], vbuf[:, :, :t]

    def replace(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Replace the layer's content (e.g. by the compressed cache), keeping ``reserve`` free slots.

        Args:
            keys, values: ``(B, H_kv, m, d)``.

        Returns:
            The new ``(keys, values)`` views ``(B, H_kv, m, d)`` (the inputs may be freed).
        """
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._key_buf = self._value_buf = None  # drop the old buffers before allocating new ones
        self._rebuffer(keys, values, keys.shape[-2] + self.reserve)
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Cut the filled part back to its first ``length`` tokens (the buffers keep their slots).

        Raises:
            ValueError: ``length`` is more than the layer holds, or the layer holds no buffer.
        """
        if not self._owns_current() or not 0 <= length <= self.keys.shape[-2]:
            raise ValueError(f"truncate({length}): the layer holds {self.keys.shape[-2] if self.keys is not None else 0} "
                             "tokens in its own buffer")
        self.keys, self.values = self._key_buf[:, :, :length], self._value_buf[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``(B, H_kv, q, d)`` in place; return the filled views."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if not self._owns_current():
            if self.keys.numel() == 0:  # first update (prefill): buffer of q + reserve tokens
                b, h, _, d = key_states.shape
                self._key_buf = key_states.new_empty((b, h, q + self.reserve, d))
                self._value_buf = value_states.new_empty((b, h, q + self.reserve, value_states.shape[-1]))
                self.keys, self.values = self._key_buf[:, :, :0], self._value_buf[:, :, :0]
            else:
                self._rebuffer(self.keys, self.values, self.keys.shape[-2] + q + self.reserve)
        t = self.keys.shape[-2]
        if t + q > self._key_buf.shape[-2]:  # out of reserve: grow (rare; keeps correctness)
            self._rebuffer(self.keys, self.values, t + q + self.reserve)
        self._key_buf[:, :, t : t + q].copy_(key_states)
        self._value_buf[:, :, t : t + q].copy_(value_states)
        self.keys, self.values = self._key_buf[:, :, : t + q], self._value_buf[:, :, : t + q]
        return self.keys, self.values


def preallocated_cache(config: Any, reserve: int) -> DynamicCache:
    """A ``DynamicCache`` for ``config`` whose full-attention layers are :class:`PreallocatedLayer`.

    Sliding-window layers (Gemma 2/3) keep transformers' own layer class.

    Args:
        config: the model config.
        reserve: decode tokens to reserve per layer (``max_new_tokens + 1``).
    """
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = PreallocatedLayer(reserve)
    return cache


def store_layer(layer: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``keys``/``values`` ``(B, H_kv, m, d)`` as a cache layer's content; return what it holds.

    A :class:`PreallocatedLayer` copies them into its buffer (returned views share it, so
    callers can drop the inputs); any other layer stores contiguous tensors.
    """
    if isinstance(layer, PreallocatedLayer):
        return layer.replace(keys, values)
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
    return layer.keys, layer.values
