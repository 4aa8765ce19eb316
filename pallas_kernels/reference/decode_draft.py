"""Float32 reference for decoding a short draft (q_len tokens) over a paged
cache: `paged_decode_reference` generalised to several query tokens.

The draft's tokens are the last q_len tokens of each sequence (already in the
cache): draft token t sits at position lengths[b] - q_len + t and sees keys
j <= that position (bottom-right causal alignment), within the window.
Masks, soft-cap, sinks and the fully-masked convention are those of
`pallas_kernels.reference.dense`.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.reference.decode import gather_pages
from pallas_kernels.reference.dense import MaskSpec, attention_reference


def paged_draft_reference(q, k_pages, v_pages, block_table, lengths, *,
                          softmax_scale=None, window_size=(-1, -1),
                          sinks=None, softcap: float = 0.0):
  """q [batch, q_len, heads_q, head_dim] -> (out [batch, q_len, heads_q,
  head_dim] float32, lse [batch, heads_q, q_len])."""
  k = gather_pages(k_pages, block_table)
  v = gather_pages(v_pages, block_table)
  b, t = k.shape[:2]
  q_len = q.shape[1]
  lengths = jnp.asarray(lengths, jnp.int32)
  kpos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  k_spec = MaskSpec(jnp.where(kpos < lengths[:, None], 0, -1), kpos,
                    jnp.broadcast_to(lengths[:, None], (b, t)))
  qpos = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32), (b, q_len))
  q_spec = MaskSpec(jnp.zeros((b, q_len), jnp.int32), qpos,
                    jnp.full((b, q_len), q_len, jnp.int32))
  return attention_reference(q, k, v, causal=True, softmax_scale=softmax_scale,
                             window_size=window_size, sinks=sinks,
                             softcap=softcap, q_spec=q_spec, k_spec=k_spec)
