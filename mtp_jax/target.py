"""The target model: a Llama / Qwen-style decoder built from the same Block as the MTP modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from mtp_jax import validate
from mtp_jax.blocks import Block, Embed, LayerCache, LayerCaches, Linear, PageRead, Pages, RMSNorm, TreeRows
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.blocks.axes import axes
from mtp_jax.blocks.caches import CachedState
from mtp_jax.config import TargetConfig
from mtp_jax.mtp import assign_state_dict, param_names
from mtp_jax.tree import TreeSpec, check_tree


class TargetModel(nnx.Module):
  """Embedding, N pre-norm blocks, final RMSNorm, LM head; a pytree, passed to jit as an argument."""

  def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, rngs=rngs)
    self.layers = nnx.List([Block(cfg.block_config(), rngs=rngs, layer_idx=i) for i in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=cfg.jnp_dtype,
                        unit_offset=cfg.norm_unit_offset, axis="embed")
    self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"), dtype=cfg.jnp_dtype, rngs=rngs)

  def __call__(self, tokens_BxT, rows_BxT, valid_BxT, kv: tuple[LayerCache, ...] | None,
               tree: TreeRows | None = None):
    """Runs tokens at cache rows rows_BxT (cache-free over this call's rows when kv is None);
    with tree, the rows are draft-tree nodes at RoPE positions rows_BxT (see TreeRows).

    Returns (logits float32[B, T, V], hiddens dtype[B, T, D] for the MTP chain, new kv or None).
    """
    h = self.embed_tokens(tokens_BxT)
    new_kv = []
    for i, layer in enumerate(self.layers):
      h, cache = layer(h, rows_BxT, valid_BxT, None if kv is None else kv[i], 0, tree)
      new_kv.append(cache)
    normed = self.norm(h)
    logits = self.lm_head(normed).astype(jnp.float32)
    return logits, (normed if self.cfg.output_normed_hidden else h), (None if kv is None else tuple(new_kv))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetState(CachedState):
  """caches: the layers' LayerCaches (`kv`: one cache per layer, `pages`: the allocator or None);
  length: int32[B], rows written per sequence."""

  caches: LayerCaches
  length: jax.Array = axes("batch")

  @property
  def rows_held(self) -> jax.Array:
    return self.length


def init_target_state(cfg: TargetConfig, batch_size: int, max_len: int, *, dtype=None,
                      page_size: int | None = None, num_pages: int | None = None,
                      pages: Pages | None = None) -> TargetState:
  """Empty caches for batch_size sequences of at most max_len positions.

  cfg: a TargetConfig; batch_size, max_len: ints >= 1; dtype: a floating cache dtype (default cfg.dtype).
  page_size, num_pages: paged caches (blocks/paged.py), pages taken as rows are written and
  returned by `trim_target` / `reset_target_slots`.
  pages: paged through a table the caller allocates and owns, `Pages.external(table, page_size,
    num_pages)` with table int32[B, max_len // page_size]; calls read and write through it and
    allocate nothing (`state.with_page_table` hands in a new table).
  """
  validate.instance("cfg", cfg, TargetConfig, "a TargetConfig")
  batch_size = validate.positive_int("batch_size", batch_size)
  max_len = validate.positive_int("max_len", max_len)
  dtype = None if dtype is None else validate.float_dtype("dtype", dtype)
  caches = LayerCaches.create(cfg.block_config(), cfg.num_layers, batch_size, max_len, dtype=dtype,
                              page_size=page_size, num_pages=num_pages, pages=pages)
  return TargetState(caches=caches, length=jnp.zeros((batch_size,), jnp.int32))


def target_step(model: TargetModel, state: TargetState, tokens_BxT, num_new_B, tree: TreeSpec | None = None, *,
                checked: bool = False, read: PageRead = WHOLE_POOL):
  """Appends num_new_B[b] tokens (left-aligned in tokens_BxT: int32[B, T]) to each sequence.

  Prefill is the call with the whole prompt; verification the call with [last token, d_1..d_k].
  With tree (static), tokens_BxT: int32[B, N + 1] are the tree's nodes, root (the last token)
  first, and num_new_B is N + 1 or 0: node n runs at position length + depth(n), sees the
  sequence and its own ancestors, and is written at row length + n (`compact_target` then moves
  an accepted path into place).
  num_new_B: int32[B] in 0..T; the real tokens are ids in 0..vocab_size-1 and length + num_new
  stays <= max_len. Eager calls check these values and raise validate.InvalidValue; traced ones
  cannot, so there rows past max_len are dropped, never wrapped, and `checked=True` adds the same
  checks as `checkify` checks (wrap the caller in `checkify.checkify`, or use `mtp_jax.checked`).
  Paged, the sequence first gets pages for its new rows; one refused them is flagged in `pages.oom`
  and its rows beyond its pages are dropped (its logits are then meaningless; others are unaffected).
  read: static `mtp_jax.blocks.PageRead`, how a paged state's call reads its pages (a page budget
  or span; default the whole pool); contiguous states ignore it.
  Returns (logits float32[B, T, V], hiddens dtype[B, T, D], new TargetState with length += num_new).
  """
  tokens_BxT, num_new_B = _check_step_args(model, state, tokens_BxT, num_new_B, tree)
  checked = validate.flag("checked", checked)
  validate.instance("read", read, PageRead, "a mtp_jax.blocks.PageRead")
  if validate.is_concrete(state.length, tokens_BxT, num_new_B):
    validate.raise_failed(_step_value_checks(state, tokens_BxT, num_new_B, model.cfg.vocab_size, tree),
                          length=state.length, num_new=num_new_B)
  elif checked:
    validate.checkify_checks(_step_value_checks(state, tokens_BxT, num_new_B, model.cfg.vocab_size, tree))
  return _target_step(model, state, tokens_BxT, num_new_B, tree, read)


def _check_step_args(model, state, tokens_BxT, num_new_B, tree):
  """(tokens int32[B, T], num_new int32[B]) as jax arrays, their types and shapes checked."""
  validate.instance("model", model, TargetModel, "a TargetModel (init_target, load_target_state_dict)")
  validate.instance("state", state, TargetState, "a TargetState (from init_target_state)")
  b = state.length.shape[0]
  tokens_BxT = validate.array("tokens", tokens_BxT, (b, None), kind="int", dims=f"[B={b}, T]")
  num_new_B = validate.array("num_new", num_new_B, (b,), kind="int", dims=f"[B={b}]")
  if tree is not None:
    check_tree(tree, vocab_size=model.cfg.vocab_size)
    if tokens_BxT.shape[1] != tree.num_nodes + 1:
      raise validate.InvalidValue("tokens", f"with tree widths={tree.widths}, tokens must be int32[B={b}, "
                                            f"N + 1={tree.num_nodes + 1}] (root first), got T={tokens_BxT.shape[1]}")
  return jnp.asarray(tokens_BxT).astype(jnp.int32), jnp.asarray(num_new_B).astype(jnp.int32)


def _step_value_checks(state, tokens_BxT, num_new_B, vocab_size, tree):
  """(condition that must hold, argument, message) over values; shared by eager and checkify checks."""
  t = tokens_BxT.shape[1]
  real_BxT = jnp.arange(t)[None] < num_new_B[:, None]
  if tree is None:
    num_new_ok = (jnp.all((num_new_B >= 0) & (num_new_B <= t)), "num_new", f"num_new must be in 0..T={t}")
  else:
    num_new_ok = (jnp.all((num_new_B == 0) | (num_new_B == t)), "num_new",
                  f"num_new must be 0 or N + 1={t} with a tree (all its nodes or none)")
  return [
      num_new_ok,
      (jnp.all(state.length + num_new_B <= state.max_len), "num_new",
       f"num_new: a sequence would outgrow max_len={state.max_len} (length + num_new > max_len)"),
      (jnp.all((tokens_BxT >= 0) & (tokens_BxT < vocab_size) | ~real_BxT), "tokens",
       f"tokens must be in 0..vocab_size-1={vocab_size - 1}"),
  ]


@validate.jit_when_concrete(static_argnums=(4, 5))
def _target_step(model: TargetModel, state: TargetState, tokens_BxT, num_new_B, tree: TreeSpec | None,
                 read: PageRead = WHOLE_POOL):
  t = tokens_BxT.shape[1]
  rows_BxT = state.length[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  valid_BxT = jnp.arange(t)[None] < num_new_B[:, None]
  tree_rows = None
  if tree is not None:
    tree_rows = TreeRows(base_B=state.length, visible_TxT=tree.visible, write_BxT=rows_BxT)
    rows_BxT = state.length[:, None] + jnp.asarray(tree.depths)[None]
  caches, layers = state.caches.open(state.length + num_new_B, read)
  logits, hiddens, layers = model(tokens_BxT, rows_BxT, valid_BxT, layers, tree_rows)
  return logits, hiddens, state.set(caches=caches.close(layers), length=state.length + num_new_B)


def trim_target(state: TargetState, length_B) -> TargetState:
  """Keeps rows 0..length_B[b]-1 (int32[B], <= length): rejected rows; paged, whole pages past them go back."""
  return state.set(length=length_B, caches=state.caches.release(length_B))


def compact_target(state: TargetState, start_B, path_BxK1, num_accepted_B) -> TargetState:
  """After a tree verification that started at row start_B[b] (int32[B]): moves the accepted path
  into place. Node path_BxK1[b, d] (int32[B, k + 1], tree indices by depth) moves from row
  start + path[d] to row start + d for d = 1..num_accepted_B[b]; `trim_target(state, start + a + 1)`
  then leaves the caches exactly as a chain verification of [last, d_1..d_a] would.
  Contiguous or paged (rows move through the page table)."""
  k1 = path_BxK1.shape[1]
  d_1xK = jnp.arange(1, k1, dtype=jnp.int32)[None]
  src_BxK, dst_BxK = start_B[:, None] + path_BxK1[:, 1:], start_B[:, None] + d_1xK
  valid_BxK = d_1xK <= num_accepted_B[:, None]
  return state.set(caches=state.caches.move_rows(src_BxK, dst_BxK, valid_BxK))


def reset_target_slots(state: TargetState, mask_B) -> TargetState:
  """Empties the slots where mask_B (bool[B]) is True; paged, their pages go back to the pool."""
  return state.set(length=jnp.where(mask_B, 0, state.length), caches=state.caches.reset(mask_B))


def init_target(cfg: TargetConfig, seed: int = 0) -> TargetModel:
  """Randomly initialised target (the same kind of object `load_target_state_dict` returns)."""
  return TargetModel(cfg, rngs=nnx.Rngs(seed))


def hf_name(path: str) -> str:
  """The HF Llama name of a TargetModel param path ("layers.0.self_attn.q_proj.weight" -> "model.layers...")."""
  return path if path.startswith("lm_head.") else "model." + path


def target_state_dict(model: TargetModel) -> dict[str, jax.Array]:
  """HF Llama names -> arrays (torch Linear layout); the inverse of `load_target_state_dict`."""
  return {hf_name(".".join(str(p) for p in path)): param[...]
          for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_target_state_dict(cfg: TargetConfig, tensors: Mapping) -> TargetModel:
  """Builds a TargetModel from HF Llama names: model.embed_tokens.weight [V, D],
  model.layers.{i}.input_layernorm.weight, model.layers.{i}.self_attn.{q,k,v,o}_proj.weight,
  model.layers.{i}.post_attention_layernorm.weight, model.layers.{i}.mlp.{gate,up,down}_proj.weight,
  model.norm.weight [D], lm_head.weight [V, D]. Errors name the tensor and the expected shape."""
  model = init_target(cfg)
  return assign_state_dict(model, param_names(model, hf_name), tensors, "load_target_state_dict")
