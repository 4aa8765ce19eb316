"""Float32 reference with attention dropout by an explicit keep mask.

`pallas_kernels.reference.deberta.disentangled_attention_reference` has no
dropout; this mirrors its core (same index conventions, same fully-masked-row
convention) and multiplies the normalised probabilities by
keep / (1 - rate) before the product with v, which is HF's
`dropout(softmax(scores)) @ v` for a given mask. Tests check it against the
dropout-free reference at rate 0 and feed it the kernels' mask
(`dropout_hash.keep_mask_padded` / `keep_mask_varlen`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import deberta as _ref

_HIGHEST = jax.lax.Precision.HIGHEST


def disentangled_attention_dropout_reference(
    q, k, v, pos_key=None, pos_query=None, *, keep=None,
    dropout_rate: float = 0.0, attention_mask=None, cu_seqlens=None,
    position_buckets: int = 256, max_relative_positions: int = 512,
    pos_att_type: Sequence[str] = ("c2p", "p2c")):
  """Args as the dropout-free reference (q, k, v [b, s, h, d], or packed
  [total, h, d] with cu_seqlens), plus keep: bool [b|1, h, s, s] (None: no
  dropout). Returns float32 out shaped like q."""
  types = tuple(pos_att_type or ())
  c2p, p2c = "c2p" in types, "p2c" in types
  span = _ref.deberta_att_span(position_buckets, max_relative_positions)
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  squeeze = cu_seqlens is not None and q.ndim == 3
  if squeeze:
    q, k, v = q[None], k[None], v[None]
  b, s, h, d = q.shape
  if cu_seqlens is not None:
    rel, vis = _ref._varlen_rel_vis(jnp.asarray(cu_seqlens, jnp.int32), s,
                                    position_buckets, max_relative_positions)
  else:
    rel = _ref.build_relative_position(s, s, position_buckets,
                                       max_relative_positions)
    if attention_mask is None:
      vis = jnp.ones((b, s, s), bool)
    else:
      m = jnp.asarray(attention_mask) != 0
      vis = m[:, :, None] & m[:, None, :]
  scale = np.sqrt(np.float32(d) * np.float32(1 + c2p + p2c), dtype=np.float32)
  idx = jnp.clip(rel + span, 0, 2 * span - 1)[:, None]  # [1|b, 1, s, s]
  idx = jnp.broadcast_to(idx, (b, h, s, s))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k / scale, precision=_HIGHEST)
  if c2p:
    pk = jnp.asarray(pos_key, jnp.float32)[: 2 * span]
    c = jnp.einsum("bqhd,rhd->bhqr", q, pk, precision=_HIGHEST)
    scores = scores + jnp.take_along_axis(c, idx, axis=-1) / scale
  if p2c:
    pq = jnp.asarray(pos_query, jnp.float32)[: 2 * span]
    pt = jnp.einsum("bkhd,rhd->bhkr", k, pq, precision=_HIGHEST)
    pidx = jnp.broadcast_to(jnp.clip(-rel + span, 0, 2 * span - 1)[:, None],
                            (b, h, s, s))
    scores = scores + jnp.swapaxes(
        jnp.take_along_axis(pt, pidx, axis=-1), -1, -2) / scale
  vis = vis[:, None]
  scores = jnp.where(vis, scores, -jnp.inf)
  mx = jnp.max(scores, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.where(vis, jnp.exp(scores - mx), 0.0)
  den = jnp.sum(p, axis=-1, keepdims=True)
  p = p / jnp.where(den > 0, den, 1.0)
  if keep is not None and dropout_rate > 0:
    p = jnp.where(keep, p / (1.0 - dropout_rate), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=_HIGHEST)
  return out[0] if squeeze else out
