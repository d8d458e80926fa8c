"""The MTP modules (DeepSeek-V3 layout, dense blocks), their state dicts and a cache-free chain forward.

Depth m (0-based i = m - 1) runs module cfg.module_of(i); row j:
    x = eh_proj(concat(enorm(E[t_{j+m}]), hnorm(h^{m-1}_j)))   # E[t] zeroed at position 0 if configured
    h^m_j = Block(x)            # RoPE position j + m
    logits^m_j = lm_head(shared_head_norm(h^m_j))              # no norm when cfg.head_norm is off;
                                                               # the module's own head with cfg.own_lm_head
    depth m + 1 reads shared_head_norm(h^m_j) or h^m_j        # cfg.pass_normed_hidden
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax import validate
from mtp_jax.blocks import Block, Embed, LayerCache, Linear, RMSNorm, TreeRows, module_state_dict
from mtp_jax.blocks.hyper_block import HyperMtpModule
from mtp_jax.config import MtpConfig


class MtpModule(nnx.Module):
  """One MTP module: enorm / hnorm, eh_proj, a Block, the shared_head norm (when cfg.head_norm) and,
  with cfg.own_lm_head, its own LM head (shared_head_head, [V, D] as torch stores it).

  Each depth that runs it has a KV cache of its own (the proposer's state holds them).
  """

  def __init__(self, cfg: MtpConfig, *, rngs: nnx.Rngs):
    d, dt, eps = cfg.hidden_size, cfg.jnp_dtype, cfg.rms_norm_eps
    self.enorm = RMSNorm(d, eps=eps, dtype=dt, unit_offset=cfg.norm_unit_offset, axis="embed")
    self.hnorm = RMSNorm(d, eps=eps, dtype=dt, unit_offset=cfg.norm_unit_offset, axis="embed")
    self.eh_proj = Linear(2 * d, d, axes=("embed", "embed"), dtype=dt, rngs=rngs)
    self.block = Block(cfg.block_config(), rngs=rngs)
    self.shared_head_norm = (RMSNorm(d, eps=eps, dtype=dt, unit_offset=cfg.norm_unit_offset, axis="embed")
                             if cfg.head_norm else None)
    self.shared_head_head = (Linear(d, cfg.vocab_size, axes=("vocab", "embed"), dtype=dt, rngs=rngs)
                             if cfg.own_lm_head else None)

  def __call__(self, emb_BxTxD, h_BxTxD, rows_BxT, valid_BxT, cache: LayerCache | None, rope_offset: int,
               tree: TreeRows | None = None):
    """Returns (h^m dtype[B, T, D] before the head norm, new cache); tree: rows are draft-tree nodes."""
    x = self.eh_proj(jnp.concatenate([self.enorm(emb_BxTxD), self.hnorm(h_BxTxD)], axis=-1))
    return self.block(x, rows_BxT, valid_BxT, cache, rope_offset, tree)


class MtpModel(nnx.Module):
  """K chained MTP modules plus the embedding and LM head they share with the target (no shared
  LM head with cfg.own_lm_head: each module scores with its own).

  Pass it as `params` to `propose`; it is a pytree (an NNX module), so it goes through
  `jax.jit` as an argument and the config rides along as static data.
  """

  def __init__(self, cfg: MtpConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=cfg.jnp_dtype, rngs=rngs)
    # DeepSeek-V4 (cfg.hyper): modules over hyper-connection streams, hidden dtype[B, T, hc_mult * D].
    module = MtpModule if cfg.hyper is None else HyperMtpModule
    self.layers = nnx.List([module(cfg, rngs=rngs) for _ in range(cfg.num_modules)])
    self.lm_head = (None if cfg.own_lm_head else
                    Linear(cfg.hidden_size, cfg.vocab_size, axes=("vocab", "embed"), dtype=cfg.jnp_dtype, rngs=rngs))

  def module(self, i: int) -> MtpModule | HyperMtpModule:
    """The module depth i runs (cfg.module_of(i))."""
    return self.layers[self.cfg.module_of(i)]

  def embed(self, i: int, tokens_BxT: jax.Array, rows_BxT: jax.Array) -> jax.Array:
    """dtype[B, T, D] embeddings of depth i's input tokens at rows rows_BxT.

    With cfg.mask_first_embedding, position 0 (depth 0, row 0) gets a zero embedding: vLLM's
    MTP layers zero the embedding where the hidden's position is 0, and depth i row j reads
    the hidden of position j + i.
    """
    emb = self.embed_tokens(tokens_BxT)
    if self.cfg.mask_first_embedding and i == 0:
      emb = jnp.where((rows_BxT == 0)[..., None], jnp.zeros_like(emb), emb)
    return emb

  def _head_input(self, i: int, h_BxTxD: jax.Array) -> jax.Array:
    module = self.module(i)
    if isinstance(module, HyperMtpModule):  # streams collapse to one hidden before the head norm
      h_BxTxD = module.collapse(h_BxTxD)
    norm = module.shared_head_norm
    return h_BxTxD if norm is None else norm(h_BxTxD)

  def next_hidden(self, i: int, h_BxTxD: jax.Array) -> jax.Array:
    """What depth i hands to depth i + 1: its residual stream, or the normed one if configured."""
    return self._head_input(i, h_BxTxD) if self.cfg.pass_normed_hidden else h_BxTxD

  def logits(self, i: int, h_BxTxD: jax.Array) -> jax.Array:
    """float32[..., V] logits of depth i from its hidden h^{i+1} (dtype[..., D])."""
    head = self.module(i).shared_head_head if self.cfg.own_lm_head else self.lm_head
    return head(self._head_input(i, h_BxTxD)).astype(jnp.float32)


def init_mtp(cfg: MtpConfig, seed: int = 0) -> MtpModel:
  """Randomly initialised MTP modules (the same kind of object `load_state_dict` returns)."""
  return MtpModel(cfg, rngs=nnx.Rngs(seed))


def canonical_name(name: str) -> str:
  """NNX path 'layers.0.block.mlp.up_proj.weight' -> canonical 'mtp.0.mlp.up_proj.weight'."""
  if not name.startswith("layers."):
    return name
  _, i, rest = name.split(".", 2)
  rest = rest.removeprefix("block.")
  if rest.startswith(("shared_head_norm.", "shared_head_head.")):
    rest = "shared_head." + rest[len("shared_head_"):]
  return f"mtp.{i}.{rest}"


def state_dict(model: MtpModel) -> dict[str, jax.Array]:
  """Canonical names -> arrays (torch Linear layout); the inverse of `load_state_dict`."""
  return {canonical_name(k): v for k, v in module_state_dict(model, "").items()}


def assign_state_dict(model: nnx.Module, names: dict[str, tuple], tensors: Mapping, what: str):
  """Copies tensors into model params by canonical name, each cast to its param's dtype (the
  config's, or float32 for an MoE router); errors name the tensor and the expectation."""
  missing = [n for n in names if n not in tensors]
  if missing:
    raise KeyError(f"{what}: missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
  unexpected = sorted(set(tensors) - set(names))
  if unexpected:
    raise KeyError(f"{what}: unexpected tensor(s) {unexpected[:5]} (expected names like {next(iter(names))!r})")
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for name, (path, shape) in names.items():
    value = np.asarray(tensors[name])
    if value.shape != shape:
      raise ValueError(f"{what}: tensor {name!r} has shape {value.shape}, expected {shape}")
    if not jnp.issubdtype(value.dtype, jnp.floating):  # int / bool weights would load as silent casts
      raise validate.InvalidType(name, f"{what}: tensor {name!r} has dtype {value.dtype}, expected a floating dtype")
    if not np.all(np.isfinite(value.astype(np.float32))):
      raise ValueError(f"{what}: tensor {name!r} contains NaN or inf")
    flat[path][...] = jnp.asarray(value, flat[path][...].dtype)
  return model


def param_names(model: nnx.Module, canonical) -> dict[str, tuple]:
  """canonical name -> (NNX path, shape) for every param of model."""
  return {canonical(".".join(str(p) for p in path)): (path, tuple(param.shape))
          for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_state_dict(cfg: MtpConfig, tensors: Mapping) -> MtpModel:
  """Builds an MtpModel from canonical names (see `state_dict`); arrays may be numpy or jax.

  Names: mtp.{i}.{enorm,hnorm}.weight [D], mtp.{i}.eh_proj.weight [D, 2D],
  mtp.{i}.input_layernorm.weight, mtp.{i}.self_attn.{q,k,v,o}_proj.weight (+ .bias for q, k, v
  when cfg.attention_bias), mtp.{i}.post_attention_layernorm.weight, mtp.{i}.mlp.{gate,up,down}_proj.weight,
  mtp.{i}.shared_head.norm.weight (when cfg.head_norm), embed_tokens.weight [V, D], lm_head.weight [V, D]
  (with cfg.own_lm_head none, and mtp.{i}.shared_head.head.weight [V, D] instead).
  """
  model = init_mtp(cfg)
  return assign_state_dict(model, param_names(model, canonical_name), tensors, "load_state_dict")


def forward_chain(model: MtpModel, hiddens_BxTxD: jax.Array, tokens_BxU: jax.Array,
                  num_modules: int | None = None) -> jax.Array:
  """Cache-free forward of the chain over whole sequences (training and reference).

  Args:
    hiddens_BxTxD: float[B, T, D] target hiddens h^0_j at rows j = 0..T-1 (D: cfg.hidden_width).
    tokens_BxU: int32[B, U], U >= T + K - 1: tokens_BxU[:, u] = t_{u+1}; module m row j reads
      t_{j+m} = tokens_BxU[:, j + m - 1].
    num_modules: run only the first depths (default all cfg.num_depths).
  Returns:
    float32[K, B, T, V]: row j of depth m predicts t_{j+m+1}.
  """
  b, t, _ = hiddens_BxTxD.shape
  k = num_modules or model.cfg.num_depths
  if tokens_BxU.shape[1] < t + k - 1:
    raise ValueError(f"tokens_BxU needs at least T + K - 1 = {t + k - 1} columns, got {tokens_BxU.shape[1]}")
  return _forward_chain(model, jnp.asarray(hiddens_BxTxD), jnp.asarray(tokens_BxU), k)


@validate.jit_when_concrete(static_argnums=3)
def _forward_chain(model: MtpModel, hiddens_BxTxD, tokens_BxU, k: int) -> jax.Array:
  b, t, _ = hiddens_BxTxD.shape
  rows_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  valid_BxT = jnp.ones((b, t), bool)
  h = hiddens_BxTxD.astype(model.cfg.jnp_dtype)
  out = []
  for i in range(k):
    emb = model.embed(i, tokens_BxU[:, i:i + t], rows_BxT)
    h, _ = model.module(i)(emb, h, rows_BxT, valid_BxT, None, rope_offset=i + 1)
    out.append(model.logits(i, h))
    h = model.next_hidden(i, h)
  return jnp.stack(out)

