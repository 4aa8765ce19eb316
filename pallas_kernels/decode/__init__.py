"""Split-KV decode over a paged KV cache whose partials combine by addition
against a softmax reference declared before the reduction (see `kernel`)."""

from pallas_kernels.decode.config import (MAX_DRAFT, DecodeBlocks,
                                          decode_blocks_for,
                                          default_num_splits)
from pallas_kernels.decode.kernel import (OVERFLOW_MARGIN, DecodeSpec,
                                          fold_decode)
from pallas_kernels.decode.ops import (DEFAULT_V8_DEPTH, arrange_queries,
                                       contiguous_as_pages, contiguous_decode,
                                       head_dim_pad, make_spec, page_anchors,
                                       page_summaries,
                                       paged_decode, unarrange_output)
from pallas_kernels.decode.v8 import decode_v8, encode_v8, v8_scale_for

__all__ = [
    "DEFAULT_V8_DEPTH", "MAX_DRAFT", "OVERFLOW_MARGIN", "DecodeBlocks",
    "DecodeSpec", "arrange_queries", "contiguous_as_pages",
    "contiguous_decode", "decode_blocks_for", "decode_v8",
    "default_num_splits", "encode_v8", "fold_decode", "head_dim_pad",
    "make_spec", "page_anchors", "page_summaries", "paged_decode", "unarrange_output",
    "v8_scale_for",
]
