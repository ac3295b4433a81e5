"""The compiled LOOK-M CPU kernels: build, cache, fallback, and equality with the PyTorch paths."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch

from methods import cpu_kernels, lookm
from methods.base import ConfigError
from methods.lookm import LookM, LookMConfig


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """A process state in which the kernels were never loaded, with an empty kernel cache."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels.LIBRARY, "loaded", None)
    monkeypatch.setattr(cpu_kernels.LIBRARY, "reason", None)
    monkeypatch.setattr(cpu_kernels.LIBRARY, "told", False)
    return tmp_path


def test_the_kernels_build_wherever_a_c_compiler_is():
    compiler = shutil.which(os.environ.get("CC") or "cc")
    reason = cpu_kernels.unavailable_reason()
    if compiler is not None:  # CI and this project's machines: the compiled path is the one tested
        assert reason is None
    else:
        assert "no C compiler" in reason


def test_build_is_cached_per_source_and_cpu(fresh_state):
    first = cpu_kernels._build()
    assert first.parent == fresh_state / "kernels" and first.name.startswith("lookm_cpu-")
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels._build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind


def test_without_a_compiler_auto_falls_back_and_c_is_refused(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("CC", "kvbench-no-such-compiler")
    with pytest.raises(ConfigError, match=r"method.kernel=c: .*no C compiler.*accepted values are auto, c, torch"):
        LookM(LookMConfig(kernel="c"))
    assert "using PyTorch operations" not in caplog.text  # the refusal is the only message

    assert "no C compiler ('kvbench-no-such-compiler' is not on PATH; set CC)" in cpu_kernels.unavailable_reason()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 20, 8, generator=g), torch.randn(1, 2, 20, 8, generator=g)
    auto = lookm.cumulative_attention(q, k, 0.35, None, 512, "auto")
    assert torch.equal(auto, lookm.cumulative_attention(q, k, 0.35, None, 512, "torch"))
    assert caplog.text.count("LOOK-M CPU kernels unavailable, using PyTorch operations: no C compiler") == 1
    lookm.cumulative_attention(q, k, 0.35, None, 512, "auto")
    assert caplog.text.count("using PyTorch operations") == 1  # once per process
    LookM(LookMConfig(kernel="auto"))  # auto is not an error


def test_a_compiler_path_that_does_not_exist_is_named_as_such(fresh_state, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "no C compiler ('/nonexistent/cc' does not exist or is not executable; set CC)" in (
        cpu_kernels.unavailable_reason())


def test_an_unusable_cache_folder_builds_in_the_temporary_folder_with_a_warning(fresh_state, monkeypatch, caplog):
    monkeypatch.setenv("KVBENCH_CACHE_DIR", "/dev/null/kvbench")
    monkeypatch.setattr(tempfile, "tempdir", str(fresh_state))
    if shutil.which(os.environ.get("CC") or "cc") is None:  # _build stops before it looks for a folder
        with pytest.raises(OSError, match="no C compiler"):
            cpu_kernels._build()
        return
    path = cpu_kernels._build()
    assert path.parent == fresh_state / f"kvbench-kernels-{os.getuid()}"
    assert "kernel cache /dev/null/kvbench/kernels is not writable" in caplog.text


def test_a_failing_compiler_is_reported_with_its_output(fresh_state, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(OSError, match=r"false failed on lookm_cpu.c \(exit 1\)"):
        cpu_kernels._build()
    assert not list((fresh_state / "kernels").iterdir())  # the temporary file is removed


def test_kernel_value_is_checked():
    with pytest.raises(ConfigError, match="method.kernel='fast': accepted values are auto, c, torch"):
        LookM(LookMConfig(kernel="fast"))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n,w,h_q,h_kv,d,chunk,softcap", [
    (300, 300, 9, 3, 64, 512, None),  # SmolLM2's layout, whole prompt (LOOK-M)
    (257, 257, 4, 4, 32, 16, None),  # MHA, blocks that do not divide the prompt
    (200, 37, 8, 2, 16, 8, 20.0),  # the last W queries, soft-capping (Gemma 2)
])
def test_attention_and_column_sums_equal_the_pytorch_path(threads, n, w, h_q, h_kv, d, chunk, softcap):
    assert cpu_kernels.load() is not None or shutil.which("cc") is None
    g = torch.Generator().manual_seed(n + w)
    q, k, v = 3 * torch.randn(1, h_q, w, d, generator=g), torch.randn(1, h_kv, n, d, generator=g), torch.randn(1, h_kv, n, d, generator=g)
    ref_sums = lookm.cumulative_attention(q, k, d**-0.5, softcap, chunk, "torch")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sums = lookm.cumulative_attention(q, k, d**-0.5, softcap, chunk, "c")
        if w == n and softcap is None:
            out, fused_sums = lookm.attention_with_column_sums(q, k, v, d**-0.5, None, chunk, "c")
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert out.transpose(1, 2).is_contiguous()  # (B, n, H_q, d) for the attention module
            assert torch.equal(fused_sums, sums)
    finally:
        torch.set_num_threads(before)
    assert sums.shape == (1, h_q, n) and sums.dtype == torch.float32
    torch.testing.assert_close(sums, ref_sums, rtol=1e-5, atol=1e-5)
    assert sums[..., n - 1].max() < 1 + 1e-5  # only the last query sees the last key


@pytest.mark.parametrize("threads", [1, 2])
def test_nearest_kept_equals_the_pytorch_path_and_ties_go_first(threads):
    g = torch.Generator().manual_seed(3)
    ev, kept = torch.randn(2, 3, 301, 16, generator=g), torch.randn(2, 3, 77, 16, generator=g)
    kept[:, :, 50] = kept[:, :, 10] * 2.0  # same direction: cosine ties, the first index wins
    ev[:, :, 7] = kept[:, :, 10]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        sim, target = lookm.nearest_kept(ev, kept, 64, "c")
    finally:
        torch.set_num_threads(before)
    ref_sim, ref_target = lookm.nearest_kept(ev, kept, 64, "torch")
    assert torch.equal(target, ref_target)
    torch.testing.assert_close(sim, ref_sim, rtol=0, atol=1e-6)
    assert (target[:, :, 7] == 10).all()
    assert sim.dtype == torch.float32 and target.dtype == torch.long


@pytest.mark.parametrize("merge", ["avg", "pivot", "weighted"])
def test_merge_equals_the_pytorch_path(merge):
    g = torch.Generator().manual_seed(7)
    kept, ev = torch.randn(1, 3, 40, 16, generator=g), torch.randn(1, 3, 200, 16, generator=g)
    target = torch.randint(0, 40, (1, 3, 200), generator=g)
    weight = (torch.rand(1, 3, 200, generator=g) > 0.3).float() * torch.rand(1, 3, 200, generator=g)
    sim = torch.rand(1, 3, 200, generator=g)
    out = lookm.merge_into_targets(kept, ev, target, weight, merge, sim, "c")
    torch.testing.assert_close(out, lookm.merge_into_targets(kept, ev, target, weight, merge, sim, "torch"),
                               rtol=1e-5, atol=1e-6)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[target[0, 0][weight[0, 0] > 0]] = False
    assert torch.equal(out[0, 0, untouched], kept[0, 0, untouched])  # rows nobody merges into stay bit-equal


def test_nearest_kept_refuses_an_empty_kept_set():
    with pytest.raises(ValueError, match="m = 0"):
        cpu_kernels.nearest_kept(torch.ones(1, 1, 3, 8), torch.ones(1, 1, 0, 8), 64)


def test_merge_refuses_a_target_outside_the_kept_rows():
    kept, ev = torch.zeros(1, 1, 4, 8), torch.ones(1, 1, 2, 8)
    with pytest.raises(RuntimeError, match="index out of range"):
        cpu_kernels.merge_into_targets(kept, ev, torch.tensor([[[1, 4]]]), torch.ones(1, 1, 2), "avg", torch.ones(1, 1, 2))


@pytest.mark.parametrize("merge", ["pivot", "avg"])
def test_lookm_decodes_the_same_with_either_kernel(merge):
    """Whole LOOK-M compression of one layer: the same kept tokens and merged cache."""
    from methods.base import HeadLayout, LayerContext

    layout = HeadLayout(1, 6, 2, 16, (0,))
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 6, 120, 16, generator=g), torch.randn(1, 2, 120, 16, generator=g), torch.randn(1, 2, 120, 16, generator=g)
    results = {}
    for kernel in ("torch", "c"):
        ctx = LayerContext(0, layout, k, v, q, 0.25, 30, positions=torch.arange(120))
        results[kernel] = LookM(LookMConfig(kernel=kernel, merge=merge), layout).compress(ctx)
    assert torch.equal(results["c"].kept_indices, results["torch"].kept_indices)
    torch.testing.assert_close(results["c"].keys, results["torch"].keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results["c"].values, results["torch"].values, rtol=1e-5, atol=1e-6)


def test_env_json_names_the_lookm_kernel_path(fresh_state, monkeypatch):
    from kvbench.job import lookm_kernel

    assert lookm_kernel({"name": "snapkv"}, None) is None  # a method without the setting
    assert lookm_kernel({"name": "lookm", "kernel": "torch"}, None) == "torch"
    monkeypatch.setenv("CC", "kvbench-no-such-compiler")
    assert lookm_kernel({"name": "lookm", "kernel": "auto"}, None).startswith("torch (no C compiler")
    monkeypatch.setattr(cpu_kernels.LIBRARY, "reason", None)
    monkeypatch.delenv("CC")
    if shutil.which("cc"):
        assert lookm_kernel({"name": "lookm", "kernel": "auto"}, None) == "c"


def test_loading_the_kernels_keeps_subnormal_floats():
    """The library is linked without -ffast-math: loading it must not turn on flush-to-zero."""
    assert cpu_kernels.load() is not None or shutil.which("cc") is None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
    assert (tiny * 1.0).item() != 0.0 and (tiny + 0.0).item() == pytest.approx(1e-40, rel=1e-3)


def test_the_kernels_leave_mkls_threads_on_the_calling_thread_alone():
    """MKL's thread count of the calling thread (the one that runs torch's own matrix products)
    is what it was before: a thread-local setting left behind halved the linear layers' speed."""
    import ctypes
    from pathlib import Path

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    max_threads = lib.MKL_GET_MAX_THREADS
    max_threads.restype = ctypes.c_int
    before = max_threads()
    g = torch.Generator().manual_seed(11)
    q, k = torch.randn(1, 6, 90, 16, generator=g), torch.randn(1, 2, 90, 16, generator=g)
    lookm.attention_with_column_sums(q, k, k, 0.25, None, 16, "c")
    lookm.nearest_kept(k[:, :, :40], k[:, :, 40:], 8, "c")
    assert max_threads() == before == torch.get_num_threads()
