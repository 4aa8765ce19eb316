"""FP8 page writes of `FoldKVCache.append` (one token per active slot).

Every append rewrites the whole page it lands in: the page's scale grows to
cover the new token (`pallas_kernels.decode.fp8.page_scale`), entries already
stored are re-quantised to the new scale, the token is quantised, and rows
after it are zero. The result is a function of that sequence's tokens alone
(and of the order they arrived in): another slot, the pool's history and the
batch never enter. Costs one page of K and one of V per slot and token.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.decode.fp8 import (dequantise, finite_maxabs, page_scale,
                                       quantise)


def _grow_page(pages, scales, page, off, x, fresh, kv_dtype):
  """One slot's page with token x [hkv, d] written at row off: (page
  [s, hkv, d] in FP8, scale [hkv]). The scale grows to cover x; entries
  before off are re-quantised to it, rows after off are zero (a fresh page
  ignores what the pool held)."""
  old = pages[page]                                   # [s, hkv, d]
  s_old = jnp.where(fresh, 0.0, scales[page])         # [hkv]
  s_x = page_scale(finite_maxabs(x, True, 1), kv_dtype)
  s_new = jnp.maximum(s_old, s_x)
  ratio = jnp.where(s_new > 0, s_old / jnp.where(s_new > 0, s_new, 1.0), 0.0)
  # entry * (s_old / s_new) is the entry's value in units of s_new.
  kept = dequantise(old, ratio[None, :, None]).astype(kv_dtype)
  new = quantise(x, s_new[:, None], kv_dtype)
  r = jnp.arange(old.shape[0])[:, None, None]
  zero = jnp.zeros_like(old)
  return jnp.where(r < off, kept, jnp.where(r == off, new[None], zero)), s_new


def append_one_fp8(cache, kp, vp, act, need, page, page_w, off, lp, bt,
                   need_i):
  """kp, vp [batch, hkv, d_pad] in the compute dtype; the rest as computed
  by `FoldKVCache._append_one` (page_w: the pool page or num_pages to drop
  the write)."""
  cfg = cache.config
  kv_dt = jnp.dtype(cfg.kv_dtype)
  p = cfg.num_pages
  pg = jnp.clip(page, 0, p - 1)
  grow = jax.vmap(functools.partial(_grow_page, kv_dtype=kv_dt),
                  in_axes=(None, None, 0, 0, 0, 0))
  kpg, ks = grow(cache.k_pages, cache.k_scales, pg, off, kp, need)
  vpg, vs = grow(cache.v_pages, cache.v_scales, pg, off, vp, need)
  rows = jnp.arange(cfg.batch)
  # The page's first key may have been re-quantised: refresh its anchor.
  anchor = dequantise(kpg[:, 0], ks[:, :, None], cache.dtype)
  slot_w = jnp.where(act, rows, cfg.batch)
  return cache._replace(
      k_pages=cache.k_pages.at[page_w].set(kpg, mode="drop"),
      v_pages=cache.v_pages.at[page_w].set(vpg, mode="drop"),
      k_scales=cache.k_scales.at[page_w].set(ks, mode="drop"),
      v_scales=cache.v_scales.at[page_w].set(vs, mode="drop"),
      anchors=cache.anchors.at[slot_w, lp].set(anchor, mode="drop"),
      block_table=bt,
      lengths_=cache.lengths_ + act.astype(jnp.int32),
      n_free=cache.n_free - jnp.sum(need_i))
