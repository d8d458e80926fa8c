"""GLM-5 (`glm_moe_dsa`): DeepSeek-V3.2's sparse attention (MLA plus a lightning indexer, blocks/dsa.py)
with the indexer's RoPE on pairs, GLM's MoE (sigmoid routing, shared expert), the `deepseek` layout.
Read from transformers 5 models/glm_moe_dsa/ (GlmMoeDsaIndexer: interleaved RoPE; indexer_types),
vLLM 0.34 (config/speculative.py: its MTP is DeepseekV32MTP, indexer_rope_interleave read from
config.json) and SGLang 0.5.23 (glm4_moe.py GlmMoeDsaForCausalLMNextN on deepseek_nextn.py; its nextn
layer always runs its own indexer). The chain is DeepSeek-V3.2's (families/deepseek_v32.py).

Cross-layer top-k sharing: a target layer whose indexer_types entry is "shared" reuses the previous
layer's top-k instead of running an indexer. mtp_jax builds targets whose every layer runs its own
(indexer_types all "full", transformers' default pattern) and refuses the others by name; MTP modules
load either way.
"""

from collections.abc import Mapping

from mtp_jax.families.base import Conventions, Family
from mtp_jax.families.deepseek_v32 import index_config


def indexer_types(config: Mapping) -> list[str]:
  """Each target layer's indexer, "full" or "shared", as transformers' GlmMoeDsaConfig derives it:
  indexer_types, else index_topk_pattern ("F" / "S" per layer), else every index_topk_freq-th layer
  from index_skip_topk_offset on (defaults 1 and 2: all "full")."""
  if config.get("indexer_types") is not None:
    return list(config["indexer_types"])
  pattern = config.get("index_topk_pattern")
  if pattern is not None:
    return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
  freq, offset = max(config.get("index_topk_freq") or 1, 1), config.get("index_skip_topk_offset", 2)
  layers = range(config.get("num_hidden_layers") or 0)  # absent: pretrained names it after this check
  return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in layers]


def full_indexers_only(config: Mapping) -> None:
  """Refuses (NotImplementedError, naming the layers) a target with cross-layer top-k sharing."""
  shared = [i for i, kind in enumerate(indexer_types(config)) if kind != "full"]
  if shared:
    raise NotImplementedError(
        f"config.json: indexer_types makes layer(s) {shared[:8]}{' ...' if len(shared) > 8 else ''} reuse an "
        "earlier layer's top-k (cross-layer top-k sharing), which mtp_jax's GLM-5 target does not build; "
        "its MTP modules load alone with load_mtp")


FAMILY = Family(
    name="glm_moe_dsa", title="GLM-5", model_types=("glm_moe_dsa",), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    mla=lambda config: {}, dsa=lambda config: index_config(config, rope_interleave=True),
    target=("glm_moe_dsa",), target_check=full_indexers_only,
    target_refusal="target with cross-layer top-k sharing (indexer_types 'shared') not built",
    sources="transformers glm_moe_dsa (indexer, block); vLLM deepseek_v32/nvidia/mtp.py, SGLang deepseek_nextn.py")
