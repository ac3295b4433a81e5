"""kvbench: a reproducible benchmark harness for KV-cache compression (packages: docs/ARCHITECTURE.md)."""


def run(overrides: list[str], method=None) -> dict:
    """The job of ``overrides``, ``method`` a Method class or instance: its summary (:func:`kvbench.job.run.api`)."""
    from kvbench.job.run import api

    return api(overrides, method)
