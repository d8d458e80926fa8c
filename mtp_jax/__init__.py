"""mtp_jax: multi-token-prediction (MTP) speculative decoding in JAX / Flax NNX."""

import importlib

from mtp_jax.blocks import KVCache, MlaCache
from mtp_jax.config import BlockConfig, MlaConfig, MtpConfig, RopeScaling, TargetConfig
from mtp_jax.mtp import MtpModel, forward_chain, init_mtp, load_state_dict, state_dict
from mtp_jax.proposer import ProposerState, after_verify, checked, init_state, propose, reset_slots
from mtp_jax.target import (TargetModel, TargetState, init_target, init_target_state, load_target_state_dict,
                            target_state_dict, target_step)
from mtp_jax.tree import DraftTree, TreeSpec
from mtp_jax.verify import (verify_greedy, verify_gumbel, verify_relaxed, verify_rows, verify_sampling,
                            verify_tree_greedy, verify_tree_gumbel, verify_tree_relaxed, verify_tree_rows,
                            verify_tree_sampling)
from mtp_jax.serving import Engine, GenerateOutput, generate
from mtp_jax import blocks, checkpoint, data, families, grammar, layouts, serving, sharding  # namespaces
from mtp_jax.demo_models import load_demo
from mtp_jax.pretrained import from_pretrained, load_mtp, load_target, load_tokenizer
from mtp_jax.assistant import Gemma4Assistant, Gemma4AssistantConfig, assistant_propose
from mtp_jax.pretrained_assistant import load_assistant

__all__ = [
    "BlockConfig", "MlaConfig", "MtpConfig", "RopeScaling", "TargetConfig", "KVCache", "MlaCache", "MtpModel",
    "forward_chain", "init_mtp", "load_state_dict", "state_dict", "ProposerState", "after_verify", "checked",
    "init_state", "propose", "reset_slots", "TargetModel", "TargetState", "init_target", "init_target_state",
    "load_target_state_dict", "target_state_dict", "target_step", "verify_greedy", "verify_relaxed",
    "verify_sampling", "verify_tree_greedy", "verify_tree_relaxed", "verify_tree_sampling", "verify_gumbel",
    "verify_rows", "verify_tree_gumbel", "verify_tree_rows", "TreeSpec", "DraftTree",
    "GenerateOutput", "generate", "Engine", "blocks", "checkpoint", "data", "families", "grammar", "layouts",
    "serving", "sharding", "train", "load_demo", "from_pretrained", "load_target", "load_mtp", "load_tokenizer",
    "Gemma4Assistant", "Gemma4AssistantConfig", "assistant_propose", "load_assistant",
]

# Imported on first use (PEP 562), so `import mtp_jax` loads neither train (its optimizer setup and tqdm)
# nor the demo's runs.
_LAZY = ("demo", "train")


def __getattr__(name: str):
  if name in _LAZY:
    return importlib.import_module(f"mtp_jax.{name}")
  raise AttributeError(f"module 'mtp_jax' has no attribute {name!r}")
