"""Tasks and metrics: LongBench, LongBench-E, Needle-in-a-Haystack, RULER, LongBench-v2, InfiniteBench, LooGLE,
ZeroSCROLLS, the math reasoning sets (AIME 2024/2025, MATH-500, GSM8K), SCBench.

``eval`` sees only text, never tensors, and never imports ``methods``.
"""

from __future__ import annotations

import importlib

from .base import Sample, Task, TaskConfigError  # noqa: F401

_TASKS: dict[str, str] = {
    "niah": "eval.niah:NIAHTask",
    "longbench": "eval.longbench:LongBenchTask",
    "longbench_e": "eval.longbench:LongBenchETask",
    "ruler": "eval.ruler:RulerTask",
    "longbench_v2": "eval.longbench_v2:LongBenchV2Task",
    "infinitebench": "eval.infinitebench:InfiniteBenchTask",
    "loogle": "eval.loogle:LoogleTask",
    "zero_scrolls": "eval.zero_scrolls:ZeroScrollsTask",
    "aime24": "eval.reasoning:AIME24Task",
    "aime25": "eval.reasoning:AIME25Task",
    "math500": "eval.reasoning:MATH500Task",
    "gsm8k": "eval.reasoning:GSM8KTask",
    "scbench": "eval.scbench:SCBenchTask",
}


def available() -> list[str]:
    """Registered task names."""
    return sorted(_TASKS)


def get_task_class(name: str) -> type[Task]:
    """The task class registered as ``name``. TaskConfigError: unknown task (lists the accepted names)."""
    if name not in _TASKS:
        raise TaskConfigError(f"task.name={name!r}: unknown task; accepted values are {', '.join(available())}")
    mod, cls = _TASKS[name].split(":")
    return getattr(importlib.import_module(mod), cls)
