"""The import graph: `import mtp_jax` loads no training code, and serving imports nothing above it."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mtp_jax"


def _run(code: str) -> None:
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]


def _imports(file: Path) -> set[str]:
  """The modules `file` imports (for `from a import b`: a, and a.b, which may be a module)."""
  names = set()
  for node in ast.walk(ast.parse(file.read_text())):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def test_import_mtp_jax_loads_neither_optax_nor_tqdm():
  _run("import mtp_jax, sys; assert 'tqdm' not in sys.modules and 'mtp_jax.train' not in sys.modules")
  # flax.nnx imports optax itself (flax/nnx/helpers.py), so mtp_jax is checked for what it adds.
  _run("import sys; from flax import nnx; before = set(sys.modules); import mtp_jax; "
       "added = sorted(set(sys.modules) - before); "
       "assert not [m for m in added if m.split('.')[0] in ('optax', 'tqdm')], added")


def test_train_and_demo_load_on_first_use():
  _run("import sys, mtp_jax; assert 'mtp_jax.demo' not in sys.modules; "
       "assert mtp_jax.demo.load_demo is mtp_jax.load_demo; "
       "assert mtp_jax.train.TrainConfig().recipe == 'joint' and 'tqdm' in sys.modules; "
       "from mtp_jax.demo import load_demo; from mtp_jax import train; "
       "assert not hasattr(mtp_jax, 'no_such_name')")


def test_the_demo_loader_and_serving_import_nothing_above_them():
  above = ("mtp_jax.demo", "mtp_jax.train", "mtp_jax.cli", "optax", "tqdm")
  for file in [PACKAGE / "demo_models.py", PACKAGE / "checkpoint_dir.py"]:
    assert not {m for m in _imports(file) if m.startswith("mtp_jax.serving") or m in above}, file
  for file in (PACKAGE / "serving").glob("*.py"):
    assert not {m for m in _imports(file) if m in above}, file


# The package's layers, bottom up, as the data flows (README's Layout): a module imports only
# from its own layer or those below. Imports under `if TYPE_CHECKING:` are annotations, not imports.
LAYERS = [
    ["validate", "data", "config", "checkpoint"],
    ["blocks"],
    ["mtp", "assistant", "grammar", "tree", "sampling"],
    ["proposer_state", "proposer", "target", "verify"],
    ["sharding", "checkpoint_dir", "families"],
    ["demo_models", "layouts", "pretrained", "pretrained_assistant"],
    ["serving"],
    ["train", "demo", "cli"],
]


def _layer(module: str) -> int:
  top = module.split(".")[1]
  return next(i for i, names in enumerate(LAYERS) if top in names)


def _runtime_imports(file: Path) -> set[str]:
  tree = ast.parse(file.read_text())
  skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
          for n in ast.walk(node)}
  names = set()
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      names.update(f"{node.module}.{a.name}" if node.module == "mtp_jax" else node.module for a in node.names)
  return {n for n in names if n.startswith("mtp_jax.")}


def test_nothing_imports_upward():
  upward = []
  for file in sorted(PACKAGE.rglob("*.py")):
    if file == PACKAGE / "__init__.py":
      continue
    module = ".".join(file.relative_to(ROOT).with_suffix("").parts)
    for name in _runtime_imports(file):
      if _layer(name) > _layer(module):
        upward.append(f"{module} imports {name}")
  assert not upward, upward
