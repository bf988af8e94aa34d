"""The analysis notebooks run top to bottom against the committed fixture (tests/fixtures/runs)
in a fresh kernel, with the same nbclient engine that `pytest --nbmake analysis/` uses."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "analysis").glob("*.ipynb"))
FIXTURE = REPO / "tests" / "fixtures" / "runs"


def test_the_notebooks_are_there_with_outputs_cleared():
    nbformat = pytest.importorskip("nbformat")
    names = {p.name for p in NOTEBOOKS}
    assert {"collapse_dynamics.ipynb", "car_mechanics.ipynb"} <= names
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        assert all("id" in c for c in cells), f"{path.name}: a cell without an id (nbformat 4.5)"
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs and c.execution_count is None for c in code), path.name
        tagged = [c for c in code if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "RUNS = None" in tagged[0].source, path.name


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
@pytest.mark.e2e
def test_notebook_runs_on_the_fixture(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("OMGRPO_RUNS", str(FIXTURE))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        timeout=120,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()  # raises CellExecutionError with the failing cell and traceback
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "no figure was displayed"
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "4 runs" in text and str(FIXTURE) in text
