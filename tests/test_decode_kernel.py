"""Split-KV paged decode kernel (Pallas, interpret mode on CPU) against the
float32 references, its bitwise invariances (split count, batch, page
placement), the declared-reference fallback, the XLA backend (a model of
the same semantics), and Triton lowering. GPU twins are
marked `gpu` (run with `pytest -m gpu` on an NVIDIA GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.decode import (contiguous_as_pages, contiguous_decode,
                                   paged_decode, xla_decode)
from pallas_kernels import triton_ir
from pallas_kernels.reference import paged_decode_reference
from pallas_kernels.reference.decode_draft import paged_draft_reference

ON_GPU = jax.devices()[0].platform == "gpu"
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}
S = 16  # page size in tests


def _rand(rng, shape, dtype, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale,
                     jnp.float32).astype(dtype)


def _bits(x):
  x = jnp.asarray(x)
  it = {2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
  return np.asarray(jax.lax.bitcast_convert_type(x, it))


def _same_bits(a, b):
  return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
      _bits(a), _bits(b))


def _paged(rng, lengths, *, hkv, d, dtype, spare=3, max_pages=None):
  """A random pool with pages placed at random; returns (k_pages, v_pages,
  block_table, page counts)."""
  b = len(lengths)
  mp = max_pages or max(1, max(-(-int(n) // S) for n in lengths))
  n_pages = b * mp + spare
  perm = rng.permutation(n_pages)
  table = perm[:b * mp].reshape(b, mp).astype(np.int32)
  k = _rand(rng, (n_pages, S, hkv, d), dtype)
  v = _rand(rng, (n_pages, S, hkv, d), dtype)
  counts = np.zeros(n_pages, np.int32)
  for i, n in enumerate(lengths):
    for p in range(mp):
      counts[table[i, p]] = np.clip(n - p * S, 0, S)
  return k, v, jnp.asarray(table), jnp.asarray(counts)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "window_size",
                                             "softcap"))
def _reference(q, k, v, table, lengths, **opts):
  if q.ndim == 3:
    return paged_decode_reference(q, k, v, table, lengths, **opts)[0]
  return paged_draft_reference(q, k, v, table, lengths, **opts)[0]


_model = jax.jit(xla_decode, static_argnames=(
    "softmax_scale", "window_left", "softcap"))


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


CASES = {
    # GQA 1, ragged lengths from 1 to several pages (and chunks); an empty
    # sequence gives zeros
    "gqa1_ragged_f32": dict(hq=2, hkv=2, d=32, lengths=(1, 16, 17, 75, 0),
                            dtype=jnp.float32, splits=3),
    # GQA 4, bf16, sinks
    "gqa4_bf16_sinks": dict(hq=8, hkv=2, d=64, lengths=(40, 3),
                            dtype=jnp.bfloat16, sinks=True, splits=2),
    # GQA 8, window and soft-cap
    "gqa8_window_softcap": dict(hq=8, hkv=1, d=32, lengths=(90, 20),
                                dtype=jnp.float32, window=(21, 0),
                                softcap=3.0, scale=0.3, splits=2),
    # a 3-token draft, fp16, window + sinks
    "draft3_fp16": dict(hq=4, hkv=1, d=32, lengths=(50, 3), q_len=3,
                        dtype=jnp.float16, window=(10, -1), sinks=True,
                        splits=2),
    # head_dim that is not a power of two (zero-padded to 32)
    "head_dim_24": dict(hq=4, hkv=2, d=24, lengths=(33, 64),
                        dtype=jnp.float32, splits=1),
}


def _inputs(*, hq, hkv, d, lengths, dtype, q_len=1, sinks=False, seed=0,
            **_):
  rng = np.random.default_rng(seed)
  k, v, table, counts = _paged(rng, lengths, hkv=hkv, d=d, dtype=dtype)
  shape = (len(lengths), hq, d) if q_len == 1 else (len(lengths), q_len, hq,
                                                    d)
  q = _rand(rng, shape, dtype)
  sink = _rand(rng, (hq,), jnp.float32) if sinks else None
  return q, k, v, table, jnp.asarray(lengths, jnp.int32), sink, counts


def _pad_pool(x, d):
  dp = 16
  while dp < d:
    dp *= 2
  return jnp.pad(x, ((0, 0),) * 3 + ((0, dp - d),))


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
  c = CASES[case]
  q, k, v, table, lengths, sink, _ = _inputs(**c)
  opts = dict(softmax_scale=c.get("scale"), sinks=sink,
              softcap=c.get("softcap", 0.0))
  window = c.get("window", (-1, -1))
  ref = _reference(q, k, v, table, lengths, window_size=window, **opts)
  kp, vp = _pad_pool(k, c["d"]), _pad_pool(v, c["d"])
  fn = jax.jit(lambda q, k, v, t, n, s: paged_decode(
      q, k, v, t, n, chunk_tokens=2 * S, interpret=True,
      num_splits=c["splits"], window_left=window[0], sinks=s,
      softmax_scale=opts["softmax_scale"], softcap=opts["softcap"]))
  out = fn(q, kp, vp, table, lengths, sink)
  assert out.shape == q.shape and out.dtype == q.dtype
  tol = TOL[c["dtype"]]
  assert _rel(out, ref) < tol, case
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  assert np.all(np.asarray(out)[np.asarray(lengths) == 0] == 0)
  # The XLA model of the same semantics (backend="xla").
  xo = _model(q, kp, vp, table, lengths, window_left=window[0], **opts)
  assert _rel(xo, ref) < tol


def _split_inputs(dtype=jnp.bfloat16, b=3):
  rng = np.random.default_rng(7)
  lengths = (150, 37, 1)[:b]
  k, v, table, counts = _paged(rng, lengths, hkv=1, d=32, dtype=dtype)
  q = _rand(rng, (b, 4, 32), dtype)
  sink = _rand(rng, (4,), jnp.float32)
  return q, k, v, table, jnp.asarray(lengths, jnp.int32), sink


def test_bitwise_identical_for_any_split_count():
  q, k, v, table, lengths, sink = _split_inputs()
  outs = {}
  for n in (1, 2, 7, 64):
    outs[n] = paged_decode(q, k, v, table, lengths, chunk_tokens=S,
                           interpret=True, num_splits=n, sinks=sink)
  for n in (2, 7, 64):
    assert _same_bits(outs[n], outs[1]), n
  again = paged_decode(q, k, v, table, lengths, chunk_tokens=S,
                       interpret=True, num_splits=1, sinks=sink)
  assert _same_bits(again, outs[1])  # repeatable
  ref = _reference(q, k, v, table, lengths, sinks=sink)
  assert _rel(outs[1], ref) < TOL[jnp.bfloat16]


def test_bitwise_alone_vs_batch_of_16():
  rng = np.random.default_rng(3)
  lengths = [int(x) for x in rng.integers(1, 70, size=16)]
  lengths[5] = 61
  k, v, table, _ = _paged(rng, lengths, hkv=2, d=32, dtype=jnp.bfloat16)
  q = _rand(rng, (16, 8, 32), jnp.bfloat16)
  run = lambda q, t, n: paged_decode(q, k, v, t, n, chunk_tokens=2 * S,
                                     interpret=True, num_splits=2)
  batch = run(q, table, jnp.asarray(lengths, jnp.int32))
  alone = run(q[5:6], table[5:6], jnp.asarray(lengths[5:6], jnp.int32))
  assert _same_bits(alone[0], batch[5])


def test_bitwise_paged_equals_contiguous():
  rng = np.random.default_rng(4)
  b, t, hkv, d = 3, 80, 2, 32
  k = _rand(rng, (b, t, hkv, d), jnp.bfloat16)
  v = _rand(rng, (b, t, hkv, d), jnp.bfloat16)
  q = _rand(rng, (b, 8, d), jnp.bfloat16)
  lengths = jnp.array([80, 33, 47], jnp.int32)
  contiguous = contiguous_decode(q, k, v, lengths, page_size=S,
                                 chunk_tokens=2 * S, interpret=True,
                                 num_splits=3)
  # The same tokens in pages scattered over a larger pool.
  kp, table = contiguous_as_pages(k, S)
  vp, _ = contiguous_as_pages(v, S)
  n = kp.shape[0]
  perm = rng.permutation(n + 5)
  pool_k = jnp.zeros((n + 5,) + kp.shape[1:], kp.dtype).at[perm[:n]].set(kp)
  pool_v = jnp.zeros((n + 5,) + vp.shape[1:], vp.dtype).at[perm[:n]].set(vp)
  paged = paged_decode(q, pool_k, pool_v, jnp.asarray(perm[:n])[table],
                       lengths, chunk_tokens=2 * S, interpret=True,
                       num_splits=2)
  assert _same_bits(paged, contiguous)


def test_declared_reference_fallback():
  """A key far above every sampled key (here 90+ in log2 units) would
  overflow 2^(s - R); such rows are recomputed against their exact maximum,
  the others keep their reference (and bits)."""
  rng = np.random.default_rng(0)
  b, t, d = 2, 96, 32
  q = np.asarray(rng.standard_normal((b, 4, d)), np.float32)
  k = np.asarray(rng.standard_normal((b, t, 1, d)), np.float32)
  v = np.asarray(rng.standard_normal((b, t, 1, d)), np.float32)
  k[0, 37, 0] = q[0, 0] / np.linalg.norm(q[0, 0]) * 130.0  # not sampled
  q, k, v = map(jnp.asarray, (q, k, v))
  lengths = jnp.array([t, 70], jnp.int32)
  kw = dict(page_size=S, chunk_tokens=2 * S, interpret=True, num_splits=2,
            return_reference=True)
  raw, r0 = contiguous_decode(q, k, v, lengths, fallback=False, **kw)
  out, r1 = contiguous_decode(q, k, v, lengths, **kw)
  assert not np.all(np.isfinite(np.asarray(raw)))  # overflow without it
  kp, table = contiguous_as_pages(k, S)
  vp, _ = contiguous_as_pages(v, S)
  ref = _reference(q, kp, vp, table, lengths)
  assert _rel(out, ref) < 1e-5
  assert float(r1[0, 0, 0]) > float(r0[0, 0, 0]) + 64  # R := M for that row
  same = np.ones(r0.shape, bool)
  same[0, 0, 0] = False
  np.testing.assert_array_equal(np.asarray(r1)[same], np.asarray(r0)[same])
  assert _same_bits(out[1], raw[1])
  assert _same_bits(out[0, 1:], raw[0, 1:])  # same group, rows that passed


def test_depth_keyword_is_gone():
  # depth pruning was removed (issue 29): the keyword is not accepted.
  rng = np.random.default_rng(5)
  k, v, table, _ = _paged(rng, (20,), hkv=1, d=16, dtype=jnp.float32)
  q = _rand(rng, (1, 2, 16), jnp.float32)
  with pytest.raises(TypeError, match="depth"):
    paged_decode(q, k, v, table, jnp.asarray([20], jnp.int32),
                 chunk_tokens=S, interpret=True, depth=8)
  with pytest.raises(TypeError, match="depth"):
    xla_decode(q, k, v, table, jnp.asarray([20], jnp.int32), depth=8)


def test_lowers_for_triton_on_cpu(fake_h200):
  """The decode kernels lower to Triton IR (what the GPU compiles)."""
  sds = jax.ShapeDtypeStruct
  b, hq, hkv, page, n_pages, mp = 4, 32, 8, 256, 64, 8
  for d, dtype, q_len, sinks in (
      (128, jnp.bfloat16, 1, False),
      (128, jnp.bfloat16, 4, True),
      (64, jnp.float32, 1, True),
      (96, jnp.float16, 3, False)):
    dp = 16
    while dp < d:
      dp *= 2
    pool = (n_pages, page, hkv, dp)

    def f(q, k, v, t, n, sk):
      return paged_decode(q, k, v, t, n, chunk_tokens=1024, window_left=300,
                          softcap=30.0, sinks=sk, interpret=False,
                          compute_capability=(9, 0), num_splits=4)
    args = (sds((b, q_len, hq, d), dtype), sds(pool, dtype),
            sds(pool, dtype), sds((b, mp), jnp.int32), sds((b,), jnp.int32),
            sds((hq,), jnp.float32) if sinks else None)
    kernels = triton_ir.capture_triton_ir(jax.jit(f), args)
    assert [name for name, _, _ in kernels] == ["fold_decode_split",
                                                "fold_decode_combine"]
    for name, ttir, _ in kernels:  # see triton_ir.signed_i1_minmax
      assert not triton_ir.signed_i1_minmax(ttir), name


# ----------------------------------------------------------------------------
# GPU (pytest -m gpu)
# ----------------------------------------------------------------------------
def _gpu_inputs(b, t, dtype=jnp.bfloat16, hq=32, hkv=8, d=128, page=256,
                seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[0] = t
  k, v, table, counts = (None,) * 4
  mp = -(-t // page)
  n_pages = b * mp + 4
  perm = rng.permutation(n_pages)
  table = jnp.asarray(perm[:b * mp].reshape(b, mp).astype(np.int32))
  k = _rand(rng, (n_pages, page, hkv, d), dtype)
  v = _rand(rng, (n_pages, page, hkv, d), dtype)
  q = _rand(rng, (b, hq, d), dtype)
  return q, k, v, table, jnp.asarray(lengths, jnp.int32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_gpu_matches_reference(dtype):
  from jax_api._backend import _gpu_capability
  q, k, v, table, lengths = _gpu_inputs(4, 3000, dtype)
  sink = jnp.linspace(-2, 2, 32, dtype=jnp.float32)
  for kw in (dict(), dict(sinks=sink), dict(window_left=700, softcap=20.0)):
    out = paged_decode(q, k, v, table, lengths, chunk_tokens=1024,
                       compute_capability=_gpu_capability(), **kw)
    ref = paged_decode_reference(
        q, k, v, table, lengths, sinks=kw.get("sinks"),
        window_size=(kw.get("window_left", -1), -1),
        softcap=kw.get("softcap", 0.0))[0]
    assert _rel(out, ref) < TOL[dtype], kw


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_gpu_bitwise_invariances():
  from jax_api._backend import _gpu_capability
  cc = _gpu_capability()
  q, k, v, table, lengths = _gpu_inputs(16, 5000)
  run = lambda q, t, n, splits: paged_decode(
      q, k, v, t, n, chunk_tokens=1024, num_splits=splits,
      compute_capability=cc)
  first = run(q, table, lengths, 1)
  for splits in (2, 7, 64):
    assert _same_bits(run(q, table, lengths, splits), first), splits
  for _ in range(5):
    assert _same_bits(run(q, table, lengths, None), first)
  alone = run(q[3:4], table[3:4], lengths[3:4], None)
  assert _same_bits(alone[0], first[3])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU")
def test_gpu_draft():
  from jax_api._backend import _gpu_capability
  cc = _gpu_capability()
  _, k, v, table, lengths = _gpu_inputs(4, 3000)
  qd = _rand(np.random.default_rng(1), (4, 5, 32, 128), jnp.bfloat16)
  out = paged_decode(qd, k, v, table, lengths, chunk_tokens=1024,
                     compute_capability=cc)
  ref = paged_draft_reference(qd, k, v, table, lengths)[0]
  assert _rel(out, ref) < 2e-2


def test_benchmark_smoke(tmp_path):
  """`python -m benchmarks.decode --smoke` runs on CPU and writes JSON."""
  import json
  import os
  import subprocess
  import sys
  from pathlib import Path
  repo = Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
  out = tmp_path / "decode.json"
  r = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--smoke",
                      "--impls", "ours,jax_xla,torch_sdpa", "--output",
                      str(out)], cwd=repo, env=env, capture_output=True,
                     text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
  doc = json.loads(out.read_text())
  by = {x["impl"]: x for x in doc["records"]}
  assert by["ours"]["error"] is None and by["ours"]["ms"] > 0
  assert by["ours"]["bitwise_repeatable"] is True
  assert by["jax_xla"]["rel_err_vs_ours"] < 2e-2
  assert by["torch_sdpa"]["error"].startswith("skipped")
  t = subprocess.run([sys.executable, "-m", "benchmarks.decode", "--table",
                      str(out)], cwd=repo, env=env, capture_output=True,
                     text=True, timeout=60)
  assert t.returncode == 0 and "ours" in t.stdout
