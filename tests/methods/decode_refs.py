"""Reference pipelines for decode-time compression parity (issue 46): what R-KV's and kvpress's own code do while
generating, on a Hugging Face model, as greedy tokens and the original positions kept at every compression.

* :func:`official_update_kv`: R-KV's ``R1KV.update_kv`` (``rkv/compression/r1_kv.py``) with ``compute_attention_scores``
  and ``cal_similarity`` (``rkv/utils.py``), transcribed op for op (commit d15c976 of Zefan-Cai/R-KV).
* :func:`rkv_generate`: R-KV's pipeline (``rkv/modeling.py``'s attention forward and ``CausalLM_forward``,
  ``run_math.py``, ``divide_method=step_length``) around the model's own attention (SDPA).
* :func:`kvpress_generate`: kvpress 0.5.5's own ``DecodingPress`` / ``PrefillDecodingPress`` hooks, in its pipeline
  (``KVPressTextGenerationPipeline``: the question forward on the compressed context) or over the whole prompt,
  instrumented (the base press's ``compress``/``score`` wrapped, its behaviour unchanged).
* :func:`assert_same_compressions`: a run against a reference run, as far as both define it (kept sets exactly,
  stored order up to float near-ties, tokens).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass
class Compression:
    """One compression of one layer in a reference pipeline.

    Attributes:
        fed: tokens fed to the model so far, the compressing forward's included (prompt + generated).
        layer: the layer index.
        kept: per KV head, the original token positions the cache holds after it, in stored slot order
            (kvpress AdaKVPress: the unmasked slots, ascending; its cache keeps every slot).
        keys: ``(H_kv, slots, d)`` the layer's keys right after it.
        scored: tokens whose queries / hidden states the scorer was handed (R-KV: its query cache; kvpress: the
            hidden-states buffer).
        scores: per KV head, the score of each kept slot, in stored order, where that order is a top-k of float
            scores computed from the model's tensors (R-KV: its window's slots ``inf``, stored after the top-k in
            position order); None where the order is exact (kvpress's StreamingLLM scores positions, AdaKVPress's
            slots ascend) or not recorded.
    """

    fed: int
    layer: int
    kept: list[list[int]]
    keys: torch.Tensor
    scored: int
    scores: list[list[float]] | None = None


@dataclass
class RefRun:
    tokens: list[int] = field(default_factory=list)
    compressions: list[Compression] = field(default_factory=list)


def official_update_kv(key_states, query_states, value_states, budget: int, window_size: int = 8,
                       kernel_size: int = 7, mix_lambda: float = 0.07, retain_direction: str = "last",
                       threshold: float = 0.5, redundancy: bool = True, with_scores: bool = False):
    """``R1KV.update_kv`` as the official code computes it: ``(keys, values, slots)``, ``slots`` ``(B, H_kv, m)``
    the kept slots in the order stored (top-k, then the window); a cache shorter than ``budget`` is returned whole.
    ``redundancy=False``: the repository's decode-time SnapKV baseline (``rkv/compression/snapkv.py``: the
    max-pooled attention alone). ``with_scores``: a fourth element, ``(B, H_kv, m)`` float32 the score of each
    stored slot (the window's and a short cache's ``inf``: kept whatever they score, in position order)."""
    head_dim, kv_len = query_states.shape[-1], key_states.shape[-2]
    if kv_len < budget:
        whole = torch.arange(kv_len, device=key_states.device).expand(*key_states.shape[:2], kv_len)
        return (key_states, value_states, whole) + (torch.full(whole.shape, math.inf),) * with_scores
    # compute_attention_scores(query_states, key_states), pooling="max" over each query group
    bsz, q_heads, q_len, _ = query_states.shape
    kv_heads = key_states.shape[1]
    if q_heads == kv_heads:
        logits = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(head_dim)
    else:
        grouped = query_states.view(bsz, kv_heads, q_heads // kv_heads, q_len, head_dim)
        logits = torch.matmul(grouped, key_states.unsqueeze(2).transpose(3, 4)) / math.sqrt(head_dim)
        logits = logits.max(dim=2).values
    probs = F.softmax(logits[:, :, -window_size:, :-window_size], dim=-1, dtype=torch.float32)
    attn_cache = F.max_pool1d(probs.mean(dim=-2).to(query_states.dtype), kernel_size=kernel_size,
                              padding=kernel_size // 2, stride=1)
    # cal_similarity(key_states, threshold, retain_direction): batch 0's keys, one zeroed entry per row
    k = key_states[0]
    n_heads, seq_len = k.shape[0], k.shape[1]
    k_norm = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
    sim = torch.matmul(k_norm, k_norm.transpose(-1, -2))
    for h in range(n_heads):
        sim[h].fill_diagonal_(0.0)
    candidates = torch.where(sim > threshold, torch.arange(seq_len, device=sim.device),
                             torch.zeros_like(sim, dtype=torch.long))
    retain = candidates.max(dim=-1)[0] if retain_direction == "last" else candidates.min(dim=-1)[0]
    sim[torch.arange(n_heads).unsqueeze(1).repeat(1, seq_len), torch.arange(seq_len).unsqueeze(0).repeat(n_heads, 1),
        retain] = 0
    similarity = sim.mean(dim=1).softmax(dim=-1)[:, :-window_size]
    final = attn_cache * mix_lambda - similarity * (1 - mix_lambda) if redundancy else attn_cache
    top = final.topk(budget - window_size, dim=-1).indices  # (B, H_kv, budget − W), descending score
    rows = top.unsqueeze(-1).expand(-1, -1, -1, head_dim)
    keys = torch.cat([key_states[:, :, :-window_size].gather(2, rows), key_states[:, :, -window_size:]], dim=2)
    values = torch.cat([value_states[:, :, :-window_size].gather(2, rows), value_states[:, :, -window_size:]], dim=2)
    window = torch.arange(kv_len - window_size, kv_len, device=top.device).expand(*top.shape[:2], window_size)
    if not with_scores:
        return keys, values, torch.cat([top, window], dim=-1)
    scores = torch.cat([final.gather(-1, top).float(), torch.full(window.shape, math.inf, device=top.device)], dim=-1)
    return keys, values, torch.cat([top, window], dim=-1), scores


@contextmanager
def attention(model, name: str, fn: Callable | None = None):
    """``model`` running the attention function ``fn`` registered as ``name`` (or the registered ``name``, e.g.
    ``sdpa``), no grad; afterwards its own attention and no kvpress AdaKVPress mask left on its layers. ``fn`` is
    also set in the models' own mapping, which shadows the registry: importing kvpress wraps every function then
    registered into it, a stale ``fn`` of an earlier call among them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if fn is not None:
        AttentionInterface.register(name, fn)
        ALL_ATTENTION_FUNCTIONS[name] = fn
        AttentionMaskInterface.register(name, sdpa_mask)
    own = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        with torch.no_grad():
            yield
    finally:
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
        model.set_attn_implementation(own)


def rkv_generate(model, ids: list[int], max_new_tokens: int, budget: int, divide_length: int = 128,
                 window_size: int = 8, stop_ids=(), update_kv: Callable | None = None, **rkv) -> RefRun:
    """Greedy generation as R-KV's ``run_math.py`` runs it (``model.generate``, ``divide_method=step_length``), each
    attention layer doing what ``rkv/modeling.py``'s forward does:

    * a query cache of the last ``window_size`` queries (after RoPE), set to the prompt's last ones at prefill and
      extended by each forward's queries before compression (the current token included);
    * prefill: the prompt's keys compressed by ``update_kv`` (when ≥ ``budget``) before being stored, the attention
      computed on all of them;
    * decoding: a forward compresses when the tokens fed before it (prompt included) are a multiple of
      ``divide_length`` (``CausalLM_forward`` sets the flag after the forward that reached it): the cache, the
      current token appended, goes through ``update_kv`` (unchanged when < ``budget``) after the attention is
      computed on it uncompressed; the next forward sees the compressed cache.

    Positions continue from the prompt (``n + step``). ``update_kv(keys, query_cache, values) -> (keys, values,
    slots[, scores])``: default :func:`official_update_kv` with ``budget``, ``window_size`` and ``rkv``
    (``kernel_size``, ``mix_lambda``, ``retain_direction``, ``threshold``), its scores recorded. Stops after
    ``max_new_tokens`` or a token in ``stop_ids`` (kept). Returns the tokens and every compression (``fed``, layer,
    kept positions in stored order, their scores where ``update_kv`` returns them).
    """
    from transformers import DynamicCache
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def official(k, q, v):
        return official_update_kv(k, q, v, budget, window_size, **rkv, with_scores=True)

    update_kv, sdpa = update_kv or official, ALL_ATTENTION_FUNCTIONS["sdpa"]
    cache, run, queries, positions = DynamicCache(config=model.config), RefRun(), {}, {}
    state = {"fed": 0, "compress": True}  # the prefill compresses (update_kv skips a prompt < budget)

    def attend(module, query, key, value, attention_mask, **kwargs):
        out = sdpa(module, query, key, value, attention_mask, **kwargs)
        i, q_len, fed = module.layer_idx, query.shape[2], state["fed"]
        queries[i] = (torch.cat([queries[i], query], dim=2) if i in queries else query)[:, :, -window_size:]
        new = torch.arange(fed - q_len, fed).expand(key.shape[1], q_len)
        positions[i] = torch.cat([positions[i], new], dim=-1) if i in positions else new
        if state["compress"] and key.shape[2] >= budget:
            keys, values, slots, *scores = update_kv(key, queries[i], value)
            cache.layers[i].keys, cache.layers[i].values = keys, values
            positions[i] = positions[i].gather(-1, slots[0])
            run.compressions.append(Compression(fed, i, positions[i].tolist(), keys[0].clone(), queries[i].shape[2],
                                                scores[0][0].tolist() if scores else None))
        return out

    with attention(model, "rkv_reference", attend):
        n = len(ids)
        state["fed"] = n
        logits = model(torch.tensor([ids]), past_key_values=cache).logits[0, -1]
        for step in range(max_new_tokens):
            run.tokens.append(int(logits.argmax()))
            if run.tokens[-1] in stop_ids or step == max_new_tokens - 1:
                break
            state["compress"] = state["fed"] % divide_length == 0
            state["fed"] += 1
            logits = model(torch.tensor([[run.tokens[-1]]]), past_key_values=cache,
                           position_ids=torch.tensor([[n + step]])).logits[0, -1]
    return run


class Recording:
    """The tokenizer kvpress's pipeline gets: ``tok``'s attributes, and ``decode`` records the answer's ids."""

    model_max_length = 1 << 40  # no context truncation

    def __init__(self, tok=None):
        self.tok, self.decoded = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kwargs):
        self.decoded.append([int(i) for i in ids])
        return ""


def _base_presses(press) -> list:
    """The ScorerPress / AdaKVPress objects whose ``compress`` does the work inside ``press``."""
    import kvpress

    if isinstance(press, kvpress.PrefillDecodingPress):
        inner = [press.prefilling_press, press.decoding_press and press.decoding_press.base_press]
        return list({id(p): p for p in inner if p is not None}.values())
    return [press.base_press] if isinstance(press, kvpress.DecodingPress) else [press]


@contextmanager
def _instrumented(model, press, run: RefRun):
    """``press``'s base presses recording every compression into ``run``; tokens fed counted by a pre-hook on the
    decoder. The kept slots are those of the press's own code: ScorerPress keeps ``scores.topk(n_kept)`` of its
    own scores, in that order (checked against the keys it returns), and those scores are recorded (not
    StreamingLLMPress's, which score positions: its order is exact); AdaKVPress masks ``module.masked_key_indices``."""
    import kvpress
    from kvpress.utils import compute_n_kept

    fed, positions = [0], {}

    def count(module, args, kwargs):
        fed[0] += kwargs["input_ids"].shape[1]

    def wrap(base):
        ada, last = isinstance(base, kvpress.AdaKVPress), {}
        exact = isinstance(base, kvpress.StreamingLLMPress)
        score, compress = base.score if not ada else None, base.compress

        def scored(*args, **kwargs):
            last["scores"] = score(*args, **kwargs)
            return last["scores"]

        def compressed(module, hidden_states, keys, values, attentions, kwargs):
            out = compress(module, hidden_states, keys, values, attentions, kwargs)
            i, (_, h, t, d) = module.layer_idx, keys.shape
            pos = positions.get(i, torch.empty(h, 0, dtype=torch.long))
            pos = positions[i] = torch.cat([pos, torch.arange(fed[0] - (t - pos.shape[1]), fed[0]).expand(h, -1)], -1)
            if base.compression_ratio == 0:  # nothing to remove (k_len <= target_size): no record
                return out
            scores = None
            if ada:  # masked, not freed: slots stay the original positions
                keep = torch.ones(h, t, dtype=torch.bool)
                keep[module.masked_key_indices[1], module.masked_key_indices[2]] = False
                kept = [pos[j][keep[j]].tolist() for j in range(h)]
            else:
                slots = last["scores"][0].topk(compute_n_kept(t, base.compression_ratio), dim=-1).indices  # (H, m)
                assert torch.equal(out[0][0], keys[0].gather(1, slots[..., None].expand(-1, -1, d)))
                positions[i] = pos.gather(-1, slots)
                kept = positions[i].tolist()
                scores = None if exact else last["scores"][0].gather(-1, slots).float().tolist()
            run.compressions.append(Compression(fed[0], i, kept, out[0][0].clone(), hidden_states.shape[1], scores))
            return out

        base.compress = compressed
        if not ada:
            base.score = scored

    bases = _base_presses(press)
    for base in bases:
        wrap(base)
    hook = model.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()
        for base in bases:  # back to the class's methods
            for name in ("score", "compress"):
                vars(base).pop(name, None)


def kvpress_generate(model, press, ids: list[int], max_new_tokens: int, question_ids: list[int] | None = None,
                     tok=None) -> RefRun:
    """kvpress 0.5.5 generating greedily under ``press`` (``DecodingPress`` or ``PrefillDecodingPress``, the model on
    SDPA), in one of its two protocols:

    * ``question_ids`` given: its ``KVPressTextGenerationPipeline._forward``: ``ids`` (the context) prefilled through
      the decoder (compressed by a PrefillDecodingPress's prefilling press, a DecodingPress leaves it), then the
      question in one forward on that cache (positions from len(ids)), which kvpress counts as a decoding step
      (its hidden states one buffer entry), then one token per forward;
    * else the whole prompt ``ids`` prefilled under the press and decoded one token per forward (positions from n).

    Stops after ``max_new_tokens`` or at the model's generation-config eos (kept), as the pipeline does.
    """
    from transformers import DynamicCache

    run, cache = RefRun(), DynamicCache(config=model.config)
    with attention(model, "sdpa"), _instrumented(model, press, run):
        if question_ids is not None:
            import kvpress

            pipe = kvpress.KVPressTextGenerationPipeline(model=model, tokenizer=Recording(tok))
            pipe._forward({"context_ids": torch.tensor([ids]), "questions_ids": [torch.tensor([question_ids])]},
                          max_new_tokens=max_new_tokens, press=press, cache=cache)
            run.tokens = pipe.tokenizer.decoded[0]
            return run
        eos = model.generation_config.eos_token_id
        stops = eos if isinstance(eos, list) else [eos]
        with press(model):
            logits = model(input_ids=torch.tensor([ids]), past_key_values=cache).logits[0, -1]
            for step in range(max_new_tokens):
                run.tokens.append(int(logits.argmax()))
                if run.tokens[-1] in stops or step == max_new_tokens - 1:
                    break
                logits = model(input_ids=torch.tensor([[run.tokens[-1]]]), past_key_values=cache,
                               position_ids=torch.tensor([[len(ids) + step]])).logits[0, -1]
    return run


# Two runs of the same compressions compute their scores from keys and queries that differ by float noise (another
# attention implementation, other vector kernels: AVX512's reductions are not AVX2's): two positions whose scores are
# that close may come out of the top-k in either order. Near-tie: reference scores within NEAR_TIE × the head's
# largest |score|. Measured on SmolLM2 between kvbench's and the references' scores of the same position, AVX2 and
# default kernels: Knorm ≤ 7e-7, R-KV ≤ 4e-6 of that.
NEAR_TIE = 1e-4


def same_up_to_near_ties(mine: list[int], theirs: list[int], scores: list[float] | None,
                         rtol: float = NEAR_TIE) -> bool:
    """Whether ``mine`` holds exactly the positions of ``theirs`` (each once) in its order, except that two of them
    may be in the other order where their ``scores`` (``theirs``'s, slot for slot; both finite) differ by at most
    ``rtol`` × the largest finite |score|. Without ``scores`` the order must be equal."""
    if mine == theirs:
        return True
    if scores is None or len(mine) != len(set(mine)) or sorted(mine) != sorted(theirs):
        return False
    at = {p: (i, s) for i, (p, s) in enumerate(zip(theirs, scores))}
    rank, score = torch.tensor([at[p] for p in mine], dtype=torch.float64).T  # in mine's order
    swapped = (rank[:, None] > rank[None, :]).triu(1)  # i before j in mine, after it in theirs
    tol = rtol * max((abs(s) for s in scores if math.isfinite(s)), default=0.0)
    return bool(((score[:, None] - score[None, :]).abs()[swapped] <= tol).all())  # inf - inf: nan, not a tie


def assert_same_compressions(mine: RefRun, theirs: RefRun, prompt: int, order_feeds_forward: bool = False,
                             rtol: float = NEAR_TIE) -> int:
    """``mine`` compresses as the reference run ``theirs`` does, as far as both define it:

    * the same compressions (tokens fed, layer), in order;
    * at each, per KV head, exactly the same kept positions (no kept set may differ);
    * in the same stored order, except near-ties (:func:`same_up_to_near_ties`, ``theirs``'s recorded scores): which
      of two keys of near-equal score the top-k stores first is float noise, not what either pipeline defines;
    * the same greedy tokens (``prompt``: the prompt's length; the forward that brings the tokens fed to f decodes
      token f − ``prompt``).

    ``order_feeds_forward`` (R-KV: its redundancy term keeps, of two similar keys, the one in the higher slot): once
    a forward's compressions store a near-tie in the other order, the next compressions score other inputs and the
    runs may part legitimately. The comparison stops there: that forward's compressions are compared, and the tokens
    decoded until the next compression's forward (its cache holds the same sets). Without it (kvpress's ScorerPress
    scores each key alone; a permuted cache attends the same up to float noise) everything is compared. Returns the
    number of compressions compared."""
    cut = None  # the forward whose compressions stored a near-tie in the other order
    compared = 0
    for k, (a, b) in enumerate(zip(mine.compressions, theirs.compressions)):
        if cut is not None and b.fed > cut:
            break
        where = f"compression {k} (fed {b.fed}, layer {b.layer})"
        assert (a.fed, a.layer) == (b.fed, b.layer), f"{where}: this run's is (fed {a.fed}, layer {a.layer})"
        assert len(a.kept) == len(b.kept), f"{where}: {len(a.kept)} heads, the reference {len(b.kept)}"
        for h, (x, y) in enumerate(zip(a.kept, b.kept)):
            assert len(x) == len(set(x)), f"{where}, head {h}: a position kept twice: {x}"
            assert set(x) == set(y), \
                f"{where}, head {h}: kept sets differ ({sorted(set(x) - set(y))} against {sorted(set(y) - set(x))})"
            assert same_up_to_near_ties(x, y, None if b.scores is None else b.scores[h], rtol), \
                f"{where}, head {h}: stored order differs beyond near-ties:\n{x}\n{y}"
            if order_feeds_forward and x != y:
                cut = b.fed
        compared += 1
    later = [c.fed for c in theirs.compressions if cut is not None and c.fed > cut]
    if not later:
        assert len(mine.compressions) == len(theirs.compressions)
        assert mine.tokens == theirs.tokens, "greedy tokens differ"
    else:  # the next compression's forward still attends a cache of the same sets
        n = later[0] - prompt + 1
        assert mine.tokens[:n] == theirs.tokens[:n], f"greedy tokens differ before the forward at {later[0]} fed"
    return compared
