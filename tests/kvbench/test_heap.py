"""kvbench.heap: a CPU engine keeps freed tensor memory in the C heap (no page faults per prefill)."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from kvbench import engine as engine_mod
from kvbench import heap
from methods.full import FullCache
from tests.conftest import loaded_for, tiny_model

BLOCK = 48 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): mmapped by default
PAGES = BLOCK // 4096


def _faults_for_new_block() -> int:
    """Minor page faults taken by allocating and writing one BLOCK-sized tensor after freeing a
    larger one (room for the allocator's alignment padding, as in a prefill's mix of sizes)."""
    first = torch.ones(2 * BLOCK // 4)
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    second = torch.ones(BLOCK // 4)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del second
    return faults


def test_freed_blocks_are_reused_without_page_faults():
    assert platform.libc_ver()[0] == "glibc", "these tests run on glibc Linux (CI)"
    assert heap.keep_freed_heap() is True
    # A fresh mmapped block faults in every page (12288 here); a reused heap block none.
    assert _faults_for_new_block() < PAGES // 8


def test_opt_out_leaves_malloc_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_applied", False)
    monkeypatch.setenv(heap.ENV, "0")
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: calls.append(name))
    assert heap.keep_freed_heap() is False
    assert calls == []  # mallopt never looked up


def test_refused_values_report_false(monkeypatch):
    class FakeLibc:
        def __init__(self):
            self.mallopt = FakeMallopt()

    class FakeMallopt:
        argtypes = restype = None

        def __call__(self, option, value):
            return 0  # glibc's "refused"

    monkeypatch.setattr(heap, "_applied", False)
    monkeypatch.delenv(heap.ENV, raising=False)
    monkeypatch.setattr(heap.ctypes, "CDLL", lambda name: FakeLibc())
    assert heap.keep_freed_heap() is False
    assert heap._applied is False


@pytest.mark.parametrize("device_type, expected", [("cpu", 1), ("meta", 0)])
def test_engine_applies_the_policy_on_cpu_only(monkeypatch, device_type, expected):
    calls = []
    monkeypatch.setattr(engine_mod, "keep_freed_heap", lambda: calls.append(1) or True)
    loaded = loaded_for(tiny_model("llama"))
    loaded.device = torch.device(device_type)
    engine_mod.Engine(loaded, FullCache(), 1.0)
    assert len(calls) == expected


@pytest.mark.parametrize("value, expected", [("", True), ("1", True), ("Yes", True), ("on", True),
                                             ("0", False), ("false", False), ("NO", False), (" off ", False)])
def test_the_variable_takes_the_usual_spellings(monkeypatch, value, expected):
    monkeypatch.setenv(heap.ENV, value)
    assert heap.wanted() is expected


def test_any_other_value_stops_a_job_before_the_model_loads(monkeypatch, tmp_path):
    from tests.kvbench.cli_util import run_cli

    monkeypatch.setenv(heap.ENV, "abc")
    with pytest.raises(ValueError, match=r"^KVBENCH_KEEP_HEAP='abc': accepted values are 1/true/yes/on"):
        heap.wanted()
    out = run_cli([f"output_root={tmp_path}"], KVBENCH_KEEP_HEAP="abc")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("error: KVBENCH_KEEP_HEAP='abc': accepted values are 1/true/yes/on (the default) or "
                          "0/false/no/off (keep glibc's malloc policy)\n")
    assert not any(tmp_path.iterdir())


def test_env_json_records_whether_the_policy_is_in_effect(monkeypatch):
    from kvbench.job import environment

    loaded = loaded_for(tiny_model("llama"))
    monkeypatch.setattr(heap, "_applied", False)
    monkeypatch.setenv(heap.ENV, "0")
    assert environment(loaded, "cpu")["keep_heap"] is False
    monkeypatch.delenv(heap.ENV)
    assert environment(loaded, "cpu")["keep_heap"] is True  # applied here, as the engine would
