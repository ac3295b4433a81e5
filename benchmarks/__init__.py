"""kvbench's performance suite: ``python -m benchmarks`` (see ``python -m benchmarks --help``).

Benchmarks (each a module with ``NAME``, ``TITLE`` and ``run(ctx) -> BenchResult``):

* ``engine``: prefill, compression and decode time and peak memory vs context length, ``full`` and ``snapkv``;
* ``overhead``: per-sample time of a ``full`` job vs plain transformers ``generate``;
* ``kvpress``: the same SnapKV setting through kvpress's pipeline vs kvbench;
* ``compression``: compression time per method as a fraction of prefill time, and its scaling;
* ``decode``: decode speed and memory vs prompt length, full vs 25 % cache, against the memory-traffic floor
  (targets judged on both caches alternating in one process);
* ``memory``: peak and decode-phase memory per method at 8k prompt tokens.

Results are printed as tables, saved as JSON under ``--out`` and summarised in ``docs/PERFORMANCE.md``.
This package must not import torch at import time (``__main__`` sets thread settings first).
"""
