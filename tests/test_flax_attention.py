"""`jax_api.flax.attention_fn` swapped into stock Flax attention modules.

Against each module's default attention: outputs and gradients under
`jax.jit` for plain, causal, padded and segment masks (valid query rows only:
fully masked rows are 0 here by convention), the nnx decode cache one token
per call, mask recognition, the reference fallback and what it refuses.
"""

from __future__ import annotations

import functools
import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jax_api.flax import FallbackWarning, attention_fn, mask_to_kernel_args

# The package attribute `attention_fn` is the function; the module is here.
afn = importlib.import_module("jax_api.flax.attention_fn")

B, T, F, H = 2, 8, 16, 2
LENS = np.array([8, 5])


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
  monkeypatch.setattr(afn, "_warned", set())


def _masks():
  valid = jnp.arange(T)[None] < jnp.asarray(LENS)[:, None]
  seg = jnp.array([[1, 1, 1, 2, 2, 2, 3, 3], [1, 1, 2, 2, 2, 2, 2, 2]])
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  pad = nn.make_attention_mask(valid, valid)
  segm = nn.make_attention_mask(seg, seg, jnp.equal)
  ones = jnp.ones((B, T), bool)
  return {
      "plain": (None, ones),
      "causal": (causal, ones),
      "padded": (pad, valid),
      "causal_padded": (nn.combine_masks(causal, pad), valid),
      "key_padding": (valid[:, None, None, :], ones),
      "segment_causal": (nn.combine_masks(segm, causal), ones),
  }


def _x(seed=0):
  return jax.random.normal(jax.random.key(seed), (B, T, F), jnp.float32)


def _close(a, b, tol):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol,
                             rtol=tol)


# ----------------------------------------------------------- mask analysis --


def test_mask_analysis_recognises_flax_masks():
  ms = _masks()
  expect = {"causal": (True, False), "padded": (False, True),
            "causal_padded": (True, False), "key_padding": (False, True),
            "segment_causal": (True, False)}
  analyse = jax.jit(mask_to_kernel_args)
  for name, (ok_c, ok_p) in expect.items():
    m = jnp.broadcast_to(ms[name][0], (B, 1, T, T))[:, 0]
    _, _, c, p = analyse(m)
    assert (bool(c), bool(p)) == (ok_c, ok_p), name
  # Block-diagonal segments with non-contiguous ids, and a decode mask.
  seg = jnp.array([[3, 1, 3, 1, 2, 2, 3, 1]] * B)
  m = nn.make_attention_mask(seg, seg, jnp.equal)[:, 0]
  assert bool(analyse(m)[3])
  dec = jnp.broadcast_to(jnp.arange(T) <= 4, (B, 1, T))
  _, _, c, p = analyse(dec)
  assert bool(c) and bool(p)
  # Not expressible: a random mask, a top-left causal mask with q_len < kv_len.
  arb = jax.random.bernoulli(jax.random.key(3), 0.6, (B, T, T))
  assert not any(map(bool, analyse(arb)[2:]))
  tl = jnp.broadcast_to(jnp.tril(jnp.ones((4, T), bool)), (B, 4, T))
  assert not any(map(bool, analyse(tl)[2:]))


# --------------------------------------------------------------- nnx ----


def _nnx_pair(fn, **kw):
  mk = lambda f: nnx.MultiHeadAttention(num_heads=H, in_features=F,
                                        decode=False, rngs=nnx.Rngs(0),
                                        attention_fn=f, **kw)
  return mk(nnx.dot_product_attention), mk(fn)


MASK_KINDS = ["plain", "causal", "padded", "causal_padded", "key_padding",
              "segment_causal"]


def _full(mask):
  """Every mask as [B, 1, T, T] (all-ones for plain), so one compile serves."""
  return jnp.broadcast_to(jnp.ones((B, 1, T, T), bool) if mask is None
                          else mask.astype(bool), (B, 1, T, T))


def test_nnx_mha_matches_default():
  ref, ours = _nnx_pair(functools.partial(attention_fn, backend="xla"),
                        num_kv_heads=1)
  x = _x()

  @nnx.jit
  def run(model, x, mask, w):
    def loss(model, x):
      out = model(x, mask=mask)
      return jnp.sum(out * w), out
    (_, out), (g_model, g_x) = nnx.value_and_grad(
        loss, argnums=(0, 1), has_aux=True)(model, x)
    return out, nnx.state(g_model, nnx.Param), g_x

  for name in MASK_KINDS:
    mask, valid = _masks()[name]
    w = jax.random.normal(jax.random.key(9), (B, T, F)) * valid[..., None]
    with warnings.catch_warnings():
      warnings.simplefilter("error", FallbackWarning)
      o1, gm1, gx1 = run(ours, x, _full(mask), w)
    o0, gm0, gx0 = run(ref, x, _full(mask), w)
    v = np.asarray(valid)[..., None]
    _close(np.where(v, o1, 0), np.where(v, o0, 0), 2e-5)
    if name in ("padded", "causal_padded"):  # convention: padded rows are 0
      assert np.all(np.asarray(o1)[~np.asarray(valid)] ==
                    np.asarray(ours.out.bias[...]))
    jax.tree.map(lambda a, b: _close(a, b, 5e-5), gm1, gm0)
    _close(gx1, gx0, 5e-5)


def test_nnx_is_causal_flag():
  ref, ours = _nnx_pair(functools.partial(attention_fn, backend="xla"))
  x = _x(1)
  f = nnx.jit(lambda m, x: m(x, is_causal=True))
  _close(f(ours, x), f(ref, x), 2e-5)


@pytest.mark.parametrize("backend,kv_heads", [("xla", 1), ("interpret", 2)])
def test_nnx_decode_cache_matches_full(backend, kv_heads):
  kw = dict(num_heads=H, in_features=F, num_kv_heads=kv_heads)
  ours = nnx.MultiHeadAttention(
      decode=True, attention_fn=functools.partial(attention_fn,
                                                  backend=backend),
      rngs=nnx.Rngs(0), **kw)
  ref = nnx.MultiHeadAttention(decode=False, rngs=nnx.Rngs(0), **kw)
  x = _x(2)
  ours.init_cache((B, T, F))

  @nnx.jit
  def step(m, xt):
    return m(xt)

  inc = jnp.concatenate([step(ours, x[:, t:t + 1]) for t in range(T)], 1)
  full = ref(x, mask=nnx.make_causal_mask(jnp.ones((B, T))))
  _close(inc, full, 2e-5)
  # Greedy "tokens" (argmax over features) agree exactly.
  assert np.array_equal(np.argmax(inc, -1), np.argmax(full, -1))


def test_sow_weights_records_reference_weights():
  ref, ours = _nnx_pair(functools.partial(attention_fn, backend="xla"))
  x = _x(3)
  mask = _masks()["causal"][0]
  fwd = lambda m, x: m(x, mask=mask, sow_weights=True)
  o1, s1 = nnx.capture(fwd, nnx.Intermediate)(ours, x)
  o0, s0 = nnx.capture(fwd, nnx.Intermediate)(ref, x)
  _close(o1, o0, 2e-5)
  w1, w0 = jax.tree.leaves(s1), jax.tree.leaves(s0)
  assert len(w1) == len(w0) == 1
  _close(w1[0], w0[0], 2e-5)


# -------------------------------------------------------------- linen ----


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_linen_mha_matches_default(backend):
  ref = nn.MultiHeadDotProductAttention(num_heads=H)
  ours = nn.MultiHeadDotProductAttention(
      num_heads=H, attention_fn=functools.partial(attention_fn,
                                                  backend=backend))
  x = _x(4)
  params = jax.jit(ref.init)(jax.random.key(1), x)

  def run(module):
    def loss(p, x, mask, w):
      out = module.apply(p, x, mask=mask)
      return jnp.sum(out * w), out
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))

  f1, f0 = run(ours), run(ref)
  kinds = (MASK_KINDS if backend == "xla" else ["causal_padded"])
  for name in kinds:
    mask, valid = _masks()[name]
    w = jax.random.normal(jax.random.key(9), (B, T, F)) * valid[..., None]
    with warnings.catch_warnings():
      warnings.simplefilter("error", FallbackWarning)
      (_, o1), g1 = f1(params, x, _full(mask), w)
    (_, o0), g0 = f0(params, x, _full(mask), w)
    v = np.asarray(valid)[..., None]
    _close(np.where(v, o1, 0), np.where(v, o0, 0), 2e-5)
    jax.tree.map(lambda a, b: _close(a, b, 5e-5), g1, g0)


def test_linen_decode_cache_matches_full():
  ours = nn.MultiHeadDotProductAttention(
      num_heads=H, decode=True,
      attention_fn=functools.partial(attention_fn, backend="xla"))
  ref = nn.MultiHeadDotProductAttention(num_heads=H)
  x = _x(5)
  params = jax.jit(ref.init)(jax.random.key(1), x)
  cache = ours.init(jax.random.key(1), x)["cache"]
  step = jax.jit(lambda p, c, xt: ours.apply({**p, "cache": c}, xt,
                                             mutable=["cache"]))
  outs = []
  for t in range(T):
    o, upd = step(params, cache, x[:, t:t + 1])
    cache = upd["cache"]
    outs.append(o)
  full = ref.apply(params, x, mask=nn.make_causal_mask(jnp.ones((B, T))))
  _close(jnp.concatenate(outs, 1), full, 2e-5)


# ---------------------------------------------- fallback and refusals ----


def test_arbitrary_mask_falls_back_exactly():
  x = _x(6)
  arb = (jax.random.bernoulli(jax.random.key(3), 0.6, (B, 1, T, T))
         | jnp.eye(T, dtype=bool))
  ref, ours = _nnx_pair(functools.partial(attention_fn, backend="xla"))
  with pytest.warns(FallbackWarning):
    o1 = ours(x, mask=arb)  # concrete mask: decided eagerly
  _close(o1, ref(x, mask=arb), 2e-5)
  # Traced: lax.switch picks the reference at run time; same values.
  f = nnx.jit(lambda m, x, mask: m(x, mask=mask))
  _close(f(ours, x, arb), ref(x, mask=arb), 2e-5)
  # Per-head masks that differ across heads also take the reference.
  heads = jnp.stack([jnp.tril(jnp.ones((T, T), bool)),
                     jnp.ones((T, T), bool)])[None]
  _close(f(ours, x, jnp.broadcast_to(heads, (B, H, T, T))),
         ref(x, mask=heads), 2e-5)


def test_refuses_what_the_kernel_cannot_honour():
  q = jnp.ones((1, 4, 2, 8))
  with pytest.raises(ValueError, match="bias"):
    attention_fn(q, q, q, bias=jnp.zeros((1, 2, 4, 4)), backend="xla")
  with pytest.raises(ValueError, match="dropout"):
    attention_fn(q, q, q, dropout_rate=0.1, deterministic=False,
                 dropout_rng=jax.random.key(0), backend="xla")
  with pytest.raises(ValueError, match="einsum"):
    attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum, backend="xla")
  # Dropout configured but deterministic: fine.
  attention_fn(q, q, q, dropout_rate=0.1, deterministic=True, backend="xla")
  m = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False,
                             dropout_rate=0.1, rngs=nnx.Rngs(0),
                             attention_fn=functools.partial(attention_fn,
                                                            backend="xla"))
  with pytest.raises(ValueError, match="dropout"):
    m(jnp.ones((1, 4, 8)), deterministic=False)
  m(jnp.ones((1, 4, 8)), deterministic=True)


def test_extra_batch_dims_and_dtype_promotion():
  x = jax.random.normal(jax.random.key(7), (2, 3, 6, 2, 8), jnp.bfloat16)
  mask = nn.make_causal_mask(jnp.ones((2, 3, 6)))
  out = jax.jit(functools.partial(attention_fn, dtype=jnp.float32,
                                  backend="xla"))(x, x, x, mask=mask)
  xf = x.astype(jnp.float32)
  ref = jax.jit(nnx.dot_product_attention)(xf, xf, xf, mask=mask)
  assert out.dtype == jnp.float32 and out.shape == x.shape
  _close(out, ref, 2e-5)


def test_cross_attention_with_key_padding():
  ref, ours = _nnx_pair(functools.partial(attention_fn, backend="xla"))
  xq, xkv = _x(8)[:, :4], _x(9)
  kv_valid = jnp.arange(T)[None] < jnp.asarray(LENS)[:, None]
  mask = nnx.make_attention_mask(jnp.ones((B, 4), bool), kv_valid)
  f = nnx.jit(lambda m, q, kv, mask: m(q, kv, mask=mask))
  with warnings.catch_warnings():
    warnings.simplefilter("error", FallbackWarning)
    got = f(ours, xq, xkv, mask)
  _close(got, f(ref, xq, xkv, mask), 2e-5)
