"""Plain-`jnp` float32 reference for dense (and packed varlen) attention.

Every dense kernel in this package is tested against `attention_reference`.

Layouts (FlashAttention's):
  q: [batch, seq_q, heads_q, head_dim]
  k, v: [batch, seq_k, heads_kv, head_dim], heads_q % heads_kv == 0 (GQA/MQA)

Conventions shared by every reference and kernel of this package:
  * scores  s_ij = scale * q_i . k_j, then `softcap * tanh(s_ij / softcap)`
    when softcap > 0 (FlashAttention's order: scale, then soft-cap).
  * causal masks are bottom-right aligned: query i of a sequence with
    `len_q` queries and `len_k` keys sees key j iff j <= i + (len_k - len_q).
  * window_size = (left, right), -1 meaning unbounded on that side: query i
    sees key j iff i + off - left <= j <= i + off + right, off = len_k - len_q.
    `causal=True` is the same as right = 0.
  * sinks: one logit per query head that joins the softmax denominator only:
    m = max(max_j s_ij, sink), out_i = sum_j exp(s_ij - m) v_j / l_i with
    l_i = sum_j exp(s_ij - m) + exp(sink - m).
  * lse_i = log(sum_j exp(s_ij) [+ exp(sink)]), the log of the denominator.
  * A fully masked query row (no visible key) gives out_i = 0, never NaN, and
    lse_i = -inf (or `sink` when sinks are given); its gradients are 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.varlen import token_seq_ids

_HIGHEST = jax.lax.Precision.HIGHEST


class MaskSpec(NamedTuple):
  """Per-token coordinates from which every dense mask is derived.

  seq_id: which sequence (segment) a token belongs to; tokens only attend
    within their own id.
  pos: position of the token inside its sequence.
  length: length of the token's sequence (queries: len_q, keys: len_k).
  """

  seq_id: jax.Array
  pos: jax.Array
  length: jax.Array


def dense_mask_spec(batch: int, seq: int, segment_ids=None) -> MaskSpec:
  """MaskSpec for a padded-batch layout: [batch, seq] coordinates."""
  pos = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
  length = jnp.full((batch, seq), seq, jnp.int32)
  if segment_ids is None:
    seq_id = jnp.zeros((batch, seq), jnp.int32)
  else:
    seq_id = jnp.asarray(segment_ids, jnp.int32)
  return MaskSpec(seq_id, pos, length)


def varlen_mask_spec(cu_seqlens, total: int) -> MaskSpec:
  """MaskSpec for a packed layout: [1, total] coordinates from `cu_seqlens`.

  Tokens at or past cu_seqlens[-1] get seq_id -1 on queries, which matches
  nothing (their rows are fully masked).
  """
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  t = jnp.arange(total, dtype=jnp.int32)
  seq = token_seq_ids(cu, total)
  n = cu.shape[0] - 1
  valid = (t < cu[-1]) & (seq >= 0) & (seq < n)
  seq_c = jnp.clip(seq, 0, n - 1)
  pos = t - cu[seq_c]
  length = cu[seq_c + 1] - cu[seq_c]
  seq_id = jnp.where(valid, seq_c, -1)
  return MaskSpec(seq_id[None], pos[None], length[None])


def visibility(qs: MaskSpec, ks: MaskSpec, *, causal: bool,
               window_size: tuple[int, int]) -> jax.Array:
  """Boolean [batch, seq_q, seq_k]: True where query i may attend key j."""
  left, right = window_size
  if causal:
    right = 0 if right < 0 else min(right, 0)
  qi = qs.pos[:, :, None]
  kj = ks.pos[:, None, :]
  off = ks.length[:, None, :] - qs.length[:, :, None]
  vis = (qs.seq_id[:, :, None] == ks.seq_id[:, None, :]) & (
      qs.seq_id[:, :, None] >= 0) & (ks.seq_id[:, None, :] >= 0)
  if right >= 0:
    vis &= kj <= qi + off + right
  if left >= 0:
    vis &= kj >= qi + off - left
  return vis


def attention_reference(q, k, v, *, causal: bool = False,
                        softmax_scale: float | None = None,
                        window_size: tuple[int, int] = (-1, -1),
                        sinks=None, softcap: float = 0.0,
                        segment_ids=None, q_spec: MaskSpec | None = None,
                        k_spec: MaskSpec | None = None):
  """Float32 dense attention.

  Args:
    q: [batch, seq_q, heads_q, head_dim]
    k, v: [batch, seq_k, heads_kv, head_dim]
    segment_ids: None, an int array [batch, seq] (needs seq_q == seq_k) or a
      pair (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_k]).
    q_spec, k_spec: explicit MaskSpecs (used by the varlen reference);
      override `segment_ids`.
    sinks: [heads_q] logits, or None.

  Returns:
    out: [batch, seq_q, heads_q, head_dim] float32
    lse: [batch, heads_q, seq_q] float32
  """
  q = jnp.asarray(q, jnp.float32)
  k = jnp.asarray(k, jnp.float32)
  v = jnp.asarray(v, jnp.float32)
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  group = hq // hkv
  scale = (1.0 / d**0.5) if softmax_scale is None else float(softmax_scale)
  if q_spec is None or k_spec is None:
    if segment_ids is None:
      qseg = kseg = None
    elif isinstance(segment_ids, (tuple, list)):
      qseg, kseg = segment_ids
    else:
      qseg = kseg = segment_ids
    q_spec = dense_mask_spec(b, sq, qseg)
    k_spec = dense_mask_spec(b, sk, kseg)
  vis = visibility(q_spec, k_spec, causal=causal, window_size=window_size)
  vis = vis[:, None]  # [b, 1, sq, sk]

  kq = jnp.repeat(k, group, axis=2)
  vq = jnp.repeat(v, group, axis=2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, kq, precision=_HIGHEST) * scale
  if softcap > 0.0:
    s = softcap * jnp.tanh(s / softcap)
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1)  # [b, h, sq]
  if sinks is not None:
    sink = jnp.asarray(sinks, jnp.float32)[None, :, None]
    m = jnp.maximum(m, sink)
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sink - m_safe)
  safe_denom = jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p / safe_denom[..., None], vq,
                   precision=_HIGHEST)
  lse = jnp.where(denom > 0, m_safe + jnp.log(safe_denom), -jnp.inf)
  return out, lse


def varlen_attention_reference(q, k, v, cu_seqlens_q, cu_seqlens_k=None, **kw):
  """Float32 packed varlen attention.

  Args:
    q: [total_q, heads_q, head_dim]; k, v: [total_k, heads_kv, head_dim]
    cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1], cumulative lengths
      (cu_seqlens_k defaults to cu_seqlens_q). Causal and window alignment is
      per sequence.

  Returns:
    out: [total_q, heads_q, head_dim] float32; lse: [heads_q, total_q].
  """
  if cu_seqlens_k is None:
    cu_seqlens_k = cu_seqlens_q
  q_spec = varlen_mask_spec(cu_seqlens_q, q.shape[0])
  k_spec = varlen_mask_spec(cu_seqlens_k, k.shape[0])
  # Keys past cu_seqlens_k[-1] must match nothing either.
  out, lse = attention_reference(q[None], k[None], v[None], q_spec=q_spec,
                                 k_spec=k_spec, **kw)
  return out[0], lse[0]
