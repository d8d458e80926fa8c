"""GLM-4.5 / 4.6: GQA with per-head q / k norms, partial RoPE, sigmoid-routed MoE; the
`deepseek` layout. Chain: transformers' MtpModel."""

from mtp_jax.families.base import Blocks, Conventions, Family

FAMILY = Family(
    name="glm4_moe", title="GLM-4.5", model_types=("glm4_moe",), layout="deepseek",
    conventions=Conventions(pass_normed_hidden=True, head_norm=True, mask_first_embedding=False),
    # transformers' Glm4MoeConfig default, left out of released config.json files.
    blocks=Blocks(partial_rotary_factor=0.5), target=("glm4_moe",),
    sources="transformers MtpModel; vLLM glm4_moe_mtp.py")
