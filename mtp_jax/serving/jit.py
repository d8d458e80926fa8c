"""The decode step's jitted entry points: `generate` and the Engine call these, never the step directly.

Each takes the `DecodeStep` and, for the model calls, the page read (`PageRead`: how a paged
call reads its pages, chosen per call) as static arguments (one compile per value and shapes)
and DONATES the loop state s, so its caches are updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mtp_jax.blocks import PageRead
from mtp_jax.blocks.pages import WHOLE_POOL
from mtp_jax.serving.state import LoopState, SlotSettings
from mtp_jax.serving.step import DecodeStep


# The jitted entry points. Each DONATES s (its caches are updated in place); `step` and `read` are static.
STATIC = ("step", "read")


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_prefill(step: DecodeStep, target, proposer, grammar, s: LoopState, prompts_BxT, lens_B, admit_B,
                gstart_B, max_new_B, slots: SlotSettings, idx_A=None, read: PageRead = WHOLE_POOL) -> LoopState:
  return step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, idx_A,
                      read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_prefill_part(step: DecodeStep, target, proposer, grammar, s: LoopState, slot_1, prompt_1xT, len_1,
                     next_1xT, read: PageRead = WHOLE_POOL, drafting_1=None) -> LoopState:
  return step.prefill_part(target, proposer, grammar, s, slot_1, prompt_1xT, len_1, next_1xT, read, drafting_1)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_step(step: DecodeStep, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
  return step(target, proposer, grammar, s, read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_run(step: DecodeStep, target, proposer, grammar, s: LoopState, read: PageRead = WHOLE_POOL) -> LoopState:
  return step.run(target, proposer, grammar, s, read)


@functools.partial(jax.jit, static_argnames=STATIC, donate_argnames=("s",))
def jit_run_for(step: DecodeStep, target, proposer, grammar, s: LoopState, max_steps, idx_A=None,
                read: PageRead = WHOLE_POOL) -> LoopState:
  return step.run_for(target, proposer, grammar, s, max_steps, idx_A, read)


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
  s = step.init(target, proposer, grammar, batch_size)
  admit_B = jnp.ones((batch_size,), bool)
  max_new_B = jnp.full((batch_size,), step.settings.max_new_tokens, jnp.int32)
  s = step.prefill(target, proposer, grammar, s, prompts_BxT, lens_B, admit_B, gstart_B, max_new_B, slots, read=read)
  return step.run(target, proposer, grammar, s, read)
