"""DeBERTa-v2/v3 in JAX: disentangled attention (Pallas kernels with a
deterministic backward), Flax modules mirroring Hugging Face's parameter
names, and checkpoint conversion.

    from jax_api.deberta import disentangled_attention, from_hf
"""

from jax_api.deberta.attention import disentangled_attention

__all__ = ["disentangled_attention"]
