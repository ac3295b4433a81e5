"""A quantized KV cache layer in KIVI's layout (arXiv 2402.02750): keys per channel, values per token, asymmetric
min-max codes packed ``8 / b`` to a byte, full blocks of ``residual`` tokens quantized (docs/QUANTIZATION.md)."""

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer


def quantize(x: torch.Tensor, bits: int, group: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's quantization of ``x`` ``(B, H, T, d)`` in groups of ``group`` along ``dim`` (-2: keys, -1: values):
    codes uint8 ``(B, H, T, d·bits/8)``, scale and mn ``(B, H, T/group, 1, d)`` (dim −2) or ``(B, H, T, d/group, 1)``."""
    g = x.unflatten(dim, (-1, group))
    mn = g.amin(dim, keepdim=True)
    scale = (g.amax(dim, keepdim=True) - mn) / (2**bits - 1)
    codes = ((g - mn) / scale.masked_fill(scale == 0, 1)).clamp(0, 2**bits - 1).round()
    return pack(codes.flatten(dim - 1, dim), bits), scale, mn


def dequantize(codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    """The values ``codes · scale + mn`` ``(B, H, T, d)`` in scale's dtype of :func:`quantize`'s output."""
    return (unpack(codes, bits).unflatten(dim, (-1, group)).to(scale.dtype) * scale + mn).flatten(dim - 1, dim)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer-valued ``codes`` ``(..., d)`` in [0, 2^bits) as uint8 ``(..., d·bits/8)``, the first of each
    ``8 / bits`` in the low bits (d a multiple of 8 / bits)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (codes.to(torch.uint8).unflatten(-1, (-1, len(shifts))) << shifts).sum(-1, dtype=torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``(..., d)``."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2)


class QuantizedLayer(DynamicLayer):
    """Quantized blocks (``qk``/``qv``: :func:`quantize`'s outputs, ``extra``: their bias channels) and the residual
    ``keys`` ``(B, H_kv, r, channels)``, ``values`` ``(B, H_kv, r, d)``; ``spec``: ``cache.*``; ``width``: returned."""

    def __init__(self, spec: Any, width: int | None = None, channels: int | None = None):
        super().__init__()
        self.bits, self.group, self.width, self.channels = int(spec.bits), int(spec.group_size), width, channels
        self.block = int(spec.residual) or self.group  # keys need whole groups of tokens
        self.quantized, self.qk, self.qv, self.extra = 0, None, None, None

    def update(self, key_states, value_states, cache_kwargs: dict[str, Any] | None = None):
        """Append ``(B, H_kv, q, d)``; return the layer ``(B, H_kv, T, width)`` dequantized (the first update: the
        states given), then quantize the residual's full blocks."""
        first = not self.is_initialized
        if first:
            self.d = d = key_states.shape[-1]
            self.channels, self.width = self.channels or d, self.width or self.channels or d
        super().update(F.pad(key_states, (0, self.channels - self.d)), value_states)  # the residual grows
        out = (key_states, value_states) if first else self.dequantized()
        self._quantize_blocks()
        return out

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer ``(B, H_kv, T, width)`` in the model dtype: the quantized tokens read back, then the residual."""
        keys, values = self.keys, self.values
        if self.quantized:
            k = dequantize(*self.qk, self.bits, self.group, -2)
            keys = torch.cat([k if self.extra is None else torch.cat([k, self.extra], -1), keys], -2)
            values = torch.cat([dequantize(*self.qv, self.bits, self.group, -1), values], -2)
        return tuple(x if x.shape[-1] == self.width else F.pad(x, (0, self.width - x.shape[-1])) for x in (keys, values))

    def _quantize_blocks(self) -> None:
        n = self.keys.shape[-2] // self.block * self.block
        if not n:
            return
        keys, d = self.keys[:, :, :n], self.d
        new = (quantize(keys[..., :d], self.bits, self.group, -2), quantize(self.values[:, :, :n], self.bits, self.group, -1))
        if self.quantized:  # every part grows along its token axis, dim 2
            new = [tuple(torch.cat(p, 2) for p in zip(old, q)) for old, q in zip((self.qk, self.qv), new)]
        self.qk, self.qv = new
        if self.channels > d:
            self.extra = keys[..., d:].clone() if self.extra is None else torch.cat([self.extra, keys[..., d:]], -2)
        self.keys, self.values = self.keys[:, :, n:].clone(), self.values[:, :, n:].clone()  # views would pin the block
        self.quantized += n

    def get_seq_length(self) -> int:
        return self.quantized + self.keys.shape[-2] if self.is_initialized else 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` tokens (negative: drop that many); ValueError if that cuts a quantized block."""
        max_length += self.get_seq_length() if max_length < 0 else 0
        if max_length < self.quantized:
            raise ValueError(f"QuantizedLayer.crop({max_length}): the first {self.quantized} tokens are quantized in blocks")
        self.keys, self.values = self.keys[:, :, : max_length - self.quantized], self.values[:, :, : max_length - self.quantized]

    @property
    def nbytes(self) -> int:
        """Bytes stored: packed codes, scales and minima, the extra channels, the residual."""
        parts = [*(self.qk or ()), *(self.qv or ()), self.extra, self.keys, self.values]
        return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))
