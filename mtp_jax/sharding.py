"""Partition specs for a ("data", "model") device mesh; JAX's GSPMD does the distributed work.

Params and states are placed with `jax.device_put(x, NamedSharding(mesh, spec))`; the jitted
`propose`, `after_verify`, `target_step` and `generate` then run sharded because jit follows the
shardings of its inputs. "data" splits the batch B, "model" splits attention heads and MLP
columns (Megatron style: column-parallel q/k/v and gate/up, row-parallel o and down, so each
block needs one all-reduce after attention and one after the MLP). In an MoE block "model"
splits the stacked routed experts by expert (expert parallel); the router and shared experts
follow the rules above.

Any dimension that does not divide by its mesh axis stays replicated on that axis: k/v
projections and KV caches when num_kv_heads % model != 0, q/o when num_heads % model != 0, an
MLP (or shared expert) whose width does not divide, the routed experts when
num_experts % model != 0, and a state's batch when B % data != 0. The results
are the same either way; only memory and communication differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mtp_jax.mtp import MtpModel
from mtp_jax.proposer import ProposerState
from mtp_jax.target import TargetModel, TargetState

DATA, MODEL = "data", "model"


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A data x model mesh over `devices` (default all devices of all processes).

  The axes are `AxisType.Auto`, so jit propagates shardings GSPMD style (jax's own default,
  Explicit, would make every op's output sharding part of its type, which the model code
  does not spell out).
  """
  devices = list(jax.devices() if devices is None else devices)
  for name, size in (("data", data), ("model", model)):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"{name} must be a positive int, got {size!r}")
  if data * model != len(devices):
    raise ValueError(f"data * model must equal the number of devices ({len(devices)}), "
                     f"got data={data}, model={model}")
  return jax.make_mesh((data, model), (DATA, MODEL), (AxisType.Auto, AxisType.Auto), devices=devices)


def _axis_sizes(mesh: Mesh) -> tuple[int, int]:
  if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {DATA, MODEL}:
    raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') (see make_mesh), got {mesh!r}")
  return mesh.shape[DATA], mesh.shape[MODEL]


def _names(path) -> list[str]:
  names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
  return names[:-1] if names and names[-1] == "value" else names  # an nnx.Variable's payload


def param_specs(model: MtpModel | TargetModel, mesh: Mesh):
  """PartitionSpecs for every param of `model`, as a pytree shaped like the model.

  Linear weights are float[out, in]. Split over "model" when the head / column count divides
  by the model axis size, replicated otherwise:
    q_proj weight [H*Dh, D], bias [H*Dh]: by query heads (axis 0);
    k_proj / v_proj weight [Hkv*Dh, D], bias [Hkv*Dh]: by KV heads (axis 0);
    o_proj weight [D, H*Dh]: by its input columns (axis 1);
    MLA q_b_proj [H*(Dn+Dr), Rq], kv_b_proj [H*(Dn+Dv), R]: by heads (axis 0); q_a_proj,
      kv_a_proj_with_mqa and the latent cache are replicated (every head reads them);
    mlp gate_proj / up_proj [F, D]: by F (axis 0); down_proj [D, F]: by F (axis 1), and so the
      shared experts of an MoE block by their own width;
    mlp.experts.{gate,up,down}_proj [E, ...]: by expert (axis 0), when E divides.
  Norms, eh_proj, routers (mlp.gate), shared_expert_gate, the embedding and lm_head are replicated.
  """
  if not isinstance(model, (MtpModel, TargetModel)):
    raise TypeError(f"model must be an MtpModel or TargetModel, got {type(model).__name__}")
  _, m = _axis_sizes(mesh)
  cfg = model.cfg
  rules = {  # layer name -> (split axis of its weight, count that must divide by the model axis)
      "q_proj": (0, cfg.num_heads), "k_proj": (0, cfg.num_kv_heads), "v_proj": (0, cfg.num_kv_heads),
      "q_b_proj": (0, cfg.num_heads), "kv_b_proj": (0, cfg.num_heads), "o_proj": (1, cfg.num_heads),
      "gate_proj": (0, None), "up_proj": (0, None), "down_proj": (1, None),
      "experts": (0, None)}  # None: the split dimension's own size (MLP widths, experts)

  def spec(path, x):
    *_, layer, leaf = _names(path)
    axis, count = rules.get(layer, (None, 1))
    count = x.shape[axis] if axis is not None and count is None else count
    if axis is None or count % m:
      return P()
    if leaf == "bias":  # a bias is float[out]: split with the weight's output rows only
      return P(MODEL) if axis == 0 else P()
    return P(*(MODEL if a == axis else None for a in range(x.ndim)))

  return jax.tree_util.tree_map_with_path(spec, model)


def state_specs(state: ProposerState | TargetState, mesh: Mesh):
  """PartitionSpecs for a ProposerState or TargetState, as a pytree of the same kind.

  Batch B on "data" (replicated if B % data != 0). Caches as their `partition_specs` say: GQA
  dtype[B, L, Hkv, Dh] with Hkv on "model" when Hkv % model == 0, MLA latents replicated on
  "model"; paged pools dtype[num_pages, page_size, ...] likewise by KV heads (MLA's replicated),
  never by batch (any slot may hold any page), and the page allocator replicated. Proposer: tail
  dtype[B, K, D], draft_probs float32[B, K, V] by batch; lengths int32[K, B] on axis 1; num_pos,
  num_drafted int32[B]. Target: length int32[B].
  """
  data_size, m = _axis_sizes(mesh)
  if isinstance(state, ProposerState):
    batch = state.batch_size
  elif isinstance(state, TargetState):
    batch = state.length.shape[0]
  else:
    raise TypeError(f"state must be a ProposerState or TargetState, got {type(state).__name__}")
  b = DATA if batch % data_size == 0 else None

  caches = state.caches.partition_specs(b, MODEL, m)
  if isinstance(state, TargetState):
    return state.set(caches=caches, length=P(b))
  return state.set(caches=caches, tail=tuple(P(b, None, None) for _ in state.tail),
                   lengths=P(None, b), num_pos=P(b), num_drafted=P(b),
                   draft_probs=None if state.draft_probs is None else P(b, None, None))


def _put(x, sharding: NamedSharding):
  if isinstance(x, jax.core.Tracer):  # inside jit: a constraint for GSPMD, not a transfer
    return jax.lax.with_sharding_constraint(x, sharding)
  # On a mesh spanning processes, every process passes the same whole array and keeps its shards.
  return jax.device_put(x, sharding)


def _place(tree, specs, mesh: Mesh):
  return jax.tree.map(lambda x, spec: _put(x, NamedSharding(mesh, spec)), tree, specs)


def shard_params(model: MtpModel | TargetModel, mesh: Mesh):
  """A copy of `model` (same class) with every param placed per `param_specs`; `model` is untouched."""
  return _place(model, param_specs(model, mesh), mesh)


def shard_state(state: ProposerState | TargetState, mesh: Mesh):
  """`state` (same class) with its arrays placed per `state_specs`.

  Under jit (traced arrays) it applies `jax.lax.with_sharding_constraint` instead, so a state
  created inside a jitted function can be sharded too.
  """
  return _place(state, state_specs(state, mesh), mesh)


def shard_batch(x, mesh: Mesh) -> jax.Array:
  """x: any[B, ...] placed with B on "data" (replicated if B % data != 0), the rest replicated.

  For per-step inputs (hiddens float[B, T, D], tokens int32[B, T], num_new int32[B], ...). Optional:
  jit would take host arrays as replicated and split them itself; placed up front, they arrive
  split already.
  """
  data_size, _ = _axis_sizes(mesh)
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have a leading batch axis, got shape {x.shape}")
  spec = P(DATA if x.shape[0] % data_size == 0 else None, *([None] * (x.ndim - 1)))
  return _put(x, NamedSharding(mesh, spec))
