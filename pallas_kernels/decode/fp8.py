"""FP8 KV pages with one float32 scale per (page, KV head).

A page p of KV head h stores x as e = fp8(x / s[p, h]) and decodes as
e * s[p, h]. The scale is a power of two,

    s = 2^ceil(log2(m / FP8_MAX)),   m = max |x| over the page's filled
                                        tokens (finite values only),

or 0 for a page whose filled values are all zero (it then decodes as zeros).
A power of two makes both directions exact apart from the one rounding to
FP8, and makes the dequantised value exactly representable in bf16 and
float32 (E4M3 / E5M2 mantissas are shorter than bf16's), so the kernel
dequantising in registers computes on the very values the float32 reference
sees over `dequantise_pages`.

Non-finite inputs (NaN, +-Inf) are stored as NaN and excluded from m, so
they never change the scale of their page, let alone of another page.

Growing a page (append): when a new token needs a larger scale s' > s, the
page's stored entries are re-quantised as fp8(e * (s / s')), deterministic
and a function of that page's own contents only (s / s' is a power of two,
so this is exact unless an entry falls into FP8's subnormal range).
"""

from __future__ import annotations

import jax.numpy as jnp

FP8_DTYPES = {jnp.dtype(jnp.float8_e4m3fn).name: 448.0,
              jnp.dtype(jnp.float8_e5m2).name: 57344.0}


def fp8_max(dtype) -> float:
  return FP8_DTYPES[jnp.dtype(dtype).name]


def page_scale(maxabs, dtype):
  """Power-of-two float32 scale mapping `maxabs` (float32, >= 0, finite) to
  at most fp8_max(dtype); 0 where maxabs is 0."""
  m = jnp.asarray(maxabs, jnp.float32)
  e = jnp.ceil(jnp.log2(jnp.maximum(m, 1e-38) / fp8_max(dtype)))
  # Keep the scale a normal float32 (and its reciprocal finite).
  e = jnp.clip(e, -120.0, 120.0)
  return jnp.where(m > 0, jnp.exp2(e), 0.0).astype(jnp.float32)


def finite_maxabs(x, mask, axes):
  """max |x| over `axes` where mask and x is finite (0 if none)."""
  xf = jnp.asarray(x, jnp.float32)
  a = jnp.where(mask & jnp.isfinite(xf), jnp.abs(xf), 0.0)
  return jnp.max(a, axis=axes)


def quantise(x, scale, dtype):
  """x (float, any shape) / scale (broadcastable, float32) -> fp8 `dtype`;
  non-finite x -> NaN, scale 0 -> 0. Saturates at +-fp8_max."""
  xf = jnp.asarray(x, jnp.float32)
  s = jnp.asarray(scale, jnp.float32)
  y = xf * jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0)
  mx = fp8_max(dtype)
  y = jnp.where(jnp.isfinite(xf), jnp.clip(y, -mx, mx), jnp.nan)
  return y.astype(dtype)


def dequantise(e, scale, dtype=jnp.float32):
  """fp8 entries times their (broadcastable) float32 scale, in `dtype`."""
  return (e.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(
      dtype)


def dequantise_pages(pages, scales, dtype=jnp.float32):
  """pages [num_pages, page_size, heads_kv, d] fp8, scales [num_pages,
  heads_kv] float32 -> dequantised pages in `dtype`."""
  return dequantise(pages, scales[:, None, :, None], dtype)


def quantise_pages(x, counts, dtype):
  """x [n, page_size, heads_kv, d] (tokens past counts[i] are ignored and
  stored as 0) -> (fp8 pages, float32 scales [n, heads_kv])."""
  s = x.shape[1]
  valid = (jnp.arange(s)[None, :] < jnp.asarray(counts)[:, None])
  valid = valid[:, :, None, None]
  scale = page_scale(finite_maxabs(x, valid, (1, 3)), dtype)
  e = quantise(jnp.where(valid, x, 0.0), scale[:, None, :, None], dtype)
  return e, scale
