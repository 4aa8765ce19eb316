"""Plain-`jnp` float32 reference for single-token decode over a paged KV cache.

Layout:
  q: [batch, heads_q, head_dim], the newest token of each sequence.
  k_pages, v_pages: [num_pages, page_size, heads_kv, head_dim], a page pool.
  block_table: int32 [batch, max_pages_per_seq]; page p of sequence b lives
    in pool slot block_table[b, p]. Entries past a sequence's length are
    ignored (they may hold anything, e.g. -1 or stale slots).
  lengths: int32 [batch], tokens in the cache for each sequence; the query is
    the token at position lengths[b] - 1 (so causal alignment is implied).

Masking, soft-cap, sinks and the fully-masked convention are those of
`pallas_kernels.reference.dense` (a sequence of length 0 gives zeros).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.reference.dense import MaskSpec, attention_reference


def gather_pages(pages, block_table):
  """[num_pages, page, h, d] x [batch, n] -> contiguous [batch, n*page, h, d]."""
  bt = jnp.clip(jnp.asarray(block_table, jnp.int32), 0, pages.shape[0] - 1)
  g = pages[bt]  # [batch, n, page, h, d]
  b, n, p, h, d = g.shape
  return g.reshape(b, n * p, h, d)


def dequantised_pages(pages, scales):
  """float32 pages: FP8 entries [num_pages, page, h, d] times their float32
  scale [num_pages, h]."""
  return (jnp.asarray(pages).astype(jnp.float32) *
          jnp.asarray(scales, jnp.float32)[:, None, :, None])


def paged_decode_reference(q, k_pages, v_pages, block_table, lengths, *,
                           softmax_scale=None, window_size=(-1, -1),
                           sinks=None, softcap: float = 0.0, k_scales=None,
                           v_scales=None):
  """Float32 decode attention of one query token per sequence.

  k_scales, v_scales: optional float32 [num_pages, heads_kv]: the pools hold
  FP8 entries that decode as entry * scale of their (page, head); the
  reference attends over those dequantised values.

  Returns:
    out: [batch, heads_q, head_dim] float32; lse: [batch, heads_q] float32.
  """
  if k_scales is not None:
    k_pages = dequantised_pages(k_pages, k_scales)
  if v_scales is not None:
    v_pages = dequantised_pages(v_pages, v_scales)
  k = gather_pages(k_pages, block_table)
  v = gather_pages(v_pages, block_table)
  b, t = k.shape[:2]
  lengths = jnp.asarray(lengths, jnp.int32)
  kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  # Keys past the sequence's length get segment -1 and are never visible.
  k_spec = MaskSpec(jnp.where(kpos < lengths[:, None], 0, -1), kpos,
                    jnp.broadcast_to(lengths[:, None], (b, t)))
  q_spec = MaskSpec(jnp.zeros((b, 1), jnp.int32), jnp.zeros((b, 1), jnp.int32),
                    jnp.ones((b, 1), jnp.int32))
  out, lse = attention_reference(q[:, None], k, v, causal=True,
                                 softmax_scale=softmax_scale,
                                 window_size=window_size, sinks=sinks,
                                 softcap=softcap, q_spec=q_spec, k_spec=k_spec)
  return out[:, 0], lse[:, :, 0]
