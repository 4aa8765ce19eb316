"""An exact integer grid on which float32 partial sums add in any order.

A value x (float32) is stored as the integer n = trunc(x / u) on a grid of
unit u = 2^e, in three int32 limbs of 20 bits, n = hi * 2^40 + mid * 2^20 +
lo (canonical form: 0 <= lo, mid < 2^20; hi signed). Integer addition is
associative, so a sum of grid values has the same limbs whatever the order
of its terms or how they were split across devices: this is what makes the
ring attention bitwise identical across device counts.

The unit is chosen from a bound T on each term (an exact function of the
inputs, e.g. a max): u = 2^(ceil(log2 T) - FRAC_BITS), so one term carries
FRAC_BITS bits below its bound and a sum of up to 2^24 terms fits the top
limb. Converting a float32 term to limbs is exact up to the truncation (all
steps subtract leading bits of a float or scale by powers of two).

Layout: limbs are the trailing axis of size 3, [..., (lo, mid, hi)].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FRAC_BITS = 44
MAX_TERMS_LOG2 = 24
_W = 20
_F32 = jnp.float32


def pow2(e) -> jax.Array:
  """Exactly 2^e as float32 for integer e in [-126, 127] (bit construction)."""
  e = jnp.asarray(e, jnp.int32)
  return jax.lax.bitcast_convert_type((e + 127) << 23, _F32)


def unit_exponent(bound) -> jax.Array:
  """int32 e with 2^e = pow2ceil(bound) * 2^-FRAC_BITS (bound >= 2^-60)."""
  bound = jnp.maximum(jnp.asarray(bound, _F32), 2.0**-60)
  _, e = jnp.frexp(bound)  # bound = m * 2^e, 0.5 <= m < 1: bound <= 2^e
  return (e - FRAC_BITS).astype(jnp.int32)


def canonical(limbs: jax.Array) -> jax.Array:
  """Propagates carries so that lo, mid are in [0, 2^20)."""
  lo, mid, hi = limbs[..., 0], limbs[..., 1], limbs[..., 2]
  c = lo >> _W
  lo = lo - (c << _W)
  mid = mid + c
  c = mid >> _W
  mid = mid - (c << _W)
  return jnp.stack([lo, mid, hi + c], axis=-1)


def to_grid(x, e) -> jax.Array:
  """float32 x -> canonical int32 limbs [..., 3] of trunc(x / 2^e)."""
  x = jnp.asarray(x, _F32)
  y = jnp.abs(x) * pow2(-e)
  hi = jnp.floor(y * 2.0**-40)
  rem = y - hi * 2.0**40  # exact: removes y's leading bits
  mid = jnp.floor(rem * 2.0**-20)
  lo = jnp.floor(rem - mid * 2.0**20)
  limbs = jnp.stack([lo, mid, hi], axis=-1).astype(jnp.int32)
  sign = jnp.where(x < 0, -1, 1).astype(jnp.int32)[..., None]
  return canonical(limbs * sign)


def add(a: jax.Array, b: jax.Array) -> jax.Array:
  """Sum of two canonical grid values (exact, commutative, associative)."""
  return canonical(a + b)


def zeros(shape) -> jax.Array:
  return jnp.zeros(tuple(shape) + (3,), jnp.int32)


def from_grid(limbs: jax.Array, e) -> jax.Array:
  """Canonical limbs -> float32 value (a fixed sequence of roundings)."""
  lo = limbs[..., 0].astype(_F32)
  mid = limbs[..., 1].astype(_F32)
  hi = limbs[..., 2].astype(_F32)
  return (hi * 2.0**40 + (mid * 2.0**20 + lo)) * pow2(e)


def psum(limbs: jax.Array, axis_name) -> jax.Array:
  """Exact all-reduce of grid values (integer psum, then carries)."""
  return canonical(jax.lax.psum(limbs, axis_name))
