"""Pure-JAX disentangled attention, chunked over query rows.

Memory: one [batch, heads, chunk, seq] score block at a time (the chunk
body is rematerialised in the backward), not [batch, heads, seq, seq].
Gradients come from JAX autodiff; on GPU the gathers' transposes are
scatter-adds, so this path is *not* bitwise deterministic there (the Pallas
path is). Dropout uses the kernels' counter-based hash, so both backends
drop the same pairs for the same seed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.deberta import dropout_hash
from pallas_kernels.deberta.config import KernelConfig

_HIGHEST = lax.Precision.HIGHEST


def _precision(dtype):
  return _HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


@functools.partial(jax.jit, static_argnames=("cfg", "chunk"))
def xla_disentangled(q, k, v, pos_key, pos_query, seg, pos, valid, seed, *,
                     cfg: KernelConfig, chunk: int = 128):
  """q, k, v: [b, s, h, d]; pos_key/pos_query: [2*span, h, d] or None;
  seg: int32 [b, s] sequence index (pairs attend within equal seg; it is
  also the dropout hash's sequence index); pos: int32 [b, s] position in the
  sequence; valid: bool [b, s] (token mask and membership); seed: uint32
  scalar or None. Returns out [b, s, h, d] in q's dtype."""
  b, s, h, d = q.shape
  g = cfg.geometry
  slot_tab = jnp.asarray(g.slot_table())
  prec = _precision(q.dtype)
  f32 = jnp.float32
  c_tab = p_tab = None
  if cfg.c2p:
    c_tab = jnp.einsum("bshd,rhd->bhsr", q, pos_key, precision=prec,
                       preferred_element_type=f32).astype(q.dtype)
  if cfg.p2c:
    p_tab = jnp.einsum("bshd,rhd->bhsr", k, pos_query, precision=prec,
                       preferred_element_type=f32).astype(q.dtype)
  n_chunks = -(-s // chunk)
  pad = n_chunks * chunk - s

  def padq(x, fill=0):
    cfg_pad = [(0, 0)] * x.ndim
    cfg_pad[1] = (0, pad)
    return jnp.pad(x, cfg_pad, constant_values=fill)

  qs = padq(q).reshape(b, n_chunks, chunk, h, d)
  segs = padq(seg, -1).reshape(b, n_chunks, chunk)
  poss = padq(pos).reshape(b, n_chunks, chunk)
  valids = padq(valid, False).reshape(b, n_chunks, chunk)
  cs = None
  if cfg.c2p:
    cs = jnp.pad(c_tab, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(
        b, h, n_chunks, chunk, g.slots)

  @jax.checkpoint
  def body(qc, segc, posc, validc, cc, k, v, p_tab):
    sc = jnp.einsum("bqhd,bkhd->bhqk", qc, k, precision=prec,
                    preferred_element_type=f32)
    delta = posc[:, :, None] - pos[:, None, :]  # [b, chunk, s]
    slot = slot_tab[g.band_column(delta)]
    if cfg.c2p:
      idx = jnp.broadcast_to(slot[:, None], (b, h, chunk, s))
      sc = sc + jnp.take_along_axis(cc, idx, axis=-1).astype(f32)
    if cfg.p2c:
      bi = jnp.arange(b)[:, None, None, None]
      hi = jnp.arange(h)[None, :, None, None]
      ji = jnp.arange(s)[None, None, None, :]
      sc = sc + p_tab[bi, hi, ji, slot[:, None]].astype(f32)
    sc = sc * cfg.scale
    vis = ((segc[:, :, None] == seg[:, None, :]) & validc[:, :, None]
           & valid[:, None, :])[:, None]
    sc = jnp.where(vis, sc, -jnp.inf)
    m = jnp.max(sc, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(sc - m), 0.0)
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    if cfg.has_dropout:
      key = dropout_hash.program_key(seed, segc[:, None, :],
                                 jnp.arange(h, dtype=jnp.int32)[None, :, None])
      rh = dropout_hash.row_hash(key, posc[:, None, :])
      keep = dropout_hash.keep(rh[..., None], pos[:, None, None, :],
                           dropout_hash.threshold(cfg.dropout_rate))
      p = jnp.where(keep, p * cfg.keep_scale, 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v, precision=prec,
                      preferred_element_type=f32).astype(q.dtype)

  def one(i):
    cc = None if cs is None else cs[:, :, i]
    return body(qs[:, i], segs[:, i], poss[:, i], valids[:, i], cc, k, v,
                p_tab)

  out = lax.map(one, jnp.arange(n_chunks))  # [n_chunks, b, chunk, h, d]
  out = jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, h, d)
  return out[:, :s]
