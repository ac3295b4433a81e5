"""kvbench: a reproducible benchmark harness for KV-cache compression.

Packages, each importing only those above it in this list (tests/test_import_graph.py):

- ``kvbench.engine``: the model and its cache: loading, kvbench's attention function, prefill, compression, decode.
- ``kvbench.job``: one job: the checked configuration and identity, the samples' prompts, the results store.
- ``kvbench.report``: tables and figures, read from a results store.
- ``kvbench.tools``: the seed papers' tools (head calibration, head masking, latency).

``kvbench.cli`` is the ``kvbench`` command and the one-line argument parser every tool uses.
``kvbench.run`` runs a job from Python (a notebook): docs/METHODS.md.
"""


def run(overrides: list[str], method=None) -> dict:
    """The job of ``overrides``, ``method`` a Method class or instance: its summary (:func:`kvbench.job.run.api`)."""
    from kvbench.job.run import api

    return api(overrides, method)
