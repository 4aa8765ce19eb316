"""FP8 KV cache (`FoldKVCache.create(kv_dtype=...)`): bytes, accuracy against
the float32 reference over the dequantised cache and against a bf16 cache,
per-sequence scales (batch composition never changes a sequence's bits), NaN
containment, validation, refused appends, and the kernel's split-count and
paged-vs-contiguous invariance with FP8 pages."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api.kvcache import ERR_MAX_LEN, FoldKVCache, fold_attn_with_kvcache
from pallas_kernels.decode import contiguous_decode, paged_decode
from pallas_kernels.decode.fp8 import dequantise_pages, fp8_max
from pallas_kernels.reference import paged_decode_reference
from pallas_kernels.reference.decode import dequantised_pages, gather_pages
from pallas_kernels.reference.decode_draft import paged_draft_reference

S = 16
E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _rand(rng, shape, dtype=jnp.bfloat16):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _prompts(rng, lens, hq, hkv, d, dtype=jnp.bfloat16):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  t = int(cu[-1])
  return (_rand(rng, (t, hq, d), dtype), _rand(rng, (t, hkv, d), dtype),
          _rand(rng, (t, hkv, d), dtype), cu)


_BF16_BOUND = {"float8_e4m3fn": 5e-2, "float8_e5m2": 1e-1}


def _kv_bytes(cache):
  parts = [cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales]
  return sum(x.size * x.dtype.itemsize for x in parts if x is not None)


def _seq_pages(cache, slot):
  """(k, v, k_scales, v_scales) of a slot's filled pages, in logical order."""
  n = -(-int(cache.lengths[slot]) // cache.config.page_size)
  pages = np.asarray(cache.block_table[slot, :n])
  return tuple(np.asarray(x)[pages] for x in
               (cache.k_pages, cache.v_pages, cache.k_scales, cache.v_scales))


@functools.partial(jax.jit, static_argnames=("window_size",))
def _ref_fp8(cache, q, window_size=(-1, -1)):
  d = cache.config.head_dim
  kp = dequantised_pages(cache.k_pages, cache.k_scales)[..., :d]
  vp = dequantised_pages(cache.v_pages, cache.v_scales)[..., :d]
  if q.ndim == 3:
    return paged_decode_reference(q, kp, vp, cache.block_table,
                                  cache.lengths, window_size=window_size)[0]
  return paged_draft_reference(q, kp, vp, cache.block_table, cache.lengths,
                               window_size=window_size)[0]


def test_fp8_cache_bytes_at_most_052_of_bf16():
  args = (4, 8, 2, 64, 256)
  bf = FoldKVCache.create(*args, page_size=S)
  for kvd in (E4M3, E5M2):
    f8 = FoldKVCache.create(*args, page_size=S, kv_dtype=kvd)
    assert f8.k_pages.dtype == jnp.dtype(kvd)
    ratio = _kv_bytes(f8) / _kv_bytes(bf)
    assert ratio <= 0.52, ratio
  assert bf.k_scales is None and bf.config.kv_dtype is None


@pytest.mark.parametrize("kvd", [E4M3, E5M2])
def test_fp8_decode_matches_reference_and_bf16(kvd):
  rng = np.random.default_rng(0)
  b, hq, hkv, d = 2, 4, 2, 32
  q, k, v, cu = _prompts(rng, [37, 12], hq, hkv, d)
  bf = FoldKVCache.create(b, hq, hkv, d, 64, page_size=S, chunk_tokens=2 * S)
  f8 = FoldKVCache.create(b, hq, hkv, d, 64, page_size=S, chunk_tokens=2 * S,
                          kv_dtype=kvd)
  _, bf = bf.prefill(q, k, v, cu, backend="xla")
  _, f8 = f8.prefill(q, k, v, cu, backend="xla")
  errs = []
  for _ in range(3):  # appends that fill, grow and open pages
    qs, ks, vs = (_rand(rng, (b, hq, d)), _rand(rng, (b, hkv, d)),
                  _rand(rng, (b, hkv, d)))
    o_bf, bf = fold_attn_with_kvcache(qs, bf, ks, vs, backend="xla")
    o_f8, f8 = fold_attn_with_kvcache(qs, f8, ks, vs, backend="interpret",
                                      num_splits=2)
    o_x, _ = fold_attn_with_kvcache(qs, f8, backend="xla")
    ref = _ref_fp8(f8, qs)
    # Over the dequantised cache: bf16 compute tolerance.
    assert _rel(o_f8, ref) < 1e-2 and _rel(o_x, ref) < 1e-2
    errs.append(_rel(o_f8, o_bf))
  print(f"\n{jnp.dtype(kvd).name} vs bf16 cache: rel L2 per step {errs}")
  # Rounding one normal vector to E4M3 (3 mantissa bits) alone costs about
  # 2.7e-2 relative L2 (E5M2: 5.3e-2); K and V both rounded give ~3.5e-2
  # here, so the bound is the format's, with margin.
  assert max(errs) < _BF16_BOUND[jnp.dtype(kvd).name]
  # Draft path (q_len 2, causal within the draft) over FP8 pages.
  qd = _rand(rng, (b, 2, hq, d))
  kd, vd = _rand(rng, (b, 2, hkv, d)), _rand(rng, (b, 2, hkv, d))
  od, f8 = fold_attn_with_kvcache(qd, f8, kd, vd, backend="interpret")
  assert od.shape == qd.shape and _rel(od, _ref_fp8(f8, qd)) < 1e-2


def test_fp8_kernel_equals_kernel_over_dequantised_pages():
  """Dequantising in registers is exact: the same bits as a cache holding
  the dequantised pages, for every split count; contiguous == paged."""
  rng = np.random.default_rng(1)
  b, hq, hkv, d, n_pg = 2, 4, 2, 16, 4
  kp = _rand(rng, (b * n_pg, S, hkv, d), jnp.float32)
  vp = _rand(rng, (b * n_pg, S, hkv, d), jnp.float32)
  ks = jnp.exp2(jnp.asarray(rng.integers(-9, -5, (b * n_pg, hkv)),
                            jnp.float32))
  vs = jnp.exp2(jnp.asarray(rng.integers(-9, -5, (b * n_pg, hkv)),
                            jnp.float32))
  kq = (kp / ks[:, None, :, None]).astype(E4M3)
  vq = (vp / vs[:, None, :, None]).astype(E4M3)
  perm = rng.permutation(b * n_pg)
  table = jnp.asarray(perm.reshape(b, n_pg), jnp.int32)
  lens = jnp.array([61, 23], jnp.int32)
  q = _rand(rng, (b, hq, d))
  kw = dict(chunk_tokens=S, interpret=True)
  deq_k = dequantise_pages(kq, ks, jnp.bfloat16)
  deq_v = dequantise_pages(vq, vs, jnp.bfloat16)
  base = paged_decode(q, deq_k, deq_v, table, lens, num_splits=1, **kw)
  for n in (1, 3):
    out = paged_decode(q, kq, vq, table, lens, k_scales=ks, v_scales=vs,
                       num_splits=n, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base))
  # Contiguous layout: the same pages in logical order, scales per page.
  kc = gather_pages(kq, table)
  vc = gather_pages(vq, table)
  out = contiguous_decode(q, kc, vc, lens, page_size=S, k_scales=ks[table],
                          v_scales=vs[table], num_splits=2, **kw)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(base))


def test_fp8_pages_do_not_depend_on_the_batch():
  rng = np.random.default_rng(2)
  hq, hkv, d = 2, 1, 16
  q, k, v, cu = _prompts(rng, [21, 40, 5], hq, hkv, d)
  mk = lambda: FoldKVCache.create(3, hq, hkv, d, 64, page_size=S,  # noqa
                                  kv_dtype=E4M3)
  _, batched = mk().prefill(q, k, v, cu, seq_ids=jnp.array([2, 0, 1]),
                            backend="xla")
  lo, hi = int(cu[1]), int(cu[2])  # the second prompt, alone in slot 1
  cu1 = jnp.array([0, hi - lo], jnp.int32)
  _, alone = mk().prefill(q[lo:hi], k[lo:hi], v[lo:hi], cu1,
                          seq_ids=jnp.array([1]), backend="xla")
  for x, y in zip(_seq_pages(batched, 0), _seq_pages(alone, 1)):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
  # Appends: the same tokens appended with different neighbours.
  tok = 5 * _rand(rng, (3, hkv, d))
  other = _rand(rng, (3, hkv, d))
  a = batched.append(tok, tok)
  mixed = jnp.where(jnp.arange(3)[:, None, None] == 0, tok, other)
  c = batched.append(mixed, mixed)
  for x, y in zip(_seq_pages(a, 0), _seq_pages(c, 0)):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_append_grows_the_page_scale_and_requantises():
  rng = np.random.default_rng(3)
  hkv, d = 1, 16
  cache = FoldKVCache.create(1, 1, hkv, d, 32, page_size=S, dtype=jnp.float32,
                             kv_dtype=E4M3)
  small = _rand(rng, (1, 3, hkv, d), jnp.float32) * 0.1
  cache = cache.append(small, small)
  s0 = float(cache.k_scales[0, 0])
  big = jnp.full((1, hkv, d), 1000.0)
  cache = cache.append(big, big)
  s1 = float(cache.k_scales[0, 0])
  assert s1 > s0 and s1 == 2.0 ** np.ceil(np.log2(1000.0 / fp8_max(E4M3)))
  deq = np.asarray(dequantised_pages(cache.k_pages, cache.k_scales))[0, :, 0]
  np.testing.assert_allclose(deq[3], 1000.0, rtol=2 ** -4)
  # Earlier tokens are re-quantised to the larger scale (coarser, bounded
  # error), rows past the last token are zero.
  np.testing.assert_allclose(deq[:3], np.asarray(small)[0, :, 0],
                             atol=s1 * 2 ** -9 * 1.01, rtol=2 ** -4)
  assert not deq[4:].any()
  # The anchor is the dequantised first key of the page.
  np.testing.assert_array_equal(np.asarray(cache.anchors[0, 0, 0]), deq[0])


def test_nan_page_is_contained():
  rng = np.random.default_rng(4)
  hq, hkv, d = 2, 1, 16
  q, k, v, cu = _prompts(rng, [20, 20], hq, hkv, d)
  k = k.at[3, 0, 5].set(jnp.nan).at[4, 0, 1].set(jnp.inf)  # prompt 0, page 0
  cache = FoldKVCache.create(2, hq, hkv, d, 64, page_size=S, kv_dtype=E4M3)
  _, cache = cache.prefill(q, k, v, cu, backend="xla")
  assert np.isfinite(np.asarray(cache.k_scales)).all()
  clean = FoldKVCache.create(2, hq, hkv, d, 64, page_size=S, kv_dtype=E4M3)
  _, clean = clean.prefill(q[20:], k[20:], v[20:], cu[:2],
                           seq_ids=jnp.array([1]), backend="xla")
  for x, y in zip(_seq_pages(cache, 1), _seq_pages(clean, 1)):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
  qs = _rand(rng, (2, hq, d))
  out = cache.attend(qs, backend="interpret")
  ref = clean.attend(qs, backend="interpret")
  assert np.isfinite(np.asarray(out[1], np.float32)).all()
  np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref[1]))
  # A NaN appended to slot 0 leaves slot 1's page and scale alone.
  tok = jnp.zeros((2, hkv, d), jnp.bfloat16).at[0, 0, 0].set(jnp.nan)
  after = cache.append(tok, tok)
  assert np.isfinite(np.asarray(after.k_scales)).all()
  p1 = int(cache.block_table[1, 1])
  assert float(after.k_scales[p1, 0]) == float(cache.k_scales[p1, 0])


def test_fp8_validation_and_refused_appends():
  with pytest.raises(ValueError, match="kv_dtype"):
    FoldKVCache.create(1, 2, 1, 16, 32, kv_dtype=jnp.int8)
  with pytest.raises(ValueError, match="kv_dtype"):
    FoldKVCache.create(1, 2, 1, 16, 32, kv_dtype="float8_e4m3fnuz")
  rng = np.random.default_rng(5)
  cache = FoldKVCache.create(2, 2, 1, 16, 32, page_size=S, kv_dtype=E4M3)
  q, k, v, cu = _prompts(rng, [30, 7], 2, 1, 16)
  _, cache = cache.prefill(q, k, v, cu, backend="xla")
  with pytest.raises(ValueError, match="head_dim"):
    cache.append(jnp.zeros((2, 1, 8), jnp.bfloat16),
                 jnp.zeros((2, 1, 8), jnp.bfloat16))
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(cache)]
  big = _rand(rng, (2, 3, 1, 16))  # slot 0: 30 + 3 > 32
  with pytest.raises(ValueError, match="max_len"):
    cache.append(big, big)
  new = jax.jit(lambda c, k, v: c.append(k, v))(cache, big, big)
  assert int(new.error) & ERR_MAX_LEN
  for x, y in zip(jax.tree_util.tree_leaves(new._replace(
      error=jnp.int32(0))), leaves):
    np.testing.assert_array_equal(np.atleast_1d(np.asarray(x)).view(np.uint8),
                                  np.atleast_1d(y).view(np.uint8))
  # Donating an FP8 cache through jit works (no aliased buffers).
  step = jax.jit(lambda c, k, v: c.append(k, v), donate_argnums=0)
  tok = _rand(rng, (2, 1, 16))
  out = step(cache, tok, tok)
  np.testing.assert_array_equal(out.lengths, [31, 8])


def test_torch_bridge_fp8_cache_matches_the_jax_cache():
  torch = pytest.importorskip("torch")
  import torch_bridge as tb
  with pytest.raises(ValueError, match="kv_dtype"):
    tb.FoldKVCache.create(1, 2, 1, 16, 32, dtype=torch.float32,
                          device="cpu", kv_dtype=torch.int8)
  torch.manual_seed(0)
  hq, hkv, d = 2, 1, 16
  tc = tb.FoldKVCache.create(2, hq, hkv, d, 48, page_size=S,
                             dtype=torch.float32, device="cpu",
                             kv_dtype=torch.float8_e4m3fn)
  assert tc.jax.k_pages.dtype == jnp.dtype(E4M3)
  cu = torch.tensor([0, 20, 27], dtype=torch.int32)
  q, k, v = (torch.randn(27, hq, d), torch.randn(27, hkv, d),
             torch.randn(27, hkv, d))
  tc.prefill(q, k, v, cu, max_seqlen=20)
  jc = FoldKVCache.create(2, hq, hkv, d, 48, page_size=S, dtype=jnp.float32,
                          kv_dtype=E4M3)
  j = lambda t: jnp.asarray(t.numpy())  # noqa: E731
  _, jc = jc.prefill(j(q), j(k), j(v), j(cu), backend="xla")
  qs, ks, vs = (torch.randn(2, hq, d), torch.randn(2, hkv, d),
                torch.randn(2, hkv, d))
  out = tb.fold_attn_with_kvcache(qs, tc, ks, vs)
  ref, jc = fold_attn_with_kvcache(j(qs), jc, j(ks), j(vs),
                                   backend=tc.target.backend)
  for x, y in zip(_seq_pages(tc.jax, 0), _seq_pages(jc, 0)):
    np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))
  np.testing.assert_allclose(out.numpy(), np.asarray(ref), rtol=1e-5,
                             atol=1e-6)
