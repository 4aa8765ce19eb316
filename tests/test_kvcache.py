"""FoldKVCache and fold_attn_with_kvcache: prefill + decode against the
float32 references, drafts, jit with donation, and cache safety (a
hypothesis state machine against a dict-of-lists model: contents, no page
shared by two live slots, no page leaked, freed pages reused, overflow
refused before any write, eagerly (ValueError) and under jit (error word,
no-op))."""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from jax_api.kvcache import (ERR_BAD_SLOT, ERR_MAX_LEN, ERR_NOT_EMPTY,
                             ERR_POOL, FoldKVCache, fold_attn_with_kvcache)
from pallas_kernels.reference import (paged_decode_reference,
                                      varlen_attention_reference)
from pallas_kernels.reference.decode import gather_pages
from pallas_kernels.reference.decode_draft import paged_draft_reference

S = 16


def _rand(rng, shape, dtype=jnp.float32):
  return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _prompts(rng, lens, hq, hkv, d, dtype):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  t = int(cu[-1])
  return (_rand(rng, (t, hq, d), dtype), _rand(rng, (t, hkv, d), dtype),
          _rand(rng, (t, hkv, d), dtype), cu)


@functools.partial(jax.jit, static_argnames=("window_size",))
def _ref_decode(cache, q, **kw):
  d = cache.config.head_dim
  kp = cache.k_pages[..., :d]
  vp = cache.v_pages[..., :d]
  if q.ndim == 3:
    return paged_decode_reference(q, kp, vp, cache.block_table,
                                  cache.lengths, **kw)[0]
  return paged_draft_reference(q, kp, vp, cache.block_table, cache.lengths,
                               **kw)[0]


def test_prefill_then_decode_steps_match_reference():
  rng = np.random.default_rng(0)
  b, hq, hkv, d = 3, 8, 2, 32
  cache = FoldKVCache.create(b, hq, hkv, d, 100, page_size=S,
                             chunk_tokens=2 * S)
  assert cache.dtype == jnp.bfloat16
  q, k, v, cu = _prompts(rng, [5, 40, 17], hq, hkv, d, jnp.bfloat16)
  sinks = _rand(rng, (hq,))
  out, cache = cache.prefill(q, k, v, cu, sinks=sinks, backend="interpret")
  ref, _ = varlen_attention_reference(q, k, v, cu, causal=True, sinks=sinks)
  assert _rel(out, ref) < 2e-2
  np.testing.assert_array_equal(cache.lengths, [5, 40, 17])

  step = jax.jit(functools.partial(fold_attn_with_kvcache, sinks=sinks,
                                   backend="interpret", num_splits=2),
                 donate_argnums=1)
  for i in range(2):
    qs = _rand(rng, (b, hq, d), jnp.bfloat16)
    ks = _rand(rng, (b, hkv, d), jnp.bfloat16)
    vs = _rand(rng, (b, hkv, d), jnp.bfloat16)
    o, cache = step(qs, cache, ks, vs)
    np.testing.assert_array_equal(cache.lengths, np.array([6, 41, 18]) + i)
    assert _rel(o, _ref_decode(cache, qs, sinks=sinks)) < 2e-2
    # the new token is in the cache
    last = gather_pages(cache.k_pages, cache.block_table)[
        jnp.arange(b), cache.lengths - 1, :, :d]
    np.testing.assert_array_equal(np.asarray(last, np.float32),
                                  np.asarray(ks, np.float32))
  assert int(cache.error) == 0
  # attend (no append) == the xla backend, to rounding
  qs = _rand(rng, (b, hq, d), jnp.bfloat16)
  a = cache.attend(qs, backend="xla", sinks=sinks)
  assert _rel(a, _ref_decode(cache, qs, sinks=sinks)) < 2e-2


def test_draft_tokens_causal_within_the_draft():
  rng = np.random.default_rng(1)
  b, hq, hkv, d, n = 2, 4, 2, 32, 3
  cache = FoldKVCache.create(b, hq, hkv, d, 80, page_size=S,
                             dtype=jnp.float32, chunk_tokens=2 * S)
  q, k, v, cu = _prompts(rng, [30, 9], hq, hkv, d, jnp.float32)
  _, cache = cache.prefill(q, k, v, cu, backend="xla")
  qd = _rand(rng, (b, n, hq, d))
  kd = _rand(rng, (b, n, hkv, d))
  vd = _rand(rng, (b, n, hkv, d))
  out, cache = fold_attn_with_kvcache(qd, cache, kd, vd, window_size=(12, 0),
                                      backend="xla")
  np.testing.assert_array_equal(cache.lengths, [33, 12])
  ref = _ref_decode(cache, qd, window_size=(12, 0))
  assert out.shape == qd.shape and _rel(out, ref) < 2e-5
  again, _ = fold_attn_with_kvcache(qd, cache, window_size=(12, 0),
                                    backend="xla")  # no append: same result
  np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


def test_depth_keyword_is_gone():
  # depth pruning was removed (issue 29): the keyword is not accepted.
  with pytest.raises(TypeError, match="depth"):
    FoldKVCache.create(1, 2, 1, 16, 32, depth=8)


def test_jit_errors_are_flagged_and_leave_the_cache_unchanged():
  rng = np.random.default_rng(4)
  b, hkv, d = 2, 1, 16
  cache = FoldKVCache.create(b, 2, hkv, d, 48, page_size=S,
                             dtype=jnp.float32, num_pages=3)
  q, k, v, cu = _prompts(rng, [16, 32], 2, hkv, d, jnp.float32)
  _, cache = cache.prefill(q, k, v, cu, backend="xla")  # uses all 3 pages
  leaves = jax.tree_util.tree_leaves(cache)
  tok = _rand(rng, (b, hkv, d))

  def unchanged(new, bit):
    assert int(new.error) & bit
    for x, y in zip(jax.tree_util.tree_leaves(new._replace(error=jnp.int32(0))),
                    leaves):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="refused"):
      new.check()

  append = jax.jit(lambda c, k, v, a: c.append(k, v, active=a))
  both = jnp.array([True, True])
  unchanged(append(cache, tok, tok, both), ERR_POOL)  # both need a 4th page
  with pytest.raises(ValueError, match="page"):
    cache.append(tok, tok)
  big = jnp.zeros((b, 17, hkv, d))
  unchanged(append(cache, big, big, both), ERR_MAX_LEN)  # 32 + 17 > 48
  with pytest.raises(ValueError, match="max_len"):
    cache.append(big, big)
  prefill = jax.jit(lambda c, q, k, v, cu: c.prefill(q, k, v, cu,
                                                     backend="xla")[1])
  unchanged(prefill(cache, q, k, v, cu), ERR_NOT_EMPTY)
  with pytest.raises(ValueError, match="empty"):
    cache.prefill(q, k, v, cu, backend="xla")
  free = jax.jit(lambda c, i: c.free(i))
  unchanged(free(cache, jnp.array([1, 1])), ERR_BAD_SLOT)
  with pytest.raises(ValueError, match="distinct"):
    cache.free(jnp.array([0, 5]))
  # A legal jitted step still works, and frees make room.
  c2 = append(free(cache, jnp.array([0])), tok, tok, jnp.array([True, False]))
  assert int(c2.error) == 0 and c2.check() is c2
  np.testing.assert_array_equal(c2.lengths, [1, 32])


def test_validation_messages():
  with pytest.raises(ValueError, match="page_size"):
    FoldKVCache.create(1, 4, 2, 32, 64, page_size=24)
  with pytest.raises(ValueError, match="n_kv_heads"):
    FoldKVCache.create(1, 4, 3, 32, 64)
  with pytest.raises(TypeError, match="dtype"):
    FoldKVCache.create(1, 4, 2, 32, 64, dtype=jnp.int8)
  with pytest.raises(ValueError, match="chunk_tokens"):
    FoldKVCache.create(1, 4, 2, 32, 64, page_size=16, chunk_tokens=24)
  cache = FoldKVCache.create(2, 4, 2, 32, 64, page_size=16)
  with pytest.raises(TypeError, match="dtype"):
    cache.attend(jnp.zeros((2, 4, 32), jnp.float32), backend="xla")
  with pytest.raises(ValueError, match="n_heads"):
    cache.attend(jnp.zeros((2, 8, 32), jnp.bfloat16), backend="xla")
  with pytest.raises(ValueError, match="draft"):
    cache.attend(jnp.zeros((2, 17, 4, 32), jnp.bfloat16), backend="xla")
  with pytest.raises(ValueError, match="both"):
    fold_attn_with_kvcache(jnp.zeros((2, 4, 32), jnp.bfloat16), cache,
                           k=jnp.zeros((2, 2, 32), jnp.bfloat16))
  with pytest.raises(ValueError, match="num_splits"):
    cache.attend(jnp.zeros((2, 4, 32), jnp.bfloat16), num_splits=0,
                 backend="xla")
  with pytest.raises(ValueError, match="k must have shape"):
    cache.append(jnp.zeros((2, 3, 32)), jnp.zeros((2, 3, 32)))
  assert "FoldKVCache(batch=2" in repr(cache)


# ----------------------------------------------------------------------------
# Cache safety: random prefill / append / free against a dict-of-lists model
# ----------------------------------------------------------------------------
B, HKV, D, MAX_LEN, POOL = 4, 1, 16, 64, 9  # 4 pages per slot, 9 in the pool
PACK = 2 * (MAX_LEN + 8)  # prompts packed into a fixed buffer (few compiles)

_ops = st.one_of(
    st.tuples(st.just("prefill"),
              st.lists(st.tuples(st.integers(0, B - 1),
                                 st.one_of(st.sampled_from(
                                     [15, 16, 17, 32, 48, 63, 64, 65]),
                                           st.integers(1, MAX_LEN + 8))),
                       min_size=1, max_size=2)),
    st.tuples(st.just("append"), st.lists(st.booleans(), min_size=B,
                                          max_size=B),
              st.sampled_from([1, 9])),
    st.tuples(st.just("free"), st.lists(st.integers(0, B - 1), min_size=1,
                                        max_size=2)),
)


class _Model:
  def __init__(self):
    self.seqs = {i: [] for i in range(B)}

  def pages(self, n):
    return -(-n // S)

  def used(self):
    return sum(self.pages(len(x)) for x in self.seqs.values())


def _token_rows(cache, slot):
  n = int(cache.lengths[slot])
  k = gather_pages(cache.k_pages, cache.block_table[slot:slot + 1])[0]
  return np.asarray(k[:n, 0, 0])


def _check_invariants(cache, model):
  lens = np.asarray(cache.lengths)
  assert lens.tolist() == [len(model.seqs[i]) for i in range(B)]
  live = []
  for i in range(B):
    live += np.asarray(cache.block_table[i, :model.pages(lens[i])]).tolist()
    np.testing.assert_array_equal(_token_rows(cache, i),
                                  np.asarray(model.seqs[i], np.float32))
    n_pg = model.pages(lens[i])
    anchors = cache.k_pages[cache.block_table[i, :n_pg], 0]
    np.testing.assert_array_equal(np.asarray(cache.anchors[i, :n_pg]),
                                  np.asarray(anchors))
  free = np.asarray(cache.free_pages[:int(cache.n_free)]).tolist()
  assert len(set(live)) == len(live), "a page is held by two live slots"
  assert not set(live) & set(free), "a live page is on the free list"
  assert sorted(live + free) == list(range(POOL)), "a page leaked"
  assert int(cache.error) == 0


def _apply(cache, model, op, rng, jitted):
  """Runs one op eagerly (expect ValueError iff the model says it must
  fail) or under jit (expect the error word and no change)."""
  kind = op[0]
  before = jax.tree_util.tree_leaves(cache)
  if kind == "prefill":
    slots, lens = zip(*op[1])
    busy = any(model.seqs[s] for s in slots) or len(set(slots)) < len(slots)
    fails = (busy or max(lens) > MAX_LEN or
             model.used() + sum(model.pages(n) for n in lens) > POOL)
    toks = [rng.standard_normal(n).astype(np.float32) for n in lens]
    flat = np.zeros((PACK, HKV, D), np.float32)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    for t, lo in zip(toks, cu[:-1]):
      flat[lo:lo + len(t), 0, 0] = t
    kv = jnp.asarray(flat)
    qq = jnp.zeros((PACK, 2, D), jnp.float32)
    ids = jnp.asarray(slots, jnp.int32)
    args = (qq, kv, jnp.asarray(cu), ids)
    call = _prefill
    update = lambda: [model.seqs[s].extend(t.tolist())
                      for s, t in zip(slots, toks)]
  elif kind == "append":
    active, n = np.asarray(op[1]), op[2]
    grow = {i: n for i in range(B) if active[i]}
    fails = (any(len(model.seqs[i]) + g > MAX_LEN for i, g in grow.items())
             or model.used() + sum(model.pages(len(model.seqs[i]) + g) -
                                   model.pages(len(model.seqs[i]))
                                   for i, g in grow.items()) > POOL)
    vals = rng.standard_normal((B, n)).astype(np.float32)
    kv = jnp.zeros((B, n, HKV, D), jnp.float32).at[:, :, 0, 0].set(vals)
    act = jnp.asarray(active)
    args = (kv, act)
    call = _append
    update = lambda: [model.seqs[i].extend(vals[i].tolist()) for i in grow]
  else:
    ids = op[1]
    fails = len(set(ids)) < len(ids)
    freed = {p for i in set(ids) for p in np.asarray(
        cache.block_table[i, :model.pages(len(model.seqs[i]))]).tolist()}
    arr = jnp.asarray(ids, jnp.int32)
    args = (arr,)
    call = _free
    update = lambda: [model.seqs[i].clear() for i in set(ids)]
  _STATS[(kind, fails, jitted)] = _STATS.get((kind, fails, jitted), 0) + 1
  if jitted:
    new = _JITTED[call](cache, *args)
    if fails:
      assert int(new.error) != 0
      for x, y in zip(jax.tree_util.tree_leaves(
          new._replace(error=jnp.int32(0))), before):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
      return cache
  else:
    if fails:
      with pytest.raises(ValueError):
        call(cache, *args)
      return cache
    new = call(cache, *args)
  update()
  if kind == "free":  # the freed pages are on top of the free stack
    top = np.asarray(new.free_pages[int(new.n_free) - len(freed):
                                    int(new.n_free)]).tolist()
    assert set(top) == freed
  return new


def _prefill(c, q, kv, cu, ids):
  return c.prefill(q, kv, kv, cu, seq_ids=ids, max_seqlen=MAX_LEN,
                   backend="xla")[1]


def _append(c, kv, act):
  return c.append(kv, kv, active=act)


def _free(c, ids):
  return c.free(ids)


_JITTED = {f: jax.jit(f) for f in (_prefill, _append, _free)}
_STATS = {}
_EXAMPLES = int(os.environ.get("FOLDAX_KV_EXAMPLES", "20"))


@settings(max_examples=_EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_ops, min_size=3, max_size=12), seed=st.integers(0, 99),
       jitted=st.booleans())
def test_cache_safety_against_a_model(ops, seed, jitted):
  rng = np.random.default_rng(seed)
  cache = FoldKVCache.create(B, 2, HKV, D, MAX_LEN, page_size=S,
                             dtype=jnp.float32, num_pages=POOL)
  model = _Model()
  for op in ops:
    cache = _apply(cache, model, op, rng, jitted)
    _check_invariants(cache, model)
