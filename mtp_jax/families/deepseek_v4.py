"""DeepSeek-V4: refused by name, target and MTP.

Every layer, the MTP layer included, carries hc_mult hyper-connection streams mixed by learned hc_*
weights (the MTP layer reads the target's hc_mult streams through h_proj and ends in hc_head), and
its attention is compressed sparse attention (compress_rates, a lightning indexer over compressed
entries) (transformers 5.25 models/deepseek_v4/, SGLang 0.5.23 srt/models/deepseek_v4_nextn.py).
mtp_jax builds neither.
"""

from mtp_jax.families.base import Family

FAMILY = Family(
    name="deepseek_v4", title="DeepSeek-V4", model_types=("deepseek_v4", "deepseek_v41"),
    target_refusal="target (hyper-connection streams, compressed sparse attention) not built",
    mtp_refusal="MTP layer (hyper-connection streams in and out, compressed sparse attention) not built",
    sources="transformers deepseek_v4; SGLang deepseek_v4_nextn.py")
