"""MTP modules: the chain forward equals an independent numpy reference written from the state-dict
names and the documented math; state dicts round-trip; bad tensors get errors naming them."""

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax

CFG = mtp_jax.MtpConfig(vocab_size=30, hidden_size=16, num_heads=4, num_kv_heads=2, head_dim=6,
                        intermediate_size=24, num_modules=2, rms_norm_eps=1e-5, rope_theta=500.0)


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x_TxHxDh, pos_T, theta):
  half = x_TxHxDh.shape[-1] // 2
  inv = theta ** (-np.arange(half) / half)
  ang = pos_T[:, None, None] * inv
  x1, x2 = x_TxHxDh[..., :half], x_TxHxDh[..., half:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def _block(sd, p, x, pos, cfg):
  t = x.shape[0]
  hq, hkv, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  h = _rms(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps)
  proj = lambda n: h @ sd[p + f"self_attn.{n}_proj.weight"].T + sd.get(p + f"self_attn.{n}_proj.bias", 0.0)
  q = _rope(proj("q").reshape(t, hq, dh), pos, cfg.rope_theta)
  k = _rope(proj("k").reshape(t, hkv, dh), pos, cfg.rope_theta)
  v = proj("v").reshape(t, hkv, dh)
  out = np.zeros((t, hq, dh))
  for head in range(hq):
    kv_head = head // (hq // hkv)  # GQA: consecutive query heads share a KV head
    s = q[:, head] @ k[:, kv_head].T / np.sqrt(dh)
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    out[:, head] = (a / a.sum(-1, keepdims=True)) @ v[:, kv_head]
  x = x + out.reshape(t, hq * dh) @ sd[p + "self_attn.o_proj.weight"].T
  h = _rms(x, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
  gate = h @ sd[p + "mlp.gate_proj.weight"].T
  up = h @ sd[p + "mlp.up_proj.weight"].T
  return x + (gate / (1 + np.exp(-gate)) * up) @ sd[p + "mlp.down_proj.weight"].T


def reference_chain(sd, hid_TxD, tokens_U, cfg):
  """Depth m row j: eh_proj(concat(enorm(E[t_{j+m}]), hnorm(h^{m-1}_j))) -> block at position j + m.

  Written from the conventions' definitions: depth i runs module i (i < K), else i mod K ("cycle")
  or K - 1 ("last"); the embedding of position 0 is zeroed when mask_first_embedding; the head
  norm is skipped when head_norm is off; the next depth reads the head-normed hidden when
  pass_normed_hidden.
  """
  t = hid_TxD.shape[0]
  k = cfg.max_depth or cfg.num_modules
  h, out = hid_TxD, []
  for i in range(k):
    mod = i if i < cfg.num_modules else (i % cfg.num_modules if cfg.depth_reuse == "cycle" else cfg.num_modules - 1)
    p = f"mtp.{mod}."
    emb = sd["embed_tokens.weight"][tokens_U[i:i + t]].copy()
    if cfg.mask_first_embedding and i == 0:
      emb[0] = 0.0
    e = _rms(emb, sd[p + "enorm.weight"], cfg.rms_norm_eps)
    g = _rms(h, sd[p + "hnorm.weight"], cfg.rms_norm_eps)
    x = np.concatenate([e, g], -1) @ sd[p + "eh_proj.weight"].T
    h = _block(sd, p, x, np.arange(t) + i + 1, cfg)
    normed = _rms(h, sd[p + "shared_head.norm.weight"], cfg.rms_norm_eps) if cfg.head_norm else h
    out.append(normed @ sd["lm_head.weight"].T)
    h = normed if cfg.pass_normed_hidden else h
  return np.stack(out)


def _random_state_dict(cfg, seed):
  rng = np.random.default_rng(seed)
  sd = {k: np.asarray(v, np.float64) for k, v in mtp_jax.state_dict(mtp_jax.init_mtp(cfg, seed)).items()}
  for k in sd:
    if k.endswith("norm.weight"):  # non-trivial norm weights, so a swapped or missing norm shows
      sd[k] = 1.0 + 0.5 * rng.normal(size=sd[k].shape)
  return sd


@pytest.mark.parametrize("bias", [False, True])
def test_chain_matches_numpy_reference(bias):
  cfg = mtp_jax.MtpConfig(**{**CFG.__dict__, "attention_bias": bias})
  sd = _random_state_dict(cfg, 0)
  if bias:
    rng = np.random.default_rng(1)
    for name in [n for n in sd if n.endswith("_proj.bias")]:
      sd[name] = rng.normal(size=sd[name].shape)
  model = mtp_jax.load_state_dict(cfg, {k: v.astype(np.float32) for k, v in sd.items()})
  rng = np.random.default_rng(2)
  hid = rng.normal(size=(7, cfg.hidden_size))
  toks = rng.integers(0, cfg.vocab_size, 7 + cfg.num_modules - 1)
  got = np.asarray(mtp_jax.forward_chain(model, jnp.asarray(hid[None], jnp.float32), jnp.asarray(toks[None])))
  want = reference_chain(sd, hid, toks, cfg)
  np.testing.assert_allclose(got[:, 0], want, rtol=2e-4, atol=2e-4)


CONVENTIONS = {
    "residual": dict(pass_normed_hidden=False),
    "no_head_norm": dict(pass_normed_hidden=False, head_norm=False),
    "mask_first": dict(mask_first_embedding=True),
    "cycle": dict(max_depth=5, depth_reuse="cycle"),
    "last": dict(max_depth=4, depth_reuse="last"),
}


@pytest.mark.parametrize("name", CONVENTIONS)
def test_conventions_match_numpy_reference(name):
  cfg = mtp_jax.MtpConfig(**{**CFG.__dict__, **CONVENTIONS[name]})
  sd = _random_state_dict(cfg, 4)
  model = mtp_jax.load_state_dict(cfg, {k: v.astype(np.float32) for k, v in sd.items()})
  rng = np.random.default_rng(5)
  hid = rng.normal(size=(6, cfg.hidden_size))
  toks = rng.integers(0, cfg.vocab_size, 6 + cfg.num_depths - 1)
  got = np.asarray(mtp_jax.forward_chain(model, jnp.asarray(hid[None], jnp.float32), jnp.asarray(toks[None])))
  assert got.shape[0] == cfg.num_depths
  np.testing.assert_allclose(got[:, 0], reference_chain(sd, hid, toks, cfg), rtol=2e-4, atol=2e-4)


def test_module_of():
  cyc = mtp_jax.MtpConfig(**{**CFG.__dict__, "num_modules": 2, "max_depth": 5})
  last = mtp_jax.MtpConfig(**{**CFG.__dict__, "num_modules": 2, "max_depth": 5, "depth_reuse": "last"})
  assert [cyc.module_of(i) for i in range(5)] == [0, 1, 0, 1, 0]
  assert [last.module_of(i) for i in range(5)] == [0, 1, 1, 1, 1]
  with pytest.raises(ValueError, match=r"depth 5 is outside 0..num_depths-1=4"):
    cyc.module_of(5)


def test_normed_hidden_lever_changes_what_the_next_module_reads():
  sd = _random_state_dict(CFG, 3)
  f32 = {k: v.astype(np.float32) for k, v in sd.items()}
  normed = mtp_jax.load_state_dict(CFG, f32)
  raw = mtp_jax.load_state_dict(mtp_jax.MtpConfig(**{**CFG.__dict__, "pass_normed_hidden": False}), f32)
  hid = jnp.asarray(np.random.default_rng(0).normal(size=(1, 5, CFG.hidden_size)), jnp.float32)
  toks = jnp.arange(6)[None] % CFG.vocab_size
  a, b = mtp_jax.forward_chain(raw, hid, toks), mtp_jax.forward_chain(normed, hid, toks)
  np.testing.assert_array_equal(a[0], b[0])  # module 1 reads the target's hidden either way
  assert not np.allclose(a[1], b[1])


def test_state_dict_round_trip():
  model = mtp_jax.init_mtp(CFG, 5)
  sd = mtp_jax.state_dict(model)
  assert set(sd) == {f"mtp.{i}.{n}" for i in range(2) for n in (
      "enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
      "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
      "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
      "mlp.up_proj.weight", "mlp.down_proj.weight", "shared_head.norm.weight")} | {
          "embed_tokens.weight", "lm_head.weight"}
  assert sd["mtp.1.eh_proj.weight"].shape == (16, 32)
  loaded = mtp_jax.load_state_dict(CFG, {k: np.asarray(v) for k, v in sd.items()})
  for k, v in mtp_jax.state_dict(loaded).items():
    np.testing.assert_array_equal(v, sd[k])


def test_bad_tensors_are_named():
  sd = {k: np.asarray(v) for k, v in mtp_jax.state_dict(mtp_jax.init_mtp(CFG, 0)).items()}
  with pytest.raises(KeyError, match=r"mtp.1.hnorm.weight"):
    mtp_jax.load_state_dict(CFG, {k: v for k, v in sd.items() if k != "mtp.1.hnorm.weight"})
  with pytest.raises(ValueError, match=r"'mtp.0.eh_proj.weight' has shape \(16, 16\), expected \(16, 32\)"):
    mtp_jax.load_state_dict(CFG, {**sd, "mtp.0.eh_proj.weight": np.zeros((16, 16), np.float32)})
  with pytest.raises(KeyError, match=r"unexpected tensor\(s\) \['mtp.2.enorm.weight'\]"):
    mtp_jax.load_state_dict(CFG, {**sd, "mtp.2.enorm.weight": np.ones(16, np.float32)})
  nan = sd["lm_head.weight"].copy()
  nan[0, 0] = np.nan
  with pytest.raises(ValueError, match=r"'lm_head.weight' contains NaN"):
    mtp_jax.load_state_dict(CFG, {**sd, "lm_head.weight": nan})


def test_config_errors():
  with pytest.raises(ValueError, match=r"num_heads \(3\) must be a multiple of num_kv_heads \(2\)"):
    mtp_jax.MtpConfig(**{**CFG.__dict__, "num_heads": 3})
  with pytest.raises(ValueError, match=r"MtpConfig.num_modules must be an int in 1\.\.2147483647, got 0"):
    mtp_jax.MtpConfig(**{**CFG.__dict__, "num_modules": 0})
  with pytest.raises(ValueError, match=r"depth_reuse must be one of \('cycle', 'last'\), got 'first'"):
    mtp_jax.MtpConfig(**{**CFG.__dict__, "depth_reuse": "first"})
  with pytest.raises(ValueError, match=r"pass_normed_hidden needs head_norm"):
    mtp_jax.MtpConfig(**{**CFG.__dict__, "head_norm": False})
