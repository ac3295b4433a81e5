"""Execute the notebooks: figures.ipynb on a results root (shared by the report tests), new_method.ipynb."""

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
    execute_notebook("figures", f"RESULTS_ROOT = {str(results_root)!r}\nOUT = {str(out)!r}\nFIGURES = {figures!r}",
                     timeout)


def execute_notebook(name: str, parameters: str | None = None, timeout: int = 600) -> object:
    """Run ``notebooks/<name>.ipynb`` from the repository root, its ``parameters`` cell's source replaced (None: kept);
    returns the executed notebook. Skips the calling test when nbclient, nbformat or ipykernel is missing."""
    nbclient = pytest.importorskip("nbclient", reason="nbclient not installed (pip install -e '.[test]')")
    nbformat = pytest.importorskip("nbformat", reason="nbformat not installed (pip install -e '.[test]')")
    pytest.importorskip("ipykernel", reason="ipykernel not installed (pip install -e '.[test]')")
    nb = nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = params.source if parameters is None else parameters
    return nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                   resources={"metadata": {"path": str(REPO)}}).execute()
