"""Test-wide settings.

The tests run tiny models, so most of their time is XLA compiling many small programs. LLVM's
optimisation level 0 compiles them about 1.5x faster (tests/test_tree.py: 136 s -> 93 s with -n 2
on 2 cores); every comparison the tests make is between programs built the same way or against
references within a tolerance. Set in the environment, so the CLI and notebook subprocesses get it
too; benchmarks and users keep XLA's defaults.
"""

import os

_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_COMPILE).strip()


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
