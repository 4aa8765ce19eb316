"""A refused KV cache operation changes nothing (issue 30).

For every refusal of `FoldKVCache` (JAX: eager ValueError/TypeError, and
under `jax.jit` the error word with every other buffer untouched; torch:
the in-place cache after the ValueError) every buffer of the cache pytree
is compared bitwise with a copy taken before the call: bf16/fp32 caches
and FP8 (E4M3 / E5M2) caches with their per-page scales. Appending to a
freed slot is not a refusal (the slot starts again at length 0); a freed
slot then refuses what any slot refuses, tested here after a free.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch_bridge as tb  # noqa: F401  (before JAX starts, see its docs)
import torch

from jax_api import FoldKVCache
from jax_api.kvcache import ERR_BAD_SLOT, ERR_MAX_LEN, ERR_NOT_EMPTY, ERR_POOL

B, HQ, HKV, D, MAXLEN, PAGE = 3, 4, 2, 16, 32, 16
KV_DTYPES = [None, jnp.float8_e4m3fn, jnp.float8_e5m2]
KV_IDS = ["plain", "e4m3", "e5m2"]


def _rand(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _snapshot(cache):
  """(field name, host copy) of every buffer of the pytree, None fields
  included; the fields are the children `tree_flatten` returns."""
  out = []
  for name, x in zip(FoldKVCache._FIELDS, cache.tree_flatten()[0]):
    parts = x if isinstance(x, tuple) else (x,)
    for i, y in enumerate(parts):
      out.append((f"{name}[{i}]", None if y is None else np.array(y)))
  return out


def _assert_same(before, cache, ignore=()):
  after = _snapshot(cache)
  assert [p for p, _ in before] == [p for p, _ in after]
  for (path, x), (_, y) in zip(before, after):
    if path.split("[")[0] in ignore:
      continue
    if x is None:
      assert y is None, path
      continue
    assert x.dtype == y.dtype and x.shape == y.shape, path
    # Bitwise (FP8 and NaN-safe): compare the raw bytes.
    assert x.tobytes() == y.tobytes(), f"{path} changed"


@functools.lru_cache(maxsize=None)
def _busy_cache(kv_dtype, dtype=jnp.float32, num_pages=None):
  """Slot 0: 20 tokens, slot 1: 3 tokens then freed, slot 2: 31 tokens."""
  rng = np.random.default_rng(0)
  c = FoldKVCache.create(B, HQ, HKV, D, MAXLEN, page_size=PAGE, dtype=dtype,
                         kv_dtype=kv_dtype, num_pages=num_pages)
  lens = [20, 3, 31]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  t = sum(lens)
  _, c = c.prefill(_rand(rng, (t, HQ, D), dtype), _rand(rng, (t, HKV, D),
                                                        dtype),
                   _rand(rng, (t, HKV, D), dtype), cu, backend="xla")
  c = c.free(jnp.array([1]))
  assert np.asarray(c.lengths).tolist() == [20, 0, 31]
  return c


def _tok(rng, n=None, dtype=jnp.float32, d=D, b=B):
  shape = (b, HKV, d) if n is None else (b, n, HKV, d)
  return _rand(rng, shape, dtype)


def _prompt(rng, lens, dtype=jnp.float32, hq=HQ):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  t = max(int(cu[-1]), 1)
  return (_rand(rng, (t, hq, D), dtype), _rand(rng, (t, HKV, D), dtype),
          _rand(rng, (t, HKV, D), dtype), cu)


# (id, operation on the cache, exception, message fragment, error bit under
# jit or None when the refusal is static (shapes, dtypes: raises at trace))
def _refusals():
  rng = np.random.default_rng(1)
  one = _tok(rng)
  two = _tok(rng, 2)
  only_1 = jnp.array([False, True, False])
  p_busy = _prompt(rng, [4])
  p_long = _prompt(rng, [MAXLEN + 1])
  p_wide = _prompt(rng, [4], hq=2 * HQ)
  bad_dim = _tok(rng, d=32)
  big_freed = _tok(rng, MAXLEN + 1)
  wide_batch = _tok(rng, b=B + 1)
  return [
      ("append-past-max-len", lambda c: c.append(two, two), ValueError,
       "max_len", ERR_MAX_LEN),
      ("append-freed-slot-past-max-len", lambda c: c.append(
          big_freed, big_freed, active=only_1),
       ValueError, "max_len", ERR_MAX_LEN),
      ("append-head-dim", lambda c: c.append(bad_dim, bad_dim),
       ValueError, "k must have shape", None),
      ("append-dtype", lambda c: c.append(one.astype(jnp.bfloat16),
                                          one.astype(jnp.bfloat16)),
       TypeError, "k has dtype", None),
      ("append-batch", lambda c: c.append(wide_batch, wide_batch),
       ValueError, "k must have shape", None),
      ("prefill-busy-slot", lambda c: c.prefill(*p_busy[:3], p_busy[3],
                                                seq_ids=jnp.array([0]),
                                                backend="xla")[1],
       ValueError, "empty slots", ERR_NOT_EMPTY),
      ("prefill-out-of-range-slot", lambda c: c.prefill(
          *p_busy[:3], p_busy[3], seq_ids=jnp.array([B]), backend="xla")[1],
       ValueError, "seq_ids", ERR_BAD_SLOT),
      ("prefill-too-long", lambda c: c.prefill(
          *p_long[:3], p_long[3], seq_ids=jnp.array([1]),
          backend="xla")[1], ValueError, "max_len", ERR_MAX_LEN),
      ("prefill-dtype", lambda c: c.prefill(
          *(x.astype(jnp.bfloat16) for x in p_busy[:3]), p_busy[3],
          seq_ids=jnp.array([1]), backend="xla")[1], TypeError,
       "k has dtype", None),
      ("prefill-heads", lambda c: c.prefill(
          *p_wide[:3], p_wide[3],
          seq_ids=jnp.array([1]), backend="xla")[1], ValueError,
       "prefill expects q", None),
      ("free-out-of-range", lambda c: c.free(jnp.array([B])), ValueError,
       "seq_ids", ERR_BAD_SLOT),
      ("free-repeated", lambda c: c.free(jnp.array([2, 2])), ValueError,
       "seq_ids", ERR_BAD_SLOT),
  ]


REFUSALS = _refusals()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
@pytest.mark.parametrize("name,op,exc,fragment,bit", REFUSALS,
                         ids=[r[0] for r in REFUSALS])
def test_refused_operation_leaves_every_buffer_unchanged(name, op, exc,
                                                         fragment, bit,
                                                         kv_dtype):
  cache = _busy_cache(kv_dtype)
  before = _snapshot(cache)
  with pytest.raises(exc, match=fragment):
    op(cache)
  _assert_same(before, cache)
  # Under jit: static refusals raise at trace time; capacity and slot
  # refusals set the error word and leave every other buffer as it was.
  jitted = jax.jit(op)
  if bit is None:
    with pytest.raises(exc, match=fragment):
      jitted(cache)
    return
  new = jitted(cache)
  assert int(new.error) & bit
  _assert_same(before, new, ignore=("error",))
  with pytest.raises(ValueError, match="refused"):
    new.check()
  _assert_same(before, cache)  # the input (not donated) is untouched too


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=KV_IDS)
def test_pool_exhausted_append_changes_nothing(kv_dtype):
  """A pool of 5 pages, 4 in use (slots 0 and 2): 17 tokens into the freed
  slot 1 need 2 pages."""
  rng = np.random.default_rng(2)
  cache = _busy_cache(kv_dtype, num_pages=5)
  big = _tok(rng, 17)
  only_1 = jnp.array([False, True, False])
  before = _snapshot(cache)
  with pytest.raises(ValueError, match="page"):
    cache.append(big, big, active=only_1)
  _assert_same(before, cache)
  new = jax.jit(lambda c, k: c.append(k, k, active=only_1))(cache, big)
  assert int(new.error) & ERR_POOL
  _assert_same(before, new, ignore=("error",))


def test_donated_refusal_under_jit_changes_nothing():
  """With the cache donated (how a serving loop runs), a refused append
  returns a cache whose buffers hold the old contents."""
  rng = np.random.default_rng(3)
  cache = jax.tree_util.tree_map(jnp.copy, _busy_cache(jnp.float8_e4m3fn))
  before = _snapshot(cache)
  step = jax.jit(lambda c, k: c.append(k, k), donate_argnums=0)
  new = step(cache, _tok(rng, 2))
  assert int(new.error) & ERR_MAX_LEN
  _assert_same(before, new, ignore=("error",))


# ---------------------------------------------------------------- torch --
def _t(x):
  return torch.from_numpy(np.array(x))


def _tcache(kv_dtype):
  rng = np.random.default_rng(4)
  c = tb.FoldKVCache.create(B, HQ, HKV, D, MAXLEN, page_size=PAGE,
                            dtype=torch.float32, device="cpu",
                            kv_dtype=kv_dtype)
  lens = [20, 3, 31]
  q, k, v, cu = _prompt(rng, lens)
  c.prefill(_t(q), _t(k), _t(v), _t(cu))
  c.free(torch.tensor([1]))
  return c


TORCH_REFUSALS = [
    ("append-past-max-len", lambda c: c.append(
        torch.zeros(B, 2, HKV, D), torch.zeros(B, 2, HKV, D)), ValueError,
     "refused"),
    ("append-dtype", lambda c: c.append(
        torch.zeros(B, HKV, D, dtype=torch.float16),
        torch.zeros(B, HKV, D, dtype=torch.float16)), TypeError,
     "k has dtype"),
    ("append-head-dim", lambda c: c.append(torch.zeros(B, HKV, 8),
                                           torch.zeros(B, HKV, 8)),
     ValueError, "k must have shape"),
    ("prefill-busy", lambda c: c.prefill(
        torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D),
        torch.tensor([0, 4], dtype=torch.int32),
        seq_ids=torch.tensor([2], dtype=torch.int32)), ValueError,
     "refused"),
    ("prefill-cu", lambda c: c.prefill(
        torch.zeros(4, HQ, D), torch.zeros(4, HKV, D), torch.zeros(4, HKV, D),
        torch.tensor([1, 4], dtype=torch.int32),
        seq_ids=torch.tensor([1], dtype=torch.int32)), ValueError,
     "cu_seqlens"),
    ("free-out-of-range", lambda c: c.free([B]), ValueError, "refused"),
]


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn],
                         ids=["plain", "e4m3"])
@pytest.mark.parametrize("name,op,exc,fragment", TORCH_REFUSALS,
                         ids=[r[0] for r in TORCH_REFUSALS])
def test_torch_refusal_leaves_the_cache_unchanged(name, op, exc, fragment,
                                                  kv_dtype):
  """The torch cache is updated in place: after a refused call its JAX
  pytree holds the same bits (and a cleared error word)."""
  cache = _tcache(kv_dtype)
  before = _snapshot(cache.jax)
  with pytest.raises(exc, match=fragment):
    op(cache)
  _assert_same(before, cache.jax)
  cache.append(torch.zeros(B, HKV, D), torch.zeros(B, HKV, D),
               active=torch.tensor([True, True, False]))  # still usable
  assert cache.lengths.tolist() == [21, 1, 31]
