"""DeepSeek-V3 / R1: MLA in every layer, sigmoid-routed MoE, MTP layers after the target's.

The `deepseek` layout (shared with GLM-4.5): module k at model.layers.{num_hidden_layers + k},
canonical names under that prefix; each may carry copies of the embedding (embed_tokens) and the
head (shared_head.head), else the main model's are used. Chain: transformers' MtpModel.
"""

import re

from mtp_jax.families.base import DEFAULT_EMBED, DEFAULT_HEAD, Conventions, Family, Layout, Sources

_EH_PROJ = re.compile(r"model\.layers\.(\d+)\.eh_proj\.weight")


def _sources(cfg, names, first_layer):
  if first_layer is None:
    layers = [int(m.group(1)) for n in names if (m := _EH_PROJ.fullmatch(n))]
    if not layers:
      raise ValueError("deepseek checkpoint has no model.layers.<n>.eh_proj.weight")
    first_layer = min(layers)
  prefixes = tuple(f"model.layers.{first_layer + i}." for i in range(cfg.num_modules))
  embed = tuple(p + "embed_tokens.weight" for p in prefixes if p + "embed_tokens.weight" in names)
  head = tuple(p + "shared_head.head.weight" for p in prefixes if p + "shared_head.head.weight" in names)
  return Sources(prefixes, lambda i, s: (prefixes[i] + s, None), embed or DEFAULT_EMBED, head or DEFAULT_HEAD)


LAYOUT = Layout("deepseek", _EH_PROJ.pattern, _sources, first_layer_key="num_hidden_layers")

FAMILY = Family(
    name="deepseek_v3", title="DeepSeek-V3", model_types=("deepseek_v3",), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    mla=lambda config: {}, target=("deepseek_v3",),
    sources="transformers MtpModel; vLLM deepseek_mtp.py, SGLang deepseek_nextn.py")
