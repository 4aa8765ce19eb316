"""What JAX users import: exact, deterministic attention with custom VJPs.

    from jax_api import fold_attn_func, fold_attn_varlen_func
"""

from jax_api.dense import fold_attn_func, fold_attn_varlen_func

__all__ = ["fold_attn_func", "fold_attn_varlen_func"]
