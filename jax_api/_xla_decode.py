"""Pure-JAX decode over a paged cache with the decode kernel's exact semantics.

`backend="xla"` (and "auto" without an NVIDIA GPU) runs this. It gathers each
sequence's pages into a contiguous [batch, max_pages * page_size] view and
computes, in float32, what `pallas_kernels.decode` computes: the same declared
reference R (the same sampled keys), the same overflow fallback (R := M for
rows with M - R > OVERFLOW_MARGIN), the same `depth` cut and mass estimate and
the same `v8` decoding with the same residual-plane rule. It is a model of the
kernel's arithmetic, not of its summation order: results agree with the kernel
to rounding, not bitwise. Memory is O(batch * max_len): a fallback, not a
serving path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode.config import SAMPLE_TILE
from pallas_kernels.decode.kernel import OVERFLOW_MARGIN, V8_RES_SHIFT
from pallas_kernels.flash.tiles import LN2, LOG2E
from pallas_kernels.reference.decode import gather_pages

_HIGHEST = jax.lax.Precision.HIGHEST


def _capped(x2, softcap: float):
  if softcap > 0.0:
    c2 = softcap * LOG2E
    return c2 * jnp.tanh(x2 / c2)
  return x2


def xla_decode(q, k_pages, v_pages, block_table, lengths, *,
               softmax_scale=None, sinks=None, window_left: int = -1,
               softcap: float = 0.0, depth=None, v_res=None, v_scale=None,
               summaries=None, v8_depth: int = 12, return_reference=False):
  """q [batch, (q_len,) heads_q, head_dim] -> same shape, q's dtype.

  Page pools as in `pallas_kernels.decode.paged_decode` (head dim may be
  zero-padded; the padding is ignored).
  """
  squeeze = q.ndim == 3
  if squeeze:
    q = q[:, None]
  b, q_len, hq, d = q.shape
  n_pages, s, hkv, _ = k_pages.shape
  g = hq // hkv
  rows = g * q_len
  scale = (1.0 / d ** 0.5) if softmax_scale is None else float(softmax_scale)
  c2 = scale * LOG2E
  v8 = v_res is not None
  bt = jnp.asarray(block_table, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)

  k = gather_pages(k_pages, bt)[..., :d].astype(jnp.float32)  # [b, t, hkv, d]
  t_max = k.shape[1]
  qg = q.astype(jnp.float32).reshape(b, q_len, hkv, g, d)
  qg = qg.transpose(0, 2, 1, 3, 4).reshape(b, hkv, rows, d)
  raw = jnp.einsum("bhrd,bthd->bhrt", qg, k, precision=_HIGHEST)
  sc = _capped(raw * c2, softcap)

  hi = lengths[:, None, None, None]
  kpos = jnp.arange(t_max, dtype=jnp.int32)[None, None, None, :]
  pos = (lengths[:, None, None] - q_len +
         jnp.arange(rows, dtype=jnp.int32)[None, None, :] // g)[..., None]
  vis = (kpos < hi) & (kpos <= pos)
  if window_left >= 0:
    vis &= kpos >= pos - window_left
    lo = jnp.maximum(hi - q_len - window_left, 0)
  else:
    lo = jnp.zeros_like(hi)
  sample = ((kpos % s == 0) | (kpos >= hi - SAMPLE_TILE)) & (kpos >= lo)
  ref = jnp.max(jnp.where(vis & sample, sc, -jnp.inf), axis=-1)
  sink2 = None
  if sinks is not None:
    sink2 = jnp.asarray(sinks, jnp.float32).reshape(hkv, g)
    sink2 = jnp.tile(sink2, (1, q_len))[None] * LOG2E  # [1, hkv, rows]
    ref = jnp.maximum(ref, sink2)
  ref = jnp.where(ref == -jnp.inf, 0.0, ref)

  # Per-page quantities, broadcast to keys.
  n_lp = bt.shape[1]
  use_summ = depth is not None
  if use_summ:
    kmax, kmin, ksum, ksq = (jnp.asarray(x)[..., :d].astype(jnp.float32)
                             for x in summaries)
    bt_c = jnp.clip(bt, 0, n_pages - 1)
    gmax, gmin, gsum, gsq = (x[bt_c] for x in (kmax, kmin, ksum, ksq))
    # [b, n_lp, hkv, d] -> bound per (b, hkv, rows, n_lp)
    u_raw = jnp.sum(jnp.maximum(qg[:, :, :, None, :] * gmax.transpose(
        0, 2, 1, 3)[:, :, None], qg[:, :, :, None, :] * gmin.transpose(
            0, 2, 1, 3)[:, :, None]), axis=-1)
    u = _capped(u_raw * c2, softcap)
    cnt = jnp.clip(lengths[:, None] - jnp.arange(n_lp)[None, :] * s, 1, s)
    cnt = cnt.astype(jnp.float32)[:, None, None, :]
    mean = gsum.transpose(0, 2, 1, 3)[:, :, None] / cnt[..., None]
    var = jnp.maximum(gsq.transpose(0, 2, 1, 3)[:, :, None] / cnt[..., None]
                      - mean * mean, 0.0)
    mu2 = jnp.sum(qg[:, :, :, None, :] * mean, axis=-1) * c2
    var2 = jnp.sum(qg[:, :, :, None, :] ** 2 * var, axis=-1) * (c2 * c2)
    e = _capped(jnp.minimum(mu2 + 0.5 * LN2 * var2, u_raw * c2), softcap)
    to_key = lambda x: jnp.repeat(x, s, axis=-1)  # noqa: E731

  if v8:
    vc = gather_pages(v_pages, bt)[..., :d].astype(jnp.float32)
    vr = gather_pages(v_res, bt)[..., :d].astype(jnp.float32)
  else:
    vv = gather_pages(v_pages, bt)[..., :d].astype(jnp.float32)

  def attend(r):
    use = vis
    if depth is not None:
      keep = to_key(u >= r[..., None] - depth)
      use = vis & keep
    m = jnp.max(jnp.where(use, sc, -jnp.inf), axis=-1)
    rel = sc - r[..., None]
    p = jnp.where(use, jnp.exp2(rel), 0.0)
    l = jnp.sum(p, axis=-1)
    num = p
    if depth is not None:
      est = jnp.where(vis & ~keep, jnp.exp2(to_key(e) - r[..., None]), 0.0)
      l = l + jnp.sum(est, axis=-1)
      num = jnp.where(rel >= -depth, p, 0.0)
    if sink2 is not None:
      l = l + jnp.exp2(sink2 - r)
    if v8:
      fine = jnp.where(rel >= -v8_depth, num, 0.0)
      acc = jnp.einsum("bhrt,bthd->bhrd", num, vc, precision=_HIGHEST)
      acc = acc + jnp.einsum("bhrt,bthd->bhrd", fine, vr,
                             precision=_HIGHEST) * 2.0 ** -V8_RES_SHIFT
      acc = acc * jnp.asarray(v_scale, jnp.float32).reshape(())
    else:
      acc = jnp.einsum("bhrt,bthd->bhrd", num, vv, precision=_HIGHEST)
    out = jnp.where((l > 0)[..., None], acc / jnp.where(l > 0, l, 1.0)[
        ..., None], 0.0)
    return out, m

  out, m = attend(ref)
  flag = m - ref > OVERFLOW_MARGIN
  ref2 = jnp.where(flag, m, ref)
  out = jax.lax.cond(jnp.any(flag), lambda: attend(ref2)[0], lambda: out)
  out = out.reshape(b, hkv, q_len, g, d).transpose(0, 2, 1, 3, 4)
  out = out.reshape(b, q_len, hq, d).astype(q.dtype)
  if squeeze:
    out = out[:, 0]
  if return_reference:
    return out, jnp.where(flag, m, ref)
  return out
