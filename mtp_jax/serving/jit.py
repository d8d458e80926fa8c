"""The decode step's jitted entry points: `generate` and the Engine call these, never the step directly.

Each takes the `DecodeStep` and, for the model calls, the page read (`PageRead`: how a paged
call reads its pages, chosen per call) as static arguments (one compile per value and shapes)
and DONATES the loop state s, so its caches are updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from mtp_jax.blocks import PageRead
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.serving.state import LoopState, SlotSettings
from mtp_jax.serving.step import DecodeStep, defers


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class FlatModel:
  """A model (a TargetModel or MtpModel) as its arrays, flattened once on the host.

  A jitted call flattens its arguments on every call: a Flax module's graph costs about 0.4 ms
  (the large demo's target) and 0.2 ms (its proposer) each time, against 0.03 ms for its arrays
  as a tuple. Hot loops (the Engine's calls, `generate`'s steps) pass `FlatModel.of(model)`
  wherever an entry point takes a model; the entry point rebuilds the module while tracing. It
  holds the arrays the model had when made: a model updated in place afterwards needs a new one.
  """

  leaves: tuple
  treedef: Any  # the module's PyTreeDef: equal for equal modules, so engines over one model share compiles

  @classmethod
  def of(cls, model):
    """model as a FlatModel (None and a FlatModel are returned as they are)."""
    if model is None or isinstance(model, cls):
      return model
    leaves, treedef = jax.tree_util.tree_flatten(model)
    return cls(tuple(leaves), treedef)

  def tree_flatten(self):
    return self.leaves, self.treedef

  @classmethod
  def tree_unflatten(cls, treedef, leaves):
    return cls(tuple(leaves), treedef)

  def module(self):
    """The model, rebuilt from the arrays."""
    return jax.tree_util.tree_unflatten(self.treedef, self.leaves)


def _modules(*models):
  return [m.module() if isinstance(m, FlatModel) else m for m in models]


# The jitted entry points. Each takes its models as modules or `FlatModel`s and DONATES s (its caches
# are updated in place); `step` and `read` are static.
STATIC = ("step", "read")


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_prefill(step: DecodeStep, target, proposer, grammar, s: LoopState, prompts_BxT, lens_B, admit_B,
                gstart_B, max_new_B, slots: SlotSettings, idx_A=None, read: PageRead = WHOLE_POOL) -> LoopState:
  target, proposer = _modules(target, proposer)
  return step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, idx_A,
                      read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_prefill_part(step: DecodeStep, target, proposer, grammar, s: LoopState, slot_1, prompt_1xT, len_1,
                     next_1xT, read: PageRead = WHOLE_POOL, drafting_1=None) -> LoopState:
  target, proposer = _modules(target, proposer)
  return step.prefill_part(target, proposer, grammar, s, slot_1, prompt_1xT, len_1, next_1xT, read, drafting_1)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_step(step: DecodeStep, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
  target, proposer = _modules(target, proposer)
  return step(target, proposer, grammar, s, read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_run(step: DecodeStep, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
  target, proposer = _modules(target, proposer)
  return step.run(target, proposer, grammar, s, read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_run_for(step: DecodeStep, target, proposer, grammar, s: LoopState, max_steps, idx_A=None,
                read: PageRead = WHOLE_POOL) -> LoopState:
  target, proposer = _modules(target, proposer)
  return step.run_for(target, proposer, grammar, s, max_steps, idx_A, read)


def run_for_lean(step: DecodeStep, target, proposer, grammar, s: LoopState, max_steps, idx_A=None,
                 read: PageRead = WHOLE_POOL) -> LoopState:
  """`jit_run_for` with what the call passes through untouched held out of it (and the state's
  parts put back after): with idle modules (`StepSettings.modules_idle`) the proposer's weights
  (41 arrays on the large demo), its state and the waiting rows (`Deferred`); at a width that
  does not defer, with no row to catch up (`may_catch_up` False), or with the deeper modules
  idle (`deeper_idle`), the waiting-row buffers (the step then runs as one with
  deferred_rows=0). Measured on the trained large demo at 1 slot, an "auto" engine's call at
  k = K carrying them took 38.3 ms against 37.2 ms for a fixed k = K engine's."""
  st, held = step.settings, {}
  if st.modules_idle:
    proposer, held = None, dict(proposer=s.proposer, deferred=s.deferred)
  elif s.deferred is not None and (st.deeper_idle or not st.may_catch_up and
                                   not defers(st.verify_width, st.num_drafts)):
    held, step = dict(deferred=s.deferred), step.replace(deferred_rows=0)
  out = jit_run_for(step, target, proposer, grammar, s.set(**dict.fromkeys(held)), max_steps, idx_A, read)
  return out.set(**held)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_free(step: DecodeStep, s: LoopState, mask_B) -> LoopState:
  return step.free(s, mask_B)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_stop_drafting(step: DecodeStep, s: LoopState, mask_B) -> LoopState:
  return step.stop_drafting(s, mask_B)


@functools.partial(jax.jit, static_argnames=STATIC)
def jit_fits(step: DecodeStep, s: LoopState, read: PageRead = WHOLE_POOL) -> jax.Array:
  return step.fits(s, read)


@functools.partial(jax.jit, static_argnames=("step",))
def jit_pages_needed(step: DecodeStep, s: LoopState, num_new_B) -> jax.Array:
  return step.pages_needed(s, num_new_B)


@functools.partial(jax.jit, static_argnames=("step",))
def jit_span_needed(step: DecodeStep, s: LoopState, num_new_B, idx_A=None) -> jax.Array:
  return step.span_needed(s, num_new_B, idx_A)


@functools.partial(jax.jit, static_argnames=STATIC + ("batch_size",))
def jit_generate(step: DecodeStep, target, proposer, grammar, prompts_BxT, lens_B, gstart_B, slots: SlotSettings,
                 batch_size: int, read: PageRead = WHOLE_POOL) -> LoopState:
  """A whole batch in one program: a free state, the prefill of every slot (with its settings
  `slots`), then `run`."""
  target, proposer = _modules(target, proposer)
  s = step.init(target, proposer, grammar, batch_size)
  admit_B = jnp.ones((batch_size,), bool)
  max_new_B = jnp.full((batch_size,), step.settings.max_new_tokens, jnp.int32)
  s = step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, read=read)
  return step.run(target, proposer, grammar, s, read)
