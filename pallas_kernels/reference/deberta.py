"""Plain-`jnp` float32 reference for DeBERTa-v2/v3 disentangled attention.

Reproduces Hugging Face transformers' `DisentangledSelfAttention`
(models/deberta_v2/modeling_deberta_v2.py, transformers 5.x) at the level of
one attention call, given already-projected q/k/v and relative-position
projections.

Layouts (FlashAttention's, as everywhere else in this package):
  q, k, v:    [batch, seq, heads, head_dim]      (self-attention: one `seq`)
  pos_key:    [2 * att_span, heads, head_dim]    rel_embeddings @ key proj
  pos_query:  [2 * att_span, heads, head_dim]    rel_embeddings @ query proj
  out:        [batch, seq, heads, head_dim]
  lse:        [batch, heads, seq]

With r(i, j) the (log-bucketed) relative position of query i to key j
(r = bucket(pos_i - pos_j)), att_span = position_buckets if > 0 else
max_relative_positions, n_terms = 1 + [c2p in types] + [p2c in types] and
c = sqrt(head_dim * n_terms):

  s_ij = (q_i . k_j) / c
       + (q_i . pos_key[clip(r(i, j) + att_span)]) / c           (c2p)
       + (k_j . pos_query[clip(-r(j, i) + att_span)]) / c        (p2c)

clip(x) = clamp(x, 0, 2 * att_span - 1). The p2c index uses r(j, i), the
*transposed* relative position: HF gathers p2c along the key rows with
-relative_pos and then transposes the result. Since the bucketing is odd
(bucket(-x) = -bucket(x)) the p2c index equals the c2p index whenever the
relative positions come from `build_relative_position`; it differs only for a
caller-supplied, non-antisymmetric `relative_pos`.

Masking: `attention_mask` is a [batch, seq] 0/1 padding mask, and pair (i, j)
is visible iff mask_i != 0 and mask_j != 0 (HF's `get_attention_mask`).
Package convention (see dense.py): a fully masked query row gives out = 0,
lse = -inf and zero gradients. NOTE this differs from HF 5.x, which fills
masked scores with finfo.min and runs a plain softmax, so a fully padded row
there is the *uniform average of all v rows*; only visible rows are
comparable.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference.dense import varlen_mask_spec

_HIGHEST = jax.lax.Precision.HIGHEST


def deberta_att_span(position_buckets: int, max_relative_positions: int) -> int:
  """HF's `pos_ebd_size`: half the number of relative-embedding rows used.

  `max_relative_positions` must already be resolved (HF replaces a value < 1
  with `config.max_position_embeddings`).
  """
  if position_buckets > 0:
    return int(position_buckets)
  if max_relative_positions < 1:
    raise ValueError(
        "max_relative_positions < 1: resolve it to max_position_embeddings "
        "first, as HF does")
  return int(max_relative_positions)


def _host_log_bucket(abs_pos: np.ndarray, mid: int, max_position: int):
  """HF's log branch, ceil(...) + mid, for |r| > mid, evaluated on the host.

  Emulates torch's float32 arithmetic in HF's operation order with a
  correctly rounded float32 log (float64 log rounded to float32). XLA's
  vectorised float32 log is less accurate and flips the ceil at some edges
  (e.g. |r| = 17852 for 256 buckets / 512 positions), hence the host path.
  """
  ratio = abs_pos.astype(np.float32) / np.float32(mid)
  log_ratio = np.log(ratio.astype(np.float64)).astype(np.float32)
  denom = np.float32(np.log(np.float64(np.float32((max_position - 1) / mid))))
  val = (log_ratio / denom) * np.float32(mid - 1)
  return np.ceil(val).astype(np.int64) + mid


@functools.lru_cache(maxsize=64)
def _log_bucket_thresholds(bucket_size: int, max_position: int):
  """(first, t): the log branch at |r| is first + #{k : t[k] <= |r|}.

  The branch is monotone in |r|, so it is fully described by the smallest
  |r| at which each successive bucket value starts; this turns the bucketing
  of traced positions into a searchsorted against host-computed edges.
  """
  mid = bucket_size // 2
  lo_a, hi_a = mid + 1, np.iinfo(np.int32).max
  first = int(_host_log_bucket(np.array([lo_a]), mid, max_position)[0])
  last = int(_host_log_bucket(np.array([hi_a]), mid, max_position)[0])
  targets = np.arange(first + 1, last + 1, dtype=np.int64)
  lo = np.full(targets.shape, lo_a, np.int64)
  hi = np.full(targets.shape, hi_a, np.int64)
  # Vectorised binary search: smallest a with bucket(a) >= target.
  while np.any(lo < hi):
    m = (lo + hi) // 2
    ge = _host_log_bucket(m, mid, max_position) >= targets
    hi = np.where(ge, m, hi)
    lo = np.where(ge, lo, m + 1)
  return first, lo


def make_log_position_buckets(relative_pos, bucket_size: int,
                              max_position: int) -> jax.Array:
  """HF's `make_log_bucket_position`, elementwise on integer positions.

  |r| <= bucket_size // 2 is kept as is; larger distances are compressed
  logarithmically (sign kept) so that max_position - 1 lands near
  bucket_size - 1. Matches HF's float32 evaluation (with a correctly rounded
  log) for every int32 r; works on traced arrays too.

  Args:
    relative_pos: integer array of any shape (query pos - key pos).
    bucket_size: >= 2; max_position: > bucket_size // 2 + 1.
  Returns:
    int32 array of the same shape.
  """
  mid = bucket_size // 2
  if mid < 1 or max_position - 1 <= mid:
    raise ValueError(
        f"need bucket_size >= 2 and max_position > bucket_size // 2 + 1, got "
        f"{bucket_size}, {max_position}")
  first, edges = _log_bucket_thresholds(int(bucket_size), int(max_position))
  if not isinstance(relative_pos, jax.core.Tracer):
    # Concrete positions: bucket on the host, avoiding per-shape compiles.
    rel = np.asarray(relative_pos).astype(np.int32)
    abs_pos = np.abs(rel.astype(np.int64))
    log_abs = first + np.searchsorted(edges, abs_pos, side="right")
    return jnp.asarray(np.where(abs_pos <= mid, rel, np.sign(rel) * log_abs)
                       .astype(np.int32))
  rel = jnp.asarray(relative_pos).astype(jnp.int32)
  abs_pos = jnp.abs(rel)
  log_abs = first + jnp.searchsorted(jnp.asarray(edges, jnp.int32), abs_pos,
                                     side="right").astype(jnp.int32)
  return jnp.where(abs_pos <= mid, rel, jnp.sign(rel) * log_abs)


def build_relative_position(query_size: int, key_size: int,
                            bucket_size: int = -1,
                            max_position: int = -1) -> jax.Array:
  """HF's `build_relative_position` for positions 0..size-1.

  Returns:
    int32 [1, query_size, key_size], entry [0, i, j] = bucket(i - j)
    (log-bucketed only when bucket_size > 0 and max_position > 0).
  """
  rel = (np.arange(query_size, dtype=np.int32)[:, None]
         - np.arange(key_size, dtype=np.int32)[None, :])
  if bucket_size > 0 and max_position > 0:
    rel = make_log_position_buckets(rel, bucket_size, max_position)
  return jnp.asarray(rel)[None]


def _rel_from_positions(pos, bucket_size, max_position):
  """[b, s] token positions -> [b, s, s] (bucketed) pos_i - pos_j."""
  rel = pos[:, :, None] - pos[:, None, :]
  if bucket_size > 0 and max_position > 0:
    rel = make_log_position_buckets(rel, bucket_size, max_position)
  return rel.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _varlen_rel_vis(cu_seqlens, total, bucket_size, max_position):
  """Packed layout -> ([1, t, t] relative positions, [1, t, t] visibility).

  Positions restart at 0 in each sequence; tokens past cu_seqlens[-1]
  (seq_id -1) see nothing and are seen by nothing.
  """
  spec = varlen_mask_spec(cu_seqlens, total)
  rel = _rel_from_positions(spec.pos, bucket_size, max_position)
  sid = spec.seq_id
  vis = (sid[:, :, None] == sid[:, None, :]) & (sid[:, :, None] >= 0)
  return rel, vis


def _hf_scale(head_dim: int, n_terms: int) -> np.float32:
  # HF: torch.sqrt(torch.tensor(head_dim, float32) * n_terms), a float32
  # divisor (not a multiplied reciprocal).
  return np.sqrt(np.float32(head_dim) * np.float32(n_terms), dtype=np.float32)


# Jitted so that the reference costs one compile per shape rather than one
# per op (tests call it on many small shapes).
@functools.partial(jax.jit, static_argnames=("att_span", "c2p", "p2c"))
def _disentangled_core(q, k, v, pos_key, pos_query, rel, vis, *,
                       att_span: int, c2p: bool, p2c: bool):
  """q, k, v: [b, s, h, d]; rel: [b|1, s, s] int; vis: [b, s, s] bool."""
  b, s, h, d = q.shape
  dtype = q.dtype
  scale = jnp.asarray(_hf_scale(d, 1 + int(c2p) + int(p2c)), dtype)
  hi = 2 * att_span - 1

  # HF divides k (not q) before QK^T, and each position term after gathering.
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k / scale, precision=_HIGHEST)
  if c2p:
    c2p_att = jnp.einsum("bqhd,rhd->bhqr", q, pos_key, precision=_HIGHEST)
    idx = jnp.clip(rel + att_span, 0, hi)[:, None]
    idx = jnp.broadcast_to(idx, (b, h, s, s))
    scores = scores + jnp.take_along_axis(c2p_att, idx, axis=-1) / scale
  if p2c:
    # Rows of p2c_att are keys; HF gathers row a at clip(-rel[a, c] + span)
    # and transposes, so score[i, j] reads index clip(-rel[j, i] + span).
    p2c_att = jnp.einsum("bkhd,rhd->bhkr", k, pos_query, precision=_HIGHEST)
    idx = jnp.clip(-rel + att_span, 0, hi)[:, None]
    idx = jnp.broadcast_to(idx, (b, h, s, s))
    g = jnp.take_along_axis(p2c_att, idx, axis=-1)
    scores = scores + jnp.swapaxes(g, -1, -2) / scale

  vis = vis[:, None]  # [b, 1, s, s]
  scores = jnp.where(vis, scores, -jnp.inf)
  m = jnp.max(scores, axis=-1)
  # Keeps fully masked rows finite (0 output, 0 gradient) instead of NaN.
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(vis, jnp.exp(scores - m_safe[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  safe_denom = jnp.where(denom > 0, denom, 1.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", p / safe_denom[..., None], v,
                   precision=_HIGHEST)
  lse = jnp.where(denom > 0, m_safe + jnp.log(safe_denom), -jnp.inf)
  return out, lse


def _check_pos(name, pos, att_span, h, d, needed):
  if not needed:
    return None
  if pos is None:
    raise ValueError(f"{name} is required by pos_att_type")
  if pos.ndim != 3 or pos.shape[1:] != (h, d):
    raise ValueError(f"{name} must be [2*att_span, {h}, {d}], got {pos.shape}")
  if pos.shape[0] < 2 * att_span:
    raise ValueError(
        f"{name} has {pos.shape[0]} rows, needs 2*att_span = {2 * att_span}")
  # HF slices rel_embeddings[0 : 2 * att_span] before projecting.
  return pos[: 2 * att_span]


def disentangled_attention_reference(
    q, k, v, pos_key=None, pos_query=None, *,
    attention_mask=None,
    position_buckets: int = 256,
    max_relative_positions: int = 512,
    pos_att_type: Sequence[str] = ("c2p", "p2c"),
    relative_pos=None,
    cu_seqlens=None,
    return_lse: bool = False):
  """DeBERTa-v2/v3 disentangled self-attention (HF parity), float32.

  Args:
    q, k, v: [batch, seq, heads, head_dim] (projected, bias included), or with
      `cu_seqlens`: [1, total, heads, head_dim] or [total, heads, head_dim].
      Computation is in float32 (float64 if the inputs are float64).
    pos_key: [>= 2*att_span, heads, head_dim], the relative embeddings
      (HF: `encoder.get_rel_embedding()`) through the key projection (or
      `pos_key_proj` when share_att_key=False); only rows < 2*att_span are
      used. Required iff "c2p" in pos_att_type.
    pos_query: same, through the query projection (or `pos_query_proj`).
      Required iff "p2c" in pos_att_type.
    attention_mask: None or [batch, seq] 0/1; pair (i, j) visible iff
      mask_i != 0 and mask_j != 0. Not allowed with `cu_seqlens`.
    position_buckets, max_relative_positions: as in DebertaV2Config
      (max_relative_positions already resolved to >= 1);
      att_span = position_buckets if > 0 else max_relative_positions, and
      log-bucketing applies when both are > 0.
    pos_att_type: subset of ("c2p", "p2c").
    relative_pos: optional precomputed (already bucketed) int relative
      positions, [seq, seq] or [1|batch, seq, seq], used as is (as HF does).
      Not allowed with `cu_seqlens`.
    cu_seqlens: optional int32 [n + 1] cumulative lengths of packed
      sequences. Positions restart at 0 in each sequence and tokens attend
      only within their sequence; tokens at or past cu_seqlens[-1] are fully
      masked.
    return_lse: also return the log-sum-exp of the (scaled, biased) scores.

  Returns:
    out: float32, same shape as q (zeros on fully masked query rows);
    with return_lse, also lse: [batch, heads, seq] ([heads, total] for 3-D
    varlen input), -inf on fully masked rows.
  """
  types = tuple(pos_att_type or ())
  unknown = set(types) - {"c2p", "p2c"}
  if unknown:
    raise ValueError(f"unsupported pos_att_type entries: {sorted(unknown)}")
  c2p, p2c = "c2p" in types, "p2c" in types
  att_span = deberta_att_span(position_buckets, max_relative_positions)

  dtype = jnp.result_type(jnp.asarray(q).dtype, jnp.float32)
  q = jnp.asarray(q, dtype)
  k = jnp.asarray(k, dtype)
  v = jnp.asarray(v, dtype)

  squeeze = False
  if cu_seqlens is not None:
    if attention_mask is not None or relative_pos is not None:
      raise ValueError("cu_seqlens excludes attention_mask and relative_pos")
    if q.ndim == 3:
      squeeze = True
      q, k, v = q[None], k[None], v[None]
    if q.shape[0] != 1:
      raise ValueError(f"packed inputs need batch 1, got {q.shape}")

  if q.shape != k.shape or q.shape != v.shape:
    raise ValueError(f"q, k, v must share one shape (self-attention), got "
                     f"{q.shape}, {k.shape}, {v.shape}")
  b, s, h, d = q.shape
  pos_key = _check_pos("pos_key", None if pos_key is None else
                       jnp.asarray(pos_key, dtype), att_span, h, d, c2p)
  pos_query = _check_pos("pos_query", None if pos_query is None else
                         jnp.asarray(pos_query, dtype), att_span, h, d, p2c)

  if cu_seqlens is not None:
    rel, vis = _varlen_rel_vis(jnp.asarray(cu_seqlens, jnp.int32), s,
                               position_buckets, max_relative_positions)
  else:
    if relative_pos is None:
      rel = build_relative_position(s, s, position_buckets,
                                    max_relative_positions)
    else:
      rel = jnp.asarray(relative_pos).astype(jnp.int32)
      if rel.ndim == 2:
        rel = rel[None]
      if rel.ndim != 3 or rel.shape[1:] != (s, s) or rel.shape[0] not in (1, b):
        raise ValueError(f"relative_pos must be [seq, seq] or [1|batch, seq, "
                         f"seq] with seq={s}, got {rel.shape}")
    if attention_mask is None:
      vis = jnp.ones((b, s, s), bool)
    else:
      m = jnp.asarray(attention_mask) != 0
      if m.shape != (b, s):
        raise ValueError(f"attention_mask must be [{b}, {s}], got {m.shape}")
      vis = m[:, :, None] & m[:, None, :]

  out, lse = _disentangled_core(q, k, v, pos_key, pos_query, rel, vis,
                                att_span=att_span, c2p=c2p, p2c=p2c)
  if squeeze:
    out, lse = out[0], lse[0]
  return (out, lse) if return_lse else out
