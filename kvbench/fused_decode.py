"""One greedy decode step of a Llama-family model without per-module dispatch.

A decode step of a small model is dominated by fixed costs, not by bytes: SmolLM2-135M runs
211 ``nn.Linear`` calls and about 40 small modules per layer through transformers' module
tree (keyword plumbing, mask and cache bookkeeping, ``repeat``/``view`` glue), about 10 ms of a
35 ms step on 2 CPU cores. :class:`FusedDecoder` computes the same step as straight-line
tensor code:

* the query/key/value projections of a layer are one matrix-vector product (their weights
  concatenated row-wise), and so are the MLP's gate and up projections;
* the model's modules are re-pointed to row slices of those concatenated weights, so the
  weights are stored once and the module path (prefill, hooks, tests) computes what it
  computed before;
* on CPU in float32 the projections and the LM head run through the compiled matrix-vector
  kernel of :mod:`kvbench.cpu_decode` (weights in PyTorch's layout, rows split over the
  threads), and the attention through its decode-attention kernel (via
  :func:`kvbench.attention._decode_attention`); without those kernels every projection (the
  fused ones, ``o_proj``, ``down_proj``) is stored input-major, its transpose contiguous
  (:func:`_input_major`), which MKL's matrix-vector product streams faster. The modules'
  weights are views with the same values; their matrix products may round differently in the
  last bits (another operand layout for the BLAS), the same order of difference as another
  thread count;
* RMSNorm, RoPE, the cache write and the attention (the fast path of
  :func:`kvbench.attention._decode_attention`, with the layer's compensation/validity bias) are
  the same operations, in the same order and
  precision, as the model's own modules: the logits equal the module path's within float32
  rounding of the fused matrix products (tests: ``tests/kvbench/test_fused_decode.py``).

On CPU, building the decoder also copies the model's other parameters (see
:func:`_own_cpu_weights`), so the resident set briefly holds the weights twice at start-up.
``FusedDecoder.INPUT_MAJOR_ON_CPU = False`` (before the decoder is built) keeps PyTorch's layout;
``KVBENCH_DECODE_KERNELS=0`` in the environment turns the compiled kernels off.

Supported: ``model_type`` llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), every layer
full attention (no sliding window), plain ``nn.Linear`` projections on one device. Anything
else (Gemma 2/3, sliding windows, quantized or offloaded weights) decodes through the model's
modules, as does any step while a forward hook is registered anywhere in the model (head
masking, fault injection, user hooks): hooks see exactly the calls they expect.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from . import attention, cpu_decode

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm, operation for operation (float32 statistics)."""
    if x.dtype == torch.float32:  # the casts are no-ops: skip their dispatch
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers' ``apply_rotary_pos_emb``: ``x·cos + rotate_half(x)·sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


@dataclass
class _Layer:
    idx: int
    ln1: torch.Tensor
    ln1_eps: float
    w_qkv: torch.Tensor  # (H_q·d + 2·H_kv·d, D)
    b_qkv: torch.Tensor | None
    q_norm: tuple[torch.Tensor, float] | None
    k_norm: tuple[torch.Tensor, float] | None
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    ln2: torch.Tensor
    ln2_eps: float
    w_gu: torch.Tensor  # (2·I, D)
    b_gu: torch.Tensor | None
    w_down: torch.Tensor
    b_down: torch.Tensor | None
    act: Any
    scaling: float


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot use :class:`FusedDecoder` (one line), or None when it can."""
    config = model.config
    mtype = getattr(config, "model_type", None)
    if mtype not in SUPPORTED_TYPES:
        return f"model_type {mtype!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    types = getattr(config, "layer_types", None)
    if types is not None and any(t != "full_attention" for t in types):
        return "sliding-window layers"
    if mtype == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "Mistral sliding window"
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(model, "lm_head"):
        return "not a *ForCausalLM with model.layers"
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1 or next(iter(devices)).type == "meta":
        return "weights on several devices or offloaded"
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            if type(lin) is not torch.nn.Linear or not lin.weight.is_floating_point():
                return f"{type(lin).__name__} projections (quantized or wrapped)"
    if type(model.lm_head) is not torch.nn.Linear:
        return f"{type(model.lm_head).__name__} lm_head"
    return None


def has_hooks(model: torch.nn.Module) -> bool:
    """True when any forward (pre-)hook is registered on ``model``, a submodule or globally."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _fuse(linears: list[torch.nn.Linear], input_major: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` row-wise and re-point each module's
    parameters to its rows of the result (one copy of the weights, module outputs unchanged).

    Returns the fused weight ``(N, K)`` (N = the modules' output features together) and bias
    ``(N,)`` or None. With ``input_major`` the weight is stored transposed, as a contiguous
    ``(K, N)`` buffer, and the returned weight and the modules' weights are ``(·, K)`` views of
    it with strides ``(1, N)``: ``F.linear`` then multiplies by the contiguous buffer directly
    (see :func:`_input_major`).
    """
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if input_major:
        weight = _transposed_storage(weight)
    bias = None
    if any(lin.bias is not None for lin in linears):
        bias = torch.cat([
            lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears
        ])
    start = 0
    for lin in linears:
        stop = start + lin.out_features
        lin.weight.data = weight[start:stop]
        if lin.bias is not None:
            lin.bias.data = bias[start:stop]
        start = stop
    return weight, bias


def _transposed_storage(weight: torch.Tensor) -> torch.Tensor:
    """The same ``(N, K)`` values stored input-major: a view of a contiguous ``(K, N)`` copy."""
    return weight.t().contiguous().t()


def _input_major(lin: torch.nn.Linear) -> torch.Tensor:
    """Store ``lin``'s weight ``(N, K)`` transposed: a contiguous ``(K, N)`` buffer, with the
    module's weight re-pointed to its ``(N, K)`` view (same values, one copy).

    Why (CPU decode): a decode step multiplies one token's activation ``(1, K)`` by each weight.
    Stored output-major (PyTorch's ``(N, K)``) that is N dot products of length K — for the short
    rows of a small model (K = 576) the matrix-vector kernel streams the weight at about 65 % of
    the machine's read bandwidth. Stored input-major, ``x @ W^T`` reads W^T row by row and adds
    scaled rows (no horizontal sums): measured 4–8 % faster per decode step on SmolLM2-135M
    with 2 threads, and unchanged prefill matrix products (MKL packs either layout).
    """
    weight = _transposed_storage(lin.weight.detach())
    lin.weight.data = weight
    return weight


def _own_cpu_weights(model: torch.nn.Module, layers: list["_Layer"], input_major: bool) -> None:
    """Give every other CPU parameter its own memory too, so no tensor keeps the checkpoint's
    file mapping alive.

    transformers maps safetensors checkpoints into memory; the loaded parameters are views of
    that mapping, and its pages count in the resident set as long as any view lives. Once the
    fused projections are copies, the mapping would stay resident for the norms, embeddings,
    ``o_proj`` and ``down_proj`` alone, holding the fused weights' old pages too (+52 % of
    SmolLM2-135M's weights in RSS). Copying the rest releases it: the process holds the
    weights once, as before fusing.
    """
    fused = {t.untyped_storage().data_ptr() for fl in layers for t in (fl.w_qkv, fl.b_qkv, fl.w_gu, fl.b_gu) if t is not None}
    if input_major:  # o_proj and down_proj are copies too
        fused |= {t.untyped_storage().data_ptr() for fl in layers for t in (fl.w_o, fl.w_down)}
    for param in model.parameters():
        storage_ptr = param.untyped_storage().data_ptr()
        if storage_ptr not in fused:
            param.data = param.data.clone()


def _is_fused(linears: list[torch.nn.Linear], weight: torch.Tensor) -> bool:
    start = 0
    for lin in linears:
        if lin.weight.data_ptr() != weight[start:].data_ptr():
            return False
        start += lin.out_features
    return True


class FusedDecoder:
    """Greedy decode step ``(token, position) → logits`` of a supported model, equal to its forward.

    Build with :meth:`for_model` (cached on the model; None when unsupported). The step reads
    and writes the same cache object and bias buffers as the module path.

    Args:
        model: a ``LlamaForCausalLM``/``MistralForCausalLM``/``Qwen2ForCausalLM``/``Qwen3ForCausalLM``
            (see :func:`unsupported_reason`). Its projection weights are re-pointed into fused buffers.
    """

    INPUT_MAJOR_ON_CPU = True  # class switch for A/B measurements (benchmarks/README.md)

    def __init__(self, model: torch.nn.Module):
        base = model.model
        config = model.config
        self.model = model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.norm_eps = float(base.norm.variance_epsilon)
        self.rotary = base.rotary_emb
        self.lm_head = model.lm_head.weight
        self.lm_head_bias = model.lm_head.bias
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.num_q = int(config.num_attention_heads)
        self.num_kv = int(config.num_key_value_heads)
        self.layers: list[_Layer] = []
        # Plain tensors even when built inside inference mode: the re-pointed parameters are
        # the model's, used by every later forward.
        # CPU: projections stored input-major (see _input_major); CUDA keeps PyTorch's layout.
        # CPU float32 with the compiled kernels (kvbench.cpu_decode): PyTorch's output-major
        # layout, which the kernel's matrix-vector product reads row by row.
        on_cpu = self.embed.device.type == "cpu"
        self.kernels = cpu_decode.load() if on_cpu and self.embed.dtype == torch.float32 else None
        self.input_major = self.INPUT_MAJOR_ON_CPU and on_cpu and self.kernels is None
        input_major = self.input_major
        with torch.inference_mode(False), torch.no_grad():
            for idx, layer in enumerate(base.layers):
                attn, mlp = layer.self_attn, layer.mlp
                w_qkv, b_qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj], input_major)
                w_gu, b_gu = _fuse([mlp.gate_proj, mlp.up_proj], input_major)
                w_o = _input_major(attn.o_proj) if input_major else attn.o_proj.weight
                w_down = _input_major(mlp.down_proj) if input_major else mlp.down_proj.weight
                q_norm = getattr(attn, "q_norm", None)
                k_norm = getattr(attn, "k_norm", None)
                self.layers.append(_Layer(
                    idx=idx,
                    ln1=layer.input_layernorm.weight, ln1_eps=float(layer.input_layernorm.variance_epsilon),
                    w_qkv=w_qkv, b_qkv=b_qkv,
                    q_norm=(q_norm.weight, float(q_norm.variance_epsilon)) if q_norm is not None else None,
                    k_norm=(k_norm.weight, float(k_norm.variance_epsilon)) if k_norm is not None else None,
                    w_o=w_o, b_o=attn.o_proj.bias,
                    ln2=layer.post_attention_layernorm.weight,
                    ln2_eps=float(layer.post_attention_layernorm.variance_epsilon),
                    w_gu=w_gu, b_gu=b_gu,
                    w_down=w_down, b_down=mlp.down_proj.bias,
                    act=F.silu if getattr(config, "hidden_act", None) == "silu" else mlp.act_fn,
                    scaling=float(attn.scaling),
                ))

            if self.embed.device.type == "cpu":
                _own_cpu_weights(model, self.layers, input_major)
        self._linear = F.linear
        if self.kernels is not None and all(
            cpu_decode.linear_applies(w, b) for fl in self.layers
            for w, b in ((fl.w_qkv, fl.b_qkv), (fl.w_o, fl.b_o), (fl.w_gu, fl.b_gu), (fl.w_down, fl.b_down))
        ) and cpu_decode.linear_applies(self.lm_head, self.lm_head_bias):
            self._linear = functools.partial(cpu_decode.linear, self.kernels)

    def _still_fused(self) -> bool:
        base = self.model.model
        if self.embed is not base.embed_tokens.weight or self.lm_head is not self.model.lm_head.weight:
            return False
        for fl, layer in zip(self.layers, base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if not (_is_fused([attn.q_proj, attn.k_proj, attn.v_proj], fl.w_qkv)
                    and _is_fused([mlp.gate_proj, mlp.up_proj], fl.w_gu)
                    and fl.w_o.data_ptr() == attn.o_proj.weight.data_ptr()
                    and fl.w_down.data_ptr() == mlp.down_proj.weight.data_ptr()):
                return False
        return True

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "FusedDecoder | None":
        """The model's decoder (built once and cached on the model), or None when unsupported.

        A cached decoder is rebuilt when the model's weights were replaced since (e.g.
        ``load_state_dict`` with ``assign=True``); in-place weight updates are seen as they are.
        """
        cached = getattr(model, "_kvbench_fused_decoder", None)
        if isinstance(cached, cls) and cached._still_fused():
            return cached
        if unsupported_reason(model) is not None:
            return None
        decoder = cls(model)
        model._kvbench_fused_decoder = decoder
        return decoder

    def step(self, token: torch.Tensor, position: torch.Tensor, cache: Any, biases: dict[int, torch.Tensor]) -> torch.Tensor:
        """One decode step: append the token's keys/values to ``cache`` and return its logits.

        Args:
            token: ``(1, 1)`` long, the token to feed.
            position: ``(1,)`` long, its RoPE position (and cache position).
            cache: the generation's transformers cache (its ``update(k, v, layer_idx)`` is called).
            biases: per-layer decode bias buffers ``(1, H_q, 1, m + max_new)`` (see
                :func:`kvbench.attention.build_decode_bias`); layers without one get none.

        Returns:
            logits ``(V,)`` of the next token, in the model's dtype.
        """
        linear = self._linear
        h = F.embedding(token, self.embed)  # (1, 1, D)
        cos, sin = self.rotary(h, position.view(1, 1))  # (1, 1, d)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (1, 1, 1, d): broadcast over heads
        d, h_q, h_kv = self.head_dim, self.num_q, self.num_kv
        for fl in self.layers:
            x = _rms_norm(h, fl.ln1, fl.ln1_eps)
            qkv = linear(x, fl.w_qkv, fl.b_qkv).view(1, 1, h_q + 2 * h_kv, d)
            if fl.q_norm is None:
                # Queries and keys get the same elementwise RoPE: one call on both.
                qk = _rotate(qkv[:, :, : h_q + h_kv], cos, sin)  # (1, 1, H_q + H_kv, d)
                q, k = qk[:, :, :h_q], qk[:, :, h_q:]
            else:
                q = _rotate(_rms_norm(qkv[:, :, :h_q], *fl.q_norm), cos, sin)
                k = _rotate(_rms_norm(qkv[:, :, h_q : h_q + h_kv], *fl.k_norm), cos, sin)
            v = qkv[:, :, h_q + h_kv :]
            keys, values = cache.update(k.transpose(1, 2), v.transpose(1, 2), fl.idx)  # (1, H_kv, T, d)
            out = attention._decode_attention(
                q.transpose(1, 2), keys, values, None, fl.scaling, None, biases.get(fl.idx)
            )  # (1, 1, H_q, d): the module path's decode attention, bias and all
            h = h + linear(out.view(1, 1, h_q * d), fl.w_o, fl.b_o)
            x = _rms_norm(h, fl.ln2, fl.ln2_eps)
            gate, up = linear(x, fl.w_gu, fl.b_gu).chunk(2, dim=-1)
            h = h + linear(fl.act(gate) * up, fl.w_down, fl.b_down)
        h = _rms_norm(h, self.norm, self.norm_eps)
        return linear(h, self.lm_head, self.lm_head_bias)[0, -1]
