"""The decode op's framework-neutral core: a paged cache's arrays and one
step's queries in, the attention output out, on the backend asked for.

`jax_api.kvcache` (`fold_attn_with_kvcache`, `FoldKVCache.attend`) and
`torch_bridge.kvcache` both call `decode`; they check the user's inputs
first, with the same rules and the same call (`CacheConfig.decode_options`
of `jax_api.kvcache`, after `jax_api.contract.kvcache.check_decode`), which
hands over what those checks resolved as a `DecodeOptions`. Decoding has no
autodiff, so there is no backward.

Layouts (those of `pallas_kernels.decode.paged_decode`):
  q:           [batch, heads_q, head_dim] (one token per sequence) or
               [batch, q_len, heads_q, head_dim] (a draft, causal within
               itself, q_len <= MAX_DRAFT).
  k_pages, v_pages: [num_pages, page_size, heads_kv, d_pad] in q's dtype, or
               FP8 with k_scales, v_scales float32 [num_pages, heads_kv].
  block_table: int32 [batch, max_pages]; lengths: int32 [batch].
  anchors:     [batch, max_pages, heads_kv, d_pad] in q's dtype, the first
               key of every logical page (dequantised when FP8), or None.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax

from pallas_kernels import device
from pallas_kernels.decode.fp8 import dequantise_pages
from pallas_kernels.decode.ops import paged_decode
from pallas_kernels.decode.xla import xla_decode

__all__ = ["BACKENDS", "DecodeOptions", "PagedKV", "decode"]

BACKENDS = ("pallas", "interpret", "xla")


class PagedKV(NamedTuple):
  """The arrays of a paged KV cache that decoding reads (a pytree; layouts
  in the module docstring)."""

  k_pages: Any
  v_pages: Any
  block_table: Any
  lengths: Any
  anchors: Any = None
  k_scales: Any = None
  v_scales: Any = None


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
  """Static options of one decode call (hashable: a jit cache key).

  backend: "pallas", "interpret" or "xla" (already resolved from "auto").
  chunk_tokens: keys per partial sum (the cache's; part of the numerics).
  softmax_scale: a float, or None for 1/sqrt(head_dim).
  window_left: the window's left extent, -1 unbounded (right is 0).
  softcap: 0 disables it. num_splits: None (the kernel chooses) or an int;
  the bits do not depend on it.
  """

  backend: str
  chunk_tokens: int
  softmax_scale: float | None = None
  window_left: int = -1
  softcap: float = 0.0
  num_splits: int | None = None

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend must be one of {BACKENDS} (resolve 'auto' "
                       f"first); got {self.backend!r}.")


_xla_decode_jit = jax.jit(xla_decode, static_argnames=(
    "softmax_scale", "window_left", "softcap", "return_reference"))


def decode(q, kv: PagedKV, sinks=None, *, options: DecodeOptions,
           compute_capability: tuple[int, int] | None = None):
  """Decode attention of q over the cache `kv`: out shaped like q, in q's
  dtype. sinks: float [heads_q] logits in the denominator only, or None.
  compute_capability: of the GPU the Pallas kernel runs on (None: the
  default device's); picks the shipped tile table, under the current
  `pallas_kernels.settings`."""
  o = options
  fp8 = kv.k_scales is not None
  if o.backend == "xla":
    kpg, vpg = kv.k_pages, kv.v_pages
    if fp8:
      # The fallback dequantises the pool (exact: power-of-two scales).
      kpg = dequantise_pages(kpg, kv.k_scales, q.dtype)
      vpg = dequantise_pages(vpg, kv.v_scales, q.dtype)
    return _xla_decode_jit(q, kpg, vpg, kv.block_table, kv.lengths,
                           softmax_scale=o.softmax_scale, sinks=sinks,
                           window_left=o.window_left, softcap=o.softcap)
  interpret = o.backend == "interpret"
  if interpret:
    compute_capability = None
  elif compute_capability is None:
    compute_capability = device.gpu_capability()
  return paged_decode(q, kv.k_pages, kv.v_pages, kv.block_table, kv.lengths,
                      anchors=kv.anchors, chunk_tokens=o.chunk_tokens,
                      softmax_scale=o.softmax_scale, sinks=sinks,
                      window_left=o.window_left, softcap=o.softcap,
                      num_splits=o.num_splits, interpret=interpret,
                      compute_capability=compute_capability,
                      k_scales=kv.k_scales if fp8 else None,
                      v_scales=kv.v_scales if fp8 else None)
