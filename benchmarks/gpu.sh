#!/usr/bin/env bash
# The benchmark tables on a GPU machine, in under 9 minutes (one 10-minute device command). From the
# repository root:
#   bash benchmarks/gpu.sh [RESULTS_DIR]      (default: $OUT if set, else /tmp/mtp-gpu-results)
# Installs only what is missing: wheels from .whl/ when that folder exists (for a machine without
# network), else pip (jax with CUDA 12, then the project's dependencies). PyTorch is skipped: its
# column is a CPU baseline. device.py runs first (correctness, then the GPU tables; its rows also
# as JSON lines in RESULTS_DIR/device.jsonl), then the older scripts. Each script runs under a
# timeout, cut to what BUDGET_S (default 540 s for the whole loop) has left, and prints its rows as
# it goes, so a run cut short still leaves what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-/tmp/mtp-gpu-results}}
mkdir -p "$results"
py=${PYTHON:-python3}
if [ -d .whl ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/mtp-site .whl/*.whl
  export PYTHONPATH=/tmp/mtp-site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$py" -c "import jax, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  "$py" -m pip install -q "jax[cuda12]"
fi
"$py" -c "import flax, optax, safetensors, tqdm, outlines_core" 2>/dev/null || "$py" -m pip install -q -e .
"$py" -c "import jax; print(jax.__version__, jax.devices())"
export PYTHONUNBUFFERED=1
budget=${BUDGET_S:-540}
start=$SECONDS
for run in "330 device.py --deadline-s 300 --json $results/device.jsonl" "170 bench_propose.py --no-torch" \
           "50 bandwidth.py" "50 hot_path_ab.py" "180 scaling.py --layers 4 16 32 64 --max-new-tokens 64"; do
  set -- $run
  left=$(( budget - (SECONDS - start) ))
  if [ "$left" -lt 20 ]; then echo "$2 skipped: out of time (BUDGET_S=$budget)"; continue; fi
  timeout "$(( $1 < left ? $1 : left ))" "$py" "benchmarks/$2" "${@:3}" | tee "$results/${2%.py}.md" \
    || echo "$2 stopped early or failed (status $?)"
done
