"""Silencing chosen attention heads: the causal masking test of Wu et al. (2025), CompressKV Table 2a.

:class:`HeadMask` silences query heads ``(layer, head)`` inside a ``with`` block through forward
hooks on the attention's own projections (the attention function is untouched). Query head h is
columns ``[h·d, (h+1)·d)`` of the projections' head-major layout ``(B, q, H_q·d)``.

``mode``: ``zero`` sets the head's output before W_O to 0 (o_proj input columns); ``uniform`` sets
its query to 0 (q_proj output columns; still 0 after RoPE and q-norm), so all its logits are 0 and
it attends uniformly to the visible keys, as the reference code of Wu et al. does.

``phase``: ``all`` masks every position; ``decode`` only the positions that yield a generated
token (the last prompt position and every decoded token), as the reference does (it prefills
``prompt[:-1]`` unmasked). Earlier prompt positions never see the last one, so masking only the
prefill's last row gives the same cache and logits.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch

from methods.base import ConfigError, HeadLayout

MODES = ("zero", "uniform")
PHASES = ("all", "decode")


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """``{layer_idx: attention module}`` for modules with ``layer_idx``, ``q_proj`` and ``o_proj``
    (Llama, Mistral, Qwen and Gemma families)."""
    return {int(m.layer_idx): m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and hasattr(m, "q_proj")}


def _masked(keep: torch.Tensor, phase: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, q, H_q·d)`` times ``keep`` ``(H_q·d,)``: every row, or with ``phase == "decode"``
    only the last row of a prefill (q > 1)."""
    keep = keep.to(dtype=x.dtype, device=x.device)
    if phase == "all" or x.shape[-2] == 1:
        return x * keep
    out = x.clone()
    out[..., -1:, :] *= keep
    return out


class HeadMask:
    """Silences the ``(layer, query head)`` pairs ``heads`` of ``model`` (laid out as ``layout``) in a
    ``with`` block, by ``mode`` and ``phase`` (module docstring). ConfigError: an unknown mode or phase,
    a head outside the layout, or (on entering) no per-layer ``q_proj``/``o_proj`` of ``H_q·d`` features."""

    def __init__(self, model: torch.nn.Module, layout: HeadLayout, heads: Iterable[tuple[int, int]],
                 mode: str = "zero", phase: str = "all"):
        for key, value, accepted in (("--mode", mode, MODES), ("--phase", phase, PHASES)):
            if value not in accepted:
                raise ConfigError(f"{key}={value!r}: accepted values are {', '.join(accepted)}")
        self.model, self.layout, self.mode, self.phase = model, layout, mode, phase
        self.by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            if not (0 <= layer < layout.num_layers and 0 <= head < layout.num_q_heads):
                raise ConfigError(f"head {layer}-{head}: outside the model's {layout.num_layers} layers x "
                                  f"{layout.num_q_heads} query heads")
            self.by_layer.setdefault(int(layer), []).append(int(head))
        self._handles: list = []

    def __enter__(self) -> "HeadMask":
        modules = attention_modules(self.model) if self.by_layer else {}
        h_q, d = self.layout.num_q_heads, self.layout.head_dim
        try:
            for layer, heads in sorted(self.by_layer.items()):
                if layer not in modules:
                    raise ConfigError(f"model {self.layout.model_name or '?'}: no attention module with "
                                      f"q_proj/o_proj for layer {layer}")
                proj = modules[layer].o_proj if self.mode == "zero" else modules[layer].q_proj
                width = proj.in_features if self.mode == "zero" else proj.out_features
                if width != h_q * d:
                    raise ConfigError(f"model {self.layout.model_name or '?'}: projection width {width} is not "
                                      f"{h_q} heads x {d}")
                keep = torch.ones(h_q, d)
                keep[heads] = 0.0
                mask = partial(_masked, keep.flatten(), self.phase)
                self._handles.append(
                    proj.register_forward_pre_hook(lambda m, args, mask=mask: (mask(args[0]), *args[1:]))
                    if self.mode == "zero" else proj.register_forward_hook(lambda m, args, out, mask=mask: mask(out)))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        while self._handles:
            self._handles.pop().remove()
