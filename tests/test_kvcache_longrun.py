"""A long run of the paged KV cache (issue 30): 10,000 decode steps with
appends and slot frees on a cache whose page pool is exactly as large as
the slots' peak demand, outputs compared against the float32 reference
every 500 steps.

Each slot has its own length limit and is freed when it reaches it, and a
random 80 % of the slots append each step, so slots drift apart and pages
are reused in every order. Besides the cache, the loop keeps a contiguous
shadow copy of every slot's keys and values (written where the slot's next
token goes, emptied when the slot is freed); the reference attends over the
shadow, so the check covers the cache's page bookkeeping (block table, free
stack, lengths) after thousands of allocations, not only the decode.

The steps run under `jax.jit` as `lax.scan`s of 500 steps (Python dispatch
per step would dominate). CI: the XLA backend at a small size; the GPU
variant (marked `gpu`) runs the Pallas kernels at a serving size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api import FoldKVCache, fold_attn_with_kvcache
from pallas_kernels.reference import paged_decode_reference

STEPS, CHECK_EVERY = 10_000, 500


def _rel(a, b):
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _chunk_fn(cfg, limits, backend, n_steps):
  """jit(cache, shadow_k, shadow_v, key) -> the state after n_steps, and
  the last step's q and output. Step: free the slots at their limit, append
  one token to the active slots, decode every slot."""
  b, hq, hkv, d = cfg.batch, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  dt = jnp.dtype(cfg.dtype)
  limits = jnp.asarray(limits, jnp.int32)

  def step(carry, key):
    cache, sk, sv, _, _ = carry
    full = cache.lengths >= limits
    for slot in range(b):  # static: one conditional free per slot
      cache = jax.lax.cond(full[slot],
                           lambda c, s=slot: c.free(jnp.array([s])),
                           lambda c: c, cache)
    sk = jnp.where(full[:, None, None, None], 0, sk)
    sv = jnp.where(full[:, None, None, None], 0, sv)
    kq, kk, kv, ka = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, hq, d), jnp.float32).astype(dt)
    k = jax.random.normal(kk, (b, hkv, d), jnp.float32).astype(dt)
    v = jax.random.normal(kv, (b, hkv, d), jnp.float32).astype(dt)
    active = jax.random.uniform(ka, (b,)) < 0.8
    pos = cache.lengths
    rows = jnp.where(active, jnp.arange(b), b)  # inactive: dropped
    sk = sk.at[rows, pos].set(k, mode="drop")
    sv = sv.at[rows, pos].set(v, mode="drop")
    out, cache = fold_attn_with_kvcache(q, cache, k, v, active=active,
                                        backend=backend)
    return (cache, sk, sv, q, out), None

  @jax.jit
  def run(cache, sk, sv, key):
    q0 = jnp.zeros((b, hq, d), dt)
    carry = (cache, sk, sv, q0, q0)
    carry, _ = jax.lax.scan(step, carry, jax.random.split(key, n_steps))
    return carry

  return run


@functools.partial(jax.jit, static_argnames="page")
def _shadow_reference(q, sk, sv, lengths, page):
  """Decode reference over the contiguous shadow (viewed as pages)."""
  b, t, h, d = sk.shape
  n = t // page
  table = jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)
  pages = lambda x: x.reshape(b * n, page, h, d)
  return paged_decode_reference(q, pages(sk), pages(sv), table, lengths)[0]


def _long_run(*, batch, n_heads, n_kv_heads, head_dim, max_len, page, dtype,
              backend, limits, tol, steps=STEPS):
  pages_per = [-(-lim // page) for lim in limits]
  cache = FoldKVCache.create(batch, n_heads, n_kv_heads, head_dim, max_len,
                             page_size=page, dtype=dtype,
                             num_pages=sum(pages_per))  # the peak demand
  sk = jnp.zeros((batch, max_len, n_kv_heads, head_dim), dtype)
  sv = jnp.zeros_like(sk)
  run = _chunk_fn(cache.config, limits, backend, CHECK_EVERY)
  key = jax.random.key(0)
  frees = 0
  worst = 0.0
  for c in range(steps // CHECK_EVERY):
    before = np.asarray(cache.lengths)
    cache, sk, sv, q, out = run(cache, sk, sv, jax.random.fold_in(key, c))
    assert int(cache.error) == 0, f"chunk {c}: error word {int(cache.error)}"
    lens = np.asarray(cache.lengths)
    assert np.all(lens <= np.asarray(limits))
    # Pages in use + free pages = the pool (no page leaked or doubled).
    used = int(np.sum(-(-lens // page)))
    assert used + int(cache.n_free) == cache.config.num_pages
    live = np.asarray(cache.block_table)[
        np.arange(cache.config.max_pages)[None, :] < -(-lens // page)[:, None]]
    assert len(set(live.tolist())) == live.size
    ref = _shadow_reference(q, sk, sv, cache.lengths, page)
    err = _rel(out, ref)
    worst = max(worst, err)
    assert err <= tol, f"chunk {c} (step {(c + 1) * CHECK_EVERY}): {err}"
    frees += int(np.sum(lens < before))
  assert frees > 0  # lower bound: slots shorter than before
  return worst


def test_longrun_10k_decode_steps_xla():
  """4 slots of at most 48 tokens (limits 48, 45, 33, 22: a pool of 11
  pages of 16, the peak demand): about 150 frees per slot."""
  _long_run(batch=4, n_heads=4, n_kv_heads=2, head_dim=16, max_len=48,
            page=16, dtype=jnp.float32, backend="xla",
            limits=(48, 45, 33, 22), tol=1e-5)


@pytest.mark.gpu
def test_gpu_longrun_10k_decode_steps_pallas():
  """The Pallas decode kernel at a serving size: 16 slots up to 4096
  tokens (staggered limits), bf16, GQA 32/8, head_dim 128."""
  limits = tuple(4096 - 97 * i for i in range(16))
  _long_run(batch=16, n_heads=32, n_kv_heads=8, head_dim=128, max_len=4096,
            page=256, dtype=jnp.bfloat16, backend="pallas", limits=limits,
            tol=2e-2)
