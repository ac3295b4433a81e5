"""The calibration's instrumented attention (:class:`AttentionProbe`) and its decode cache
(:func:`reserved_cache`: decoded tokens written in place instead of ``torch.cat`` copying each layer
at every step, a third of a SmolLM2 step at 3k tokens on CPU; the scores are unchanged)."""

from __future__ import annotations

import torch

from .head_scores import relative_output_error
from .scoring import window_attention


def reserved_cache(config, reserve: int):
    """A ``transformers.DynamicCache`` for ``config`` whose full-attention layers keep ``reserve``
    free token slots and append in place (``keys``/``values`` are views of the buffers; a full
    buffer grows by ``reserve``). Sliding-window layers keep their own class."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        _bufs = None

        def update(self, key_states, value_states, cache_kwargs=None):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            t, q = self.get_seq_length(), key_states.shape[-2]
            if self._bufs is None or t + q > self._bufs[0].shape[-2]:
                self._bufs = tuple(
                    s.new_empty((*s.shape[:2], t + q + max(1, reserve), s.shape[-1])) for s in (key_states, value_states))
                if t:
                    self._bufs[0][:, :, :t].copy_(self.keys)
                    self._bufs[1][:, :, :t].copy_(self.values)
            kbuf, vbuf = self._bufs
            kbuf[:, :, t : t + q].copy_(key_states)
            vbuf[:, :, t : t + q].copy_(value_states)
            self.keys, self.values = kbuf[:, :, : t + q], vbuf[:, :, : t + q]
            return self.keys, self.values

    cache = DynamicCache(config=config)
    cache.layers = [ReservedLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class AttentionProbe:
    """An SDPA attention function (registered with transformers' ``AttentionInterface``) that also
    records what the calibration needs.

    * ``record_rows``: at a decoding step, ``rows[l]`` = ``(H_q, n)`` float32 attention of the query.
    * ``selector``: at prefill, ``keep[l] = selector(layer, window_queries, keys, values, scaling)``
      (``(k,)`` kept prompt positions); then at each decoding step the output with the cache cut to
      ``keep[l]`` + generated positions is compared with the full one and ``errors[l]`` adds the
      term of Eq. 4.
    """

    def __init__(self, num_layers: int, window: int = 8):
        self.rows: list[torch.Tensor | None] = [None] * num_layers
        self.keep: list[torch.Tensor | None] = [None] * num_layers
        self.errors = torch.zeros(num_layers, dtype=torch.float64)
        self.record_rows, self.selector, self.window, self.n_prompt = False, None, window, 0

    def install(self, lm) -> None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self._sdpa = sdpa_attention_forward
        AttentionInterface.register("kvbench_calibrate", self)
        AttentionMaskInterface.register("kvbench_calibrate", sdpa_mask)
        lm.set_attn_implementation("kvbench_calibrate")

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, weights = self._sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer, q_len = module.layer_idx, query.shape[2]
        if q_len == 1 and self.record_rows:
            self.rows[layer] = window_attention(query, key, scaling)[0, :, 0]  # (H_q, n)
        if q_len > 1 and self.selector is not None:
            self.n_prompt = key.shape[2]
            self.keep[layer] = self.selector(layer, query[:, :, -min(self.window, q_len):], key, value, scaling)
        elif q_len == 1 and self.keep[layer] is not None:
            idx = torch.cat([self.keep[layer], torch.arange(self.n_prompt, key.shape[2], device=key.device)])
            comp, _ = self._sdpa(module, query, key[:, :, idx], value[:, :, idx], None, scaling=scaling, dropout=dropout)
            o_full, o_comp = module.o_proj(out.reshape(1, -1)), module.o_proj(comp.reshape(1, -1))
            self.errors[layer] += float(relative_output_error(o_full, o_comp))
        return out, weights
