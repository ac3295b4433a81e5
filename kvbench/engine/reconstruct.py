"""Reconstruction forwards (KVzip) after the prefill, before compression (docs/ARCHITECTURE.md, method contract)."""

import torch

from kvbench.engine.attention import CompressionState, clock, compress_layer
from kvbench.engine.kvcache import PreallocatedLayer
from kvbench.engine.models import attention_modules


@torch.inference_mode()
def reconstruct(model: torch.nn.Module, state: CompressionState, n: int) -> None:
    """Run ``state.scoring``'s forwards on ``state.cache`` (n prefilled tokens), then compress every compressible
    layer from their scores (RuntimeError: an input that does not fit the model)."""
    sc, cache, dev = state.scoring, state.cache, model.get_input_embeddings().weight.device

    def keep_norm(module, args, kwargs):  # KVzip+'s ||h||: the attention input, which the attention function never sees
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        sc.hidden_norms[module.layer_idx] = torch.linalg.vector_norm(hidden, dim=-1)

    hooks = [m.register_forward_pre_hook(keep_norm, with_kwargs=True) for m in attention_modules(model).values()]
    t0, state.phase = clock(dev), "score"
    try:
        for sc.forward, (ids, _start, _end) in enumerate(sc.reconstruction.inputs):
            # sliding-window layers (Gemma) drop old tokens as they take new ones: restored as they were
            saved = [None if isinstance(layer, PreallocatedLayer) else dict(vars(layer)) for layer in cache.layers]
            pos = torch.arange(n, n + len(ids), device=dev)
            model(input_ids=torch.tensor([ids], device=dev), past_key_values=cache, use_cache=True,
                  position_ids=pos.view(1, -1), cache_position=pos, logits_to_keep=1, kvbench_state=state)
            for layer, old in zip(cache.layers, saved):
                layer.crop(n) if old is None else vars(layer).update(old)
            sc.tokens += len(ids)
    finally:
        for hook in hooks:
            hook.remove()
        state.phase = "prefill"
    sc.seconds = clock(dev) - t0
    state.plan = state.method.allocate(state.plan, sc.scores, sc.reconstruction)
    state.compress_s += clock(dev) - t0
    for idx, (scaling, softcap) in sc.scaling.items():
        key, value = cache.layers[idx].keys[:, :, :n], cache.layers[idx].values[:, :, :n]
        compress_layer(state, idx, key[:, :, :0], key, value, scaling, softcap, reconstruction_scores=sc.scores[idx])
