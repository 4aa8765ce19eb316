"""The nnx modules under their plain names: `from jax_api.flax.nnx import
DecoderAttention` (the same class as `jax_api.flax.DecoderAttentionNNX`)."""

from jax_api.flax.attention_fn import attention_fn
from jax_api.flax.decoder import DecoderAttentionNNX as DecoderAttention

__all__ = ["DecoderAttention", "attention_fn"]
