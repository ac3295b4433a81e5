"""Compiled CPU kernels for the decode step: one token's projections and its attention.

A greedy decode step of a small model on CPU is bound by reading memory: every weight once
(538 MB for SmolLM2-135M in float32) and every cached key and value once. PyTorch's own paths
read them well below the machine's bandwidth on some CPUs: on a 2-core AMD EPYC, MKL's
matrix-vector product ran on one thread (35 ms per step for the weights that a plain read
takes 18 ms for), and SDPA's CPU flash kernel read an 8000-token cache at about a third of the
read bandwidth (45 ms against 15 ms). ``csrc/decode_cpu.c`` does the same arithmetic:

* :func:`linear`: ``y = x·Wᵀ + b`` for one token, the weight in PyTorch's ``(N, K)`` layout,
  rows split over torch's threads (four rows share each slice of ``x``);
* :func:`attention`: ``softmax(scale·q·Kᵀ + bias)·V`` for one query token with grouped-query
  attention (the G query heads of a KV head as G rows against its un-repeated keys), the keys
  split into chunks run as separate tasks with an online softmax, combined exactly (split-K
  flash decoding).

Both run on torch's OpenMP threads (the library links ``libgomp.so.1``, already loaded by
torch) and need AVX-512; results equal ``F.linear`` and SDPA within float32 rounding
(another summation order; tests: ``tests/kvbench/test_cpu_decode.py``). Used by
:class:`kvbench.fused_decode.FusedDecoder` (projections) and
:func:`kvbench.attention._decode_attention` (attention) for float32 tensors on CPU.

Built on first use (:func:`kvbench.ckernels.build`, about 0.3 s once per machine). Without a C
compiler, on a CPU without AVX-512, outside Linux, or with ``KVBENCH_DECODE_KERNELS=0`` in the
environment, :func:`load` returns None and the decode step uses PyTorch's operations (the
reason: :func:`unavailable_reason`; logged once at INFO).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from pathlib import Path

import torch

from . import ckernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "decode_cpu.c"
# No -ffast-math: the attention kernel relies on IEEE −inf (invalid cache slots).
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC")
LINK = ("-shared", "-fopenmp")
LIBS = ("-lm",)
ENV_SWITCH = "KVBENCH_DECODE_KERNELS"  # "0": PyTorch operations only (A/B measurements)
MIN_CHUNK = 256  # keys per attention task at least (a task's fixed cost is about 1 µs)
MAX_GROUP, MAX_HEAD_DIM = 16, 256  # the kernel's limits (query heads per KV head, head dim)


class _Kernels:
    """The loaded library's entry points (one per process; copies of a model share it)."""

    def __copy__(self) -> "_Kernels":
        return self

    def __deepcopy__(self, memo: dict) -> "_Kernels":
        return self

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self.gemv = lib.kvb_gemv
        self.gemv.restype = ctypes.c_int
        self.gemv.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64]
        self.attention = lib.kvb_decode_attention
        self.attention.restype = ctypes.c_int
        self.attention.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, i64, f32, i64, i64]


def _open() -> _Kernels:
    if os.environ.get(ENV_SWITCH, "1").strip() in ("0", "false", "no", "off"):
        raise OSError(f"{ENV_SWITCH}={os.environ[ENV_SWITCH]} in the environment")
    if platform.system() != "Linux":
        raise OSError(f"built for Linux only (this is {platform.system()})")
    lib = ctypes.CDLL(str(ckernels.build(SOURCE, FLAGS, LINK, LIBS, "the decode CPU kernels")))
    lib.kvb_decode_has_avx512.restype = ctypes.c_int
    if not lib.kvb_decode_has_avx512():
        raise OSError("this CPU (or compiler) has no AVX-512")
    return _Kernels(lib)


LIBRARY = ckernels.Library("decode CPU kernels", _open, "decoding with PyTorch operations", logging.INFO)


def load() -> _Kernels | None:
    """The kernels, built and loaded once per process; None when they cannot be used (never raises).

    The first None logs the reason once at INFO: PyTorch's operations compute the same step.
    Cheap once the outcome is known (no lock): the decode step calls it per layer.
    """
    return LIBRARY.get()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (one line), or None when they can (builds them)."""
    LIBRARY.get_quietly()
    return LIBRARY.reason


def _check(status: int, what: str) -> None:
    if status:
        raise RuntimeError(f"decode CPU kernel {what}: arguments out of range (status {status})")


def linear(kernels: _Kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for one token, on CPU in float32.

    Args:
        kernels: :func:`load`'s result.
        x: ``(..., K)`` with one row in all (e.g. ``(1, 1, K)``), float32.
        weight: ``(N, K)`` float32, stride 1 along K (row slices of a larger matrix allowed).
        bias: ``(N,)`` float32 contiguous, or None.

    Returns:
        ``(..., N)`` float32, a new tensor.

    Raises:
        RuntimeError: the kernel refused its arguments (a caller's error).
    """
    n, k = weight.shape
    xc = x.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    _check(kernels.gemv(weight.data_ptr(), weight.stride(0), xc.data_ptr(),
                        bias.data_ptr() if bias is not None else None, y.data_ptr(), n, k,
                        torch.get_num_threads()), "gemv")
    return y


def linear_applies(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether :func:`linear` takes this weight (float32 on CPU, rows contiguous) and bias."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.stride(1) == 1 and weight.stride(0) >= weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))


def attention(kernels: _Kernels, rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              bias: torch.Tensor | None, scaling: float) -> torch.Tensor | None:
    """Decode attention of one query token, GQA groups as rows: SDPA's result, or None if it does not apply.

    Args:
        kernels: :func:`load`'s result.
        rows: ``(B, H_kv, G, d)`` float32, the G query heads of each KV head (after RoPE).
        key, value: ``(B, H_kv, T, d)`` float32, views of a preallocated cache allowed (each
            head's T·d floats contiguous, heads equally spaced).
        bias: ``(B, H_kv, G, T)`` float32 additive logit bias (−inf: an invalid slot), each
            row's T floats contiguous and rows equally spaced (a view of the decode bias
            buffer), or None.
        scaling: logit scale.

    Returns:
        ``(B, H_kv, G, d)`` float32, or None when a layout, dtype or size is outside the
        kernel's (then the caller uses SDPA).
    """
    b, h, g, d = rows.shape
    t = key.shape[2]
    tensors = (rows, key, value) + ((bias,) if bias is not None else ())
    if (t == 0 or g > MAX_GROUP or d > MAX_HEAD_DIM or d % 16
            or any(x.dtype != torch.float32 or x.device.type != "cpu" for x in tensors)):
        return None
    heads = b * h
    kv_stride = key.stride(1) if h > 1 else key.stride(0)
    for x in (key, value):
        if x.stride(3) != 1 or x.stride(2) != d or x.stride() != key.stride() or (
                b > 1 and x.stride(0) != h * kv_stride):
            return None
    bias_ld = 0
    if bias is not None:
        if bias.shape != (b, h, g, t) or bias.stride(3) != 1:
            return None
        # row (bh, g) starts at (bh·G + g)·ld floats: ld is the stride of the first dimension of size > 1
        bias_ld = bias.stride(2) if g > 1 else bias.stride(1) if h > 1 else bias.stride(0) if b > 1 else t
        if (bias_ld < t or (g > 1 and h > 1 and bias.stride(1) != g * bias_ld)
                or (b > 1 and (h > 1 or g > 1) and bias.stride(0) != h * g * bias_ld)):
            return None
    q = rows.contiguous()
    threads = torch.get_num_threads()
    chunks = 1
    if threads > 1:  # the smallest chunk count giving every thread work, chunks of ≥ MIN_CHUNK keys
        while heads * chunks < 2 * threads and t // (chunks + 1) >= MIN_CHUNK:
            chunks += 1
        while (heads * chunks) % threads and t // (chunks + 1) >= MIN_CHUNK:
            chunks += 1
    out = torch.empty(b, h, g, d)
    scratch = torch.empty(heads * chunks * g * (d + 2))
    _check(kernels.attention(q.data_ptr(), key.data_ptr(), value.data_ptr(), kv_stride,
                             bias.data_ptr() if bias is not None else None, bias_ld, out.data_ptr(),
                             scratch.data_ptr(), heads, g, t, d, float(scaling), chunks, threads), "attention")
    return out
