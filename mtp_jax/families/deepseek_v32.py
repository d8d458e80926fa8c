"""DeepSeek-V3.2: DeepSeek-V3 (MLA, sigmoid-routed MoE, YaRN, the `deepseek` layout) with DeepSeek
Sparse Attention in every attention layer, the MTP layers' included (blocks/dsa.py). Where each fact
was read (transformers 5 models/deepseek_v32/, vLLM 0.34 models/deepseek_v32/ and config/speculative.py,
SGLang 0.5.23 srt/models/deepseek_nextn.py and deepseek_v2.py):

- The indexer's tensors sit under self_attn.indexer.{wq_b, wk, k_norm (a LayerNorm with a bias),
  weights_proj} of each layer; config.json's index_n_heads, index_head_dim and index_topk size it.
- Indexer RoPE: halves (transformers' DeepseekV32Indexer; vLLM's and SGLang's neox style unless
  config.json's indexer_rope_interleave says pairs), over the first qk_rope_head_dim dims; MLA's own
  RoPE rotates pairs as DeepSeek-V3's.
- MTP: vLLM maps deepseek_v32 and glm_moe_dsa onto DeepseekV32MTP; each module's decoder layer runs an
  indexer of its own (SGLang's nextn layer builds one even where target layers share top-k). Chain as
  DeepSeek-V3's: enorm(e), hnorm(h) concatenated embedding first, the post-norm shared_head.norm(h)
  handed on and scored by the head (vLLM's nvidia/mtp.py recycles the post-final-norm hidden; SGLang
  deepseek_nextn.py the same). vLLM zeroes the embedding at position 0, SGLang does not; mtp_jax keeps
  DeepSeek-V3's record (no mask).
"""

from collections.abc import Mapping

from mtp_jax import validate
from mtp_jax.config import DsaConfig
from mtp_jax.families.base import Conventions, Family


def index_config(config: Mapping, rope_interleave: bool) -> DsaConfig:
  """The DSA indexer of a config.json (index_n_heads, index_head_dim, index_topk; its RoPE pairs when
  indexer_rope_interleave, default `rope_interleave`, the family's)."""
  for key in ("index_n_heads", "index_head_dim", "index_topk"):
    if config.get(key) is None:
      raise validate.InvalidValue(f"config.json: {key}", f"config.json has no {key!r}, which the DeepSeek "
                                  "Sparse Attention indexer reads")
  return DsaConfig(index_n_heads=config["index_n_heads"], index_head_dim=config["index_head_dim"],
                   index_topk=config["index_topk"],
                   rope_interleave=bool(config.get("indexer_rope_interleave", rope_interleave)))


FAMILY = Family(
    name="deepseek_v32", title="DeepSeek-V3.2", model_types=("deepseek_v32",), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    mla=lambda config: {}, dsa=lambda config: index_config(config, rope_interleave=False),
    target=("deepseek_v32",),
    sources="transformers deepseek_v32 (indexer, block); vLLM deepseek_v32/nvidia/mtp.py, SGLang deepseek_nextn.py")
