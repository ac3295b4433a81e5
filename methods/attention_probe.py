"""The calibration's instrumented attention (:class:`AttentionProbe`) and its decode cache.

Used by ``python -m methods.calibrate``: the prompt runs through SDPA; at each decoding step the
probe also records the step query's attention row of every head (a ``1×n`` row from the query
and the cached keys, never an ``n×n`` matrix) and, for the layer scores, the attention-block
output with a compressed cache (CompressKV Eq. 2–4).

:func:`reserved_cache` is a transformers ``DynamicCache`` whose layers append a decoded token in
place into a buffer with free room, instead of ``torch.cat`` copying the whole layer at every
step (at 3k prompt tokens that copy was a third of a SmolLM2-135M decoding step on CPU). The
attention sees the same keys and values (a view of the buffer), so every score is unchanged.
transformers is imported lazily.
"""

from __future__ import annotations

import functools

import torch

from .head_scores import relative_output_error
from .scoring import window_attention

_ATTN_NAME = "kvbench_calibrate"


@functools.cache
def _reserved_layer_class():
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` backed by buffers ``(B, H_kv, T + reserve, d)``; ``keys``/``values``
        are views ``[:, :, :T]`` and an update writes its rows in place (a full buffer grows by
        ``reserve`` more free slots)."""

        def __init__(self, reserve: int):
            super().__init__()
            self.reserve = max(1, int(reserve))
            self._bufs: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states, value_states, cache_kwargs=None):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            t, q = self.get_seq_length(), key_states.shape[-2]
            if self._bufs is None or t + q > self._bufs[0].shape[-2]:
                new = tuple(s.new_empty((*s.shape[:2], t + q + self.reserve, s.shape[-1])) for s in (key_states, value_states))
                if t:
                    new[0][:, :, :t].copy_(self.keys)
                    new[1][:, :, :t].copy_(self.values)
                self._bufs = new
            kbuf, vbuf = self._bufs
            kbuf[:, :, t : t + q].copy_(key_states)
            vbuf[:, :, t : t + q].copy_(value_states)
            self.keys, self.values = kbuf[:, :, : t + q], vbuf[:, :, : t + q]
            return self.keys, self.values

    return ReservedLayer


def reserved_cache(config, reserve: int):
    """A ``DynamicCache`` for ``config`` whose full-attention layers write decoded tokens in place.

    Args:
        config: the model config.
        reserve: free token slots after the prompt (the decoding budget + 1).

    Returns:
        A ``transformers.DynamicCache`` (sliding-window layers keep their own class).
    """
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _reserved_layer_class()(reserve)
    return cache


class AttentionProbe:
    """An SDPA attention function that also records what the calibration needs.

    * ``record_rows``: at a decoding step (one query), ``rows[l]`` = ``(H_q, n)`` float32 attention
      of the query over the n cached positions (from q and K, not from an n×n matrix).
    * ``selector``: at prefill, ``keep[l] = selector(layer, window_queries, keys, values, scaling)``,
      ``(k,)`` kept prompt positions; then at each decoding step the output with the cache
      restricted to ``keep[l]`` + generated positions is compared with the full one and
      ``errors[l]`` accumulates the term of Eq. 4.
    """

    def __init__(self, num_layers: int, window: int = 8):
        self.rows: list[torch.Tensor | None] = [None] * num_layers
        self.keep: list[torch.Tensor | None] = [None] * num_layers
        self.errors = torch.zeros(num_layers, dtype=torch.float64)
        self.record_rows = False
        self.selector = None
        self.window = window
        self.n_prompt = 0

    def install(self, lm) -> None:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self._sdpa = sdpa_attention_forward
        AttentionInterface.register(_ATTN_NAME, self)
        AttentionMaskInterface.register(_ATTN_NAME, sdpa_mask)
        lm.set_attn_implementation(_ATTN_NAME)

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        out, weights = self._sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        layer, q_len = module.layer_idx, query.shape[2]
        if q_len == 1 and self.record_rows:
            self.rows[layer] = window_attention(query, key, scaling)[0, :, 0]  # (H_q, n)
        if q_len > 1 and self.selector is not None:
            self.n_prompt = key.shape[2]
            w = min(self.window, q_len)
            self.keep[layer] = self.selector(layer, query[:, :, -w:], key, value, scaling)
        elif q_len == 1 and self.keep[layer] is not None:
            idx = torch.cat([self.keep[layer], torch.arange(self.n_prompt, key.shape[2], device=key.device)])
            comp, _ = self._sdpa(module, query, key[:, :, idx], value[:, :, idx], None, scaling=scaling, dropout=dropout)
            o_full = module.o_proj(out.reshape(1, -1))
            o_comp = module.o_proj(comp.reshape(1, -1))
            self.errors[layer] += float(relative_output_error(o_full, o_comp))
        return out, weights
