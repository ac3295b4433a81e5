"""Pure helpers of the benchmark suite (no model, no timing)."""

from __future__ import annotations

import math

from benchmarks.common import BenchResult, Target, table
from benchmarks.compression import fit_exponent
from benchmarks.memory import decode_phase_bytes
from benchmarks.report import contention_note, render


def test_fit_exponent_recovers_power_laws():
    lengths = [2048, 4096, 8000]
    assert math.isclose(fit_exponent(lengths, [3e-6 * n for n in lengths]), 1.0, abs_tol=1e-9)
    assert math.isclose(fit_exponent(lengths, [1e-9 * n**2 for n in lengths]), 2.0, abs_tol=1e-9)
    assert fit_exponent([4096], [0.1]) is None


def test_decode_phase_bytes_is_above_the_process_baseline():
    assert decode_phase_bytes({"decode_mem_bytes": 1_500, "rss_after_load_bytes": 1_000}) == 500


def test_table_and_report_show_every_target_verdict():
    text = table(["a", "b"], [["x", 1.23456], ["yy", None]])
    assert text.splitlines()[0] == "| a  | b     |" and "| yy | -     |" in text
    res = BenchResult("decode", "Decode", headers=["n"], rows=[[1]], targets=[
        Target("speed-up", "1.20×", "≥ 1.5×", False), Target("floor", "1.4×", "≤ 2×", True),
        Target("kvpress", "-", "≤ 0.9×", None, "kvpress not importable"),
    ])
    machine = {"date": "today", "cpu": "cpu", "cores": 2, "ram_bytes": 2**31, "device": "cpu", "torch": "t",
               "transformers": "tf", "python": "3", "torch_threads": 2, "omp_wait_policy": "PASSIVE",
               "load_average_start": [7.0, 0, 0], "load_average_end": [1.0, 0, 0], "model": "smollm2", "wall_s": 60}
    page = render(machine, [res], "python -m benchmarks", ["a note"])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in page.splitlines() if line.startswith("| decode")]
    assert rows == [
        ["decode", "speed-up", "1.20×", "≥ 1.5×", "FAIL"],
        ["decode", "floor", "1.4×", "≤ 2×", "PASS"],
        ["decode", "kvpress", "-", "≤ 0.9×", "SKIP (kvpress not importable)"],
    ]
    assert "CPU contention" in page and "- a note" in page
    assert contention_note(dict(machine, load_average_start=[1.0], load_average_end=[1.5])) is None
