"""Serving: the decode step at the bottom, `generate` and the continuous-batching `Engine` above it.

    options.py   StepSettings and its parts (Sampling, Relaxed, Paging), EngineConfig: typed, frozen
    state.py     LoopState and SlotSettings: what a step carries, each slot's request settings
    parts.py     the verifiers and the drafter a step picks once from its settings
    step.py      DecodeStep: drafter + verifier over the models' caches; prefill, step, run
    jit.py       the step's jitted entry points (the loop state donated), FlatModel (models flattened once)
    generate.py  generate: one fixed batch to its end
    policy.py    DraftPolicy: the verify width of num_drafts="auto", from measured times and acceptance
    requests.py  Request, QueueFull: the Engine's host-side records
    admission.py the Engine's queue, page reservations and chunked prefill
    metrics.py   Tally (the Engine's counters), latency samples, the Prometheus text format
    calibrate.py Engine.calibrate: the auto policy's step times measured before traffic
    engine.py    Engine: requests come and go, slots refilled as they free

`mtp-jax serve` (the `serve` extra; nothing here imports it): model.py, the served model and its chat
template; text.py, tokens to text; engine_thread.py, the one thread that calls the Engine; server.py, HTTP.
"""

from mtp_jax.serving.options import EngineConfig, Paging, Relaxed, Sampling, StepSettings
from mtp_jax.serving.state import LoopState, SlotSettings
from mtp_jax.serving.parts import Drafter, Verdict, pick_verifier
from mtp_jax.serving.step import DecodeStep
from mtp_jax.serving.jit import FlatModel, jit_prefill, jit_run, jit_step
from mtp_jax.serving import generate as generate_lib
from mtp_jax.serving.generate import GenerateOutput, generate
from mtp_jax.serving.policy import DraftPolicy
from mtp_jax.serving.requests import QueueFull, Request
from mtp_jax.serving.engine import Engine
from mtp_jax.serving.metrics import prometheus_text

__all__ = ["EngineConfig", "Paging", "Relaxed", "Sampling", "StepSettings", "DecodeStep", "Drafter", "LoopState",
           "SlotSettings", "Verdict", "FlatModel",
           "jit_prefill", "jit_run", "jit_step", "pick_verifier", "generate_lib", "GenerateOutput", "generate",
           "DraftPolicy", "Engine", "QueueFull", "Request", "prometheus_text"]
