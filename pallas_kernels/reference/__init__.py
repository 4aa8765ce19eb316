"""Float32 `jnp` references that every kernel of `pallas_kernels` is tested against."""

from pallas_kernels.reference.dense import (
    MaskSpec,
    attention_reference,
    dense_mask_spec,
    varlen_attention_reference,
    varlen_mask_spec,
    visibility,
)
from pallas_kernels.reference.decode import gather_pages, paged_decode_reference

__all__ = [
    "MaskSpec",
    "attention_reference",
    "dense_mask_spec",
    "gather_pages",
    "paged_decode_reference",
    "varlen_attention_reference",
    "varlen_mask_spec",
    "visibility",
]
