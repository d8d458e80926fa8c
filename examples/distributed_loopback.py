"""Two processes, one global mesh: sharded MTP drafting over CPU collectives, on loopback only.

    python examples/distributed_loopback.py

launches two worker processes on 127.0.0.1 (a free port, 2 CPU devices each), which join with
`jax.distributed.initialize`, build a 2 x 2 ("data", "model") mesh over all 4 devices, shard an
MTP proposer and its state across it and run propose / after_verify steps. Each worker also
computes the same steps unsharded on one local device and exits non-zero unless the drafts
match. One worker by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
      python examples/distributed_loopback.py --worker --process-id 0 --port 12345
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

import mtp_jax
from mtp_jax import sharding

NUM_PROCESSES, LOCAL_DEVICES = 2, 2
CFG = mtp_jax.MtpConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                        intermediate_size=64, num_modules=2)
BATCH, MAX_LEN, STEPS = 4, 32, 4


def drive(params, state, place, fetch, settle=lambda state: state):
  """Runs a prompt call and STEPS - 1 verify / propose rounds over the batch of `state`.

  Every call has T = K + 1 rows (prompts of 1..K + 1 tokens), so propose compiles once.
  place: puts a host array (batch first) where the params live; fetch: brings drafts back to host;
  settle: puts the state back on its specs before each propose (jit may hand it back laid out
  differently, which would compile propose a second time).
  Accept counts and bonus tokens come from a fixed seed, so every run sees the same inputs as long
  as its drafts agree. Returns (drafts int32[STEPS, B, K], the final ProposerState).
  """
  rng = np.random.default_rng(0)
  cfg, b = params.cfg, state.batch_size
  k, d, v = cfg.num_modules, cfg.hidden_size, cfg.vocab_size
  hid = rng.normal(size=(b, k + 1, d)).astype(np.float32)
  tok = rng.integers(0, v, (b, k + 1)).astype(np.int32)
  num_new = rng.integers(1, k + 2, b).astype(np.int32)
  out = []
  for _ in range(STEPS):
    drafts, state = mtp_jax.propose(params, settle(state), place(hid), place(tok), place(num_new), num_drafts=k)
    drafts = fetch(drafts)
    out.append(drafts)
    accepted = rng.integers(0, k + 1, b).astype(np.int32)
    state = mtp_jax.after_verify(state, place(accepted))
    # The next call gets the accepted drafts, then a bonus token, at the a + 1 new positions.
    hid = rng.normal(size=(b, k + 1, d)).astype(np.float32)
    bonus = rng.integers(0, v, b).astype(np.int32)
    tok = np.zeros((b, k + 1), np.int32)
    for i, a in enumerate(accepted):
      tok[i, :a], tok[i, a] = drafts[i, :a], bonus[i]
    num_new = accepted + 1
  return np.stack(out), state


def worker(process_id: int, port: int) -> int:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=NUM_PROCESSES,
                             process_id=process_id, coordinator_bind_address=f"127.0.0.1:{port}",
                             initialization_timeout=60)
  params = mtp_jax.init_mtp(CFG, seed=0)  # the same seed everywhere: identical params per process
  want, _ = drive(params, mtp_jax.init_state(CFG, BATCH, MAX_LEN), np.asarray, np.asarray)

  data = NUM_PROCESSES
  mesh = sharding.make_mesh(data, jax.device_count() // data)
  got, state = drive(sharding.shard_params(params, mesh), mtp_jax.init_state(CFG, BATCH, MAX_LEN),
                     lambda x: sharding.shard_batch(x, mesh),
                     lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)),
                     lambda state: sharding.shard_state(state, mesh))
  k_cache = state.kv[0].k
  shard_shape = k_cache.addressable_shards[0].data.shape
  ok = np.array_equal(got, want)
  print(f"process {process_id}/{jax.process_count()}: {jax.device_count()} devices "
        f"({jax.local_device_count()} local), mesh {dict(mesh.shape)}, KV cache {k_cache.shape} "
        f"as {k_cache.sharding.spec}, local shard {shard_shape}; drafts "
        f"{'match' if ok else 'DIFFER from'} the single-device run", flush=True)
  if not ok:
    print(f"sharded drafts:\n{got}\nsingle-device drafts:\n{want}", flush=True)
  jax.distributed.shutdown()
  return 0 if ok else 1


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(timeout_s: float = 240) -> int:
  """Starts both workers on loopback; returns 0 when both succeed. Kills them after timeout_s."""
  port = free_port()
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
             JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--process-id", str(i), "--port", str(port)],
                            env=env) for i in range(NUM_PROCESSES)]
  codes = []
  for p in procs:
    try:
      codes.append(p.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      print(f"timed out after {timeout_s} s", file=sys.stderr)
      return 1
  return 0 if codes == [0] * NUM_PROCESSES else 1


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--worker", action="store_true", help="run one worker (default: launch both)")
  parser.add_argument("--process-id", type=int, default=0)
  parser.add_argument("--port", type=int, default=0)
  args = parser.parse_args()
  if not args.worker:
    return launch()
  if not 0 <= args.process_id < NUM_PROCESSES or not 0 < args.port < 65536:
    parser.error(f"--process-id must be in 0..{NUM_PROCESSES - 1} and --port in 1..65535")
  return worker(args.process_id, args.port)


if __name__ == "__main__":
  sys.exit(main())
