"""Which sequence each token of a packed batch belongs to, and its position
there: the one `searchsorted` over `cu_seqlens` that the kernels' wrappers,
the references and the models share.

cu_seqlens: int [num_seqs + 1], non-decreasing offsets; total: the packed
length (static), which may run past cu_seqlens[-1] (padding tokens).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_seq_ids(cu_seqlens, total: int) -> jax.Array:
  """int32 [total]: s with cu_seqlens[s] <= t < cu_seqlens[s + 1] for token
  t; num_seqs for tokens at or past cu_seqlens[-1], -1 before
  cu_seqlens[0]."""
  cu = jnp.asarray(cu_seqlens)
  t = jnp.arange(total, dtype=jnp.int32)
  # Unrolled: no XLA while loop (compute-sanitizer's initcheck flagged a
  # read in the rolled scan's loop on the GPU); same bits, log2 steps.
  return jnp.searchsorted(cu, t, side="right",
                          method="scan_unrolled").astype(jnp.int32) - 1


def token_seq_ids_clipped(cu_seqlens, total: int) -> jax.Array:
  """`token_seq_ids` clipped to [0, num_seqs - 1] (a valid index into
  cu_seqlens[:-1] for every token; callers mask the padding tokens)."""
  return jnp.clip(token_seq_ids(cu_seqlens, total), 0,
                  jnp.asarray(cu_seqlens).shape[0] - 2)


def token_positions(cu_seqlens, total: int) -> jax.Array:
  """int32 [total]: each token's position in its sequence, t -
  cu_seqlens[s] (tokens past cu_seqlens[-1] count on from the last
  sequence's start; callers mask them)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  t = jnp.arange(total, dtype=jnp.int32)
  return t - cu[token_seq_ids_clipped(cu, total)]
