"""mtp_jax's own names (`layouts.save_canonical`): mtp.{i}.<suffix>, embed_tokens, lm_head."""

from mtp_jax.families.base import Layout, Sources


def _sources(cfg, names, first_layer):
  return Sources(prefixes=tuple(f"mtp.{i}." for i in range(cfg.num_modules)),
                 source=lambda i, s: (f"mtp.{i}.{s}", None), embed=("embed_tokens.weight",))


# Every module's block has input_layernorm, DeepSeek-V4's (e_proj / h_proj, no eh_proj) included;
# no release names a tensor mtp.{i}.input_layernorm.weight.
LAYOUT = Layout("canonical", r"mtp\.\d+\.input_layernorm\.weight", _sources)
