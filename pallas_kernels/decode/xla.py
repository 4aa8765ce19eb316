"""The "xla" backend of the decode op: pure JAX over a paged cache, with the
decode kernel's exact semantics (inference only: no autodiff).

`backend="xla"` (and "auto" without an NVIDIA GPU) runs this, through
`pallas_kernels.decode.core.decode`. It gathers each sequence's pages into a
contiguous [batch, max_pages * page_size] view and computes, in float32, what
the Pallas kernel (`pallas_kernels.decode.kernel`) computes: the same declared
reference R (the same sampled keys) and the same overflow fallback (R := M
for rows with M - R > OVERFLOW_MARGIN). It is a model of the kernel's
arithmetic, not of its summation order: results agree with the kernel to
rounding, not bitwise. Memory is O(batch * max_len): a fallback, not a
serving path. FP8 pools are dequantised first
(`pallas_kernels.decode.fp8.dequantise_pages`, exact).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.decode.config import SAMPLE_TILE
from pallas_kernels.decode.kernel import OVERFLOW_MARGIN
from pallas_kernels.flash.tiles import LOG2E
from pallas_kernels.reference.decode import gather_pages

__all__ = ["xla_decode"]

_HIGHEST = jax.lax.Precision.HIGHEST


def _capped(x2, softcap: float):
  if softcap > 0.0:
    c2 = softcap * LOG2E
    return c2 * jnp.tanh(x2 / c2)
  return x2


def xla_decode(q, k_pages, v_pages, block_table, lengths, *,
               softmax_scale=None, sinks=None, window_left: int = -1,
               softcap: float = 0.0, return_reference=False):
  """q [batch, (q_len,) heads_q, head_dim] -> same shape, q's dtype.

  k_pages, v_pages: [num_pages, page_size, heads_kv, d_pad] in a float dtype
  (head dim may be zero-padded; the padding is ignored); block_table int32
  [batch, max_pages]; lengths int32 [batch]. With return_reference, also
  the float32 declared references [batch, heads_kv, rows] used.
  """
  squeeze = q.ndim == 3
  if squeeze:
    q = q[:, None]
  b, q_len, hq, d = q.shape
  _, s, hkv, _ = k_pages.shape
  g = hq // hkv
  rows = g * q_len
  scale = (1.0 / d ** 0.5) if softmax_scale is None else float(softmax_scale)
  c2 = scale * LOG2E
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

  vv = gather_pages(v_pages, bt)[..., :d].astype(jnp.float32)

  def attend(r):
    m = jnp.max(jnp.where(vis, sc, -jnp.inf), axis=-1)
    p = jnp.where(vis, jnp.exp2(sc - r[..., None]), 0.0)
    l = jnp.sum(p, axis=-1)
    if sink2 is not None:
      l = l + jnp.exp2(sink2 - r)
    acc = jnp.einsum("bhrt,bthd->bhrd", p, vv, precision=_HIGHEST)
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
