"""examples/quickstart.ipynb runs headless, top to bottom, and leaves its plots.

The notebook runs in a Jupyter kernel of this interpreter (a kernel spec registered in a
temporary folder), with MAXMOE_QUICKSTART_QUICK=1: fewer and smaller steps than a person
would run. Its own cells check what it shows (one device and eight give the same losses).
"""

from pathlib import Path

import nbformat
import pytest
from ipykernel.kernelspec import install
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "quickstart.ipynb"
KERNEL = "maxmoe-test"


@pytest.mark.slow
def test_quickstart_notebook_executes_and_leaves_plots(tmp_path, monkeypatch):
    prefix = tmp_path / "jupyter"
    install(kernel_name=KERNEL, prefix=str(prefix))
    monkeypatch.setenv("JUPYTER_PATH", str(prefix / "share" / "jupyter"))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))  # this checkout, not an installed copy
    monkeypatch.setenv("MAXMOE_QUICKSTART_QUICK", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebook's run folders
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend makes the PNGs
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(
        notebook, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": str(ROOT / "examples")}}
    )
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails

    outputs = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]
    assert not [out for out in outputs if out.get("output_type") == "error"]
    images = [out for out in outputs if "image/png" in out.get("data", {})]
    assert len(images) >= 2, [out.get("data", {}).keys() for out in outputs]
    text = "".join(out.get("text", "") for out in outputs)
    assert "relative difference" in text and "eval loss" in text
    assert "removed" in text and not list(tmp_path.glob("maxmoe-quickstart-*"))  # its run folders are gone
