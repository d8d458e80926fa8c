"""Bailing / Ling hybrid (bailing_hybrid): refused by name, target and MTP.

The target mixes KDA linear-attention layers with MLA every layer_group_size layers (transformers 5.25
models/bailing_hybrid/). The MTP layers (vLLM 0.34 model_executor/models/bailing_moe_mtp.py,
BailingMoeV25MTPModel, which vLLM's speculative config picks for bailing_hybrid; SGLang 0.5.23
srt/models/bailing_moe_nextn.py) follow DeepSeek's wiring (position-0 embedding zeroed, enorm /
hnorm, eh_proj, final_layernorm) around MLA and a routed-expert FFN; transformers' MLA for this
model_type adds a head-wise output gate (g_proj) that vLLM's MTP attention lacks, and the experts
clip their SwiGLU per layer (expert_swiglu_limit_list). Which the released MTP layers carry is not
settled by the sources, so mtp_jax loads neither rather than guess.
"""

from mtp_jax.families.base import Family

FAMILY = Family(
    name="bailing_hybrid", title="Bailing / Ling hybrid", model_types=("bailing_hybrid",),
    target_refusal="hybrid KDA linear-attention / MLA target not built",
    mtp_refusal="MTP layers (MLA with or without a head-wise gate, clipped-SwiGLU experts) not built",
    sources="vLLM bailing_moe_mtp.py, SGLang bailing_moe_nextn.py; transformers bailing_hybrid")
