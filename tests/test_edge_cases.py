"""Numerical edge cases of dense and varlen attention against the float32
reference, forward and gradients (issue 30): fully masked rows and
sequences, logits near the dtype's range (q and k scaled by 100), -inf
sinks, length-0 and length-1 sequences inside varlen, seq_q > seq_k with
causal, seq_k = 1, head_dim 256 in fp32; and NaN / Inf in one input row
reaching exactly the rows that depend on it (row by row).

Interpret backend (the Pallas kernel on CPU) and the XLA backend; tiny
shapes, lengths not multiples of the 16-row interpret tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import KernelSettings, fold_attn_func, fold_attn_varlen_func
from pallas_kernels.reference import (attention_reference,
                                      varlen_attention_reference)
from pallas_kernels.reference.dense import (dense_mask_spec, varlen_mask_spec,
                                            visibility)

BACKENDS = ["interpret", "xla"]
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
F32 = jnp.float32
D = 16


def _rand(rng, shape, dtype=F32, scale=1.0):
  return (jnp.asarray(rng.standard_normal(shape), F32) * scale).astype(dtype)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _f32(x):
  return None if x is None else jnp.asarray(x, F32)


def _compare(ours, ref, args, cts, tol, names=("dq", "dk", "dv", "dsinks")):
  """vjp of `ours` (returns (out, lse)) against `ref` on float32 copies of
  `args`; out, lse and every gradient finite and within `tol` (relative
  L2; lse: where the reference's is finite it matches, elsewhere equal)."""
  (out, lse), vjp = jax.vjp(ours, *args)
  (rout, rlse), rvjp = jax.vjp(ref, *(_f32(a) for a in args))
  assert out.dtype == args[0].dtype
  assert bool(jnp.all(jnp.isfinite(out))), "out has NaN/Inf"
  assert _rel(out, rout) <= tol, ("out", _rel(out, rout))
  fin = np.isfinite(np.asarray(rlse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_array_equal(np.asarray(lse)[~fin], np.asarray(rlse)[~fin])
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rlse)[fin],
                             rtol=tol, atol=10 * tol)
  do, dlse = cts
  dlse = jnp.where(fin, dlse, 0.0)  # no cotangent through an lse of -inf
  grads = vjp((do, dlse))
  rgrads = rvjp((_f32(do), dlse))
  for name, g, rg in zip(names, grads, rgrads):
    if rg is None:
      continue
    assert bool(jnp.all(jnp.isfinite(g))), f"{name} has NaN/Inf"
    assert _rel(g, rg) <= 2 * tol, (name, _rel(g, rg))
  return out, lse, grads


def _dense(rng, b, sq, sk, hq, hkv, d=D, dtype=F32, scale=1.0):
  q = _rand(rng, (b, sq, hq, d), dtype, scale)
  k = _rand(rng, (b, sk, hkv, d), dtype, scale)
  v = _rand(rng, (b, sk, hkv, d), dtype)
  cts = (_rand(rng, (b, sq, hq, d), dtype), _rand(rng, (b, hq, sq)))
  return q, k, v, cts


def _dense_fns(backend, **opts):
  def ours(q, k, v, *s):
    return fold_attn_func(q, k, v, sinks=s[0] if s else None,
                          return_lse=True, backend=backend, **opts)

  def ref(q, k, v, *s):
    return attention_reference(q, k, v, sinks=s[0] if s else None, **opts)
  return ours, ref


# ------------------------------------------------------- fully masked ------
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_seq_q_gt_seq_k_fully_masked_rows(backend):
  """Bottom-right causal with seq_q 21 > seq_k 7: the first 14 query rows
  see no key: output 0, lse -inf, dq 0 exactly; the rest match."""
  rng = np.random.default_rng(0)
  q, k, v, cts = _dense(rng, 1, 21, 7, 2, 1)
  ours, ref = _dense_fns(backend, causal=True)
  out, lse, (dq, _, _) = _compare(ours, ref, (q, k, v), cts, TOL[F32])
  masked = slice(0, 14)
  assert not np.any(np.asarray(out[:, masked]))
  assert np.all(np.asarray(lse[..., masked]) == -np.inf)
  assert not np.any(np.asarray(dq[:, masked]))
  assert np.all(np.isfinite(np.asarray(lse[..., 14:])))


@pytest.mark.parametrize("backend", BACKENDS)
def test_segment_ids_fully_masked_rows(backend):
  """Query segment ids that match no key id: those rows give 0 with zero
  gradients, and add nothing to dk / dv."""
  rng = np.random.default_rng(1)
  q, k, v, cts = _dense(rng, 2, 19, 19, 2, 2)
  qs = np.zeros((2, 19), np.int32)
  qs[0, 3:9] = 7      # no key carries id 7
  qs[1, :] = 5        # a whole batch row masked
  ks = np.zeros((2, 19), np.int32)
  seg = (jnp.asarray(qs), jnp.asarray(ks))
  ours, ref = _dense_fns(backend, segment_ids=seg)
  out, lse, (dq, dk, dv) = _compare(ours, ref, (q, k, v), cts, TOL[F32])
  assert not np.any(np.asarray(out[0, 3:9])) and not np.any(out[1])
  assert not np.any(np.asarray(dq[0, 3:9])) and not np.any(dq[1])
  assert not np.any(np.asarray(dk[1])) and not np.any(dv[1])
  assert np.all(np.asarray(lse[1]) == -np.inf)


def _varlen_fns(backend, cu_q, cu_k, **opts):
  def ours(q, k, v, *s):
    return fold_attn_varlen_func(q, k, v, cu_q, cu_k,
                                 sinks=s[0] if s else None, return_lse=True,
                                 backend=backend, **opts)

  def ref(q, k, v, *s):
    return varlen_attention_reference(q, k, v, cu_q, cu_k,
                                      sinks=s[0] if s else None, **opts)
  return ours, ref


def _packed(rng, tq, tk, hq=2, hkv=1, d=D, dtype=F32):
  q = _rand(rng, (tq, hq, d), dtype)
  k = _rand(rng, (tk, hkv, d), dtype)
  v = _rand(rng, (tk, hkv, d), dtype)
  cts = (_rand(rng, (tq, hq, d), dtype), _rand(rng, (hq, tq)))
  return q, k, v, cts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
def test_varlen_fully_masked_sequence(backend, sinks):
  """A sequence with queries but no keys (len_k 0), and query tokens past
  cu_seqlens_q[-1]: zeros, zero gradients (lse -inf, or the sink)."""
  rng = np.random.default_rng(2)
  cu_q = jnp.array([0, 5, 9, 14], jnp.int32)  # seq 1: 4 queries ...
  cu_k = jnp.array([0, 6, 6, 11], jnp.int32)  # ... and no key
  q, k, v, cts = _packed(rng, 17, 12)          # 3 query tokens past the end
  s = (jnp.array([0.3, -0.7], F32),) if sinks else ()
  ours, ref = _varlen_fns(backend, cu_q, cu_k, causal=True)
  out, lse, (dq, *_rest) = _compare(ours, ref, (q, k, v) + s, cts, TOL[F32])
  for rows in (slice(5, 9), slice(14, 17)):
    assert not np.any(np.asarray(out[rows]))
    assert not np.any(np.asarray(dq[rows]))
  want = np.asarray(s[0])[:, None] if sinks else -np.inf
  np.testing.assert_array_equal(np.asarray(lse[:, 5:9]),
                                np.broadcast_to(want, (2, 4)))


# -------------------------------------------------------- large logits ------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_logits_near_dtype_max(backend, dtype):
  """q and k scaled by 100 (scores ~1e4, far past exp's range before the
  max is subtracted): the reference's answer and gradients, no NaN."""
  rng = np.random.default_rng(3)
  q, k, v, cts = _dense(rng, 1, 18, 21, 2, 1, dtype=dtype, scale=100.0)
  ours, ref = _dense_fns(backend, causal=True)
  # Conditioning, not a tolerance for the kernel: a score of size |s| is
  # only known to |s| * 2^-24 in float32 (the reference's own rounding of
  # its dots differs by that much), and P and the gradients inherit it.
  s = jnp.einsum("bqhd,bkhd->bhqk", _f32(q), jnp.repeat(_f32(k), 2, 2),
                 precision="highest") / D**0.5
  cond = 16 * 2.0**-24 * float(jnp.max(jnp.abs(s)))
  _compare(ours, ref, (q, k, v), cts, TOL[dtype] + cond)


# ---------------------------------------------------------------- sinks ----
@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_sinks(backend):
  """A sink of -inf adds exp(-inf) = 0: the same as no sink for its head
  (and its gradient is 0), a finite sink on the other head; rows that see
  no key (seq_q > seq_k, causal) give 0 with lse -inf / the sink."""
  rng = np.random.default_rng(4)
  q, k, v, cts = _dense(rng, 1, 20, 9, 2, 1)
  sinks = jnp.array([-jnp.inf, 0.5], F32)
  ours, ref = _dense_fns(backend, causal=True)
  out, lse, grads = _compare(ours, ref, (q, k, v, sinks), cts, TOL[F32])
  assert float(grads[3][0]) == 0.0
  plain = fold_attn_func(q, k, v, causal=True, backend=backend)
  np.testing.assert_allclose(np.asarray(out[:, :, 0]),
                             np.asarray(plain[:, :, 0]), rtol=1e-6,
                             atol=1e-6)
  assert np.all(np.asarray(lse[0, 0, :11]) == -np.inf)
  np.testing.assert_array_equal(np.asarray(lse[0, 1, :11]), 0.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_sink_on_rows_that_see_no_key(backend):
  """One head, one key, causal with seq_q > seq_k, a -inf sink: 17 rows see
  nothing at all; their dsinks term is 0, not NaN (found by hypothesis)."""
  rng = np.random.default_rng(6)
  q, k, v, cts = _dense(rng, 1, 18, 1, 1, 1)
  sinks = jnp.array([-jnp.inf], F32)
  ours, ref = _dense_fns(backend, causal=True)
  _, _, grads = _compare(ours, ref, (q, k, v, sinks), cts, TOL[F32])
  assert float(grads[3][0]) == 0.0


# ----------------------------------------------------- varlen lengths ------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_length_0_and_1_sequences(backend, causal):
  """Sequences of 1, 0, 5, 0, 1 and 17 tokens packed together."""
  rng = np.random.default_rng(5)
  lens = [1, 0, 5, 0, 1, 17]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  q, k, v, cts = _packed(rng, 24, 24)
  ours, ref = _varlen_fns(backend, cu, cu, causal=causal)
  out, _, _ = _compare(ours, ref, (q, k, v), cts, TOL[F32])
  # A length-1 sequence's output is its own value row (one visible key).
  np.testing.assert_allclose(np.asarray(out[0]),
                             np.repeat(np.asarray(v[0]), 2, axis=0),
                             rtol=1e-6, atol=1e-6)


# ------------------------------------------------------ shapes at limits ---
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_seq_k_1(backend, causal):
  rng = np.random.default_rng(6)
  q, k, v, cts = _dense(rng, 2, 9, 1, 4, 2)
  ours, ref = _dense_fns(backend, causal=causal)
  _compare(ours, ref, (q, k, v), cts, TOL[F32])


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_dim_256_fp32(backend):
  rng = np.random.default_rng(7)
  q, k, v, cts = _dense(rng, 1, 17, 13, 2, 1, d=256)
  ours, ref = _dense_fns(backend, causal=True, window_size=(9, -1))
  _compare(ours, ref, (q, k, v), cts, TOL[F32])


# ------------------------------------------ NaN / Inf reach their rows -----
# One non-finite entry in row `bad` of q, k or v. Which rows may and must
# turn non-finite follows from the visibility mask `vis` [seq_q, seq_k]:
#   rows R = {bad} (q) or {i : vis[i, bad]} (k, v): out, dq (and lse for
#     q, k; lse does not read v) are non-finite exactly on R;
#   dk, dv: at most U = {j : vis[i, j] for some i in R} (+ bad for k, v),
#     at least the rows that read the bad value directly.
# Checked row by row (a row is a token, all heads). An infinite k entry is
# not a poison of this kind: q.k = -inf hides the key (P = 0, as in the
# float32 reference) and +inf makes the row NaN, so its rows follow the sign
# of q rather than the mask.
NAN_LAYOUTS = {
    "dense-causal": dict(causal=True, bad=5),
    "dense-full": dict(causal=False, bad=5),
    "varlen": dict(causal=False, bad=9),  # in sequence 1 of [0, 7, 20)
}
NAN_CU = jnp.array([0, 7, 20], jnp.int32)
QUANTITIES = ("out", "lse", "dq", "dk", "dv")

# The integer-grid dQ ("atomic") cannot carry NaN through its int32 sums:
# it has its own rule (rows whose D or LSE is not finite), checked here too.
NAN_BACKENDS = {"interpret": ("interpret", None),
                "interpret-atomic": ("interpret",
                                     KernelSettings(dq_mode="atomic")),
                "xla": ("xla", None)}
# The same on the GPU (the Triton kernels, whose tiles are larger).
NAN_BACKENDS_GPU = {"pallas": ("pallas", None),
                    "pallas-atomic": ("pallas",
                                      KernelSettings(dq_mode="atomic"))}


@functools.lru_cache(maxsize=None)
def _fwd_bwd(layout, backend_id):
  """jit(q, k, v, do, dlse) -> out, lse [tokens, heads], dq, dk, dv (one
  compile per layout and backend; the bad entries are data)."""
  causal = NAN_LAYOUTS[layout]["causal"]
  backend, config = {**NAN_BACKENDS, **NAN_BACKENDS_GPU}[backend_id]
  extra = {} if config is None else dict(config=config)

  def f(q, k, v):
    if layout == "varlen":
      out, lse = fold_attn_varlen_func(q, k, v, NAN_CU, causal=causal,
                                       return_lse=True, backend=backend,
                                       **extra)
      return out, lse.T
    out, lse = fold_attn_func(q[None], k[None], v[None], causal=causal,
                              return_lse=True, backend=backend, **extra)
    return out[0], lse[0].T

  def run(q, k, v, do, dlse):
    (out, lse), vjp = jax.vjp(f, q, k, v)
    return (out, lse) + vjp((do, dlse))
  return jax.jit(run)


def _run(layout, which, backend):
  """out, lse, dq, dk, dv as [tokens, -1] arrays, with one q/k/v entry set
  to NaN or Inf (which = "q", "inf-v", ...), or none (which = "clean")."""
  rng = np.random.default_rng(8)
  q, k, v, (do, dlse) = _packed(rng, 20, 20)
  arrs = dict(q=q, k=k, v=v)
  if which != "clean":
    value = jnp.inf if which.startswith("inf-") else jnp.nan
    name = which.removeprefix("inf-")
    arrs[name] = arrs[name].at[NAN_LAYOUTS[layout]["bad"], 0, 3].set(value)
  res = _fwd_bwd(layout, backend)(arrs["q"], arrs["k"], arrs["v"], do,
                                  dlse.T)
  return {qname: np.asarray(x).reshape(x.shape[0], -1)
          for qname, x in zip(QUANTITIES, res)}


@functools.lru_cache(maxsize=None)
def _clean(layout, backend):
  return _run(layout, "clean", backend)


@functools.lru_cache(maxsize=None)
def _poisoned(layout, which, backend):
  """Rows (token indices) where out, lse, dq, dk, dv are not finite, and the
  values of every quantity."""
  res = _run(layout, which, backend)
  return ({qname: set(np.flatnonzero(~np.isfinite(x).all(axis=1)).tolist())
           for qname, x in res.items()}, res)


def _nan_expectation(layout, which):
  cfg = NAN_LAYOUTS[layout]
  n, bad = 20, cfg["bad"]
  spec = (varlen_mask_spec(NAN_CU, n) if layout == "varlen" else
          dense_mask_spec(1, n))
  vis = np.asarray(visibility(spec, spec, causal=cfg["causal"],
                              window_size=(-1, -1)))[0]
  name = which.removeprefix("inf-")
  rows = {bad} if name == "q" else set(np.flatnonzero(vis[:, bad]).tolist())
  upper = set(np.flatnonzero(vis[sorted(rows)].any(axis=0)).tolist())
  if name != "q":
    upper.add(bad)
  direct = set(np.flatnonzero(vis[bad]).tolist()) if name == "q" else {bad}
  # dv_j = sum_i P_ij dO_i: a bad v is not read; an infinite q entry makes
  # row r's scores +-inf, and the keys at -inf get P_rj = 0 (finite).
  dv_lower = set() if which in ("v", "inf-v", "inf-q") else direct
  return dict(
      out=(rows, rows), lse=(set(), set()) if name == "v" else (rows, rows),
      dq=(rows, rows), dk=(direct, upper), dv=(dv_lower, upper))


# A hidden pair (i, j) still meets in the kernels' matmuls (P @ V, dS @ K,
# dS^T @ Q) with P_ij = dS_ij = 0, and 0 * NaN = NaN: where a tile mixes
# hidden and visible pairs (causal: the diagonal tile), a fast launch lets a
# bad entry reach rows that never see it. Each fast kernel flags the tiles
# whose result holds a non-finite value and a second launch redoes only
# those, containing it (`pallas_kernels.flash.forward`); the checks below
# hold for every backend with no exception.


def _has_gpu():
  try:
    return jax.devices()[0].platform == "gpu"
  except RuntimeError:
    return False


def _nan_params():
  out = []
  gpu = [pytest.mark.gpu,
         pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")]
  for layout in NAN_LAYOUTS:
    for which in ("q", "k", "v", "inf-q", "inf-v"):
      for backend in (*NAN_BACKENDS, *NAN_BACKENDS_GPU):
        marks = gpu if backend in NAN_BACKENDS_GPU else []
        for qty in QUANTITIES:
          out.append(pytest.param(layout, which, backend, qty, marks=marks,
                                  id=f"{layout}-{which}-{backend}-{qty}"))
  return out


@pytest.mark.parametrize("layout,which,backend,qty", _nan_params())
def test_non_finite_input_reaches_exactly_its_rows(layout, which, backend,
                                                   qty):
  rows, values = _poisoned(layout, which, backend)
  got = rows[qty]
  lower, upper = _nan_expectation(layout, which)[qty]
  assert lower <= got, f"rows {sorted(lower - got)} should be non-finite"
  assert got <= upper, (f"rows {sorted(got - upper)} do not depend on the "
                        f"bad entry but are non-finite")
  # Rows that do not depend on the bad entry keep their clean values (a
  # finite but wrong value is a leak the finiteness check cannot see). With
  # the integer-grid dQ, the bad entry's sequence gets its dQ recomputed
  # (another summation order), hence a tolerance rather than bits.
  free = sorted(set(range(values[qty].shape[0])) - upper)
  np.testing.assert_allclose(values[qty][free],
                             _clean(layout, backend)[qty][free],
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dq_mode", ["atomic", "recompute"])
def test_tile_flags_survive_the_triton_lowering(fake_h200, monkeypatch,
                                                dq_mode):
  """The flags that start the containing launches, as lowered for the GPU:
  no signed max on i1. MLIR folds maxsi(extui a, extui b) of 0/1 flags
  into maxsi on i1, where true is -1, so max(1, 0) was 0 on an H100
  (2026-12-08: the dK/dV flag lost whenever k was clean, and the integer-grid
  dQ's recompute never ran), while interpret mode was right."""
  from jax_api import _backend
  from pallas_kernels import triton_ir
  monkeypatch.setattr(_backend, "_gpu_capability", lambda: (9, 0))
  cfg = KernelSettings(dq_mode=dq_mode)

  def grads(q, k, v, do):
    _, vjp = jax.vjp(lambda q, k, v: fold_attn_func(
        q, k, v, causal=True, backend="pallas", config=cfg), q, k, v)
    return vjp(do)
  x = jax.ShapeDtypeStruct((1, 20, 2, 32), jnp.float32)
  kernels = triton_ir.capture_triton_ir(jax.jit(grads), (x, x, x, x))
  names = [name for name, _, _ in kernels]
  assert "fold_flash_backward_dkdv" in names, names
  for name, ttir, _ in kernels:
    assert not triton_ir.signed_i1_minmax(ttir), name
