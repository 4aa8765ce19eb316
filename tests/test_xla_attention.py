"""The "xla" backend (`jax_api._xla_attention.xla_attention`) against the
float32 references of `pallas_kernels.reference`: outputs, lse and the
gradients wrt q, k, v and sinks (random cotangents on out *and* lse)."""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api._xla_attention import xla_attention
from pallas_kernels.reference import (
    attention_reference,
    dense_mask_spec,
    varlen_attention_reference,
    varlen_mask_spec,
)

F32_TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(seed, b, sq, sk, hq, hkv, d, dtype=jnp.float32, with_sinks=False):
  # NumPy draws: jax.random would compile a sampler per shape (slow on CPU).
  rng = np.random.default_rng(seed)
  draw = lambda *shape: jnp.asarray(
      rng.standard_normal(shape, np.float32)).astype(dtype)
  q, k, v = draw(b, sq, hq, d), draw(b, sk, hkv, d), draw(b, sk, hkv, d)
  sinks = (jnp.asarray(rng.standard_normal((hq,), np.float32) * 1.5)
           if with_sinks else None)
  return q, k, v, sinks


def _cotangents(seed, out_shape, lse_shape):
  rng = np.random.default_rng(seed + 1000)
  return (jnp.asarray(rng.standard_normal(out_shape, np.float32)),
          jnp.asarray(rng.standard_normal(lse_shape, np.float32)))


# LLVM -O0 halves XLA:CPU compile time, which dominates these tiny cases; the
# HLO (and so the arithmetic) is unchanged. `test_jit_deterministic_...`
# compiles with the default options.
@functools.partial(jax.jit, static_argnums=(0,),
                   compiler_options={"xla_backend_optimization_level": 0})
def _value_and_vjp(fn, args, cts):
  """(out, lse) and the vjp of both wrt every entry of `args`."""
  (out, lse), pullback = jax.vjp(fn, *args)
  ct_out, ct_lse = cts
  # Fully masked rows have lse = -inf: a finite cotangent there is fine.
  grads = pullback((ct_out.astype(out.dtype), ct_lse))
  return out, lse, grads


def _compare(got, want, names, tol):
  for name, g, w in zip(names, got, want):
    if g is None and w is None:
      continue
    g = np.asarray(jnp.asarray(g, jnp.float32))
    w = np.asarray(jnp.asarray(w, jnp.float32))
    assert np.all(np.isfinite(g) | np.isneginf(w)), f"{name}: non-finite"
    np.testing.assert_allclose(g, w, err_msg=name, **tol)


def _check_dense(seed, *, b, sq, sk, hq, hkv, d, causal=False,
                 window_size=(-1, -1), softcap=0.0, with_sinks=False,
                 segment_ids=None, chunk_size=16, softmax_scale=None,
                 dtype=jnp.float32, tol=F32_TOL, grad_tol=None):
  q, k, v, sinks = _inputs(seed, b, sq, sk, hq, hkv, d, dtype, with_sinks)
  qseg, kseg = segment_ids if segment_ids is not None else (None, None)
  q_spec = dense_mask_spec(b, sq, qseg)
  k_spec = dense_mask_spec(b, sk, kseg)
  opts = dict(causal=causal, window_size=window_size, softcap=softcap,
              softmax_scale=softmax_scale)

  def impl(q, k, v, *s):
    return xla_attention(q, k, v, q_spec, k_spec, s[0] if s else None,
                         chunk_size=chunk_size, **opts)

  def ref(q, k, v, *s):
    return attention_reference(q, k, v, sinks=s[0] if s else None,
                               segment_ids=segment_ids, **opts)

  args = (q, k, v) + ((sinks,) if with_sinks else ())
  # The reference runs in float32 on the (possibly bf16-rounded) inputs.
  ref_args = tuple(jnp.asarray(a, jnp.float32) for a in args)
  cts = _cotangents(seed, (b, sq, hq, d), (b, hq, sq))
  out, lse, grads = _value_and_vjp(impl, args, cts)
  r_out, r_lse, r_grads = _value_and_vjp(ref, ref_args, cts)

  assert out.dtype == dtype and out.shape == (b, sq, hq, d)
  assert lse.dtype == jnp.float32 and lse.shape == (b, hq, sq)
  for g, a in zip(grads, args):
    assert g.shape == a.shape and g.dtype == a.dtype
  _compare((out, lse), (r_out, r_lse), ("out", "lse"), tol)
  grad_tol = tol if grad_tol is None else grad_tol
  _compare(grads, r_grads, ("dq", "dk", "dv", "dsinks"), grad_tol)
  return q_spec, k_spec, out, lse, grads


DENSE_CASES = {
    # name: kwargs of _check_dense
    "full_gqa1": dict(b=2, sq=24, sk=40, hq=2, hkv=2, d=8),
    "causal_sq_lt_sk": dict(b=2, sq=24, sk=40, hq=2, hkv=2, d=8, causal=True),
    # seq_q > seq_k: the first seq_q - seq_k query rows are fully masked.
    "causal_sq_gt_sk_mqa": dict(b=1, sq=40, sk=24, hq=4, hkv=1, d=8,
                                causal=True),
    "window_both_gqa4": dict(b=1, sq=33, sk=47, hq=8, hkv=2, d=8,
                             window_size=(5, 3)),
    "window_left_only": dict(b=2, sq=30, sk=30, hq=4, hkv=4, d=8,
                             window_size=(7, 0)),
    "window_right_only": dict(b=1, sq=30, sk=30, hq=4, hkv=2, d=8,
                              window_size=(-1, 4)),
    "causal_window_sq_gt_sk": dict(b=1, sq=37, sk=21, hq=4, hkv=2, d=8,
                                   causal=True, window_size=(6, 9)),
    "sinks_softcap_gqa4": dict(b=2, sq=20, sk=53, hq=4, hkv=1, d=16,
                               causal=True, softcap=2.5, with_sinks=True,
                               softmax_scale=0.7),
    "sinks_fully_masked": dict(b=1, sq=30, sk=18, hq=2, hkv=1, d=8,
                               causal=True, with_sinks=True),
    "softcap_window": dict(b=1, sq=29, sk=29, hq=2, hkv=1, d=8,
                           softcap=5.0, window_size=(3, 3), chunk_size=8),
    "one_chunk_default_size": dict(b=2, sq=19, sk=23, hq=4, hkv=2, d=8,
                                   causal=True, chunk_size=512),
    "chunk_not_dividing": dict(b=1, sq=50, sk=53, hq=2, hkv=2, d=8,
                               causal=True, chunk_size=7),
}


@pytest.mark.parametrize("name", sorted(DENSE_CASES))
def test_dense_float32_matches_reference(name):
  _check_dense(zlib.crc32(name.encode()) % 1000, **DENSE_CASES[name])


def test_segment_ids_float32():
  b, sq, sk = 2, 26, 34
  rng = np.random.default_rng(3)
  qseg = np.sort(rng.integers(0, 3, (b, sq)), axis=1).astype(np.int32)
  kseg = np.sort(rng.integers(0, 3, (b, sk)), axis=1).astype(np.int32)
  qseg[0, -3:] = 7  # a segment with no keys: fully masked query rows
  _check_dense(5, b=b, sq=sq, sk=sk, hq=4, hkv=2, d=8, window_size=(6, 2),
               segment_ids=(jnp.asarray(qseg), jnp.asarray(kseg)),
               with_sinks=True)


@pytest.mark.parametrize("causal,window_size,with_sinks", [
    (True, (-1, -1), False),
    (False, (4, 0), True),
])
def test_varlen_packed_float32(causal, window_size, with_sinks):
  # Sequence 1 has len_q > len_k (fully masked causal rows); the q tail past
  # cu_seqlens_q[-1] and the k tail past cu_seqlens_k[-1] match nothing.
  cu_q = jnp.array([0, 5, 17, 30], jnp.int32)
  cu_k = jnp.array([0, 9, 12, 31], jnp.int32)
  tq, tk, hq, hkv, d = 34, 37, 4, 2, 8
  q, k, v, sinks = _inputs(11, 1, tq, tk, hq, hkv, d, with_sinks=with_sinks)
  q_spec = varlen_mask_spec(cu_q, tq)
  k_spec = varlen_mask_spec(cu_k, tk)
  opts = dict(causal=causal, window_size=window_size, softcap=0.0,
              softmax_scale=None)

  def impl(q, k, v, *s):
    return xla_attention(q, k, v, q_spec, k_spec, s[0] if s else None,
                         chunk_size=16, **opts)

  def ref(q, k, v, *s):
    out, lse = varlen_attention_reference(q[0], k[0], v[0], cu_q, cu_k,
                                          sinks=s[0] if s else None, **opts)
    return out[None], lse[None]

  args = (q, k, v) + ((sinks,) if with_sinks else ())
  cts = _cotangents(11, q.shape, (1, hq, tq))
  out, lse, grads = _value_and_vjp(impl, args, cts)
  r_out, r_lse, r_grads = _value_and_vjp(ref, args, cts)
  _compare((out, lse), (r_out, r_lse), ("out", "lse"), F32_TOL)
  _compare(grads, r_grads, ("dq", "dk", "dv", "dsinks"), F32_TOL)
  # The padded q tail: out exactly 0, zero dq.
  assert np.all(np.asarray(out[0, 30:]) == 0.0)
  assert np.all(np.asarray(grads[0][0, 30:]) == 0.0)
  # The padded k tail gets no gradient.
  assert np.all(np.asarray(grads[1][0, 31:]) == 0.0)
  assert np.all(np.asarray(grads[2][0, 31:]) == 0.0)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows_exact(with_sinks):
  # Causal with seq_q > seq_k: query rows 0..(sq - sk - 1) see no key.
  b, sq, sk, hq, hkv, d = 2, 28, 12, 4, 2, 8
  n_masked = sq - sk
  _, _, out, lse, grads = _check_dense(
      21, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, causal=True,
      with_sinks=with_sinks, chunk_size=8)
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.all(out[:, :n_masked] == 0.0)
  assert np.all(np.abs(out[:, n_masked:]).sum(-1) > 0)
  if with_sinks:
    _, _, _, sinks = _inputs(21, b, sq, sk, hq, hkv, d, with_sinks=True)
    np.testing.assert_allclose(
        lse[:, :, :n_masked],
        np.broadcast_to(np.asarray(sinks)[None, :, None], (b, hq, n_masked)),
        rtol=0, atol=1e-6)
  else:
    assert np.all(np.isneginf(lse[:, :, :n_masked]))
  assert np.all(np.isfinite(lse[:, :, n_masked:]))
  for g in grads:
    assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(grads[0])[:, :n_masked] == 0.0)


def test_everything_masked_no_nan():
  # Every query row is fully masked (disjoint segments): out 0, lse -inf, all
  # gradients exactly 0.
  b, sq, sk, hq, hkv, d = 1, 20, 20, 2, 1, 8
  q, k, v, _ = _inputs(4, b, sq, sk, hq, hkv, d)
  q_spec = dense_mask_spec(b, sq, jnp.zeros((b, sq), jnp.int32))
  k_spec = dense_mask_spec(b, sk, jnp.ones((b, sk), jnp.int32))
  fn = lambda q, k, v: xla_attention(
      q, k, v, q_spec, k_spec, causal=False, window_size=(-1, -1),
      softcap=1.0, softmax_scale=None, chunk_size=8)
  cts = _cotangents(4, q.shape, (b, hq, sq))
  out, lse, grads = _value_and_vjp(fn, (q, k, v), cts)
  assert np.all(np.asarray(out) == 0.0)
  assert np.all(np.isneginf(np.asarray(lse)))
  for g in grads:
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("dtype,tol,grad_tol", [
    # Observed max abs errors (|ref| <= ~3): bf16 out 3e-3, grads 8e-3;
    # fp16 out 4e-4, grads 1e-3 (the rounding of out/P/dS to the dtype).
    (jnp.bfloat16, 1e-2, 2e-2),
    (jnp.float16, 2e-3, 4e-3),
])
def test_low_precision_matches_reference(dtype, tol, grad_tol):
  # Reference in float32 on the rounded inputs; the kernel rounds P/dS to the
  # input dtype before the dots (float32 accumulation) and out/grads to it.
  _check_dense(8, b=1, sq=40, sk=53, hq=4, hkv=2, d=16, causal=True,
               window_size=(20, -1), softcap=4.0, with_sinks=True,
               chunk_size=16, dtype=dtype, tol=dict(rtol=tol, atol=tol),
               grad_tol=dict(rtol=grad_tol, atol=grad_tol))


def test_sinks_gradient_formula():
  # dsinks = sum_i exp(sink - lse_i) * (dlse_i - dO_i . O_i), summed per head.
  b, sq, sk, hq, hkv, d = 2, 17, 23, 4, 2, 8
  q, k, v, sinks = _inputs(9, b, sq, sk, hq, hkv, d, with_sinks=True)
  q_spec, k_spec = dense_mask_spec(b, sq), dense_mask_spec(b, sk)
  fn = lambda s: xla_attention(q, k, v, q_spec, k_spec, s, causal=True,
                               window_size=(-1, -1), softcap=0.0,
                               softmax_scale=None, chunk_size=8)
  cts = _cotangents(9, q.shape, (b, hq, sq))
  out, lse, (dsinks,) = _value_and_vjp(fn, (sinks,), cts)
  ct_out, ct_lse = cts
  delta = jnp.einsum("bqhd,bqhd->bhq", ct_out, out,
                     precision=jax.lax.Precision.HIGHEST)
  want = jnp.sum(jnp.exp(sinks[None, :, None] - lse) * (ct_lse - delta),
                 axis=(0, 2))
  np.testing.assert_allclose(dsinks, want, **F32_TOL)


def test_jit_deterministic_and_scalar_loss():
  b, sq, sk, hq, hkv, d = 1, 33, 45, 4, 2, 8
  q, k, v, sinks = _inputs(13, b, sq, sk, hq, hkv, d, with_sinks=True)
  q_spec, k_spec = dense_mask_spec(b, sq), dense_mask_spec(b, sk)
  opts = dict(causal=True, window_size=(10, -1), softcap=3.0,
              softmax_scale=0.3)

  def loss(q, k, v, s, q_spec, k_spec):
    out, _ = xla_attention(q, k, v, q_spec, k_spec, s, chunk_size=16, **opts)
    return jnp.sum(out * out)

  def ref_loss(q, k, v, s):
    out, _ = attention_reference(q, k, v, sinks=s, **opts)
    return jnp.sum(out * out)

  # Only `out` is used: the lse cotangent is a symbolic zero. The MaskSpecs
  # are traced jit arguments (not constants).
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
  g1 = grad(q, k, v, sinks, q_spec, k_spec)
  g2 = grad(q, k, v, sinks, q_spec, k_spec)
  for a, c in zip(g1, g2):
    assert np.array_equal(np.asarray(a), np.asarray(c))
  want = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2, 3)))(q, k, v, sinks)
  _compare(g1, want, ("dq", "dk", "dv", "dsinks"), F32_TOL)


def _all_shapes(jaxpr):
  """Every aval shape in a (closed) jaxpr, sub-jaxprs included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  shapes = []
  for var in list(jaxpr.invars) + list(jaxpr.constvars):
    shapes.append(tuple(getattr(var.aval, "shape", ())))
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      shapes.append(tuple(getattr(var.aval, "shape", ())))
    for param in eqn.params.values():
      subs = param if isinstance(param, (tuple, list)) else (param,)
      for sub in subs:
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None),
                                           "eqns"):
          shapes.extend(_all_shapes(sub))
  return shapes


def test_no_seq_q_by_seq_k_intermediate():
  b, sq, sk, hq, hkv, d, chunk = 1, 40, 72, 4, 2, 8, 16
  q, k, v, sinks = _inputs(2, b, sq, sk, hq, hkv, d, with_sinks=True)
  q_spec, k_spec = dense_mask_spec(b, sq), dense_mask_spec(b, sk)
  opts = dict(causal=True, window_size=(-1, -1), softcap=2.0,
              softmax_scale=None)
  sq_sizes = {sq, -(-sq // chunk) * chunk}
  sk_sizes = {sk, -(-sk // chunk) * chunk}

  def quadratic(shapes):
    return [s for s in shapes
            if any(x in sq_sizes for x in s) and any(x in sk_sizes for x in s)]

  def fwd_bwd(fn):
    def run(q, k, v, s):
      (out, lse), pullback = jax.vjp(fn, q, k, v, s)
      return out, lse, pullback((out, lse))
    return _all_shapes(jax.make_jaxpr(run)(q, k, v, sinks))

  impl = lambda q, k, v, s: xla_attention(q, k, v, q_spec, k_spec, s,
                                          chunk_size=chunk, **opts)
  ref = lambda q, k, v, s: attention_reference(q, k, v, sinks=s, **opts)
  assert quadratic(fwd_bwd(ref)), "checker sanity: the reference is quadratic"
  assert not quadratic(fwd_bwd(impl))
  # The largest intermediate is a [b, hkv, group, chunk, chunk] score tile.
  biggest = max(int(np.prod(s)) for s in fwd_bwd(impl))
  assert biggest <= max(b * hq * chunk * chunk, b * sk * hkv * d * 2,
                        b * sq * hq * d * 2)
