"""Silencing chosen attention heads: the causal masking test of Wu et al. (2025).

CompressKV (Sec. 4.3, Table 2a) follows that test: mask the top-k heads ranked by a head score
and measure how much the Needle-in-a-Haystack score drops. :class:`HeadMask` silences a set of
query heads ``(layer, head)`` for the duration of a ``with`` block, with forward hooks on the
attention's own projections (removed on exit; the attention function is untouched, SDPA or
kvbench's, so the fast paths stay). Query head h of a layer is columns ``[h·d, (h+1)·d)`` of
the projections' head-major layout ``(B, q, H_q·d)``; it belongs to KV head ``h // G``.

``mode``:

* ``zero``: the head's attention output is set to 0 before W_O (the o_proj input columns of the
  head): the head adds nothing to the residual stream.
* ``uniform``: the head's query is set to 0 (its q_proj output columns). It stays 0 after RoPE
  and q-norm, so all its logits are 0 and it attends uniformly to every visible key (its output
  is the mean of the visible values). This is what the reference code of Wu et al. does
  (``query_states[:, h] = 0`` before FlashAttention; its eager path zeroes the head's logits,
  the same thing).

``phase``:

* ``all``: every position of the prefill and of decoding is masked;
* ``decode``: only the positions whose output yields a generated token, the last prompt position
  and every decoded token, as the reference does (it prefills ``prompt[:-1]`` unmasked and feeds
  the last prompt token as the first masked decoding step). Earlier prompt positions never see
  the last one, so masking the last row of the prefill gives the same cache and logits.
"""

from __future__ import annotations

from functools import partial
from typing import Iterable

import torch

from methods.base import ConfigError, HeadLayout

MODES = ("zero", "uniform")
PHASES = ("all", "decode")


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The attention module of each layer: ``{layer_idx: module}`` (modules with ``layer_idx``,
    ``q_proj`` and ``o_proj``, as in the Llama, Mistral, Qwen and Gemma families)."""
    found: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "o_proj") and hasattr(module, "q_proj"):
            found[int(module.layer_idx)] = module
    return found


def _masked(x: torch.Tensor, keep: torch.Tensor, phase: str) -> torch.Tensor:
    """``x`` ``(B, q, H_q·d)`` with the masked heads' columns zeroed (all rows, or the last row
    only when ``phase == "decode"`` and this is a prefill of q > 1 positions)."""
    keep = keep.to(dtype=x.dtype, device=x.device)
    if phase == "all" or x.shape[-2] == 1:
        return x * keep
    out = x.clone()
    out[..., -1:, :] *= keep
    return out


def _zero_output(keep, phase, module, args):  # forward pre-hook of o_proj
    return (_masked(args[0], keep, phase), *args[1:])


def _zero_query(keep, phase, module, args, output):  # forward hook of q_proj
    return _masked(output, keep, phase)


class HeadMask:
    """Context manager that silences query heads of a model (see the module docstring).

    Args:
        model: a transformers causal LM whose attention modules have ``q_proj`` and ``o_proj``.
        layout: the model's :class:`methods.base.HeadLayout` (layers, query heads, head dim).
        heads: ``(layer, query-head id)`` pairs; empty means no mask (no hook is installed).
        mode: ``zero`` (output before W_O) or ``uniform`` (zero query).
        phase: ``all`` or ``decode``.

    Raises:
        ConfigError: unknown mode or phase, a head outside the layout, a model without
            per-layer ``q_proj``/``o_proj`` of ``H_q · d`` features (fused projections).
    """

    def __init__(self, model: torch.nn.Module, layout: HeadLayout, heads: Iterable[tuple[int, int]],
                 mode: str = "zero", phase: str = "all"):
        if mode not in MODES:
            raise ConfigError(f"--mode={mode!r}: accepted values are {', '.join(MODES)}")
        if phase not in PHASES:
            raise ConfigError(f"--phase={phase!r}: accepted values are {', '.join(PHASES)}")
        self.model, self.layout, self.mode, self.phase = model, layout, mode, phase
        self.by_layer: dict[int, list[int]] = {}
        for layer, head in heads:
            if not (0 <= layer < layout.num_layers and 0 <= head < layout.num_q_heads):
                raise ConfigError(
                    f"head {layer}-{head}: outside the model's {layout.num_layers} layers x {layout.num_q_heads} query heads"
                )
            self.by_layer.setdefault(int(layer), []).append(int(head))
        self._handles: list = []

    def _keep(self, width: int, heads: list[int]) -> torch.Tensor:
        h_q, d = self.layout.num_q_heads, self.layout.head_dim
        if width != h_q * d:
            raise ConfigError(f"model {self.layout.model_name or '?'}: projection width {width} is not {h_q} heads x {d}")
        keep = torch.ones(h_q, d)
        keep[heads] = 0.0
        return keep.flatten()  # (H_q·d,)

    def __enter__(self) -> "HeadMask":
        if not self.by_layer:
            return self
        modules = attention_modules(self.model)
        missing = sorted(set(self.by_layer) - set(modules))
        if missing:
            raise ConfigError(
                f"model {self.layout.model_name or '?'}: no attention module with q_proj/o_proj for layer {missing[0]}"
            )
        try:
            for layer, heads in sorted(self.by_layer.items()):
                attn = modules[layer]
                if self.mode == "zero":
                    keep = self._keep(attn.o_proj.in_features, heads)
                    handle = attn.o_proj.register_forward_pre_hook(partial(_zero_output, keep, self.phase))
                else:
                    keep = self._keep(attn.q_proj.out_features, heads)
                    handle = attn.q_proj.register_forward_hook(partial(_zero_query, keep, self.phase))
                self._handles.append(handle)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
