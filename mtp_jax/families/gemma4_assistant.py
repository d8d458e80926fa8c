"""Gemma 4 MTP assistants (gemma4_assistant, gemma4_unified_assistant): built as assistants
(mtp_jax/assistant.py, loaded by `mtp_jax.load_assistant`), not as an MTP chain; the target is refused.

An assistant checkpoint is a small Gemma 4 text decoder of its own (transformers 5.25
models/gemma4_assistant/ and gemma4_unified_assistant/, the same wiring; vLLM 0.34
model_executor/models/gemma4_mtp.py, SGLang 0.5.23 srt/models/gemma4_mtp.py), applied k times: its
input is pre_projection(concat(target embedding, target hidden)), its layers hold no keys or values of
their own but attend to the target's (shared_kv_states of the target's last full and sliding-window
layers; vLLM's kv_sharing_target_layer_name) at one constant position, post_projection maps its output
back to the target's width for the next step, and its head may score only the tokens of the top
centroids (use_ordered_embeddings). `assistant.assistant_propose` runs it from the caller's target
hidden and K/V; mtp_jax's chain loaders (load_mtp), which hand a module only the target's hiddens,
refuse it, and the directory holds no target.
"""

from mtp_jax.families.base import Family

FAMILY = Family(
    name="gemma4_assistant", title="Gemma 4 assistant", model_types=("gemma4_assistant", "gemma4_unified_assistant"),
    target_refusal="assistant directory holds no target (the Gemma 4 model is separate)",
    mtp_refusal="assistant attends to the target's KV cache (shared_kv_states), which the chain does not hand over: "
                "load it with mtp_jax.load_assistant and draft with mtp_jax.assistant_propose",
    assistant="one Gemma 4 decoder run k times from the caller's target hidden and K/V (`assistant_propose`)",
    sources="transformers gemma4_assistant, gemma4_unified_assistant + candidate_generator; vLLM gemma4_mtp.py, "
            "SGLang gemma4_mtp.py")
