"""Training a small target and its K MTP modules on the byte corpus; checkpoints; resume.

Two recipes (docs/training.md):

- "joint" (DeepSeek-V3): target and modules trained together, loss = L_main + lambda / K * sum_m L_m.
  The MTP loss reaches the target through its hiddens, as in DeepSeek-V3 (stop_gradient=False).
- "mimo" (MiMo): start from a checkpoint, freeze the target and module 1, copy module 1 into the
  deeper modules and train only those, loss = mean over m >= 2 of L_m.

The MTP modules share the target's embedding and LM head (one set of weights while training), so a
checkpoint's MTP file holds copies of both under its own canonical names.

Checkpoints are directories (`mtp_jax.checkpoint_dir`: their files, atomic saves, loading).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from mtp_jax import data, validate
from mtp_jax.checkpoint_dir import (OPTIMIZER_FILE, check_out_dir, check_step, load_checkpoint, load_optimizer_state,
                                    read_config, save_checkpoint)
from mtp_jax.config import MtpConfig, TargetConfig, TrainConfig
from mtp_jax.mtp import MtpModel, forward_chain, init_mtp, load_state_dict, state_dict
from mtp_jax.target import TargetModel, init_target

EVAL_SEED = 1234  # held-out windows are the same for every run, so evaluations compare


def model_configs(*, hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                  intermediate_size: int = 384, num_modules: int = 3, output_normed_hidden: bool = False,
                  pass_normed_hidden: bool = False) -> tuple[TargetConfig, MtpConfig]:
  """A target and an MTP config of matching width; the defaults are the small demo models' sizes.

  output_normed_hidden / pass_normed_hidden: the chain's conventions (see TargetConfig, MtpConfig).
  Sizes are ints >= 1 (the configs check the rest, e.g. num_heads a multiple of num_kv_heads).
  """
  for name, value in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads),
                      ("num_kv_heads", num_kv_heads), ("intermediate_size", intermediate_size),
                      ("num_modules", num_modules)):
    validate.positive_int(name, value)
  if hidden_size % num_heads:
    raise validate.InvalidValue("hidden_size", f"hidden_size ({hidden_size}) must be a multiple of num_heads "
                                               f"({num_heads})")
  block = dict(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
               head_dim=hidden_size // num_heads, intermediate_size=intermediate_size,
               vocab_size=data.VOCAB_SIZE)
  return (TargetConfig(num_layers=num_layers, output_normed_hidden=output_normed_hidden, **block),
          MtpConfig(num_modules=num_modules, pass_normed_hidden=pass_normed_hidden, **block))


# Named recipes that reproduce the shipped demo models: (model_configs kwargs, TrainConfig kwargs).
# "demo-small": mtp_jax/assets/small (0.85M-parameter target, compute-bound on a CPU).
# "demo-large": mtp_jax/assets/large (12.8M+ parameters, about 64 MB in float32: a target whose
# weights do not fit in a CPU's caches, so a decode step is bound by memory bandwidth, as real
# MTP targets are). Its chain follows transformers' MtpModel: the target hands module 1 its
# post-final-norm hidden and each module hands the next its post-norm hidden.
PRESETS = {
    "demo-small": (dict(), dict(steps=1500)),
    "demo-large": (dict(hidden_size=384, num_layers=10, num_heads=6, num_kv_heads=2, intermediate_size=1024,
                        num_modules=3, output_normed_hidden=True, pass_normed_hidden=True),
                   dict(steps=800, learning_rate=2e-3, warmup_steps=100)),
}


class Joint(nnx.Module):
  """The target and the MTP chain, the chain's embedding and LM head tied to the target's."""

  def __init__(self, target: TargetModel, mtp: MtpModel):
    if (target.cfg.hidden_size, target.cfg.vocab_size) != (mtp.cfg.hidden_size, mtp.cfg.vocab_size):
      raise ValueError(f"target (D={target.cfg.hidden_size}, V={target.cfg.vocab_size}) and MTP "
                       f"(D={mtp.cfg.hidden_size}, V={mtp.cfg.vocab_size}) must share hidden and vocab sizes")
    mtp.embed_tokens, mtp.lm_head = target.embed_tokens, target.lm_head
    self.target, self.mtp = target, mtp


def losses(model: Joint, batch_BxS1: jax.Array, stop_gradient: bool = False):
  """Per-depth cross-entropy and top-1 accuracy on windows int32[B, S + 1].

  Depth 0 is the target (row j predicts t_{j+1}); depth m the m-th MTP module (row j predicts
  t_{j+m+1}; rows whose label lies past the window are masked out).
  Returns (loss float32[K + 1], accuracy float32[K + 1]).
  """
  b, s1 = batch_BxS1.shape
  s, k = s1 - 1, model.mtp.cfg.num_modules
  rows_BxS = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
  logits_BxSxV, hid_BxSxD, _ = model.target(batch_BxS1[:, :s], rows_BxS, jnp.ones((b, s), bool), None)
  if stop_gradient:
    hid_BxSxD = jax.lax.stop_gradient(hid_BxSxD)
  # Rows near the window's end read padding tokens; their labels are masked, and causal
  # attention keeps them from reaching the rows before.
  padded_BxU = jnp.pad(batch_BxS1, ((0, 0), (0, k)))
  mtp_logits_KxBxSxV = forward_chain(model.mtp, hid_BxSxD, padded_BxU[:, 1:s + k])
  loss, acc = [], []
  for m in range(k + 1):
    logits = logits_BxSxV if m == 0 else mtp_logits_KxBxSxV[m - 1]
    labels_BxS = padded_BxU[:, m + 1:m + 1 + s]
    mask_BxS = jnp.broadcast_to(jnp.arange(s) + m + 1 <= s, (b, s)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels_BxS)
    hit = (jnp.argmax(logits, axis=-1) == labels_BxS).astype(jnp.float32)
    loss.append(jnp.sum(ce * mask_BxS) / jnp.sum(mask_BxS))
    acc.append(jnp.sum(hit * mask_BxS) / jnp.sum(mask_BxS))
  return jnp.stack(loss), jnp.stack(acc)


def objective(loss_K1: jax.Array, cfg: TrainConfig) -> jax.Array:
  """The scalar minimised: joint L_0 + lambda / K * sum L_m; mimo the mean of L_m for m >= 2."""
  k = loss_K1.shape[0] - 1
  if cfg.recipe == "joint":
    return loss_K1[0] + cfg.mtp_weight / k * jnp.sum(loss_K1[1:])
  return jnp.mean(loss_K1[2:])


def _trainable(recipe: str):
  if recipe == "joint":
    return nnx.Param
  # MiMo: only MTP modules 2..K (0-based layer index >= 1) learn.
  return lambda path, x: (isinstance(x, nnx.Param) and tuple(map(str, path[:2])) == ("mtp", "layers")
                          and str(path[2]) != "0")


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """AdamW (decay on matrices only) after global-norm clipping, warmup + cosine schedule."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, cfg.learning_rate, cfg.warmup_steps, cfg.steps, cfg.learning_rate * cfg.final_lr_fraction)
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  return optax.chain(optax.clip_by_global_norm(cfg.grad_clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask))


def _loss(params, rest, graphdef, cfg: TrainConfig, batch):
  loss_K1, acc_K1 = losses(nnx.merge(graphdef, params, rest), batch, cfg.stop_gradient)
  return objective(loss_K1, cfg), (loss_K1, acc_K1)


# Module-level jits keyed on (graphdef, cfg): runs of the same model and settings share one compile.
@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def _train_step(graphdef, cfg: TrainConfig, params, rest, opt_state, batch):
  (_, (loss_K1, _)), grads = jax.value_and_grad(_loss, has_aux=True)(params, rest, graphdef, cfg, batch)
  updates, opt_state = optimizer(cfg).update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss_K1


@functools.partial(jax.jit, static_argnames=("graphdef", "cfg"))
def _eval_step(graphdef, cfg: TrainConfig, params, rest, batch):
  return _loss(params, rest, graphdef, cfg, batch)[1]


@dataclasses.dataclass
class TrainResult:
  """The trained models (MTP embedding / head tied to the target's), the final step, and
  history: one dict per evaluation with step, train loss and held-out loss / accuracy per depth."""

  target: TargetModel
  mtp: MtpModel
  step: int
  history: list[dict]


def _batches_from(cfg: TrainConfig, start_step: int) -> Iterator[np.ndarray]:
  # Skipping the consumed batches makes a resumed run see what an uninterrupted one would.
  it = data.batches(data.load_corpus("train"), batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
  for _ in range(start_step):
    next(it)
  return it


def _eval_batches(cfg: TrainConfig) -> list[np.ndarray]:
  it = data.batches(data.load_corpus("heldout"), batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                    seed=EVAL_SEED)
  return [next(it) for _ in range(cfg.eval_batches)]


def _initial_models(cfg, target_cfg, mtp_cfg, resume_from, init_from):
  """(target, mtp, opt-state path or None, start step) for a fresh, resumed or MiMo-initialised run."""
  if resume_from is not None and init_from is not None:
    raise ValueError("pass resume_from or init_from, not both")
  if resume_from is not None:
    target, mtp = load_checkpoint(resume_from)
    for given, loaded in ((target_cfg, target.cfg), (mtp_cfg, mtp.cfg)):
      if given is not None and given != loaded:
        raise ValueError(f"resume_from={resume_from} holds {loaded}, not the requested {given}")
    step = read_config(resume_from)["step"]
    opt_path = os.path.join(os.fspath(resume_from), OPTIMIZER_FILE)
    if not os.path.isfile(opt_path):
      raise FileNotFoundError(f"resume_from={resume_from} has no {OPTIMIZER_FILE}; it cannot be resumed")
    check_step(opt_path, step)
    return target, mtp, opt_path, step
  if cfg.recipe == "mimo":
    if init_from is None:
      raise ValueError("recipe 'mimo' needs init_from, a checkpoint with a trained target and module 1")
    target, mtp1 = load_checkpoint(init_from)
    mtp_cfg = mtp_cfg or mtp1.cfg
    if mtp_cfg.num_modules < 2:
      raise ValueError(f"recipe 'mimo' trains modules 2..K; num_modules must be >= 2, got {mtp_cfg.num_modules}")
    return target, grow_modules(mtp1, mtp_cfg), None, 0
  if init_from is not None:
    raise ValueError("init_from is for recipe 'mimo'; use resume_from to continue a joint run")
  if target_cfg is None or mtp_cfg is None:
    default_target, default_mtp = model_configs()
    target_cfg, mtp_cfg = target_cfg or default_target, mtp_cfg or default_mtp
  return init_target(target_cfg, cfg.seed), init_mtp(mtp_cfg, cfg.seed + 1), None, 0


def grow_modules(mtp: MtpModel, cfg: MtpConfig) -> MtpModel:
  """An MTP model with cfg.num_modules modules, every one a copy of `mtp`'s module 1 (MiMo's init)."""
  if dataclasses.replace(cfg, num_modules=mtp.cfg.num_modules) != mtp.cfg:
    raise ValueError(f"the checkpoint's MTP config {mtp.cfg} differs from {cfg} in more than num_modules")
  tensors = {n: v for n, v in state_dict(mtp).items() if not n.startswith("mtp.")}
  first = {n[len("mtp.0."):]: v for n, v in state_dict(mtp).items() if n.startswith("mtp.0.")}
  for i in range(cfg.num_modules):
    tensors.update({f"mtp.{i}.{n}": v for n, v in first.items()})
  return load_state_dict(cfg, tensors)


def train(cfg: TrainConfig, target_cfg: TargetConfig | None = None, mtp_cfg: MtpConfig | None = None, *,
          out_dir=None, resume_from=None, init_from=None, stop_at: int | None = None,
          progress: bool = True, overwrite: bool = False) -> TrainResult:
  """Trains on `data.load_corpus("train")` windows int32[batch_size, seq_len + 1]; evaluates on held-out.

  target_cfg / mtp_cfg: model sizes (default `model_configs()`; taken from the checkpoint when
    resuming or with the MiMo recipe, where mtp_cfg may only change num_modules).
  out_dir: where checkpoints go, every save_every steps and at the end (None: not saved); checked
    writable before training starts. An existing non-empty directory other than resume_from is
    refused unless overwrite is set.
  resume_from: a checkpoint directory with optimizer.safetensors; training continues at its step.
  init_from: the MiMo recipe's starting checkpoint.
  stop_at: end (and save) after this step, as if interrupted; `resume_from` continues the run.
  progress: show a tqdm bar (loss, tokens/s) and print each evaluation.
  """
  validate.instance("cfg", cfg, TrainConfig)
  stop = cfg.steps if stop_at is None else validate.integer("stop_at", stop_at, 1, cfg.steps)
  progress = validate.flag("progress", progress)
  if out_dir is not None:
    out_dir = check_out_dir(out_dir, resume_from=resume_from, overwrite=overwrite)
  target, mtp, opt_path, start = _initial_models(cfg, target_cfg, mtp_cfg, resume_from, init_from)
  model = Joint(target, mtp)
  graphdef, params, rest = nnx.split(model, _trainable(cfg.recipe), ...)
  opt_state = optimizer(cfg).init(params)
  if opt_path is not None:
    opt_state = load_optimizer_state(opt_path, opt_state)

  def evaluate(step, train_loss):
    loss, acc = zip(*(_eval_step(graphdef, cfg, params, rest, b) for b in eval_batches))
    record = dict(step=step, train_loss=train_loss, loss=np.mean(loss, 0).tolist(), accuracy=np.mean(acc, 0).tolist())
    if progress:
      tqdm.write(f"step {step}: held-out loss " + " ".join(f"{x:.3f}" for x in record["loss"])
                 + " | top-1 accuracy " + " ".join(f"{x:.3f}" for x in record["accuracy"]) + " (depth 0..K)")
    return record

  def save(step):
    nnx.update(model, params, rest)
    save_checkpoint(out_dir, model.target, model.mtp, step=step, train_config=cfg, opt_state=opt_state)

  train_iter, eval_batches = _batches_from(cfg, start), _eval_batches(cfg)
  history, tokens_per_step = [], cfg.batch_size * cfg.seq_len
  bar = tqdm(range(start, stop), initial=start, total=cfg.steps, disable=not progress, unit="step")
  t0 = None
  for step in bar:
    params, opt_state, loss_K1 = _train_step(graphdef, cfg, params, rest, opt_state, next(train_iter))
    done = step + 1
    if t0 is None:  # tokens/s counts from the end of the first (compiling) step
      jax.block_until_ready(loss_K1)
      t0 = time.perf_counter()
    elif done % 10 == 0 or done == stop:
      loss_K1 = np.asarray(loss_K1)  # waits for the device: the timing is real
      rate = tokens_per_step * (done - start - 1) / (time.perf_counter() - t0)
      bar.set_postfix(loss=f"{loss_K1[0]:.3f}", mtp=" ".join(f"{x:.2f}" for x in loss_K1[1:]), tok_s=f"{rate:.0f}")
    if done % cfg.eval_every == 0 or done == stop:
      history.append(evaluate(done, np.asarray(loss_K1).tolist()))
    if out_dir is not None and (done % cfg.save_every == 0 or done == stop):
      save(done)
  bar.close()
  nnx.update(model, params, rest)
  return TrainResult(model.target, model.mtp, max(start, stop), history)
