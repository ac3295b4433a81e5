"""kvbench's performance suite: ``python -m benchmarks`` (see ``python -m benchmarks --help``).

Benchmarks (each a module with ``NAME``, ``TITLE`` and ``run(ctx) -> BenchResult``):

* ``engine``: prefill, compression and decode time and peak memory vs prompt length, ``full`` and ``snapkv``;
* ``overhead``: per-sample time of a ``full`` job vs plain transformers ``generate``;
* ``kvpress``: the same SnapKV setting through kvpress's pipeline vs kvbench;
* ``compression``: compression time per method as a fraction of prefill time, and its scaling;
* ``decode``: decode step time vs prompt length, full vs 25 % cache;
* ``memory``: memory per method (AdaKV's stored vs kept slots included).

Every target is a ratio of two things measured in the same run. Results are printed as tables,
saved as JSON under ``--out`` and summarised in ``docs/PERFORMANCE.md``.
"""
