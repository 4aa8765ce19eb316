"""Which sequence each token of a packed batch belongs to: the one
`searchsorted` over `cu_seqlens` that the kernels' wrappers, the references
and the models share.

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
  return jnp.searchsorted(cu, t, side="right").astype(jnp.int32) - 1


def token_seq_ids_clipped(cu_seqlens, total: int) -> jax.Array:
  """`token_seq_ids` clipped to [0, num_seqs - 1] (a valid index into
  cu_seqlens[:-1] for every token; callers mask the padding tokens)."""
  return jnp.clip(token_seq_ids(cu_seqlens, total), 0,
                  jnp.asarray(cu_seqlens).shape[0] - 2)
