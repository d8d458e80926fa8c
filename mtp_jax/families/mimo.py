"""Xiaomi MiMo-7B: a Qwen2 target (q, k, v biases) and MTP modules at model.mtp_layers.{i}.

input_proj reads concat(hidden, embedding), the reverse of the canonical order, so its column
halves are swapped on load. Chain: vLLM / SGLang mimo_mtp.py.
"""

import numpy as np

from mtp_jax.families.base import Blocks, Conventions, Family, Layout, Sources

_NAMES = {"enorm.weight": "token_layernorm.weight", "hnorm.weight": "hidden_layernorm.weight",
          "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_layernorm.weight"}


def swap_halves(w: np.ndarray) -> np.ndarray:
  """input_proj [D, 2D] over concat(hidden, embedding) -> eh_proj over concat(embedding, hidden)."""
  half = w.shape[1] // 2
  return np.concatenate([w[:, half:], w[:, :half]], axis=1)


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"model.mtp_layers.{i}." for i in range(cfg.num_modules))
  # MiMo's q, k, v biases sit where the canonical ones do: no renaming needed.
  return Sources(prefixes, lambda i, s: (prefixes[i] + _NAMES.get(s, s),
                                         swap_halves if s == "eh_proj.weight" else None))


LAYOUT = Layout("mimo", r"model\.mtp_layers\.\d+\.input_proj\.weight", _sources)

FAMILY = Family(
    name="mimo", title="MiMo-7B", model_types=("mimo",), layout="mimo",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=True),
    # Qwen2-family configs have no attention_bias key: their q, k, v always carry biases.
    blocks=Blocks(attention_bias=True), target=("mimo",), sources="vLLM / SGLang mimo_mtp.py")
