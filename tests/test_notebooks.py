"""Both notebooks execute top to bottom (small settings), and are committed without outputs."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


def _run(name, tmp_path, monkeypatch):
  # The kernel inherits this environment: the package is importable from the repo root.
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("MTP_JAX_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("MTP_JAX_NOTEBOOK_NEW_TOKENS", "16")
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
  return nb


@pytest.mark.parametrize("name", ["quickstart.ipynb", "train_and_measure.ipynb"])
def test_committed_without_outputs(name):
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(not c.outputs and c.execution_count is None for c in code)


def test_quickstart_executes(tmp_path, monkeypatch):
  nb = _run("quickstart.ipynb", tmp_path, monkeypatch)
  text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
  assert "drafts:" in text and "accepted" in text and "mean_accepted_length" in text


@pytest.mark.slow
def test_train_and_measure_executes(tmp_path, monkeypatch):
  nb = _run("train_and_measure.ipynb", tmp_path, monkeypatch)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
  assert any("image/png" in o.get("data", {}) for o in outputs)
  assert any("mean accepted length" in o.get("text", "") for o in outputs)
