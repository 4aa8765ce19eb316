"""What a `FoldKVCache` is, statically: its `CacheConfig` (the pytree's aux
data, which also turns one decode call's static inputs into the decode op's
options, for `jax_api` and `torch_bridge` alike) and the bits of its sticky
error word, shared by the cache (`jax_api.kvcache`), its write paths
(`jax_api._kvcache_write`) and its decode call (`jax_api._kvcache_decode`)."""

from __future__ import annotations

import dataclasses

import jax

from jax_api.contract import kvcache as _ckv
from pallas_kernels.decode import MAX_DRAFT, head_dim_pad
from pallas_kernels.decode.core import DecodeOptions

ERR_MAX_LEN = 1    # a sequence would grow past max_len
ERR_POOL = 2       # the page pool is exhausted
ERR_NOT_EMPTY = 4  # prefill into a slot that already holds tokens
ERR_BAD_SLOT = 8   # a slot id outside [0, batch) or named twice
ERROR_NAMES = {ERR_MAX_LEN: "append past max_len", ERR_POOL: "page pool "
              "exhausted", ERR_NOT_EMPTY: "prefill into a non-empty slot",
              ERR_BAD_SLOT: "invalid or repeated slot id"}


def concrete(*xs) -> bool:
  """True when none of xs is a tracer (the eager checks can read them)."""
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def cdiv(a, b):
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Static (hashable) description of a cache; the pytree's aux data."""

  batch: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  max_len: int
  page_size: int
  num_pages: int
  dtype: str
  chunk_tokens: int
  kv_dtype: str | None = None  # an FP8 dtype name, or None (pages in dtype)

  @property
  def fp8(self) -> bool:
    return self.kv_dtype is not None

  @property
  def d_pad(self) -> int:
    return head_dim_pad(self.head_dim)

  @property
  def max_pages(self) -> int:
    return cdiv(self.max_len, self.page_size)

  def decode_options(self, q_shape, q_dtype, sinks_shape=None,
                     sinks_dtype=None, *, backend: str, softmax_scale=None,
                     window_size=(-1, -1), softcap: float = 0.0,
                     num_splits=None) -> DecodeOptions:
    """Checks one decode call's static inputs against this cache (q [batch,
    (q_len,) n_heads, head_dim] in the cache dtype, sinks None or float
    [n_heads], the options as `fold_attn_with_kvcache`; the rules of
    `jax_api.contract.kvcache.check_decode`) and returns the options of the
    decode op's core. backend: already resolved ("pallas", "interpret" or
    "xla")."""
    checked = _ckv.check_decode(
        tuple(q_shape), q_dtype, sinks_shape, sinks_dtype,
        softmax_scale=softmax_scale, window_size=window_size,
        softcap=softcap, num_splits=num_splits, batch=self.batch,
        n_heads=self.n_heads, head_dim=self.head_dim, cache_dtype=self.dtype,
        max_draft=MAX_DRAFT)
    return DecodeOptions(backend=backend, chunk_tokens=self.chunk_tokens,
                         **checked)
