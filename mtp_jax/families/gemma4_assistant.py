"""Gemma 4 MTP assistants (gemma4_assistant, gemma4_unified_assistant): refused by name.

An assistant checkpoint is a small decoder of its own (transformers 5.25 models/gemma4_assistant/,
vLLM 0.34 model_executor/models/gemma4_mtp.py, SGLang 0.5.23 srt/models/gemma4_mtp.py): its input is
pre_projection(concat(embedding, target hidden)) at the target's width, its layers hold no keys or
values of their own but attend to the target's KV cache (shared_kv_states of the target's last full
and sliding-window layers; vLLM's kv_sharing_target_layer_name), post_projection maps its output back
to the target's width for the next step, and its head may score only the tokens of the top centroids
(use_ordered_embeddings). mtp_jax's chain hands a module the target's hiddens, never its KV cache, and
the directory holds no target.
"""

from mtp_jax.families.base import Family

FAMILY = Family(
    name="gemma4_assistant", title="Gemma 4 assistant", model_types=("gemma4_assistant", "gemma4_unified_assistant"),
    target_refusal="assistant directory holds no target (the Gemma 4 model is separate)",
    mtp_refusal="assistant attends to the target's KV cache (shared_kv_states), which the chain does not hand over",
    sources="transformers gemma4_assistant; vLLM gemma4_mtp.py, SGLang gemma4_mtp.py")
