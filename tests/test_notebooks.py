"""Every notebook executes top to bottom (small settings), and is stored executed: a reader on a code
host sees its outputs and plots."""

import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
NAMES = ["quickstart.ipynb", "train_and_measure.ipynb", "serving.ipynb", "trees.ipynb", "real_families.ipynb"]


def _run(name, tmp_path, monkeypatch):
  # The kernel inherits this environment: the package is importable from the repo root.
  monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  monkeypatch.setenv("MTP_JAX_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("MTP_JAX_NOTEBOOK_NEW_TOKENS", "16")
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
  return nb


def _outputs(nb):
  return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


def _text(nb):
  """Streams and the text of rich outputs (markdown tables), joined."""
  return "".join(o.get("text", "") + o.get("data", {}).get("text/markdown", "") for o in _outputs(nb))


def _has_plot(nb):
  return any("image/png" in o.get("data", {}) for o in _outputs(nb))


def test_every_notebook_is_listed():
  assert sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_stored_executed_with_outputs_and_a_plot(name):
  nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  # Run once, top to bottom, in one kernel, with no error.
  assert code and [c.execution_count for c in code] == list(range(1, len(code) + 1))
  assert not [o for o in _outputs(nb) if o.output_type == "error"]
  assert _text(nb) and _has_plot(nb)


def test_quickstart_executes(tmp_path, monkeypatch):
  nb = _run("quickstart.ipynb", tmp_path, monkeypatch)
  text = _text(nb)
  assert "drafts:" in text and "accepted" in text and "mean_accepted_length" in text
  assert _has_plot(nb)


@pytest.mark.slow
def test_train_and_measure_executes(tmp_path, monkeypatch):
  nb = _run("train_and_measure.ipynb", tmp_path, monkeypatch)
  assert _has_plot(nb)
  assert "mean accepted length" in _text(nb)


@pytest.mark.slow
def test_serving_executes(tmp_path, monkeypatch):
  nb = _run("serving.ipynb", tmp_path, monkeypatch)
  text = _text(nb)
  assert "engine output equals generate's" in text and "finished" in text
  assert _has_plot(nb)


@pytest.mark.slow
def test_trees_executes(tmp_path, monkeypatch):
  nb = _run("trees.ipynb", tmp_path, monkeypatch)
  text = _text(nb)
  assert "chain k=3" in text and "tree 2,2,2" in text and "plain greedy:" in text
  assert _has_plot(nb)


@pytest.mark.slow
def test_real_families_executes(tmp_path, monkeypatch):
  nb = _run("real_families.ipynb", tmp_path, monkeypatch)
  text = _text(nb)
  assert "layout: deepseek   family: deepseek_v3" in text and "same tokens as generate" in text
  assert "| MiMo-7B | mimo | mimo | True | True | True | cycle |" in text  # the conventions table
  assert _has_plot(nb)
