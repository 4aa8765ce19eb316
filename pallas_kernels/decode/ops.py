"""Array-level entry points of the decode kernel: query/output layouts and
a contiguous-cache adapter.

`paged_decode` takes FlashAttention-style queries [batch, q_len, heads_q,
head_dim] and returns the same layout; `contiguous_decode` views a contiguous
cache [batch, seq, heads_kv, head_dim] as a page pool with an identity block
table, which runs the very same program on the very same values (so paged and
contiguous layouts give identical bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode.config import DecodeBlocks, decode_blocks_for, \
    default_num_splits
from pallas_kernels.decode.kernel import DecodeSpec, _pow2, fold_decode


def head_dim_pad(head_dim: int) -> int:
  return _pow2(head_dim)


def arrange_queries(q, heads_kv: int, d_pad: int):
  """[batch, q_len, heads_q, d] -> [batch, heads_kv, rows_pad, d_pad]."""
  b, q_len, hq, d = q.shape
  g = hq // heads_kv
  rows = g * q_len
  x = q.reshape(b, q_len, heads_kv, g, d).transpose(0, 2, 1, 3, 4)
  x = x.reshape(b, heads_kv, rows, d)
  return jnp.pad(x, ((0, 0), (0, 0), (0, _pow2(rows) - rows), (0, d_pad - d)))


def unarrange_output(out, q_len: int, heads_q: int, head_dim: int):
  """[batch, heads_kv, >=rows, d_pad] -> [batch, q_len, heads_q, head_dim]."""
  b, hkv = out.shape[:2]
  g = heads_q // hkv
  x = out[:, :, :g * q_len, :head_dim].reshape(b, hkv, q_len, g, head_dim)
  return x.transpose(0, 2, 1, 3, 4).reshape(b, q_len, heads_q, head_dim)


def make_spec(*, heads_q: int, heads_kv: int, q_len: int, head_dim: int,
              page_size: int, chunk_tokens: int, dtype, batch: int,
              max_pages: int, softmax_scale=None, softcap: float = 0.0,
              window_left: int = -1, has_sinks: bool = False,
              fp8: bool = False, num_splits=None, interpret: bool = False,
              compute_capability=None,
              blocks: DecodeBlocks | None = None) -> DecodeSpec:
  d_pad = head_dim_pad(head_dim)
  if blocks is None:
    blocks = decode_blocks_for(compute_capability=compute_capability,
                               head_dim_pad=d_pad, dtype=dtype,
                               page_size=page_size, interpret=interpret)
  n_chunks = -(-max_pages * page_size // chunk_tokens)
  if num_splits is None:
    num_splits = default_num_splits(batch, heads_kv, n_chunks, interpret)
  scale = (1.0 / head_dim ** 0.5) if softmax_scale is None else float(
      softmax_scale)
  return DecodeSpec(
      group=heads_q // heads_kv, q_len=q_len, d_pad=d_pad,
      page_size=page_size, chunk_tokens=chunk_tokens, block_k=blocks.block_k,
      num_warps=blocks.num_warps, num_stages=blocks.num_stages,
      n_splits=int(num_splits), scale=scale, softcap=float(softcap),
      left=int(window_left), has_sinks=has_sinks, interpret=interpret,
      fp8=bool(fp8))


def page_anchors(k_pages, block_table):
  """[batch, max_pages, heads_kv, d_pad]: the first key of every logical page
  (entries past a sequence's length are ignored by the kernel)."""
  bt = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, k_pages.shape[0] - 1)
  return k_pages[bt, 0]


def paged_decode(q, k_pages, v_pages, block_table, lengths, *, anchors=None,
                 page_size=None,
                 chunk_tokens: int, softmax_scale=None, sinks=None,
                 window_left: int = -1, softcap: float = 0.0, num_splits=None,
                 interpret: bool = False, compute_capability=None,
                 blocks: DecodeBlocks | None = None, fallback: bool = True,
                 return_reference: bool = False, k_scales=None,
                 v_scales=None):
  """Decode attention; q [batch, q_len, heads_q, head_dim] (or [batch,
  heads_q, head_dim]) -> the same shape, in q's dtype.

  k_pages, v_pages: [num_pages, page_size, heads_kv, d_pad] with d_pad =
  head_dim rounded up to a power of two >= 16 (zero padded). anchors:
  `page_anchors(k_pages, block_table)` (computed here when None; a cache
  keeps it incrementally).
  FP8 when k_scales and v_scales (float32 [num_pages, heads_kv]) are given:
  the pools hold FP8 entries (`pallas_kernels.decode.fp8`) and anchors, if
  passed, are the dequantised first keys in q's dtype.
  """
  squeeze = q.ndim == 3
  if squeeze:
    q = q[:, None]
  b, q_len, hq, d = q.shape
  hkv = k_pages.shape[2]
  page_size = k_pages.shape[1] if page_size is None else page_size
  fp8 = k_scales is not None
  if fp8 != (v_scales is not None):
    raise ValueError("pass both k_scales and v_scales (FP8 pages), or "
                     "neither.")
  spec = make_spec(heads_q=hq, heads_kv=hkv, q_len=q_len, head_dim=d,
                   page_size=page_size, chunk_tokens=chunk_tokens,
                   dtype=q.dtype, batch=b, max_pages=block_table.shape[1],
                   softmax_scale=softmax_scale, softcap=softcap,
                   window_left=window_left, has_sinks=sinks is not None,
                   fp8=fp8, num_splits=num_splits, interpret=interpret,
                   compute_capability=compute_capability, blocks=blocks)
  block_table = jnp.asarray(block_table, jnp.int32)
  if anchors is None:
    if fp8:
      bt = jnp.clip(block_table, 0, k_pages.shape[0] - 1)
      anchors = (k_pages[bt, 0].astype(jnp.float32) *
                 k_scales[bt][..., None]).astype(q.dtype)
    else:
      anchors = page_anchors(k_pages, block_table)
  out, ref = _paged_decode(
      q, k_pages, v_pages, block_table, jnp.asarray(lengths, jnp.int32),
      anchors, sinks, k_scales, v_scales, spec=spec, fallback=fallback)
  if squeeze:
    out = out[:, 0]
  return (out, ref) if return_reference else out


@functools.partial(jax.jit, static_argnames=("spec", "fallback"))
def _paged_decode(q, k_pages, v_pages, block_table, lengths, anchors,
                  sinks, k_scales, v_scales, *, spec, fallback):
  b, q_len, hq, d = q.shape
  qa = arrange_queries(q, k_pages.shape[2], spec.d_pad)
  out, ref = fold_decode(qa, k_pages, v_pages, block_table, lengths, anchors,
                         spec=spec, sinks=sinks,
                         k_scales=k_scales, v_scales=v_scales,
                         fallback=fallback)
  return unarrange_output(out, q_len, hq, d), ref


def contiguous_as_pages(k, page_size: int):
  """[batch, seq, heads_kv, d] -> (pool [batch*seq/page, page, heads_kv,
  d_pad], identity block table [batch, seq/page]). A free reshape when
  seq % page_size == 0 and d is a power of two >= 16."""
  b, t, hkv, d = k.shape
  d_pad = head_dim_pad(d)
  pad_t = -t % page_size
  if pad_t or d_pad != d:
    k = jnp.pad(k, ((0, 0), (0, pad_t), (0, 0), (0, d_pad - d)))
  n = (t + pad_t) // page_size
  pool = k.reshape(b * n, page_size, hkv, d_pad)
  table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
  return pool, table


def contiguous_decode(q, k, v, lengths, *, page_size: int, chunk_tokens: int,
                      **kw):
  """`paged_decode` over a contiguous cache k, v [batch, seq, heads_kv, d].

  FP8: k, v hold FP8 entries and kw has k_scales, v_scales float32 [batch,
  ceil(seq / page_size), heads_kv] (one per page of the contiguous view)."""
  kp, table = contiguous_as_pages(k, page_size)
  vp, _ = contiguous_as_pages(v, page_size)
  for name in ("k_scales", "v_scales"):
    if kw.get(name) is not None:
      kw[name] = jnp.reshape(kw[name], (-1, kw[name].shape[-1]))
  return paged_decode(q, kp, vp, table, lengths, page_size=page_size,
                      chunk_tokens=chunk_tokens, **kw)
