"""Gemma 4 assistants (model_type gemma4_assistant, gemma4_unified_assistant): one small Gemma 4 text
decoder applied k times, served from the caller's target outputs.

Each draft step (transformers 5.25 generation/candidate_generator.py,
SinglePositionMultiTokenCandidateGenerator, and models/gemma4_assistant/):

    x = pre_projection(concat(embed_scale * embed_VxH[token], hidden))     # target width H -> D
    y = norm(layers(x))    # every layer attends to the target's K/V of its type, position length - 1
    hidden = post_projection(y)                                            # D -> H, the next step's
    logits = lm_head(y)    # tied to embed_tokens; or the centroid-masked head (use_ordered_embeddings)
    token = argmax(logits)

The assistant computes no keys or values: a sliding layer reads the K/V of the target's last sliding
layer, a full layer those of its last full layer (transformers' shared_kv_states), and the position
id stays length - 1 for all k steps. The target itself is the caller's (mtp_jax does not build Gemma 4).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtp_jax import validate
from mtp_jax.blocks.gemma4 import ROPE_TYPES, SharedKvLayer, gemma4_inv_freq, shared_kv_mask
from mtp_jax.blocks.linear import Embed, Linear, param
from mtp_jax.blocks.norms import RMSNorm

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class LayerKind:
  """What the layers of one type (sliding or full) share: the shape of the K/V they read (head_dim,
  num_kv_heads) and their RoPE (rope_type "default" or "proportional", `blocks.gemma4.gemma4_inv_freq`)."""
  head_dim: int
  num_kv_heads: int
  rope_type: str = "default"
  theta: float = 10000.0
  partial_rotary_factor: float = 1.0
  factor: float = 1.0

  def inv_freq(self) -> np.ndarray:
    return gemma4_inv_freq(self.head_dim, self.rope_type, self.theta, self.partial_rotary_factor, self.factor)


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantConfig:
  """A Gemma 4 assistant: its text decoder (text_config) and the target width it serves.

  layer_types: per layer "sliding_attention" or "full_attention"; sliding / full: the `LayerKind` of
  each type present. backbone_hidden_size: the target's hidden width H. use_ordered_embeddings: score
  only the tokens of the centroid_top_k best of num_centroids centroids (vocab_size a multiple of
  num_centroids).
  """
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_heads: int
  layer_types: tuple[str, ...]
  sliding_window: int
  backbone_hidden_size: int
  sliding: LayerKind | None = None
  full: LayerKind | None = None
  rms_norm_eps: float = 1e-6
  use_ordered_embeddings: bool = False
  num_centroids: int = 2048
  centroid_top_k: int = 32
  dtype: str = "float32"

  def __post_init__(self):
    cls = type(self).__name__
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "sliding_window",
                 "backbone_hidden_size", "num_centroids", "centroid_top_k"):
      validate.positive_int(f"{cls}.{name}", getattr(self, name))
    validate.real(f"{cls}.rms_norm_eps", self.rms_norm_eps, 0.0, lo_open=True)
    validate.float_dtype(f"{cls}.dtype", self.dtype)
    if not self.layer_types or any(t not in LAYER_TYPES for t in self.layer_types):
      raise validate.InvalidValue(f"{cls}.layer_types", f"{cls}.layer_types must be a non-empty list of "
                                  f"{LAYER_TYPES}, got {self.layer_types!r}")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    for t in set(self.layer_types):
      kind = self.kind(t)
      name = f"{cls}.{t.split('_')[0]}"
      if kind is None:
        raise validate.InvalidValue(name, f"{name} must be set: layer_types has {t!r} layers")
      validate.positive_int(f"{name}.head_dim", kind.head_dim)
      validate.positive_int(f"{name}.num_kv_heads", kind.num_kv_heads)
      if self.num_heads % kind.num_kv_heads or kind.head_dim % 2:
        raise validate.InvalidValue(name, f"{cls}: num_heads ({self.num_heads}) must be a multiple of "
                                    f"{name}.num_kv_heads ({kind.num_kv_heads}), and its head_dim even")
      validate.one_of(f"{name}.rope_type", kind.rope_type, ROPE_TYPES)
    if self.use_ordered_embeddings and (self.vocab_size % self.num_centroids
                                        or self.centroid_top_k > self.num_centroids):
      raise validate.InvalidValue(f"{cls}.num_centroids", f"{cls}: vocab_size ({self.vocab_size}) must be a multiple "
                                  f"of num_centroids ({self.num_centroids}), and centroid_top_k "
                                  f"({self.centroid_top_k}) at most num_centroids")

  def kind(self, layer_type: str) -> LayerKind | None:
    """The LayerKind of "sliding_attention" or "full_attention" layers."""
    return self.sliding if layer_type == "sliding_attention" else self.full

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)


class AssistantDecoder(nnx.Module):
  """The text decoder: embed_tokens (the tied LM head), the layers over shared K/V, the final norm."""

  def __init__(self, cfg: Gemma4AssistantConfig, *, rngs: nnx.Rngs):
    d, dt = cfg.hidden_size, cfg.jnp_dtype
    self.embed_tokens = Embed(cfg.vocab_size, d, dtype=dt, rngs=rngs)

    def layer(t):
      kind = cfg.kind(t)
      return SharedKvLayer(hidden_size=d, num_heads=cfg.num_heads, head_dim=kind.head_dim,
                           intermediate_size=cfg.intermediate_size, eps=cfg.rms_norm_eps, inv_freq=kind.inv_freq(),
                           window=cfg.sliding_window if t == "sliding_attention" else None, dtype=cfg.dtype,
                           rngs=rngs)

    self.layers = nnx.List([layer(t) for t in cfg.layer_types])
    self.norm = RMSNorm(d, eps=cfg.rms_norm_eps, dtype=dt, axis="embed")


class MaskedEmbedding(nnx.Module):
  """use_ordered_embeddings' head: centroids float[C, D] score C clusters of V / C tokens each
  (token_ordering int32[V], row c of its [C, V / C] view the tokens of cluster c)."""

  def __init__(self, cfg: Gemma4AssistantConfig, *, rngs: nnx.Rngs):
    self.centroids = Linear(cfg.hidden_size, cfg.num_centroids, axes=(None, "embed"), dtype=cfg.jnp_dtype,
                            rngs=rngs)
    self.token_ordering = param(jnp.arange(cfg.vocab_size, dtype=jnp.int32), ("vocab",))
    self.top_k, self.num_centroids = cfg.centroid_top_k, cfg.num_centroids

  def __call__(self, y_BxD: jax.Array, head_VxD: jax.Array) -> jax.Array:
    """float32[B, V]: y . head[v] for the tokens of the top_k centroids, every other token the row's
    smallest of those minus 1 (transformers takes the batch's smallest; a row's own keeps rows apart)."""
    b, v = y_BxD.shape[0], head_VxD.shape[0]
    _, top_BxK = jax.lax.top_k(self.centroids(y_BxD).astype(jnp.float32), self.top_k)
    clusters = self.token_ordering[...].reshape(self.num_centroids, v // self.num_centroids)
    chosen_BxN = clusters[top_BxK].reshape(b, -1)
    scores_BxN = jnp.einsum("bd,bnd->bn", y_BxD, head_VxD[chosen_BxN],
                            preferred_element_type=jnp.float32).astype(y_BxD.dtype).astype(jnp.float32)
    floor_B = jnp.min(scores_BxN, axis=-1) - 1.0
    out = jnp.broadcast_to(floor_B[:, None], (b, v))
    return out.at[jnp.arange(b)[:, None], chosen_BxN].set(scores_BxN)


class Gemma4Assistant(nnx.Module):
  """A Gemma 4 assistant (module names as transformers' Gemma4AssistantForCausalLM state dict, the LM
  head tied to model.embed_tokens). Pass it to `assistant_propose`."""

  def __init__(self, cfg: Gemma4AssistantConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, hb, dt = cfg.hidden_size, cfg.backbone_hidden_size, cfg.jnp_dtype
    self.model = AssistantDecoder(cfg, rngs=rngs)
    self.pre_projection = Linear(2 * hb, d, axes=("embed", None), dtype=dt, rngs=rngs)
    self.post_projection = Linear(d, hb, axes=(None, "embed"), dtype=dt, rngs=rngs)
    self.masked_embedding = MaskedEmbedding(cfg, rngs=rngs) if cfg.use_ordered_embeddings else None

  def step(self, x_BxH2, pos_B, shared_kv: dict, masks: dict):
    """One draft step: inputs dtype[B, 2H] (embedding, hidden) -> (next hidden dtype[B, H], logits
    float32[B, V])."""
    x = self.pre_projection(x_BxH2)
    for t, layer in zip(self.cfg.layer_types, self.model.layers):
      k, v = shared_kv[t]
      x = layer(x, pos_B, k, v, masks[t])
    y = self.model.norm(x)
    head = self.model.embed_tokens.weight[...]
    if self.masked_embedding is not None:
      logits = self.masked_embedding(y, head)
    else:
      logits = jnp.einsum("bd,vd->bv", y, head, preferred_element_type=jnp.float32).astype(y.dtype)
    return self.post_projection(y), logits.astype(jnp.float32)


def assistant_propose(assistant: Gemma4Assistant, *, tokens_B, hidden_BxH, shared_kv: dict, lengths_B, k: int,
                      embed_VxH, embed_scale: float):
  """k greedy drafts of a Gemma 4 assistant after the target verified lengths_B tokens per row.

  Args:
    tokens_B: int32[B], each row's last verified token (at row lengths_B - 1).
    hidden_BxH: float[B, H], the target's last hidden (after its final norm) at that token.
    shared_kv: {"sliding_attention": (k, v), "full_attention": (k, v)} for the layer types the
      assistant has: the K/V of the target's last layer of that type, float[B, S, Hkv, Dh] each, one S
      for all (row s holds position s, after the target's k / v norms and RoPE, as a dense cache holds
      them, not a ring buffer; rows >= lengths_B[b] are never read), Hkv and Dh as the assistant's
      config names for that type.
    lengths_B: int32[B] in [1, S], the verified length of each row (rows may differ).
    k: drafts per row, >= 1 (the loop is unrolled: one compile per k).
    embed_VxH: float[V', H], the target's input embedding table (V' >= the assistant's vocab_size V).
    embed_scale: the target's embedding multiplier (Gemma 4: H ** 0.5, Gemma4TextScaledWordEmbedding).
  Returns:
    (drafts int32[B, k], logits float32[B, k, V]): step i's argmax and its logits.
  Bad arguments raise validate.InvalidValue / InvalidType naming the argument and its limit.
  """
  cfg = validate.instance("assistant", assistant, Gemma4Assistant).cfg
  k = validate.positive_int("k", k)
  embed_scale = validate.real("embed_scale", embed_scale, 0.0, lo_open=True)
  tokens_B = validate.array("tokens_B", tokens_B, (None,), kind="int", dims="[B]")
  b = tokens_B.shape[0]
  hb = cfg.backbone_hidden_size
  hidden_BxH = validate.array("hidden_BxH", hidden_BxH, (b, hb), kind="float", dims=f"[B={b}, H={hb}]")
  lengths_B = validate.array("lengths_B", lengths_B, (b,), kind="int", dims=f"[B={b}]")
  embed_VxH = validate.array("embed_VxH", embed_VxH, (None, hb), kind="float", dims=f"[V, H={hb}]")
  if not isinstance(shared_kv, dict):
    raise validate.InvalidType("shared_kv", f"shared_kv must be a dict of layer type -> (k, v), got "
                               f"{type(shared_kv).__name__}")
  if embed_VxH.shape[0] < cfg.vocab_size:
    raise validate.InvalidValue("embed_VxH", f"embed_VxH must have at least the assistant's vocab_size "
                                f"({cfg.vocab_size}) rows (drafts are embedded next), got {embed_VxH.shape[0]}")
  kv, s = {}, None
  for t in sorted(set(cfg.layer_types)):
    pair = shared_kv.get(t)
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
      raise validate.InvalidValue(f"shared_kv[{t!r}]", f"shared_kv[{t!r}] must be a (k, v) pair: the assistant's "
                                  f"{t} layers read the K/V of the target's last {t} layer")
    kind = cfg.kind(t)
    arrays = []
    for i, x in enumerate(pair):
      dims = f"[B={b}, S{'' if s is None else '=' + str(s)}, Hkv={kind.num_kv_heads}, Dh={kind.head_dim}]"
      arrays.append(validate.array(f"shared_kv[{t!r}][{i}]", x, (b, s, kind.num_kv_heads, kind.head_dim),
                                   kind="float", dims=dims))
      s = arrays[-1].shape[1]
    kv[t] = tuple(arrays)
  if validate.is_concrete(tokens_B, lengths_B):
    lengths, tokens = np.asarray(lengths_B), np.asarray(tokens_B)
    validate.raise_failed([
        (np.all((lengths >= 1) & (lengths <= s)), "lengths_B", f"lengths_B must be in [1, S={s}] (the K/V rows)"),
        (np.all((tokens >= 0) & (tokens < embed_VxH.shape[0])), "tokens_B",
         f"tokens_B must be in [0, {embed_VxH.shape[0]}) (embed_VxH's rows)")], lengths_B=lengths, tokens_B=tokens)
  return _propose(assistant, jnp.asarray(tokens_B, jnp.int32), jnp.asarray(hidden_BxH), kv,
                  jnp.asarray(lengths_B, jnp.int32), jnp.asarray(embed_VxH), k, embed_scale)


@validate.jit_when_concrete(static_argnums=(6, 7))
def _propose(assistant: Gemma4Assistant, tokens_B, hidden_BxH, shared_kv, lengths_B, embed_VxH, k, embed_scale):
  cfg = assistant.cfg
  dt = cfg.jnp_dtype
  pos_B = lengths_B - 1
  masks = {t: shared_kv_mask(lengths_B, shared_kv[t][0].shape[1],
                             cfg.sliding_window if t == "sliding_attention" else None) for t in shared_kv}
  kv = {t: (a.astype(dt), b.astype(dt)) for t, (a, b) in shared_kv.items()}
  # As Gemma4TextScaledWordEmbedding: the scale cast to the table's dtype, then multiplied.
  scale = jnp.asarray(embed_scale, embed_VxH.dtype)
  token, hidden = tokens_B, hidden_BxH.astype(dt)
  drafts, logits = [], []
  for _ in range(k):
    emb = (embed_VxH[token] * scale).astype(dt)
    hidden, step_logits = assistant.step(jnp.concatenate([emb, hidden], axis=-1), pos_B, kv, masks)
    token = jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
    drafts.append(token)
    logits.append(step_logits)
  return jnp.stack(drafts, axis=1), jnp.stack(logits, axis=1)
