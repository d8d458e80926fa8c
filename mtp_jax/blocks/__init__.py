"""Building blocks shared by the target model and the MTP modules.

Shapes are written as suffixes (`x_BxTxD`) and as `dtype[B, T, D]` in docstrings:
B batch, T rows in this call, L cache rows (max_len), S keys attended to, D hidden,
H query heads, G = H / Hkv query heads per KV head, Dh head dim, F MLP width, V vocabulary.

Data flow: linear, norms, rope, masks (the attention math) -> cache (the per-layer cache interface,
dense caches) -> pages (the page allocator, the per-call `AttentionMetadata`) -> paged (paged
caches) -> mla -> dsa (DeepSeek Sparse Attention
and its caches) -> caches (`LayerCaches`, one model's caches, and `init_cache`, which picks the cache
for a config) -> attention, mlp, moe -> block (the pre-norm `Block`); hyper, sink_mqa -> hyper_block
(DeepSeek-V4's layer over hyper-connection streams and its MTP module).
"""

from mtp_jax.blocks.attention import Attention
from mtp_jax.blocks.block import Block
from mtp_jax.blocks.cache import KVCache, LayerCache, MlaCache
from mtp_jax.blocks.caches import LayerCaches, init_cache
from mtp_jax.blocks.dsa import DsaAttention, DsaCache, PagedDsaCache
from mtp_jax.blocks.linear import Embed, Linear, module_state_dict, normal
from mtp_jax.blocks.masks import TreeRows
from mtp_jax.blocks.mla import MlaAttention
from mtp_jax.blocks.mlp import Mlp
from mtp_jax.blocks.moe import Moe
from mtp_jax.blocks.norms import RMSNorm
from mtp_jax.blocks.paged import PagedKVCache, PagedMlaCache
from mtp_jax.blocks.pages import AttentionMetadata, PageRead, Pages
from mtp_jax.blocks.rope import rope

__all__ = ["Attention", "TreeRows", "Block", "DsaAttention", "DsaCache", "PagedDsaCache", "init_cache", "KVCache",
           "LayerCache", "LayerCaches", "MlaCache", "MlaAttention", "Embed", "Linear", "module_state_dict", "normal",
           "Mlp", "Moe", "AttentionMetadata", "PageRead", "Pages", "PagedKVCache", "PagedMlaCache", "RMSNorm", "rope"]
