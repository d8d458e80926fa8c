"""Training: the loss falls, checkpoints round-trip exactly, bad files fail by name, resume, MiMo."""

import dataclasses
import json
import os

import jax
import numpy as np
import pytest

import mtp_jax
from mtp_jax import checkpoint, checkpoint_dir, data, train

TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64, num_modules=2)
CFG = train.TrainConfig(steps=4, warmup_steps=1, batch_size=4, seq_len=32, learning_rate=1e-2, eval_every=2,
                        eval_batches=1, save_every=2)


def _flat(model):
  return {k: np.asarray(v) for k, v in mtp_jax.state_dict(model).items()}


def _flat_target(model):
  return {k: np.asarray(v) for k, v in mtp_jax.target_state_dict(model).items()}


def _heldout_batch():
  return next(data.batches(data.load_corpus("heldout"), batch_size=8, seq_len=32, seed=5))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A tiny joint run stopped at step 2 of 4 and the same run uninterrupted."""
  tcfg, mcfg = train.model_configs(**TINY)
  stopped, full = tmp_path_factory.mktemp("stopped"), tmp_path_factory.mktemp("full")
  half = train.train(CFG, tcfg, mcfg, out_dir=stopped, stop_at=2, progress=False)
  whole = train.train(CFG, tcfg, mcfg, out_dir=full, progress=False)
  return half, stopped, whole, full


def test_training_lowers_every_depths_loss(trained):
  _, _, whole, _ = trained
  tcfg, mcfg = train.model_configs(**TINY)
  batch = _heldout_batch()
  losses = jax.jit(train.losses)
  # The run's initial weights: train() seeds the target with cfg.seed and the modules with cfg.seed + 1.
  before, _ = losses(train.Joint(mtp_jax.init_target(tcfg, 0), mtp_jax.init_mtp(mcfg, 1)), batch)
  after, _ = losses(train.Joint(whole.target, whole.mtp), batch)
  assert whole.step == 4 and [h["step"] for h in whole.history] == [2, 4]
  assert np.all(np.asarray(after) < np.asarray(before) - 0.2), (before, after)


def test_losses_align_labels_and_mask_rows_past_the_window():
  tcfg, mcfg = train.model_configs(**TINY)
  model = train.Joint(mtp_jax.init_target(tcfg, 0), mtp_jax.init_mtp(mcfg, 1))
  long_BxL = next(data.batches(data.load_corpus("heldout"), batch_size=2, seq_len=40, seed=6))
  s, k = 16, mcfg.num_modules
  loss, _ = train.losses(model, long_BxL[:, :s + 1])
  # Reference: the chain over the same rows, fed real tokens past the window instead of padding
  # (causal rows cannot see them); module m's row j scored on t_{j+m+1} for j + m + 1 <= s only.
  rows = np.broadcast_to(np.arange(s), (2, s))
  logits, hid, _ = model.target(long_BxL[:, :s], rows, np.ones((2, s), bool), None)
  chain = mtp_jax.forward_chain(model.mtp, hid, long_BxL[:, 1:s + k])
  for m in range(k + 1):
    logp = jax.nn.log_softmax(np.asarray(logits if m == 0 else chain[m - 1]), axis=-1)
    n = s - m
    want = -np.mean(np.take_along_axis(np.asarray(logp)[:, :n], long_BxL[:, m + 1:m + 1 + n, None], axis=-1))
    np.testing.assert_allclose(loss[m], want, rtol=1e-5, err_msg=f"depth {m}")


def test_checkpoint_round_trip_gives_identical_drafts(trained, tmp_path):
  _, _, whole, full = trained
  target, mtp = train.load_checkpoint(full)
  assert _flat_target(target).keys() == _flat_target(whole.target).keys()
  for name, value in _flat_target(whole.target).items():
    np.testing.assert_array_equal(_flat_target(target)[name], value, err_msg=name)
  for name, value in _flat(whole.mtp).items():
    np.testing.assert_array_equal(_flat(mtp)[name], value, err_msg=name)
  prompts = data.heldout_prompts(2, prompt_len=20, seed=0)
  a = mtp_jax.generate(whole.target, whole.mtp, prompts, 12, num_drafts=2)
  b = mtp_jax.generate(target, mtp, prompts, 12, num_drafts=2)
  assert a.tokens == b.tokens and a.stats == b.stats


def test_resume_continues_from_the_saved_step(trained):
  half, stopped, whole, _ = trained
  assert half.step == 2 and train.read_config(stopped)["step"] == 2
  with checkpoint.CheckpointReader(os.path.join(stopped, checkpoint_dir.OPTIMIZER_FILE)) as reader:
    counts = [np.asarray(reader[n]) for n in reader.keys() if n.endswith(".count")]
  assert counts and all(np.ravel(c).tolist() == [2] for c in counts)
  resumed = train.train(CFG, out_dir=stopped, resume_from=stopped, progress=False)
  assert resumed.step == 4 and train.read_config(stopped)["step"] == 4
  assert [h["step"] for h in resumed.history] == [4]
  # Same batches, same optimizer state: the resumed run ends where the uninterrupted one did.
  for name, value in _flat(whole.mtp).items():
    np.testing.assert_allclose(_flat(resumed.mtp)[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  for name, value in _flat_target(whole.target).items():
    np.testing.assert_allclose(_flat_target(resumed.target)[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def _copy_checkpoint(src, dst):
  os.makedirs(dst)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return dst


def test_bad_checkpoint_errors_name_the_tensor(trained, tmp_path):
  _, _, _, full = trained
  mtp_file = checkpoint_dir.MTP_FILE

  bad = _copy_checkpoint(full, tmp_path / "shape")
  tensors = checkpoint.load_tensors(os.path.join(bad, mtp_file))
  tensors["mtp.1.eh_proj.weight"] = tensors["mtp.1.eh_proj.weight"][:, :10]
  checkpoint.save_tensors(os.path.join(bad, mtp_file), tensors)
  with pytest.raises(ValueError, match=r"'mtp\.1\.eh_proj\.weight' has shape \(32, 10\), expected \(32, 64\)"):
    train.load_checkpoint(bad)

  bad = _copy_checkpoint(full, tmp_path / "nan")
  tensors = checkpoint.load_tensors(os.path.join(bad, checkpoint_dir.TARGET_FILE))
  tensors["model.norm.weight"] = np.full_like(tensors["model.norm.weight"], np.nan)
  checkpoint.save_tensors(os.path.join(bad, checkpoint_dir.TARGET_FILE), tensors)
  with pytest.raises(ValueError, match=r"'model\.norm\.weight' contains NaN"):
    train.load_checkpoint(bad)

  bad = _copy_checkpoint(full, tmp_path / "missing")
  tensors = checkpoint.load_tensors(os.path.join(bad, mtp_file))
  del tensors["mtp.0.hnorm.weight"]
  checkpoint.save_tensors(os.path.join(bad, mtp_file), tensors)
  with pytest.raises(KeyError, match=r"mtp\.0\.hnorm\.weight"):
    train.load_checkpoint(bad)

  bad = _copy_checkpoint(full, tmp_path / "truncated")
  path = os.path.join(bad, mtp_file)
  with open(path, "rb") as f:
    head = f.read(os.path.getsize(path) // 2)
  with open(path, "wb") as f:
    f.write(head)
  with pytest.raises(ValueError, match="mtp.safetensors"):
    train.load_checkpoint(bad)

  # A config that disagrees with the tensors: the first tensor of the wrong size is named.
  bad = _copy_checkpoint(full, tmp_path / "config")
  with open(os.path.join(bad, checkpoint_dir.CONFIG_FILE)) as f:
    meta = json.load(f)
  meta["target"]["intermediate_size"] = 48
  with open(os.path.join(bad, checkpoint_dir.CONFIG_FILE), "w") as f:
    json.dump(meta, f)
  with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.\w+_proj\.weight' has shape"):
    train.load_checkpoint(bad)


def test_resume_rejects_an_optimizer_state_of_another_model(trained, tmp_path):
  _, _, _, full = trained
  bad = _copy_checkpoint(full, tmp_path / "opt")
  path = os.path.join(bad, checkpoint_dir.OPTIMIZER_FILE)
  tensors = checkpoint.load_tensors(path)
  name = next(n for n in tensors if tensors[n].ndim == 2)
  tensors[name] = tensors[name][:1]
  checkpoint.save_tensors(path, tensors)
  with pytest.raises(ValueError, match="tensor .* has shape"):
    train.train(CFG, resume_from=bad, progress=False)


def test_mimo_recipe_trains_only_the_deeper_modules(trained, tmp_path):
  _, _, _, full = trained
  base_target, base_mtp = train.load_checkpoint(full)
  cfg = train.TrainConfig(recipe="mimo", steps=3, warmup_steps=1, batch_size=4, seq_len=32, eval_every=3,
                          eval_batches=1, save_every=3)
  mcfg = dataclasses.replace(base_mtp.cfg, num_modules=3)
  result = train.train(cfg, mtp_cfg=mcfg, init_from=full, out_dir=tmp_path / "mimo", progress=False)
  new = _flat(result.mtp)
  old = _flat(base_mtp)
  for name, value in _flat_target(base_target).items():
    np.testing.assert_array_equal(_flat_target(result.target)[name], value, err_msg=name)
  for name in old:
    if not name.startswith("mtp.1."):
      np.testing.assert_array_equal(new[name], old[name], err_msg=name)
  # Modules 2 and 3 started as copies of module 1 and moved.
  for i in (1, 2):
    assert not np.array_equal(new[f"mtp.{i}.eh_proj.weight"], old["mtp.0.eh_proj.weight"])
  assert train.load_checkpoint(tmp_path / "mimo")[1].cfg.num_modules == 3


def test_grow_modules_copies_module_one():
  _, mcfg = train.model_configs(**TINY)
  grown = train.grow_modules(mtp_jax.init_mtp(mcfg, 1), dataclasses.replace(mcfg, num_modules=4))
  sd = _flat(grown)
  for i in (1, 2, 3):
    np.testing.assert_array_equal(sd[f"mtp.{i}.mlp.up_proj.weight"], sd["mtp.0.mlp.up_proj.weight"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(recipe="mtp"), "recipe must be one of"),
    (dict(steps=0), r"TrainConfig\.steps must be an int in 1\.\.2147483647, got 0"),
    (dict(steps=10, warmup_steps=10), r"TrainConfig\.warmup_steps must be an int in 0\.\.9, got 10"),
    (dict(learning_rate=0.0), "learning_rate"),
])
def test_train_config_rejects_bad_values(kwargs, match):
  with pytest.raises(ValueError, match=match):
    train.TrainConfig(**kwargs)


def test_train_argument_errors(trained):
  _, _, _, full = trained
  with pytest.raises(ValueError, match="recipe 'mimo' needs init_from"):
    train.train(train.TrainConfig(recipe="mimo"), progress=False)
  with pytest.raises(ValueError, match="not both"):
    train.train(CFG, resume_from=full, init_from=full, progress=False)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    train.load_checkpoint(os.path.dirname(full))
  with pytest.raises(ValueError, match=r"stop_at must be an int in 1\.\.4, got 5"):
    train.train(CFG, stop_at=5, progress=False)
