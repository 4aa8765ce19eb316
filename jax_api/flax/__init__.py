"""Flax integration: a drop-in `attention_fn` and decoder attention modules.

    from jax_api.flax import attention_fn          # nnx / linen MultiHeadAttention
    from jax_api.flax import DecoderAttention      # flax.linen module
    from jax_api.flax.nnx import DecoderAttention  # flax.nnx module
                                                   # (= DecoderAttentionNNX)
"""

from jax_api.flax.attention_fn import (FallbackWarning, attention_fn,
                                       mask_to_kernel_args,
                                       reference_attention)
from jax_api.flax.decoder import (DecoderAttention, DecoderAttentionNNX,
                                  apply_rope)

__all__ = ["attention_fn", "DecoderAttention", "DecoderAttentionNNX",
           "FallbackWarning", "mask_to_kernel_args", "reference_attention",
           "apply_rope"]
