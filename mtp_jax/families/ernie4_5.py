"""Baidu ERNIE-4.5: MTP modules spread over model.mtp_{block,emb_norm,hidden_norm,linear_proj}.{i};
the residual is handed on and scored with no head norm; interleaved RoPE. Chain: vLLM ernie_mtp.py,
SGLang ernie4_eagle.py. The MoE models' MTP block is dense too (SGLang's Ernie4DecoderLayer with
is_mtp, vLLM's LlamaDecoderLayer): their moe_* config fields name no MoE here (moe reads n_routed_experts)."""

from mtp_jax.families.base import Blocks, Conventions, Family, Layout, Sources

_NAMES = {"enorm.weight": "model.mtp_emb_norm.{i}.weight", "hnorm.weight": "model.mtp_hidden_norm.{i}.weight",
          "eh_proj.weight": "model.mtp_linear_proj.{i}.weight"}


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"model.{part}.{i}." for i in range(cfg.num_modules)
                   for part in ("mtp_block", "mtp_emb_norm", "mtp_hidden_norm", "mtp_linear_proj"))
  return Sources(prefixes, lambda i, s: (_NAMES[s].format(i=i) if s in _NAMES else f"model.mtp_block.{i}.{s}",
                                         None))


LAYOUT = Layout("ernie", r"model\.mtp_linear_proj\.\d+\.weight", _sources)

FAMILY = Family(
    name="ernie4_5", title="ERNIE-4.5", model_types=("ernie4_5", "ernie4_5_moe"), layout="ernie",
    conventions=Conventions(pass_normed_hidden=False, head_norm=False, mask_first_embedding=True),
    # transformers' ernie4_5 rotate_half, SGLang's rope_is_neox_style False.
    blocks=Blocks(rope_interleave=True), target=("ernie4_5",),
    target_refusal="MoE target (ernie4_5_moe) not built", sources="vLLM ernie_mtp.py, SGLang ernie4_eagle.py")
