"""The Pallas ring-step kernels (`pallas_kernels.flash.ring_step`): a shard's
partials do not depend on how the keys (or, for dK/dV, the queries) were
split, bit for bit. This is what makes the ring's bits the same for every
device count; the 8-virtual-device check of the whole ring against the
float32 reference is in `tests/test_sharding.py`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api.sharding import _grid
from pallas_kernels.flash import ring_step
from pallas_kernels.flash.config import head_dim_bucket
from pallas_kernels.flash.tiles import MaskConfig


def _has_gpu():
  try:
    return jax.devices()[0].platform == "gpu"
  except RuntimeError:
    return False


_GPU = [pytest.mark.gpu,
        pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")]
# (backend, block, head_dim, len_q, len_k): the CPU case is small; the GPU
# case has the ring's real block and a head dim to pad (96 -> 128).
CASES = [
    pytest.param("interpret", 16, 32, 48, 32, id="interpret"),
    pytest.param("pallas", 128, 96, 512, 256, marks=_GPU, id="pallas"),
]
MASKS = {
    "causal": dict(causal=True, window_size=(-1, -1)),
    "full": dict(causal=False, window_size=(-1, -1)),
    "window-softcap": dict(causal=False, window_size=(40, 8), softcap=5.0),
    "segments": dict(causal=True, window_size=(-1, -1), segments=True),
}


def _setup(backend, block, head_dim, len_q, len_k, mask):
  b, hq, hkv = 2, 4, 2
  rng = np.random.default_rng(0)
  d_pad = head_dim_bucket(head_dim)

  def rnd(rows, h, scale=1.0):
    x = rng.standard_normal((rows, h, d_pad)) * scale
    x[..., head_dim:] = 0.0
    return jnp.asarray(x, jnp.bfloat16)
  q, do = rnd(b * len_q, hq), rnd(b * len_q, hq)
  k, v = rnd(b * len_k, hkv), rnd(b * len_k, hkv)
  # Queries after the keys, as a zig-zag shard's later chunk sees an
  # earlier one; the key positions are two chunks, as in a zig-zag shard.
  q_pos = jnp.arange(len_q, dtype=jnp.int32) + len_k // 2
  half = len_k // 2
  k_pos = jnp.concatenate([jnp.arange(half), len_q + jnp.arange(half)
                           ]).astype(jnp.int32)
  seg = mask.get("segments", False)
  q_seg = k_seg = None
  if seg:
    q_seg = jnp.asarray(rng.integers(-1, 3, b * len_q), jnp.int32)
    k_seg = jnp.asarray(rng.integers(0, 3, b * len_k), jnp.int32)
  cfg = MaskConfig.make(causal=mask["causal"], window_size=mask["window_size"],
                        has_segments=seg, softcap=mask.get("softcap", 0.0),
                        scale=head_dim**-0.5)
  kw = dict(cfg=cfg, block=block, batch=b, interpret=backend == "interpret")
  return q, k, v, do, q_pos, k_pos, q_seg, k_seg, kw


def _split_keys(x, len_k, cut, batch):
  """x [batch * len_k, ...] -> the first `cut` and the other keys of every
  batch row, each packed again."""
  x = x.reshape((batch, len_k) + x.shape[1:])
  return (x[:, :cut].reshape((-1,) + x.shape[2:]),
          x[:, cut:].reshape((-1,) + x.shape[2:]))


def _eq(a, b):
  return bool(jnp.array_equal(a, b))


def test_long_loops_carry_every_reg_terms_partials(monkeypatch):
  """With REG_TERMS = 1 every loop folds each partial into three limbs
  (the path of shards longer than REG_TERMS blocks): same checks."""
  monkeypatch.setattr(ring_step, "REG_TERMS", 1)
  jax.clear_caches()
  try:
    test_ring_step_partials_do_not_depend_on_the_split(
        "interpret", 16, 32, 48, 32, "causal")
  finally:
    jax.clear_caches()


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("backend,block,head_dim,len_q,len_k", CASES)
def test_ring_step_partials_do_not_depend_on_the_split(backend, block,
                                                        head_dim, len_q,
                                                        len_k, mask):
  q, k, v, do, q_pos, k_pos, q_seg, k_seg, kw = _setup(
      backend, block, head_dim, len_q, len_k, MASKS[mask])
  b, hq, d = kw["batch"], q.shape[1], q.shape[2]
  cut = block  # the first key block, then the rest
  k1, k2 = _split_keys(k, len_k, cut, b)
  v1, v2 = _split_keys(v, len_k, cut, b)
  p1, p2 = k_pos[:cut], k_pos[cut:]
  s1, s2 = (None, None) if k_seg is None else _split_keys(k_seg, len_k, cut,
                                                          b)

  def qp(mode, kk, vv, kp, ks, *rest):
    return ring_step.query_pass(q, kk, vv, q_pos, kp, q_seg, ks, *rest,
                                mode=mode, **kw)
  m = qp("max", k, v, k_pos, k_seg)
  assert _eq(m, jnp.maximum(qp("max", k1, v1, p1, s1),
                            qp("max", k2, v2, p2, s2)))
  assert bool(jnp.any(jnp.isfinite(m)))
  ref2 = jnp.where(jnp.isfinite(m), m, 0.0)
  units = jnp.stack([_grid.pow2(-_grid.unit_exponent(4.0 * block)),
                     _grid.pow2(-_grid.unit_exponent(float(block)))])
  acc0 = jnp.zeros((3, q.shape[0], hq, d), jnp.int32)
  den0 = jnp.zeros((3, hq, q.shape[0]), jnp.int32)
  whole = qp("forward", k, v, k_pos, k_seg, ref2, units, acc0, den0)
  part = qp("forward", k1, v1, p1, s1, ref2, units, acc0, den0)
  part = qp("forward", k2, v2, p2, s2, ref2, units, *part)
  assert all(_eq(a, c) for a, c in zip(whole, part))
  assert bool(jnp.any(whole[0] != 0))
  # The grid sum is the float sum to within one unit per partial.
  den = _grid.from_grid(jnp.moveaxis(whole[1], 0, -1),
                        _grid.unit_exponent(float(block)))
  assert bool(jnp.all(den >= 0)) and bool(jnp.any(den >= 1.0))

  lse2 = jnp.where(den > 0, ref2 + jnp.log2(jnp.where(den > 0, den, 1.0)),
                   jnp.inf)
  delta = jnp.asarray(np.random.default_rng(1).standard_normal(lse2.shape),
                      jnp.float32) * 0.1
  unit_dq = units[:1]
  dq = qp("dq", k, v, k_pos, k_seg, do, lse2, delta, unit_dq, acc0)
  dq_part = qp("dq", k1, v1, p1, s1, do, lse2, delta, unit_dq, acc0)
  dq_part = qp("dq", k2, v2, p2, s2, do, lse2, delta, unit_dq, dq_part)
  assert _eq(dq, dq_part) and bool(jnp.any(dq != 0))

  # dK/dV: the queries split at a multiple of the query step.
  zkv = jnp.zeros((3,) + k.shape, jnp.int32)
  qcut = ring_step.query_step(block) * 2

  def kp_(rows, kk, dk, dv):
    sl = lambda x: _split_keys(x, len_q, qcut, b)[rows] if rows >= 0 else x
    row_sl = lambda x: jnp.moveaxis(sl(jnp.moveaxis(x, 0, 1)), 0, 1)
    pos = q_pos if rows < 0 else (q_pos[:qcut], q_pos[qcut:])[rows]
    return ring_step.key_pass(
        sl(q), k, v, pos, k_pos, None if q_seg is None else sl(q_seg), k_seg,
        sl(do), row_sl(lse2), row_sl(delta), units, dk, dv, **kw)
  whole = kp_(-1, k, zkv, zkv)
  part = kp_(1, k, *kp_(0, k, zkv, zkv))
  assert all(_eq(a, c) for a, c in zip(whole, part))
  assert bool(jnp.any(whole[0] != 0)) and bool(jnp.any(whole[1] != 0))


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("kw", [dict(causal=True),
                                dict(causal=True, window_size=(100, 0),
                                     softcap=20.0),
                                dict(causal=False)], ids=str)
def test_ring_on_one_gpu_matches_the_reference(kw):
  """The whole ring with the Pallas step on a one-device mesh (bf16, GQA
  2, head dim 96 padded to 128): output and gradients near the float32
  reference, gradients bitwise the same on a second run."""
  from jax_api.sharding import make_mesh, sharded_attention
  from pallas_kernels.reference.dense import attention_reference
  mesh = make_mesh(context=1)
  keys = jax.random.split(jax.random.key(0), 4)
  b, s, hq, hkv, d = 2, 1024, 8, 4, 96
  q, w = (jax.random.normal(x, (b, s, hq, d), jnp.bfloat16)
          for x in keys[:2])
  k, v = (jax.random.normal(x, (b, s, hkv, d), jnp.bfloat16)
          for x in keys[2:])

  # w is an argument, not a constant of the trace: XLA would spend seconds
  # constant-folding reductions of the cotangent it makes.
  def loss(attn):
    return lambda q, k, v, w: jnp.sum(attn(q, k, v).astype(jnp.float32) * w)
  ring = lambda q, k, v: sharded_attention(
      q, k, v, mesh=mesh, backend="pallas", layout="contiguous", **kw)
  ref = lambda q, k, v: attention_reference(q, k, v, **kw)[0]
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  grad = jax.jit(jax.grad(loss(ring), (0, 1, 2)))
  got = (jax.jit(ring)(q, k, v),) + grad(q, k, v, w)
  want = (ref(*f32),) + jax.grad(loss(ref), (0, 1, 2))(*f32, w)
  for a, c in zip(got, want):
    a = a.astype(jnp.float32)
    assert float(jnp.abs(a - c).max() / jnp.abs(c).max()) < 2e-2
  again = grad(q, k, v, w)
  assert all(_eq(a, c) for a, c in zip(got[1:], again))


def test_auto_picks_the_pallas_step_on_a_gpu(monkeypatch):
  from jax_api import _backend
  from jax_api.sharding.ring import ring_backend
  monkeypatch.setattr(_backend, "_gpu_capability", lambda: (9, 0))
  assert ring_backend("auto") == "pallas"
  monkeypatch.setattr(_backend, "_gpu_capability", lambda: (7, 5))
  assert ring_backend("auto") == "xla"
  monkeypatch.setattr(_backend, "_gpu_capability", lambda: None)
  assert ring_backend("auto") == "xla"
  assert ring_backend("interpret") == "interpret"
  with pytest.raises(ValueError, match="backend='pallas' needs an NVIDIA"):
    ring_backend("pallas")
  with pytest.raises(ValueError, match="backend must be one of"):
    ring_backend("mosaic")


@pytest.mark.parametrize("mask", list(MASKS))
def test_ring_step_kernels_lower_for_the_gpu(fake_h200, mask):
  """All four kernels lower to Triton IR for sm_90 on CPU (a non-causal
  mask once lowered a constant predicate Triton rejects), with no signed
  min/max on i1 (`triton_ir.signed_i1_minmax`)."""
  from pallas_kernels import triton_ir
  q, k, v, do, q_pos, k_pos, q_seg, k_seg, kw = _setup(
      "pallas", 128, 96, 256, 256, MASKS[mask])
  kw = dict(kw, interpret=False)
  rows = jnp.zeros((q.shape[1], q.shape[0]), jnp.float32)
  acc = jnp.zeros((3,) + q.shape, jnp.int32)
  den = jnp.zeros((3, q.shape[1], q.shape[0]), jnp.int32)
  units = jnp.ones((2,), jnp.float32)

  def qp(mode, *rest):
    fn = jax.jit(lambda *a: ring_step.query_pass(*a, mode=mode, **kw))
    return fn, (q, k, v, q_pos, k_pos, q_seg, k_seg) + rest
  calls = [qp("max"), qp("forward", rows, units, acc, den),
           qp("dq", do, rows, rows, units[:1], acc),
           (jax.jit(lambda *a: ring_step.key_pass(*a, **kw)),
            (q, k, v, q_pos, k_pos, q_seg, k_seg, do, rows, rows, units,
             acc[:, :k.shape[0]], acc[:, :k.shape[0]]))]
  names = []
  for fn, args in calls:
    for name, ttir, _ in triton_ir.capture_triton_ir(fn, args):
      names.append(name)
      assert not triton_ir.signed_i1_minmax(ttir), name
  assert names == ["fold_ring_max", "fold_ring_forward", "fold_ring_dq",
                   "fold_ring_dkdv"]
