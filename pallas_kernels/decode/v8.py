"""Two-plane FP8 (E4M3) value storage.

A value v is stored as a coarse plane c = e4m3(v / scale) and a residual
plane r = e4m3((v / scale - c) * 2^4); it decodes as scale * (c + r * 2^-4).
`scale` is one power of two per cache (per layer), fixed at the first write
(prefill) so that the largest value seen then maps to 224, half of E4M3's
largest finite 448: later values up to twice as large still fit; larger ones
saturate at +-448 * scale. Multiplying by a power of two is exact, so the
scale costs no precision.

E4M3 keeps 3 mantissa bits (relative spacing 2^-3), so the coarse plane alone
is within 2^-4 of v (relative) and the residual takes that error down to
about 2^-8 relative, close to bf16's 2^-9, for values in E4M3's normal range
(|v / scale| >= 2^-6; smaller ones lose relative precision gracefully).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.decode.kernel import V8_RES_SHIFT

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
V8_TARGET = 224.0


def v8_scale_for(maxabs):
  """Power-of-two scale mapping `maxabs` to at most V8_TARGET (float32)."""
  maxabs = jnp.asarray(maxabs, jnp.float32)
  e = jnp.ceil(jnp.log2(jnp.maximum(maxabs, 1e-30) / V8_TARGET))
  e = jnp.clip(e, -100.0, 100.0)
  return jnp.where(maxabs > 0, jnp.exp2(e), 1.0).astype(jnp.float32)


def encode_v8(v, scale):
  """v (any float dtype) -> (coarse, residual) E4M3 planes."""
  x = jnp.asarray(v, jnp.float32) / scale
  x = jnp.clip(x, -E4M3_MAX, E4M3_MAX)
  c = x.astype(E4M3)
  r = ((x - c.astype(jnp.float32)) * (2.0 ** V8_RES_SHIFT))
  r = jnp.clip(r, -E4M3_MAX, E4M3_MAX).astype(E4M3)
  return c, r


def decode_v8(c, r, scale, *, residual: bool = True):
  """float32 values from the planes (residual=False: coarse plane only)."""
  x = c.astype(jnp.float32)
  if residual:
    x = x + r.astype(jnp.float32) * (2.0 ** -V8_RES_SHIFT)
  return x * scale
