"""What JAX users import: exact, deterministic attention with custom VJPs.

    from jax_api import fold_attn_func, fold_attn_varlen_func      # dense
    from jax_api import FoldKVCache, fold_attn_with_kvcache       # serving
    from jax_api import disentangled_attention                    # DeBERTa
    from jax_api import deberta, flax                             # modules
"""

from jax_api.dense import fold_attn_func, fold_attn_varlen_func
from jax_api.kvcache import FoldKVCache, fold_attn_with_kvcache
from jax_api.deberta import disentangled_attention
from pallas_kernels.settings import KernelSettings

__all__ = ["fold_attn_func", "fold_attn_varlen_func", "FoldKVCache",
           "fold_attn_with_kvcache", "disentangled_attention",
           "KernelSettings"]
