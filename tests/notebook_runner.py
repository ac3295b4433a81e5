"""Execute notebooks/figures.ipynb on a results root (shared by the report tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def execute_figures_notebook(results_root: Path, out: Path, figures: list[str] | None = None,
                             timeout: int = 600) -> None:
    """Run the figures notebook with its parameters cell set to ``results_root``, ``out`` and
    ``figures`` (names or patterns; None = all).

    Skips the calling test when nbclient, nbformat or ipykernel is missing (the ``test`` extra).
    """
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install -e '.[test]')")
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install -e '.[test]')")
    nb = nbformat.read(REPO / "notebooks" / "figures.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = f"RESULTS_ROOT = {str(results_root)!r}\nOUT = {str(out)!r}\nFIGURES = {figures!r}"
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(REPO)}})
    client.execute()
