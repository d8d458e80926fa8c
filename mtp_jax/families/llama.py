"""Llama: a GQA decoder target; no MTP modules released."""

from mtp_jax.families.base import Family

FAMILY = Family(name="llama", title="Llama", model_types=("llama",), target=("llama",))
