"""A KV cache of preallocated buffers written in place; a logit bias b: key columns ``b / scaling`` after d channels."""

from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.engine.quantcache import QuantizedLayer

ALIGN = {"cuda": 8}  # stored channels are a multiple of this per device type (flash kernels: of 8)


class PreallocatedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys``/``values`` are views ``(B, H_kv, T, width)`` of buffers with ``reserve`` free
    token slots after them (grown when full). Keys/values assigned by other code are copied in at the next update."""

    keys = property(lambda self: self._k, lambda self, t: self.__dict__.update(_k=t, _key_buf=None))
    values = property(lambda self: self._v, lambda self, t: self.__dict__.update(_v=t, _value_buf=None))

    def __init__(self, reserve: int):
        super().__init__()
        self.reserve = max(1, int(reserve))
        self._len = 0  # filled slots: an int, so that a compiled decode step reads no view of a buffer it writes

    def replace(self, keys: torch.Tensor, values: torch.Tensor, width: int | None = None, capacity: int | None = None):
        """Copy ``keys``/``values`` ``(B, H_kv, T, d)`` into new zeroed buffers of ``capacity`` (default T + reserve)
        slots and ``width`` (default d) channels; ``keys``/``values`` are then views ``(B, H_kv, T, width)``."""
        self.lazy_initialization(keys, values)  # its empty keys/values free the old buffers before the new ones
        b, h, t, _ = keys.shape
        for name, x in (("_key_buf", keys), ("_value_buf", values)):
            setattr(self, name, x.new_zeros((b, h, capacity or t + self.reserve, width or x.shape[-1])))
            getattr(self, name)[:, :, :t, : x.shape[-1]].copy_(x)
        self._len, self._k, self._v = t, self._key_buf[:, :, :t], self._value_buf[:, :, :t]

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``key_states``/``value_states`` ``(B, H_kv, q, d)`` in place; return the filled views."""
        q = key_states.shape[-2]
        # the first update (prefill), keys/values assigned, or the buffers full
        if self._key_buf is None or self._value_buf is None or self._len + q > self._key_buf.shape[-2]:
            old = (self.keys, self.values) if self.is_initialized else (key_states[:, :, :0], value_states[:, :, :0])
            self.replace(*old, capacity=old[0].shape[-2] + q + self.reserve)
        t = self._len
        self._key_buf[:, :, t : t + q, : key_states.shape[-1]].copy_(key_states)
        self._value_buf[:, :, t : t + q, : value_states.shape[-1]].copy_(value_states)
        self._len, self._k, self._v = t + q, self._key_buf[:, :, : t + q], self._value_buf[:, :, : t + q]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self._key_buf is not None else super().get_seq_length()

    def crop(self, max_length: int) -> None:
        """Forget the slots from ``max_length`` on (tokens ≥ 0); the buffers stay, for the next updates."""
        self._len = min(self._len, max_length)
        self._k, self._v = self._key_buf[:, :, : self._len], self._value_buf[:, :, : self._len]


def preallocated_cache(config: Any, reserve: int, quant: Any = None) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers are :class:`PreallocatedLayer` (``quant``: ``QuantizedLayer``)."""
    cache = DynamicCache(config=config)
    cache.layers = [(QuantizedLayer(quant) if quant else PreallocatedLayer(reserve)) if type(layer) is DynamicLayer
                    else layer for layer in cache.layers]
    cache.quant = quant
    return cache


class RaggedLayer(DynamicLayer):
    """A compressed layer whose KV heads keep different numbers of tokens, flat as AdaKV stores it: head i owns slots
    ``[cu[i], cu[i + 1])`` of ``keys``/``values`` ``(S, 1, width)``, its ``lengths[i]`` tokens, then ``reserve``
    free ones. Built from ``keys``/``values`` ``(B, H_kv, m, d)`` and ``valid`` ``(B, H_kv, m)``, the kept slots."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, reserve: int, width: int):
        self.lazy_initialization(keys, values)  # what DynamicLayer's __init__ sets, for these keys
        self.shape, self.reserve, self.decoded = valid.shape[:2], reserve, 0
        lens = valid.sum(-1).flatten()
        self.cu = F.pad((lens + reserve).cumsum(0), (1, 0)).int()  # (B·H_kv + 1,) segment starts
        self.lengths = lens.int()  # (B·H_kv,) filled slots per head, on the device
        self.cu_q = torch.arange(len(self.cu), device=keys.device, dtype=torch.int32)  # one query row per head
        self.lens_host, self.cu_host = lens.tolist(), self.cu.tolist()
        self.keys, self.values = (x.new_zeros((self.cu_host[-1], 1, width)) for x in (keys, values))
        slots = self.slots(valid)
        self.keys[slots, 0, : keys.shape[-1]] = keys[valid]
        self.values[slots, 0, : values.shape[-1]] = values[valid]

    def slots(self, valid: torch.Tensor) -> torch.Tensor:
        """Flat slot of each True entry of ``valid`` ``(B, H_kv, m)``, in ``valid[valid]`` order."""
        return (self.cu[:-1].view(*self.shape, 1) + valid.cumsum(-1) - 1)[valid]

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``(B, H_kv, q, d)`` to every head (past the reserve, the layer is laid out again with twice the
        room); return the flat buffers."""
        q = key_states.shape[-2]
        if self.decoded + q > self.reserve:
            self.__init__(*self.padded(), max(2 * self.reserve, self.decoded + q), self.keys.shape[-1])
        idx = ((self.cu[:-1] + self.lengths).unsqueeze(1) + torch.arange(q, device=self.cu.device)).flatten()
        self.keys[idx, 0, : key_states.shape[-1]] = key_states.reshape(-1, key_states.shape[-1])
        self.values[idx, 0, : value_states.shape[-1]] = value_states.reshape(-1, value_states.shape[-1])
        self.lengths, self.decoded = self.lengths + q, self.decoded + q  # new tensors: a checkpoint's stay as they were
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """The longest head's filled slots (tokens)."""
        return max(self.lens_host) + self.decoded

    def padded(self, left: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys, values ``(B, H_kv, T, width)`` zero-padded to the longest head (``left``: on the left) and the
        validity mask ``(B, H_kv, T)``."""
        lens = [n + self.decoded for n in self.lens_host]
        pad = lambda buf: pad_sequence([buf[s : s + n, 0] for s, n in zip(self.cu_host, lens)], batch_first=True,
                                       padding_side="left" if left else "right").view(*self.shape, max(lens), -1)
        slot, n = torch.arange(max(lens), device=self.keys.device), torch.tensor(lens, device=self.keys.device).unsqueeze(1)
        valid = slot >= max(lens) - n if left else slot < n
        return pad(self.keys), pad(self.values), valid.view(*self.shape, -1)


def stack_ragged(layers: list[RaggedLayer]) -> RaggedLayer:
    """The ragged layers ``(1, H_kv)`` of one width of a decode batch's rows as one ``(B, H_kv)`` ragged layer for one
    attention call: keys/values ``(S, 1, width)`` concatenated (a copy, S their slots), decoded tokens in lengths."""
    out, starts = RaggedLayer.__new__(RaggedLayer), [0, *accumulate(x.keys.shape[0] for x in layers)]
    lens = [n + x.decoded for x in layers for n in x.lens_host]
    vars(out).update(vars(layers[0]), shape=(len(layers), layers[0].shape[1]), decoded=0, lens_host=lens,
                     keys=torch.cat([x.keys for x in layers]), values=torch.cat([x.values for x in layers]),
                     cu=torch.cat([layers[0].cu[:1], *(x.cu[1:] + s for x, s in zip(layers, starts))]),
                     cu_host=[c + s for x, s in zip(layers, starts) for c in x.cu_host[:-1]] + starts[-1:],
                     lengths=torch.cat([x.lengths for x in layers]),
                     cu_q=torch.arange(len(lens) + 1, device=layers[0].cu.device, dtype=torch.int32))
    return out


def store_layer(cache: Any, idx: int, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None,
                bias_rows: int = 0, scaling: float = 1.0, reserve: int = 1) -> Any:
    """Store a compressed layer's ``keys``/``values`` ``(B, H_kv, m, d)`` (``valid`` ``(B, H_kv, m)``: ragged) as
    ``cache.layers[idx]`` and return it; ``bias_rows`` columns for :func:`write_bias`."""
    align = ALIGN.get(keys.device.type, 1)
    width = -(-(keys.shape[-1] + bias_rows) // align) * align  # d + bias columns, zero-padded to ``align``
    if getattr(cache, "quant", None):
        if valid is not None:
            raise ValueError("cache.bits: the quantized cache stores one length per layer, not per-head lengths")
        layer = QuantizedLayer(cache.quant, width, keys.shape[-1] + bias_rows)  # bias columns stored, not padding
        layer.update(keys, values)
    elif valid is not None:
        layer = RaggedLayer(keys, values, valid, reserve, width)
    else:
        layer = cache.layers[idx] if isinstance(cache.layers[idx], PreallocatedLayer) else PreallocatedLayer(reserve)
        layer.replace(keys, values, width)
    cache.layers[idx], layer.bias_rows, layer.bias_scale = layer, bias_rows, scaling
    return layer


def write_bias(layer: Any, bias: torch.Tensor, d: int, valid: torch.Tensor | None = None) -> None:
    """Write a logit bias ``(B, H_kv · bias_rows, m)`` as ``bias / bias_scale`` into the columns ``[d, d + bias_rows)``
    of a layer made by :func:`store_layer` (``valid``: a ragged layer's stored slots)."""
    r = layer.bias_rows
    # −inf (a hidden slot) → −1e3: exp underflows to 0 as for −inf, 0·(−1e3) is no NaN, fp16 holds it
    cols = (bias.float().clamp(min=-1e3) / layer.bias_scale).view(bias.shape[0], -1, r, bias.shape[-1]).transpose(-1, -2)
    if isinstance(layer, RaggedLayer):
        layer.keys[layer.slots(valid), 0, d : d + r] = cols[valid].to(layer.keys.dtype)
        return
    q = getattr(layer, "quantized", 0)  # a QuantizedLayer keeps its quantized tokens' columns in ``extra``
    if q:
        layer.extra[:, :, :, :r] = cols[:, :, :q].to(layer.extra.dtype)
    layer.keys[:, :, : cols.shape[2] - q, d : d + r] = cols[:, :, q:].to(layer.keys.dtype)


class RowsCache(DynamicCache):
    """The caches of a decode batch's rows as one transformers cache (:meth:`kvbench.engine.generate.Engine.decode_rows`):
    a layer's update ``(B, H_kv, q, d)`` goes row by row to each row's own cache and returns the lists of what they
    return (the attention function takes them row by row); row 0's cache answers transformers' other questions."""

    def __init__(self, caches: list[Any]):
        vars(self).update(vars(caches[0]), rows=caches)

    def update(self, key_states, value_states, layer_idx: int, cache_kwargs: dict[str, Any] | None = None):
        return tuple(map(list, zip(*(c.update(key_states[r : r + 1], value_states[r : r + 1], layer_idx, cache_kwargs)
                                     for r, c in enumerate(self.rows)))))
