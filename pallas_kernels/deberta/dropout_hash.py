"""Counter-based attention dropout: a hash of (seed, sequence, head, i, j).

Nothing is stored: the forward and both backward kernels regenerate the same
keep mask from the same integers. i and j are positions *within* their
sequence and `sequence` is the sequence's index (the batch row of a padded
batch, the cu_seqlens slot of a packed one), so a padded batch and its packed
form draw the same mask. The hash is murmur3's 32-bit finaliser applied
twice (per row, then per element); pair (i, j) is kept iff the top 24 bits of
its hash are >= round(rate * 2^24), so the keep probability is 1 - rate up
to 2^-24.

The functions work on jnp uint32 arrays both inside Pallas kernels (Triton
lowering and interpret mode) and in plain XLA, with identical bits.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.varlen import token_seq_ids_clipped

_M1 = np.uint32(0x85EBCA6B)
_M2 = np.uint32(0xC2B2AE35)
_GOLD = np.uint32(0x9E3779B9)
_ROW = np.uint32(0x27D4EB2F)
_COL = np.uint32(0x165667B1)


def fmix32(x):
  x = x ^ (x >> 16)
  x = x * _M1
  x = x ^ (x >> 13)
  x = x * _M2
  return x ^ (x >> 16)


def threshold(rate: float) -> int:
  """Integer threshold on the top 24 hash bits."""
  return int(round(float(rate) * (1 << 24)))


def program_key(seed, seq, head):
  """uint32 key of one (sequence, head); seed: uint32 scalar; seq, head:
  int32 scalars (or arrays broadcasting together)."""
  s = jnp.asarray(seq).astype(jnp.uint32)
  h = jnp.asarray(head).astype(jnp.uint32)
  return fmix32(seed ^ fmix32(s * _GOLD + h * _ROW + np.uint32(1)))


def row_hash(key, i):
  """uint32 hash of query rows i (int32, sequence-relative)."""
  return fmix32(key + jnp.asarray(i).astype(jnp.uint32) * _GOLD)


def keep(row_h, j, thresh: int):
  """Boolean keep mask from row hashes and key positions j (broadcast)."""
  h = fmix32(row_h ^ (jnp.asarray(j).astype(jnp.uint32) * _COL + _ROW))
  return (h >> 8).astype(jnp.int32) >= np.int32(thresh)


def seed_from_rng(rng):
  """uint32 seed scalar from a jax.random key (typed or raw uint32[2])."""
  import jax
  return jax.random.bits(rng, (), jnp.uint32)


def keep_mask_dense(seed, q_seq, heads: int, q_pos, k_pos, rate: float):
  """Full keep mask for reference computations.

  seed: uint32 scalar; q_seq: int [batch, s], the hash sequence index of each
  query token (the batch row for padded batches, the cu_seqlens slot for
  packed ones); q_pos, k_pos: int [batch, s] sequence-relative positions.
  Returns bool [batch, heads, s, s] (entry [b, h, i, j]).
  """
  q_seq = jnp.asarray(q_seq, jnp.int32)
  key = program_key(seed, q_seq[:, None, :],
                    jnp.arange(heads, dtype=jnp.int32)[None, :, None])
  rh = row_hash(key, jnp.asarray(q_pos)[:, None, :])
  return keep(rh[..., None], jnp.asarray(k_pos)[:, None, None, :],
              threshold(rate))


def keep_mask_padded(seed, heads: int, batch: int, seq: int, rate: float):
  """bool [batch, heads, seq, seq]: the kernels' mask for a padded batch."""
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  q_seq = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None],
                           (batch, seq))
  return keep_mask_dense(seed, q_seq, heads, pos, pos, rate)


def keep_mask_varlen(seed, heads: int, cu_seqlens, total: int, rate: float):
  """bool [1, heads, total, total]: the kernels' mask for a packed batch
  (entries of pairs in different sequences are meaningless)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  t = jnp.arange(total, dtype=jnp.int32)
  sid = token_seq_ids_clipped(cu, total)
  pos = t - cu[sid]
  return keep_mask_dense(seed, sid[None], heads, pos[None], pos[None], rate)
