"""Xiaomi MiMo-V2-Flash: MTP modules at model.mtp.layers.{i} (pre_mlp_layernorm, final_layernorm).
Names and conventions only: its attention (v_head_dim, value scale, sinks) is not built. Chain:
vLLM mimo_v2_mtp.py."""

from mtp_jax.families.base import Conventions, Family, Layout, Sources

_NAMES = {"post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
          "shared_head.norm.weight": "final_layernorm.weight"}


def _sources(cfg, names, first_layer):
  prefixes = tuple(f"model.mtp.layers.{i}." for i in range(cfg.num_modules))
  return Sources(prefixes, lambda i, s: (prefixes[i] + _NAMES.get(s, s), None))


LAYOUT = Layout("mimo_v2", r"model\.mtp\.layers\.\d+\.final_layernorm\.weight", _sources)

FAMILY = Family(
    name="mimo_v2_flash", title="MiMo-V2-Flash", model_types=("mimo_v2_flash", "mimo_v2"), layout="mimo_v2",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    target_refusal="target (hybrid sliding-window attention with sinks) not built", sources="vLLM mimo_v2_mtp.py")
