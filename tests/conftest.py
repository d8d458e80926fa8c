"""Test-wide settings.

The tests run tiny models, so most of their time is XLA compiling many small programs. LLVM's
optimisation level 0 compiles them about 1.5x faster (tests/test_tree.py: 136 s -> 93 s with -n 2
on 2 cores). XLA:CPU's older elemental emitters for fusions, in one LLVM module per program, halve
that again: a generate and an Engine run on the test models compiled 49 programs in 11.1-12.6 s
with the fusion emitters and split codegen, 5.6 s without (this machine, 2 cores). Every
comparison the tests make is between programs built the same way or against references within a
tolerance. Set in the environment, so the CLI and notebook subprocesses get it too; benchmarks and
users keep XLA's defaults.
"""

import os
import tempfile

_FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()


# A disk cache of compiled programs, shared by both xdist workers, the modules (each module's
# in-memory programs are dropped, below) and the subprocesses (CLI, notebooks, server, the mesh
# child), which compile many of the same small programs. Keys are the programs' HLO and compile
# options, so an entry is reused only for an identical program; a stale entry is never read.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"mtp-jax-tests-xla-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import gc  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """Drops each test module's compiled programs when it ends. XLA:CPU maps every executable's code
  into its own memory regions, and one worker compiles thousands: without this a worker passed
  Linux's default vm.max_map_count (65530) mid-suite and crashed inside the compiler (a
  segmentation fault or an abort, seen here). Modules share few programs, so little is
  recompiled."""
  yield
  jax.clear_caches()
  gc.collect()


def pytest_collection_modifyitems(items):
  """Slow-marked tests first (a stable sort): with -n 2 the workers take tests in collection order,
  and a long test collected last ran alone while the other worker sat idle (a clean run here:
  24.8 min of CPU in a 15.2 min wall)."""
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)
