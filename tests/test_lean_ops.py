"""The memory-lean GELU / LayerNorm / dropout match plain autodiff of
flax's layers, forward and backward, and keep less for the backward."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import _lean_ops as lean


def _x(shape, seed=0, dtype=jnp.float32):
  return jax.random.normal(jax.random.key(seed), shape, dtype) * 2.0 + 0.3


def test_gelu_matches_flax_exact_gelu():
  x = _x((7, 33))
  g = _x((7, 33), 1)
  ref = lambda x: nn.gelu(x, approximate=False)
  np.testing.assert_allclose(lean.gelu_erf(x), ref(x), rtol=1e-6, atol=1e-6)
  d = jax.vjp(lean.gelu_erf, x)[1](g)[0]
  dr = jax.vjp(ref, x)[1](g)[0]
  np.testing.assert_allclose(d, dr, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_matches_flax(dtype):
  x = _x((3, 5, 48), dtype=dtype)
  g = _x((3, 5, 48), 1, dtype=dtype)
  ours = lean.LayerNorm(epsilon=1e-7, dtype=dtype, param_dtype=jnp.float32)
  ref = nn.LayerNorm(epsilon=1e-7, dtype=dtype, param_dtype=jnp.float32,
                     use_fast_variance=False)
  params = ref.init(jax.random.key(0), x)
  params = jax.tree.map(lambda a: a + _x(a.shape, 3) * 0.1, params)
  assert (jax.tree.structure(ours.init(jax.random.key(0), x)) ==
          jax.tree.structure(params))
  f = lambda p, x: ours.apply(p, x)
  fr = lambda p, x: ref.apply(p, x)
  tol = 1e-5 if dtype == jnp.float32 else 2e-2
  y, vjp = jax.vjp(f, params, x)
  yr, vjpr = jax.vjp(fr, params, x)
  assert y.dtype == yr.dtype
  np.testing.assert_allclose(np.float32(y), np.float32(yr), rtol=tol,
                             atol=tol)
  for a, b in zip(jax.tree.leaves(vjp(g)), jax.tree.leaves(vjpr(g))):
    np.testing.assert_allclose(np.float32(a), np.float32(b), rtol=tol,
                               atol=tol * 10)


def test_dropout_same_mask_and_grad_as_flax():
  x = _x((4, 64))
  g = _x((4, 64), 1)
  rngs = {"dropout": jax.random.key(5)}
  ours = lean.Dropout(0.3)
  ref = nn.Dropout(0.3)
  y, vjp = jax.vjp(lambda x: ours.apply({}, x, False, rngs=rngs), x)
  yr, vjpr = jax.vjp(lambda x: ref.apply({}, x, False, rngs=rngs), x)
  np.testing.assert_array_equal(y == 0, yr == 0)  # the same mask
  np.testing.assert_allclose(y, yr, rtol=1e-6)
  np.testing.assert_allclose(vjp(g)[0], vjpr(g)[0], rtol=1e-6)
  assert 0 < int(jnp.sum(y == 0)) < y.size
  np.testing.assert_array_equal(ours.apply({}, x, True), x)


def test_nnx_dropout_same_mask_and_grad_as_nnx():
  from flax import nnx
  x = _x((4, 64))
  g = _x((4, 64), 1)

  def run(cls):
    y = cls(0.3, rngs=nnx.Rngs(dropout=5))(x)
    layer = cls(0.3, rngs=nnx.Rngs(dropout=5))
    gx = nnx.grad(lambda layer, x: jnp.sum(layer(x) * g), argnums=1)(layer,
                                                                      x)
    y2 = layer(x)  # the stream advanced: a new mask
    return y, gx, y2

  y, gx, y2 = run(lean.DropoutNNX)
  yr, gxr, y2r = run(nnx.Dropout)
  np.testing.assert_array_equal(y == 0, yr == 0)
  np.testing.assert_allclose(y, yr, rtol=1e-6)
  np.testing.assert_allclose(gx, gxr, rtol=1e-6)
  np.testing.assert_allclose(y2, y2r, rtol=1e-6)
  assert not np.array_equal(y == 0, y2 == 0)
  assert 0 < int(jnp.sum(y == 0)) < y.size
  layer = lean.DropoutNNX(0.3, rngs=nnx.Rngs(dropout=5))
  layer.eval()
  np.testing.assert_array_equal(layer(x), x)


def test_residuals_are_lean():
  """The backward keeps x for GELU and LayerNorm, the key for dropout."""
  from jax._src.ad_checkpoint import saved_residuals
  x = _x((8, 32))
  scale, bias = jnp.ones(32), jnp.zeros(32)

  def f(x):
    h = lean.gelu_erf(x)
    h = lean.layer_norm(h, scale, bias, 1e-6, jnp.float32)
    return jnp.sum(lean.dropout(h, jax.random.key(0), 0.5))

  big = [r for r in saved_residuals(f, x) if r[0].shape == x.shape]
  # x (GELU) and the GELU output (LayerNorm's input): two [8, 32] arrays
  assert len(big) == 2, big
