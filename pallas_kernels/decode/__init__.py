"""Split-KV decode over a paged KV cache whose partials combine by addition
against a softmax reference declared before the reduction (see `kernel`).

`core` is the op's framework-neutral entry (`core.decode`), `kernel` the one
Pallas kernel body, `ops` its array-level wrappers, `xla` the pure-JAX
backend, `fp8` the FP8 page format, `config` the tile table."""

from pallas_kernels.decode.config import (MAX_DRAFT, DecodeBlocks,
                                          decode_blocks_for,
                                          default_num_splits)
from pallas_kernels.decode.kernel import (OVERFLOW_MARGIN, DecodeSpec,
                                          fold_decode)
from pallas_kernels.decode.ops import (arrange_queries, contiguous_as_pages,
                                       contiguous_decode, head_dim_pad,
                                       make_spec, page_anchors, paged_decode,
                                       unarrange_output)
from pallas_kernels.decode.xla import xla_decode

__all__ = [
    "MAX_DRAFT", "OVERFLOW_MARGIN", "DecodeBlocks", "DecodeSpec",
    "arrange_queries", "contiguous_as_pages", "contiguous_decode",
    "decode_blocks_for", "default_num_splits", "fold_decode", "head_dim_pad",
    "make_spec", "page_anchors", "paged_decode",
    "unarrange_output", "xla_decode",
]
