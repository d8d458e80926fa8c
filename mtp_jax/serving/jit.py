"""The decode step's jitted entry points: `generate` and the Engine call these, never the step directly.

Each takes the `DecodeStep` as a static argument (one compile per step value and shapes) and
DONATES the loop state s, so its caches are updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax.serving.state import LoopState, SlotSettings
from mtp_jax.serving.step import DecodeStep


# The jitted entry points. Each DONATES s (its caches are updated in place); `step` is static.

@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_prefill(step: DecodeStep, target, proposer, grammar, s: LoopState, prompts_BxT, lens_B, admit_B,
                gstart_B, max_new_B, slots: SlotSettings, idx_A=None) -> LoopState:
  return step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, idx_A)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_prefill_part(step: DecodeStep, target, proposer, grammar, s: LoopState, slot_1, prompt_1xT, len_1,
                     next_1xT) -> LoopState:
  return step.prefill_part(target, proposer, grammar, s, slot_1, prompt_1xT, len_1, next_1xT)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_step(step: DecodeStep, target, proposer, grammar, s: LoopState) -> LoopState:
  return step(target, proposer, grammar, s)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_run(step: DecodeStep, target, proposer, grammar, s: LoopState) -> LoopState:
  return step.run(target, proposer, grammar, s)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_run_for(step: DecodeStep, target, proposer, grammar, s: LoopState, max_steps, idx_A=None) -> LoopState:
  return step.run_for(target, proposer, grammar, s, max_steps, idx_A)


@functools.partial(jax.jit, static_argnames=("step",), donate_argnames=("s",))
def jit_free(step: DecodeStep, s: LoopState, mask_B) -> LoopState:
  return step.free(s, mask_B)


@functools.partial(jax.jit, static_argnames=("step",))
def jit_fits(step: DecodeStep, s: LoopState) -> jax.Array:
  return step.fits(s)


@functools.partial(jax.jit, static_argnames=("step",))
def jit_pages_needed(step: DecodeStep, s: LoopState, num_new_B) -> jax.Array:
  return step.pages_needed(s, num_new_B)


@functools.partial(jax.jit, static_argnames=("step",))
def jit_span_needed(step: DecodeStep, s: LoopState, num_new_B, idx_A=None) -> jax.Array:
  return step.span_needed(s, num_new_B, idx_A)


@functools.partial(jax.jit, static_argnames=("step", "batch_size"))
def jit_generate(step: DecodeStep, target, proposer, grammar, prompts_BxT, lens_B, gstart_B, slots: SlotSettings,
                 batch_size: int) -> LoopState:
  """A whole batch in one program: a free state, the prefill of every slot (with its settings
  `slots`), then `run`."""
  s = step.init(target, proposer, grammar, batch_size)
  admit_B = jnp.ones((batch_size,), bool)
  max_new_B = jnp.full((batch_size,), step.settings.max_new_tokens, jnp.int32)
  s = step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots)
  return step.run(target, proposer, grammar, s)
