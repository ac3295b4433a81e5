"""Compiled CPU kernels for LOOK-M's two quadratic steps, built on first use with the C compiler.

LOOK-M (Wan et al. 2024) scores every prompt token by the attention it receives from every
prompt query (the column sums of the causal attention matrix) and merges every evicted key into
its most cosine-similar kept key. Both are quadratic in the prompt length by definition. With
PyTorch operations each costs memory passes over matrices far larger than the CPU caches (the
probabilities, the similarities); ``csrc/lookm_cpu.c`` does the same arithmetic one
cache-sized block at a time:

* :func:`attention_column_sums`: per block of query rows, ``S = scale·Q·Kᵀ`` (BLAS), an exact
  row softmax over the keys each row may see, the column sums and ``O = P·V`` (BLAS): the
  prefill's attention output and LOOK-M's score for about the price of SDPA alone;
* :func:`nearest_kept`: per block of evicted keys, ``S = E·Kᵀ`` (BLAS) and a row argmax;
* :func:`merge_into_targets`: the merge itself, one pass over the evicted rows per head
  (PyTorch needs a gather, a scatter-add over ``d`` and four element-wise passes).

The matrix products call the ``sgemm`` of the MKL inside PyTorch's CPU library, one thread per
call; the blocks are shared out in ``torch.get_num_threads()`` parts of about equal work, run
by an OpenMP region on torch's own OpenMP threads (the library links ``libgomp.so.1``, the
runtime torch has loaded; inside the region MKL runs each product on the calling thread, and no
thread-local MKL setting is left behind on the thread that runs torch's own products). Each part
always covers the same blocks, so results do not depend on thread scheduling. Results equal the
PyTorch-operation paths of :mod:`methods.lookm` within float32 rounding (the exponential is glibc's vector ``expf``; tests:
``tests/methods/test_cpu_kernels.py``).

Build: ``$CC`` (default ``cc``) ``-O3 -march=native -ffast-math -fopenmp -fPIC``, then linked
``-shared`` without ``-ffast-math`` (which would link GCC's ``crtfastmath.o``: flush-to-zero
for the whole process once the library loads), into
``$KVBENCH_CACHE_DIR/kernels`` (default ``~/.cache/kvbench/kernels``), named after a hash of
the source, the flags, the compiler's version and the CPU's feature flags (a cache shared by
machines of different CPUs keeps one library per CPU); written to a temporary name and renamed,
so concurrent jobs never load a half-written file. About 0.3 s, once per machine. A cache
folder that cannot be created gives a warning and ``$TMPDIR/kvbench-kernels-<uid>``.

When the kernels cannot be used (no C compiler, a PyTorch without MKL's ``sgemm``, not Linux)
:func:`unavailable_reason` says why and :mod:`methods.lookm` uses its PyTorch operations
(``method.kernel: auto``) or stops with that reason (``method.kernel: c``).
"""

from __future__ import annotations

import ctypes
import logging
import platform
from pathlib import Path

import torch

from kvbench import ckernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "lookm_cpu.c"
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")  # compile step
# Link step: without -ffast-math, which would link GCC's crtfastmath.o into the library, whose
# constructor turns on flush-to-zero for the whole process when the library loads.
LINK = ("-shared", "-fopenmp")
LIBS = ("-lm",)
BLOCK_FLOATS = 1 << 20  # float32 scratch per thread and block (4 MiB; measured on SmolLM2 at 2k–8k tokens)



class _Kernels:
    def __init__(self, lib: ctypes.CDLL, sgemm: int):
        self.sgemm = sgemm
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        self.attention = lib.kvb_attention_column_sums
        self.attention.restype = ctypes.c_int
        self.attention.argtypes = [ptr] * 7 + [i64] * 6 + [f32, f32] + [i64] * 2 + [ptr]
        self.nearest = lib.kvb_nearest_kept
        self.nearest.restype = ctypes.c_int
        self.nearest.argtypes = [ptr] * 7 + [i64] * 7 + [ptr]
        lib.kvb_has_avx512.restype = ctypes.c_int
        self.avx512 = bool(lib.kvb_has_avx512())
        self.merge = lib.kvb_merge_into_targets
        self.merge.restype = ctypes.c_int
        self.merge.argtypes = [ptr] * 5 + [i64] + [ptr] * 2 + [i64] * 5 + [ptr]


def _blas() -> int:
    """Address of torch's MKL ``sgemm_`` (Fortran interface, as ``csrc/lookm_cpu.c`` calls it).

    Raises:
        OSError: torch's CPU library has no ``sgemm_`` (a build without MKL).
    """
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    lib = ctypes.CDLL(str(path))  # already loaded by torch: this only looks symbols up
    try:
        return ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
    except AttributeError:
        raise OSError(f"{path.name} exports no BLAS sgemm_ (a PyTorch built without MKL)") from None


def _build() -> Path:
    """Compile :data:`SOURCE` into the kernel cache (or reuse it); returns the library's path.

    Raises:
        OSError: no compiler, or the compiler failed (:func:`kvbench.ckernels.build`).
    """
    return ckernels.build(SOURCE, FLAGS, LINK, LIBS, "the LOOK-M CPU kernels")


def _open() -> _Kernels:
    if platform.system() != "Linux":
        raise OSError(f"built for Linux only (this is {platform.system()})")
    return _Kernels(ctypes.CDLL(str(_build())), _blas())


LIBRARY = ckernels.Library("LOOK-M CPU kernels", _open, "using PyTorch operations")


def load() -> _Kernels | None:
    """The kernels, built and loaded once per process; None when they cannot be used.

    For the computations that fall back to PyTorch operations (``method.kernel: auto``): the
    first fallback logs one warning with the reason. Never raises.
    """
    return LIBRARY.get()


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used here (one line), or None when they can (builds them; logs nothing)."""
    LIBRARY.get_quietly()
    return LIBRARY.reason


def _require() -> _Kernels:
    """The loaded kernels; RuntimeError with :func:`unavailable_reason` when there are none."""
    k = LIBRARY.get_quietly()
    if k is None:
        raise RuntimeError(f"LOOK-M CPU kernels unavailable: {LIBRARY.reason}")
    return k


def _check(status: int) -> None:
    if status:  # bit 1: a work item beyond the heads; bit 2: a merge target outside [0, m); bit 3: scratch too small
        raise RuntimeError(f"LOOK-M CPU kernel: index out of range (status {status})")


def _cuts(weights: torch.Tensor, parts: int) -> torch.Tensor:
    """Split items with these costs into ``parts`` contiguous ranges of about equal total cost.

    Returns ``(parts + 1,)`` int64 boundaries, 0 first and the item count last.
    """
    total = weights.double().cumsum(0)
    inner = torch.searchsorted(total, total[-1] * torch.arange(1, parts, dtype=torch.float64) / parts)
    return torch.cat([torch.zeros(1, dtype=torch.long), inner.long(), torch.tensor([weights.numel()])])


def _threads(items: int) -> int:
    return max(1, min(torch.get_num_threads(), items))


def attention_column_sums(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, scaling: float, softcap: float | None, chunk: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of the last W prompt queries and the column sums of its softmax matrix.

    The same quantities as :func:`methods.lookm.cumulative_attention` (sums) and
    :func:`methods.lookm.attention_with_column_sums` (output), in float32: row i (absolute
    position n − W + i) attends to keys ``0 … n − W + i``; logits ``q·k·scaling``, or
    ``softcap·tanh(q·k·scaling / softcap)`` with soft-capping (Gemma 2).

    Args:
        query: ``(B, H_q, W, d)``, the last W prompt queries after RoPE (any dtype/strides).
        key, value: ``(B, H_kv, n, d)``; ``value`` None: column sums only.
        scaling: logit scale; softcap: soft-capping value or None.
        chunk: at most this many query positions per block (tokens); blocks are also capped at
            :data:`BLOCK_FLOATS` logits.

    Returns:
        ``(sums (B, H_q, n) float32, out (B, H_q, W, d) float32 or None)``; ``out`` is a view of
        a ``(B, W, H_q, d)`` contiguous tensor (the layout the attention module wants).

    Raises:
        RuntimeError: the kernels are unavailable (:func:`unavailable_reason`).
    """
    k = _require()
    b, h_q, w, d = query.shape
    h_kv, n = key.shape[1], key.shape[2]
    g = h_q // h_kv
    q = query.float().unflatten(1, (h_kv, g)).transpose(2, 3).contiguous()  # (B, H_kv, W, G, d)
    kk = key.float().contiguous()
    vv = value.float().contiguous() if value is not None else None
    block = max(1, min(chunk, w, BLOCK_FLOATS // (g * n)))
    nblocks = -(-w // block)
    heads = b * h_kv
    stops = torch.clamp(torch.arange(1, nblocks + 1) * block, max=w)
    weights = ((stops - (stops - block).clamp(min=0)) * (n - w + stops)).repeat(heads)  # rows × keys per item
    parts = _threads(weights.numel())
    cuts = _cuts(weights, parts)
    out = torch.empty(b, h_kv, w, g, d) if vv is not None else None
    sums = torch.zeros(parts, b, h_kv, g, n)
    scratch = torch.empty(parts, block * g * (n + 1))  # the block's logits, then its rows' 1 / Σ exp
    _check(k.attention(k.sgemm, q.data_ptr(), kk.data_ptr(), vv.data_ptr() if vv is not None else None,
                       out.data_ptr() if out is not None else None, sums.data_ptr(), scratch.data_ptr(),
                       scratch.shape[1], heads, g, w, n, d, float(scaling), float(softcap or 0.0), block, parts,
                       cuts.data_ptr()))
    total = sums.sum(0) if parts > 1 else sums[0]
    if out is None:
        return total.view(b, h_q, n), None
    # (B, H_kv, W, G, d) -> (B, W, H_kv, G, d) contiguous, seen as (B, H_q, W, d)
    out = out.permute(0, 2, 1, 3, 4).contiguous().view(b, w, h_q, d).transpose(1, 2)
    return total.view(b, h_q, n), out


def nearest_kept(evicted_keys: torch.Tensor, kept_keys: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Most cosine-similar kept key of every evicted key, as :func:`methods.lookm.nearest_kept`.

    Args:
        evicted_keys: ``(B, H, E, d)``.
        kept_keys: ``(B, H, m, d)``, m ≥ 1.
        chunk: at most this many evicted rows per block; blocks are also capped at
            :data:`BLOCK_FLOATS` similarities.

    Returns:
        ``(max_similarity (B, H, E) float32, target (B, H, E) long index into m)``; ties go to
        the first kept key.

    Raises:
        RuntimeError: the kernels are unavailable (:func:`unavailable_reason`).
        ValueError: no kept key (m = 0).
    """
    k = _require()
    b, h, e, d = evicted_keys.shape
    m = kept_keys.shape[2]
    if m == 0:
        raise ValueError("nearest_kept: no kept key to merge into (m = 0)")
    ev = torch.nn.functional.normalize(evicted_keys.float(), dim=-1, eps=1e-6).contiguous()
    kept = torch.nn.functional.normalize(kept_keys.float(), dim=-1, eps=1e-6).contiguous()
    kept_t = kept.transpose(-1, -2).contiguous() if k.avx512 else None  # (B, H, d, m)
    sim = torch.empty(b, h, e)
    target = torch.empty(b, h, e, dtype=torch.long)
    if e == 0:
        return sim, target
    block = max(1, min(chunk, e, BLOCK_FLOATS // max(m, 1)))
    items = b * h * -(-e // block)
    parts = _threads(items)
    cuts = _cuts(torch.ones(items), parts)
    scratch = torch.empty(parts, block * m)
    _check(k.nearest(k.sgemm, ev.data_ptr(), kept.data_ptr(),
                     kept_t.data_ptr() if kept_t is not None else None, sim.data_ptr(), target.data_ptr(),
                     scratch.data_ptr(), scratch.shape[1], b * h, e, m, d, block, parts, cuts.data_ptr()))
    return sim, target


MERGE_MODES = {"avg": 0, "pivot": 1, "weighted": 2}


def merge_into_targets(kept: torch.Tensor, evicted: torch.Tensor, target: torch.Tensor, weight: torch.Tensor,
                       merge: str, sim: torch.Tensor) -> torch.Tensor:
    """LOOK-M's merge, as :func:`methods.lookm.merge_into_targets` (same arguments and result).

    Evicted rows are added in their order (as ``scatter_add``); rows with ``w_j = 0`` are skipped.

    Raises:
        RuntimeError: the kernels are unavailable, or a target outside ``[0, m)``.
        KeyError: ``merge`` is not avg, pivot or weighted.
    """
    k = _require()
    mode = MERGE_MODES[merge]
    b, h, m, d = kept.shape
    e = evicted.shape[2]
    x_t, x_j = kept.float().contiguous(), evicted.float().contiguous()
    tgt = target.to(torch.long).contiguous()
    w = weight.float().contiguous()
    s = sim.float().contiguous()
    out = torch.empty(b, h, m, d)
    heads = b * h
    parts = _threads(heads)
    cuts = _cuts(torch.ones(heads), parts)
    den = torch.empty(parts, m)
    _check(k.merge(x_t.data_ptr(), x_j.data_ptr(), tgt.data_ptr(), w.data_ptr(), s.data_ptr(), mode, out.data_ptr(),
                   den.data_ptr(), heads, m, e, d, parts, cuts.data_ptr()))
    return out.to(kept.dtype)
