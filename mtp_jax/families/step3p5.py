"""Step-3.5 / Step-3.7 (step3p5, step3p7): refused by name, target and MTP.

vLLM 0.34 model_executor/models/step3p5_mtp.py (and SGLang 0.5.23 srt/models/step3p5_mtp.py): module
k at model.layers.{num_hidden_layers + k} with enorm / hnorm (GemmaRMSNorm, 1 + w), eh_proj over
concat(embedding, hidden), the decoder layer under mtp_block, and a shared_head of its own: a norm
and its own LM head (Step3p5MTP.has_own_lm_head), the residual handed on. The layer's attention has a
head-wise output gate (g_proj, one sigmoid per head) and per-layer windows / rotary fractions, its
FFN clipped SwiGLU (swiglu_limits). mtp_jax's modules share one LM head (released heads must equal
it) and its attention has no head-wise gate. The target mixes sliding-window and full layers.
"""

from mtp_jax.families.base import Family

FAMILY = Family(
    name="step3p5", title="Step-3.5", model_types=("step3p5", "step3p7"),
    target_refusal="target (sliding-window / full layers with head-wise attention gates) not built",
    mtp_refusal="MTP modules score with LM heads of their own and gate attention per head (g_proj), not built",
    sources="vLLM step3p5_mtp.py, SGLang step3p5_mtp.py")
