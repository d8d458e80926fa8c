"""Qwen2: a GQA decoder target with q, k, v biases (its configs have no attention_bias key);
no MTP modules released."""

from mtp_jax.families.base import Blocks, Family

FAMILY = Family(name="qwen2", title="Qwen2", model_types=("qwen2",), blocks=Blocks(attention_bias=True),
                target=("qwen2",))
