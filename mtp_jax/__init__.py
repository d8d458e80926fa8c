"""mtp_jax: multi-token-prediction (MTP) speculative decoding in JAX / Flax NNX."""

from mtp_jax.config import BlockConfig, MtpConfig, TargetConfig
from mtp_jax.layers import KVCache
from mtp_jax.mtp import MtpModel, forward_chain, init_mtp, load_state_dict, state_dict
from mtp_jax.proposer import ProposerState, after_verify, checked, init_state, propose, reset_slots

__all__ = [
    "BlockConfig", "MtpConfig", "TargetConfig", "KVCache", "MtpModel", "forward_chain", "init_mtp",
    "load_state_dict", "state_dict", "ProposerState", "after_verify", "checked", "init_state",
    "propose", "reset_slots",
]
