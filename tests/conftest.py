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
