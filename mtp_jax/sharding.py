"""Partition specs for a ("data", "model") device mesh, optionally with an "expert" axis; JAX's GSPMD
does the distributed work.

Every param declares its logical axes where it is created (blocks/linear.py: `Linear(axes=...)`,
`Embed`, `RMSNorm(axis=...)`, `param(...)` for the MoE experts, router and attention sinks). RULES
is the one table that maps logical axes onto mesh axes; `param_specs` reads the declarations
through it, and a param that declares nothing is an error naming it. "data" splits the batch B,
"model" attention heads and MLP columns (Megatron style: column-parallel q/k/v and gate/up,
row-parallel o and down, so each block needs one all-reduce after attention and one after the
MLP), "expert" the stacked routed experts of an MoE block; on a mesh without it they split over
"model" (expert parallel), and the router and shared experts follow the rules above.

A dimension that does not divide by its mesh axis stays whole on that axis: k/v projections and
KV caches when num_kv_heads % model != 0, q/o when num_heads % model != 0, an MLP (or shared
expert) whose width does not divide, the routed experts when num_experts does not divide, and a
state's batch when B % data != 0. The results are the same either way; only memory and
communication differ.

Params are placed with `jax.device_put(x, NamedSharding(mesh, spec))` (`shard_params`), or read
from a checkpoint block by block straight into their sharding (`place_blocks`, which
`pretrained.from_pretrained(path, mesh=...)` uses); the jitted `propose`, `after_verify`,
`target_step` and `generate` then run sharded because jit follows the shardings of its inputs.
Traced under `use_mesh(mesh)`, the blocks also constrain their outputs (blocks.linear.constrain).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mtp_jax.blocks.axes import leaf_axes
from mtp_jax.blocks.linear import AXES, axis_resolver
from mtp_jax.mtp import MtpModel
from mtp_jax.proposer import ProposerState
from mtp_jax.target import TargetModel, TargetState

DATA, MODEL, EXPERT = "data", "model", "expert"

# Logical axis -> the mesh axes it may split over, first choice first. A dimension takes the first
# one the mesh has, that no earlier dimension of the same array took, and that divides its count
# ("heads" and "kv_heads" count heads, not rows, so a head is never cut; others their size).
# An empty tuple: never split.
RULES: dict[str, tuple[str, ...]] = {
    "batch": (DATA,),  # the sequences of a batch (activations, states)
    "embed": (),  # the hidden size D: norms, eh_proj, the residual stream
    "vocab": (),  # embedding and LM head rows
    "heads": (MODEL,),  # query heads (times their head dim): q / o projections, MLA q_b / kv_b, sinks
    "kv_heads": (MODEL,),  # KV heads (times head dim): k / v projections
    "head_dim": (),  # per-head q / k norms
    "mlp": (MODEL,),  # dense MLP and shared-expert width
    "experts": (EXPERT, MODEL),  # routed experts: the expert axis where the mesh has one
    "expert_mlp": (MODEL,),  # a routed expert's width, when the experts left "model" free
    "q_lora": (),  # MLA's q LoRA rank
    "kv_lora": (),  # MLA's latent (and shared rope key): every head reads it
    # State only (blocks/axes.py): cache rows, page pools and the page table are never split.
    "cache_rows": (),  # a contiguous cache's rows (positions)
    "pages": (),  # a page pool's pages: any slot may hold any page
    "page_rows": (),  # the rows of one page
    "table_slots": (),  # the page table's slots: every device reads every slot's pages
}


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None, *, expert: int = 1) -> Mesh:
  """A data x model mesh over `devices` (default all devices of all processes); with expert > 1 a
  data x expert x model mesh, whose "expert" axis splits only the routed experts.

  The axes are `AxisType.Auto`, so jit propagates shardings GSPMD style (jax's own default,
  Explicit, would make every op's output sharding part of its type, which the model code
  does not spell out).
  """
  devices = list(jax.devices() if devices is None else devices)
  for name, size in (("data", data), ("model", model), ("expert", expert)):
    if not isinstance(size, int) or size < 1:
      raise ValueError(f"{name} must be a positive int, got {size!r}")
  if data * model * expert != len(devices):
    raise ValueError(f"data * model{' * expert' if expert > 1 else ''} must equal the number of devices "
                     f"({len(devices)}), got data={data}, model={model}{f', expert={expert}' if expert > 1 else ''}")
  if expert == 1:
    return jax.make_mesh((data, model), (DATA, MODEL), (AxisType.Auto,) * 2, devices=devices)
  return jax.make_mesh((data, expert, model), (DATA, EXPERT, MODEL), (AxisType.Auto,) * 3, devices=devices)


def _axis_sizes(mesh: Mesh) -> dict[str, int]:
  names = set(getattr(mesh, "axis_names", ()))
  if not isinstance(mesh, Mesh) or not {DATA, MODEL} <= names <= {DATA, MODEL, EXPERT}:
    raise ValueError("mesh must be a jax.sharding.Mesh with axes ('data', 'model') or ('data', 'expert', 'model') "
                     f"(see make_mesh), got {mesh!r}")
  return dict(mesh.shape)


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                 counts: dict[str, int] | None = None) -> P:
  """The PartitionSpec, per RULES, of an array of `shape` whose dimensions have logical `axes`
  (names of RULES, or None: never split). counts: the unit count of a logical axis where it is
  not the dimension's size (heads). P() when nothing splits."""
  sizes = _axis_sizes(mesh)
  if len(axes) != len(shape):
    raise ValueError(f"logical axes {tuple(axes)} do not match shape {tuple(shape)}")
  taken, out = set(), []
  for name, size in zip(axes, shape):
    if name is not None and name not in RULES:
      raise ValueError(f"unknown logical axis {name!r}; sharding.RULES has {sorted(RULES)}")
    count = (counts or {}).get(name, size)
    pick = next((a for a in RULES.get(name, ()) if a in sizes and a not in taken and count % sizes[a] == 0), None)
    taken.add(pick)
    out.append(pick)
  return P(*out) if any(out) else P()


def _dotted(path) -> str:
  return ".".join(str(getattr(k, "name", getattr(k, "idx", getattr(k, "key", k)))) for k in path)


def param_specs(model: MtpModel | TargetModel, mesh: Mesh):
  """PartitionSpecs for every param of `model`, as a pytree shaped like the model.

  Each param's spec is its declared logical axes mapped through RULES (`logical_spec`, heads
  counted by cfg.num_heads / num_kv_heads). Linear weights are float[out, in]: q_proj, MLA
  q_b_proj / kv_b_proj ("heads", *) and k / v_proj ("kv_heads", "embed") split by rows, o_proj
  ("embed", "heads") by columns; mlp gate / up ("mlp", "embed") by rows, down ("embed", "mlp") by
  columns; experts [E, D, Fe] / [E, Fe, D] by expert. Norms, eh_proj, routers, the embedding,
  lm_head and MLA's q_a / kv_a projections declare no split axis and are replicated.
  A param without declared logical axes raises ValueError naming it.
  """
  if not isinstance(model, (MtpModel, TargetModel)):
    raise TypeError(f"model must be an MtpModel or TargetModel, got {type(model).__name__}")
  _axis_sizes(mesh)
  counts = {"heads": model.cfg.num_heads, "kv_heads": model.cfg.num_kv_heads}

  def spec(path, var):
    axes = var.get_metadata().get(AXES) if isinstance(var, nnx.Variable) else None
    if axes is None:
      raise ValueError(f"param {_dotted(path)} of {type(model).__name__} (shape {tuple(np.shape(var))}) declares no "
                       "logical axes: give them where it is created (Linear(axes=...), RMSNorm(axis=...), "
                       "blocks.linear.param)")
    return var.replace(logical_spec(axes, var.shape, mesh, counts))

  return jax.tree_util.tree_map_with_path(spec, model, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_specs(state: ProposerState | TargetState, mesh: Mesh):
  """PartitionSpecs for a ProposerState or TargetState, as a pytree of the same kind.

  Each array's spec is its declared logical axes (blocks/axes.py: declared on the state's and
  the caches' fields) mapped through RULES, as params are: the slots ("batch") on "data" when B
  divides, KV heads on "model" when Hkv divides (GQA caches dtype[B, L, Hkv, Dh] and paged pools
  dtype[num_pages, page_size, Hkv, Dh]); MLA latents, page pools' pages and the page allocator
  (its table's "table_slots" included: any slot may hold any page) replicated.
  """
  if not isinstance(state, (ProposerState, TargetState)):
    raise TypeError(f"state must be a ProposerState or TargetState, got {type(state).__name__}")
  _axis_sizes(mesh)
  leaves, treedef = jax.tree_util.tree_flatten(state)
  return treedef.unflatten([logical_spec(names, np.shape(x), mesh) for x, names in zip(leaves, leaf_axes(state))])


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
  data_size = _axis_sizes(mesh)[DATA]
  x = x if isinstance(x, jax.Array) else np.asarray(x)
  if x.ndim < 1:
    raise ValueError(f"x must have a leading batch axis, got shape {x.shape}")
  spec = P(DATA if x.shape[0] % data_size == 0 else None, *([None] * (x.ndim - 1)))
  return _put(x, NamedSharding(mesh, spec))


def place_blocks(read: Callable, shape: Sequence[int], dtype, spec: P, mesh: Mesh) -> jax.Array:
  """A jax.Array of `shape` and `dtype` laid out as `spec` on `mesh`, each device's block read by
  read(index) -> array-like x[index] (index: a tuple of slices) and cast to dtype.

  Only the blocks of this process's devices are read, each once however many devices hold it,
  so the host holds at most this one array's blocks at a time.
  """
  blocks = {}

  def block(index):
    key = tuple((s.start, s.stop, s.step) for s in index)
    if key not in blocks:
      blocks[key] = np.asarray(read(index), dtype)
    return blocks[key]

  return jax.make_array_from_callback(tuple(shape), NamedSharding(mesh, spec), block)


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """`with use_mesh(mesh):` jax.set_mesh(mesh), and the blocks' activation constraints
  (blocks.linear.constrain, e.g. each Block's output dtype[B, T, D] with B on "data") resolved
  by RULES on mesh for whatever is traced inside."""
  _axis_sizes(mesh)
  with jax.set_mesh(mesh), axis_resolver(lambda axes, shape: NamedSharding(mesh, logical_spec(axes, shape, mesh))):
    yield mesh
