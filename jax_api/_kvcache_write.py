"""The write paths of `FoldKVCache`: append, prefill and free, as jitted
cores (one dispatch per call eagerly; inlined under an outer jit).

Each core checks capacity on the device and, when a check fails, writes
nothing: every scatter goes to an out-of-range row (`mode="drop"`) and the
error word gets the matching bit (`jax_api._kvcache_config.ERR_*`). The
eager checks that raise before a core runs are the cache's
(`jax_api.kvcache`). Page layout, FP8 scales and anchors as the
`jax_api.kvcache` module docstring describes; the FP8 append is
`jax_api._kvcache_fp8`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_api import _validation as val
from jax_api._kvcache_config import (ERR_BAD_SLOT, ERR_MAX_LEN,
                                     ERR_NOT_EMPTY, ERR_POOL, CacheConfig)
from jax_api._kvcache_config import cdiv as _cdiv
from jax_api._kvcache_fp8 import append_one_fp8 as _append_one_fp8
from jax_api.contract import kvcache as _ckv
from jax_api.dense import fold_attn_varlen_func
from pallas_kernels.decode.fp8 import dequantise, quantise_pages


@functools.partial(jax.jit, static_argnames=(
    "max_seqlen", "softmax_scale", "window_size", "softcap", "backend",
    "config"))
def _prefill_attention(q, k, v, cu, sinks, *, max_seqlen, softmax_scale,
                       window_size, softcap, backend, config):
  """The prompts' causal attention (config: a KernelSettings or None; a
  static argument, so two settings never share a trace)."""
  return fold_attn_varlen_func(q, k, v, cu, max_seqlen_q=max_seqlen,
                               causal=True, softmax_scale=softmax_scale,
                               sinks=sinks, window_size=window_size,
                               softcap=softcap, backend=backend,
                               config=config)


def _check_append(cfg: CacheConfig, k, v, active):
  for name, x in (("k", k), ("v", v)):
    val.check_array(name, x, ndim=(3, 4),
                    layout="[batch, (n,) n_kv_heads, head_dim]")
  if active is not None:
    val.check_array("active", active, ndim=1, layout="[batch]")
  _ckv.check_append(k.shape, v.shape, k.dtype, v.dtype, batch=cfg.batch,
                    n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    cache_dtype=cfg.dtype,
                    active_shape=None if active is None else active.shape)
  if k.ndim == 3:
    k, v = k[:, None], v[:, None]
  if active is None:
    active = jnp.ones((cfg.batch,), bool)
  else:
    active = jnp.asarray(active).astype(bool)
  return k, v, active


@functools.partial(jax.jit, static_argnums=1)
def _append_capacity(cache, n: int, active):
  cfg = cache.config
  lens = cache.lengths_
  new_len = lens + jnp.where(active, n, 0).astype(jnp.int32)
  need = jnp.sum(_cdiv(new_len, cfg.page_size) - _cdiv(lens, cfg.page_size))
  return (jnp.any(new_len > cfg.max_len), need > cache.n_free, need, new_len)


def _slot_ok(cfg: CacheConfig, ids):
  """(valid [n]: in range and first occurrence; all valid)."""
  n = ids.shape[0]
  in_range = (ids >= 0) & (ids < cfg.batch)
  earlier = (ids[:, None] == ids[None, :]) & (
      jnp.arange(n)[None, :] < jnp.arange(n)[:, None])
  valid = in_range & ~jnp.any(earlier, axis=1)
  return valid, jnp.all(valid)


def _pad_kv(cfg: CacheConfig, x):
  pad = [(0, 0)] * (x.ndim - 1) + [(0, cfg.d_pad - cfg.head_dim)]
  return jnp.pad(x, pad)


@jax.jit
def _append_core(cache, k, v, active):
  over_len, over_pool, _, _ = _append_capacity(cache, k.shape[1], active)
  ok = ~(over_len | over_pool)
  err = (jnp.where(over_len, ERR_MAX_LEN, 0) |
         jnp.where(over_pool, ERR_POOL, 0)).astype(jnp.int32)
  cache = cache._replace(error=cache.error | err)
  act = active & ok
  for i in range(k.shape[1]):
    cache = _append_one(cache, k[:, i], v[:, i], act)
  return cache


def _append_one(cache, k, v, act):
  """One token per active slot (capacity already checked)."""
  cfg = cache.config
  s, p = cfg.page_size, cfg.num_pages
  pos = cache.lengths_
  need = act & (pos % s == 0)
  need_i = need.astype(jnp.int32)
  rank = jnp.cumsum(need_i) - need_i
  fresh = cache.free_pages[jnp.clip(cache.n_free - 1 - rank, 0, p - 1)]
  lp = jnp.clip(pos // s, 0, cfg.max_pages - 1)
  rows = jnp.arange(cfg.batch)
  bt = cache.block_table.at[rows, lp].set(
      jnp.where(need, fresh, cache.block_table[rows, lp]))
  page = bt[rows, lp]
  page_w = jnp.where(act, page, p)  # out of range: dropped
  off = pos % s
  kp = _pad_kv(cfg, k).astype(cache.dtype)
  vp = _pad_kv(cfg, v).astype(cache.dtype)
  if cfg.fp8:
    return _append_one_fp8(cache, kp, vp, act, need, page, page_w, off, lp,
                           bt, need_i)
  slot_w = jnp.where(need, rows, cfg.batch)  # a page's first key: its anchor
  upd = dict(
      k_pages=cache.k_pages.at[page_w, off].set(kp, mode="drop"),
      v_pages=cache.v_pages.at[page_w, off].set(vp, mode="drop"),
      anchors=cache.anchors.at[slot_w, lp].set(kp, mode="drop"),
      block_table=bt,
      lengths_=pos + act.astype(jnp.int32),
      n_free=cache.n_free - jnp.sum(need_i))
  return cache._replace(**upd)


@jax.jit
def _prompt_checks(cache, cu, seq_ids):
  cfg = cache.config
  seq_len = cu[1:] - cu[:-1]
  total = jnp.sum(_cdiv(seq_len, cfg.page_size))
  valid, ids_ok = _slot_ok(cfg, seq_ids)
  ids_c = jnp.clip(seq_ids, 0, cfg.batch - 1)
  not_empty = jnp.any(valid & (cache.lengths_[ids_c] > 0))
  too_long = jnp.any(seq_len > cfg.max_len)
  over_pool = total > cache.n_free
  return ids_ok, not_empty, too_long, over_pool, total


@functools.partial(jax.jit, static_argnames="mp")
def _prefill_core(cache, k, v, cu, seq_ids, *, mp: int):
  """Writes packed prompts page by page into fresh pages (mp: most pages of
  one prompt)."""
  cfg = cache.config
  s, p = cfg.page_size, cfg.num_pages
  ids_ok, not_empty, too_long, over_pool, total = _prompt_checks(
      cache, cu, seq_ids)
  ok = ids_ok & ~not_empty & ~too_long & ~over_pool
  err = (jnp.where(ids_ok, 0, ERR_BAD_SLOT) |
         jnp.where(not_empty, ERR_NOT_EMPTY, 0) |
         jnp.where(too_long, ERR_MAX_LEN, 0) |
         jnp.where(over_pool, ERR_POOL, 0)).astype(jnp.int32)
  seq_len = cu[1:] - cu[:-1]
  n_pg = _cdiv(seq_len, s)
  n_seq = seq_len.shape[0]
  start = jnp.cumsum(n_pg) - n_pg  # pages popped before prompt i
  pidx = jnp.arange(mp, dtype=jnp.int32)[None, :]
  has = (pidx < n_pg[:, None]) & ok
  pages = cache.free_pages[jnp.clip(
      cache.n_free - 1 - (start[:, None] + pidx), 0, p - 1)]
  pages_w = jnp.where(has, pages, p).reshape(-1)  # [n_seq * mp]
  # Tokens laid out page by page: [n_seq, mp, s].
  rel = pidx[..., None] * s + jnp.arange(s, dtype=jnp.int32)[None, None, :]
  tmask = (rel < seq_len[:, None, None])[..., None, None]
  tok = jnp.clip(cu[:-1, None, None] + rel, 0, k.shape[0] - 1)
  kd = jnp.where(tmask, _pad_kv(cfg, k)[tok], 0).astype(cache.dtype)
  vd = jnp.where(tmask, _pad_kv(cfg, v)[tok], 0).astype(cache.dtype)
  shp = (n_seq * mp, s, cfg.n_kv_heads, cfg.d_pad)
  if cfg.fp8:
    # Each page quantised from its own filled tokens (in the compute dtype).
    kv_dt = jnp.dtype(cfg.kv_dtype)
    counts = jnp.clip(seq_len[:, None] - pidx * s, 0, s).reshape(-1)
    kq, ks = quantise_pages(kd.reshape(shp), counts, kv_dt)
    vq, vs = quantise_pages(vd.reshape(shp), counts, kv_dt)
    upd = dict(k_pages=cache.k_pages.at[pages_w].set(kq, mode="drop"),
               v_pages=cache.v_pages.at[pages_w].set(vq, mode="drop"),
               k_scales=cache.k_scales.at[pages_w].set(ks, mode="drop"),
               v_scales=cache.v_scales.at[pages_w].set(vs, mode="drop"))
    kd = dequantise(kq, ks[:, None, :, None], cache.dtype).reshape(kd.shape)
  else:
    upd = dict(
        k_pages=cache.k_pages.at[pages_w].set(kd.reshape(shp), mode="drop"),
        v_pages=cache.v_pages.at[pages_w].set(vd.reshape(shp), mode="drop"))
  valid, _ = _slot_ok(cfg, seq_ids)
  ids_c = jnp.clip(seq_ids, 0, cfg.batch - 1)
  row_w = jnp.where(valid & ok, ids_c, cfg.batch)  # dropped if not ok
  bt_rows = jnp.where(pidx < n_pg[:, None], pages,
                      cache.block_table[ids_c, :mp])
  upd["block_table"] = cache.block_table.at[row_w, :mp].set(bt_rows,
                                                            mode="drop")
  upd["anchors"] = cache.anchors.at[row_w, :mp].set(kd[:, :, 0], mode="drop")
  upd["lengths_"] = cache.lengths_.at[row_w].set(seq_len, mode="drop")
  upd["n_free"] = cache.n_free - jnp.where(ok, total, 0)
  upd["error"] = cache.error | err
  return cache._replace(**upd)


@jax.jit
def _free_core(cache, ids):
  cfg = cache.config
  s, p = cfg.page_size, cfg.num_pages
  valid, ids_ok = _slot_ok(cfg, ids)
  ids_c = jnp.clip(ids, 0, cfg.batch - 1)
  take = valid & ids_ok
  n_pg = jnp.where(take, _cdiv(cache.lengths_[ids_c], s), 0)
  start = cache.n_free + jnp.cumsum(n_pg) - n_pg
  pidx = jnp.arange(cfg.max_pages, dtype=jnp.int32)[None, :]
  dst = jnp.where(pidx < n_pg[:, None], start[:, None] + pidx, p).reshape(-1)
  free_pages = cache.free_pages.at[dst].set(
      cache.block_table[ids_c].reshape(-1), mode="drop")
  row_w = jnp.where(take, ids_c, cfg.batch)
  return cache._replace(
      free_pages=free_pages,
      n_free=cache.n_free + jnp.sum(n_pg),
      lengths_=cache.lengths_.at[row_w].set(0, mode="drop"),
      block_table=cache.block_table.at[row_w].set(0, mode="drop"),
      error=cache.error | jnp.where(ids_ok, 0, ERR_BAD_SLOT).astype(
          jnp.int32))
