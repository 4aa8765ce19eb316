"""Memory-lean elementwise layers for training: GELU, LayerNorm and dropout
with custom VJPs that keep as little as possible for the backward.

Plain autodiff of `nn.gelu(x, approximate=False)` keeps four
[tokens, intermediate] arrays (erfc, exp, two products) per layer, flax's
`nn.LayerNorm` keeps three float32 [tokens, hidden] intermediates, and
`nn.Dropout` keeps its mask and its output. Here:

* `gelu_erf(x)` keeps x (the array the next matmul keeps anyway) and
  recomputes the erf and the Gaussian in the backward.
* `layer_norm(x, scale, bias, eps, dtype)` keeps x and the float32
  per-row mean and 1/std ([tokens] each).
* `dropout(x, key, rate)` keeps only the key: the backward regenerates the
  same mask from it (the mask is what flax's `nn.Dropout` draws from the
  same key: `jax.random.bernoulli(key, 1 - rate, x.shape)`); `Dropout` and
  `DropoutNNX` are the linen and nnx layers over it.

Each backward first passes what it kept through `jax.lax.optimization_barrier`
together with the incoming cotangent (`_after`): otherwise XLA merges the
recomputation with the forward's identical one (CSE), or schedules it as
soon as its inputs exist (the dropout key exists when the step starts), and
keeps the float32 intermediates or the random bits alive until the backward
after all. The forward dropout draws its bits only once `x` exists, for the
same reason.

All three compute in float32 and round once to the output dtype. With a
DeBERTa-v3-base training step at B2 L2048 this is most of the activation
memory (see benchmarks/deberta.py, `train` points).
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
from flax import nnx
import jax.numpy as jnp

_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _after(kept, g):
  """`kept`, passed through an optimization barrier with `g`: what is
  computed from the result cannot be scheduled before `g` exists, nor be
  merged with the same computation on the original `kept`."""
  return jax.lax.optimization_barrier((kept, g))[0]


# ----------------------------------------------------------------------------
# GELU (erf form)
# ----------------------------------------------------------------------------

@jax.custom_vjp
def gelu_erf(x: jax.Array) -> jax.Array:
  """x * Phi(x) (exact GELU, as torch's `gelu`), computed in float32."""
  xf = x.astype(jnp.float32)
  return (0.5 * xf * (1.0 + jax.lax.erf(xf * _INV_SQRT2))).astype(x.dtype)


def _gelu_fwd(x):
  return gelu_erf(x), x


def _gelu_bwd(x, g):
  x = _after(x, g)
  xf = x.astype(jnp.float32)
  cdf = 0.5 * (1.0 + jax.lax.erf(xf * _INV_SQRT2))
  pdf = _INV_SQRT_2PI * jnp.exp(-0.5 * xf * xf)
  return ((g.astype(jnp.float32) * (cdf + xf * pdf)).astype(x.dtype),)


gelu_erf.defvjp(_gelu_fwd, _gelu_bwd)


# ----------------------------------------------------------------------------
# LayerNorm over the last axis
# ----------------------------------------------------------------------------

def _ln_stats(xf, eps):
  mean = jnp.mean(xf, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
  return mean, jax.lax.rsqrt(var + eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float,
               dtype) -> jax.Array:
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in
  float32 (two-pass variance), rounded to `dtype`. x: [..., features];
  scale, bias: [features]."""
  return _ln_fwd(x, scale, bias, eps, dtype)[0]


def _ln_fwd(x, scale, bias, eps, dtype):
  xf = x.astype(jnp.float32)
  mean, rstd = _ln_stats(xf, eps)
  y = (xf - mean) * rstd * scale.astype(jnp.float32) + bias.astype(
      jnp.float32)
  return y.astype(dtype), (x, mean, rstd, scale, bias)


def _ln_bwd(eps, dtype, res, g):
  del eps, dtype
  x, mean, rstd, scale, bias = res
  x, mean, rstd = _after((x, mean, rstd), g)
  xhat = (x.astype(jnp.float32) - mean) * rstd
  gf = g.astype(jnp.float32)
  lead = tuple(range(gf.ndim - 1))
  dbias = jnp.sum(gf, axis=lead)
  dscale = jnp.sum(gf * xhat, axis=lead)
  dxhat = gf * scale.astype(jnp.float32)
  dx = rstd * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
               - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
  return (dx.astype(x.dtype), dscale.astype(scale.dtype),
          dbias.astype(bias.dtype))


layer_norm.defvjp(_ln_fwd, _ln_bwd)


class LayerNorm(nn.Module):
  """`flax.linen.LayerNorm` over the last axis with the same parameters
  (`scale` ones, `bias` zeros, [features]) and `layer_norm`'s lean VJP."""

  epsilon: float = 1e-6
  dtype: jnp.dtype | None = None
  param_dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    feat = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (feat,),
                       self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (feat,),
                      self.param_dtype)
    dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    return layer_norm(x, scale, bias, float(self.epsilon), jnp.dtype(dtype))


# ----------------------------------------------------------------------------
# Dropout
# ----------------------------------------------------------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dropout(x: jax.Array, key: jax.Array, rate: float) -> jax.Array:
  """Inverted dropout: x / (1 - rate) where
  `jax.random.bernoulli(key, 1 - rate, x.shape)`, else 0."""
  return _apply_mask(x, _after_key(key, x), rate)


def _after_key(key, x):
  """The key, usable only once `x` exists (see `_after`)."""
  return jax.random.wrap_key_data(_after(jax.random.key_data(key), x),
                                  impl=jax.random.key_impl(key))


def _apply_mask(x, key, rate):
  keep_prob = 1.0 - rate
  mask = jax.random.bernoulli(key, keep_prob, x.shape)
  return jax.lax.select(mask, x / jnp.asarray(keep_prob, x.dtype),
                        jnp.zeros_like(x))


def _dropout_fwd(x, key, rate):
  return dropout(x, key, rate), key


def _dropout_bwd(rate, key, g):
  return _apply_mask(g, _after_key(key, g), rate), None


dropout.defvjp(_dropout_fwd, _dropout_bwd)


class Dropout(nn.Module):
  """`flax.linen.Dropout` (no broadcast dims) whose backward regenerates
  the mask from the key instead of keeping it: the same mask, the same
  rng stream (`make_rng("dropout")` at the same module path)."""

  rate: float
  deterministic: bool | None = None
  rng_collection: str = "dropout"

  @nn.compact
  def __call__(self, x, deterministic: bool | None = None):
    deterministic = nn.merge_param("deterministic", self.deterministic,
                                   deterministic)
    if self.rate == 0.0 or deterministic:
      return x
    if self.rate == 1.0:
      return jnp.zeros_like(x)
    return dropout(x, self.make_rng(self.rng_collection), float(self.rate))


class DropoutNNX(nnx.Dropout):
  """`flax.nnx.Dropout` whose backward regenerates the mask from the key
  (`dropout`): the same key draw from the same rng stream, the same mask.
  With `broadcast_dims`, rate 0 or 1, or deterministic, it is nnx.Dropout."""

  def __call__(self, inputs, *, deterministic: bool | None = None,
               rngs=None):
    det = self.deterministic if deterministic is None else deterministic
    rngs = self.rngs if rngs is None else rngs
    if (self.broadcast_dims or det is None or det or rngs is None or
        self.rate in (0.0, 1.0)):
      return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
    if isinstance(rngs, nnx.Rngs):
      key = rngs[self.rng_collection]()
    elif isinstance(rngs, nnx.RngStream):
      key = rngs()
    else:
      key = rngs
    return dropout(inputs, key, float(self.rate))
