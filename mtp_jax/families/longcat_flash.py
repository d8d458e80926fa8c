"""Meituan LongCat-Flash: scaled MLA, a dense MTP FFN under transformer_layer, one final norm
(model.mtp.norm) for all modules. Chain: vLLM longcat_flash_mtp.py."""

from mtp_jax.families.base import DEFAULT_EMBED, Conventions, Family, Layout, Sources, no_moe

_NAMES = {"enorm.weight": "enorm.m.weight", "hnorm.weight": "hnorm.m.weight",
          "mlp.gate_proj.weight": "transformer_layer.mlp.gate_proj.weight",
          "mlp.up_proj.weight": "transformer_layer.mlp.up_proj.weight",
          "mlp.down_proj.weight": "transformer_layer.mlp.down_proj.weight"}


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"model.mtp.layers.{i}." for i in range(cfg.num_modules)) + (
      "model.mtp.norm.", "model.mtp.embed_tokens.")
  embed = tuple(n for n in ["model.mtp.embed_tokens.weight"] if n in names) or DEFAULT_EMBED
  return Sources(prefixes, lambda i, s: ("model.mtp.norm.weight" if s == "shared_head.norm.weight" else
                                         f"model.mtp.layers.{i}.{_NAMES.get(s, s)}", None), embed=embed)


def mla_scales(config) -> dict:
  """transformers' LongcatFlashMLA scales the query by sqrt(hidden_size / q_lora_rank) and the
  normed latent by sqrt(hidden_size / kv_lora_rank); SGLang / vLLM fold them into the norms when
  mla_scale_q_lora / mla_scale_kv_lora (default true)."""
  d, q_rank, kv_rank = config["hidden_size"], config.get("q_lora_rank"), config["kv_lora_rank"]
  scales = {}
  if config.get("mla_scale_q_lora", True):
    if not q_rank:
      raise ValueError("config.json: mla_scale_q_lora needs q_lora_rank (LongCat-Flash always has a q LoRA)")
    scales["q_lora_scale"] = (d / q_rank) ** 0.5
  if config.get("mla_scale_kv_lora", True):
    scales["kv_lora_scale"] = (d / kv_rank) ** 0.5
  return scales


LAYOUT = Layout("longcat", r"model\.mtp\.layers\.\d+\.enorm\.m\.weight", _sources)

FAMILY = Family(
    name="longcat_flash", title="LongCat-Flash", model_types=("longcat_flash",), layout="longcat",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    mla=mla_scales,
    # vLLM's longcat_flash_mtp.py clears n_routed_experts; SGLang defaults num_nextn_predict_layers to 1.
    moe=no_moe, num_mtp=1,
    target_refusal="target (zero-computation experts, shortcut-connected MoE) not built",
    sources="vLLM longcat_flash_mtp.py")
