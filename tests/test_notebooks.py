"""Executes every notebook in ``notebooks/`` on the shipped models (or ``DFLASH_JAX_ASSETS``), as CI does."""

from __future__ import annotations

import os
import time
from importlib import resources
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
ASSETS = Path(os.environ.get("DFLASH_JAX_ASSETS", str(resources.files("dflash_jax") / "assets")))


def test_notebooks_are_stored_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    assert len(NOTEBOOKS) == 4
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), \
            f"{path.name}: clear its outputs before committing (CI executes it)"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if not (ASSETS / "target" / "config.json").exists() or not (ASSETS / "drafter" / "config.json").exists():
        pytest.skip(f"no shipped models in {ASSETS} (dflash-jax ship writes them)")
    nb = nbformat.read(path, as_version=4)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits it: figures render without a display
    # Two minutes on a quiet CPU; a machine whose load average exceeds its cores grants proportionally more.
    limit = 120 * max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))
    start = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=max(300, int(2 * limit)), kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    took = time.perf_counter() - start
    assert took < limit, f"{path.name} took {took:.0f} s: it must run in under 2 minutes on a quiet CPU"
