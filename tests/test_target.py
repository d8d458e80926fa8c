"""Target model: cached incremental forward equals the cache-free forward; state dict round trip."""

import jax.numpy as jnp
import numpy as np
import pytest

import mtp_jax
from mtp_jax import target as target_lib

TCFG = mtp_jax.TargetConfig(vocab_size=40, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, intermediate_size=64)
TARGET = mtp_jax.init_target(TCFG, seed=0)


def _full(tokens):
  t = len(tokens)
  rows = jnp.arange(t, dtype=jnp.int32)[None]
  logits, hid, _ = TARGET(jnp.asarray([tokens], jnp.int32), rows, jnp.ones((1, t), bool), None)
  return np.asarray(logits[0]), np.asarray(hid[0])


def test_cached_chunks_equal_full_forward_on_ragged_batch():
  rng = np.random.default_rng(0)
  seqs = [list(rng.integers(0, 40, n)) for n in (11, 5)]
  state = mtp_jax.init_target_state(TCFG, 2, 16)
  got_logits = [[], []]
  chunks = [(6, 3), (3, 1), (2, 1)]  # per call: how many tokens each sequence appends
  pos = [0, 0]
  for n0, n1 in chunks:
    toks = np.zeros((2, 6), np.int32)
    for b, n in enumerate((n0, n1)):
      toks[b, :n] = seqs[b][pos[b]:pos[b] + n]
    logits, _, state = mtp_jax.target_step(TARGET, state, toks, np.array([n0, n1], np.int32))
    for b, n in enumerate((n0, n1)):
      got_logits[b].append(np.asarray(logits[b, :n]))
      pos[b] += n
  np.testing.assert_array_equal(state.length, [11, 5])
  for b in range(2):
    want, _ = _full(seqs[b])
    np.testing.assert_allclose(np.concatenate(got_logits[b]), want, rtol=1e-4, atol=1e-4)


def test_normed_hidden_lever():
  cfg = mtp_jax.TargetConfig(**{**TCFG.__dict__, "output_normed_hidden": False})
  model = mtp_jax.load_target_state_dict(cfg, mtp_jax.target_state_dict(TARGET))
  toks = jnp.asarray([[1, 2, 3]], jnp.int32)
  rows, valid = jnp.arange(3)[None], jnp.ones((1, 3), bool)
  assert TARGET.cfg.output_normed_hidden  # the default: what engines and transformers feed module 1
  _, h_raw, _ = model(toks, rows, valid, None)
  _, h_normed, _ = TARGET(toks, rows, valid, None)
  np.testing.assert_allclose(h_normed, TARGET.norm(h_raw), rtol=1e-6)
  assert not np.allclose(h_raw, h_normed)


def test_state_dict_round_trip_and_errors():
  sd = {k: np.asarray(v) for k, v in mtp_jax.target_state_dict(TARGET).items()}
  assert "model.layers.1.self_attn.q_proj.weight" in sd and "lm_head.weight" in sd
  other = mtp_jax.load_target_state_dict(TCFG, sd)
  for k, v in mtp_jax.target_state_dict(other).items():
    np.testing.assert_array_equal(v, sd[k])
  missing = dict(sd)
  del missing["model.norm.weight"]
  with pytest.raises(KeyError, match="model.norm.weight"):
    mtp_jax.load_target_state_dict(TCFG, missing)
  bad = dict(sd, **{"model.layers.0.mlp.up_proj.weight": np.zeros((3, 3), np.float32)})
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight.*expected \(64, 32\)"):
    mtp_jax.load_target_state_dict(TCFG, bad)


MLA_TCFG = mtp_jax.TargetConfig(**{**TCFG.__dict__, "num_kv_heads": 4, "mla": mtp_jax.MlaConfig(
    kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12)})


@pytest.mark.parametrize("cfg", [TCFG, MLA_TCFG], ids=["gqa", "mla"])
def test_paged_target_equals_contiguous_through_trims(cfg):
  """Chunks, a trim of rejected rows (pages past them go back) and more chunks: paged logits equal
  contiguous ones (GQA pools read page by page, MLA latents through the table)."""
  model = mtp_jax.init_target(cfg, seed=2)
  rng = np.random.default_rng(3)
  flat = mtp_jax.init_target_state(cfg, 2, 32)
  paged = mtp_jax.init_target_state(cfg, 2, 32, page_size=4, num_pages=12)
  for n0, n1, keep in [(6, 3, None), (4, 4, (7, 5)), (3, 1, None), (2, 4, (11, 9)), (4, 4, None)]:
    toks = rng.integers(0, 40, size=(2, 6)).astype(np.int32)
    num_new = np.array([n0, n1], np.int32)
    want, want_h, flat = mtp_jax.target_step(model, flat, toks, num_new)
    got, got_h, paged = mtp_jax.target_step(model, paged, toks, num_new)
    for b, n in enumerate((n0, n1)):
      np.testing.assert_allclose(got[b, :n], want[b, :n], rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(got_h[b, :n], want_h[b, :n], rtol=1e-5, atol=1e-5)
    if keep is not None:
      flat, paged = (target_lib.trim_target(s, np.array(keep, np.int32)) for s in (flat, paged))
  assert not np.asarray(paged.out_of_pages).any()
  np.testing.assert_array_equal(np.asarray(paged.pages.used), -(-np.asarray(paged.length) // 4))
