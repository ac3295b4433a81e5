"""Tasks and metrics: LongBench, LongBench-E, Needle-in-a-Haystack, RULER, LongBench-v2, InfiniteBench, LooGLE,
ZeroSCROLLS, the math reasoning sets (AIME 2024/2025, MATH-500, GSM8K), SCBench.

``eval`` sees only text, never tensors, and never imports ``methods``.
"""

from __future__ import annotations

import importlib
import importlib.metadata

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
    """The task class registered as ``name``, an installed entry point of the group ``kvbench.tasks`` or ``module:Class``
    (a task of one's own, ``name:`` of its yaml in one's own ``--config-dir``). TaskConfigError: none of them (lists the
    accepted names)."""
    points = {e.name: e.value for e in importlib.metadata.entry_points(group="kvbench.tasks")}
    mod, _, cls = _TASKS.get(name, points.get(name, name)).partition(":")
    try:
        found = getattr(importlib.import_module(mod), cls) if mod and cls else None
    except (ImportError, AttributeError):
        found = None
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise TaskConfigError(f"task.name={name!r}: unknown task; accepted values are {', '.join(available())}, "
                              "module:Class (a Task on PYTHONPATH) or an entry point of kvbench.tasks")
    return found
