"""Groups of config keys that decide whether two job configs compute the same thing.

Light on purpose (no torch): the job runner (:mod:`kvbench.job`) and the report's data layer
(:mod:`kvbench.report_data`) both use it.
"""

from __future__ import annotations

from typing import Any, Iterable

#: ``method.*`` fields that choose how a method's arithmetic runs, not what it computes:
#: ``kernel`` (LOOK-M's compiled CPU kernels or PyTorch operations, equal within float32
#: rounding). They do not name the job's folder and do not make a report variant.
METHOD_RUN_CONTROL_FIELDS = ("kernel",)

#: Keys that control how a job runs, not what it computes: a rerun that differs only in these
#: is the same job (no new ``config.<time>.yaml``, and a finished job is not run again).
RUN_CONTROL_KEYS = ("quiet", "lock_wait_s", "output_root", "threads", "reuse_full") + tuple(
    f"method.{f}" for f in METHOD_RUN_CONTROL_FIELDS)

#: Keys that may differ between runs of one job folder: they choose which samples run (the
#: sample ids encode them), not how a sample is computed; plus the run-control keys.
SAMPLE_SELECTION_KEYS = (
    "max_samples", "shard", "task.context_lengths", "task.depth_percents", "task.datasets", "task.n_samples",
    "model.gguf_cache",
)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}`` (an empty node stays a leaf)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v})
    return out


def under(key: str, prefixes: Iterable[str]) -> bool:
    """Whether dotted ``key`` is one of ``prefixes`` or lies under one."""
    return any(key == f or key.startswith(f + ".") for f in prefixes)
