"""`FoldKVCache`: one layer's paged KV cache, and `fold_attn_with_kvcache`.

    cache = FoldKVCache.create(batch, n_heads, n_kv_heads, head_dim, max_len)
    out, cache = cache.prefill(q, k, v, cu_seqlens)     # causal varlen prompt
    out, cache = fold_attn_with_kvcache(q_step, cache, k_step, v_step)
    cache = cache.free(seq_ids)                         # pages back to the pool

The cache is a pytree (jit it, donate it: `jax.jit(step, donate_argnums=...)`).
Methods never mutate; they return what changed.

Storage
-------
  k_pages, v_pages: [num_pages, page_size, n_kv_heads, d_pad] page pool
    (d_pad: head_dim rounded up to a power of two >= 16, zero padded).
  block_table: int32 [batch, max_pages]; page p of slot b is pool page
    block_table[b, p] for p < ceil(lengths[b] / page_size) (other entries are
    stale and never read).
  anchors: [batch, max_pages, n_kv_heads, d_pad], the first key of every
    page of every slot, contiguous per slot (the kernel's declared reference
    samples them without chasing the block table).
  free_pages, n_free: a stack; free_pages[:n_free] are the free pool pages.
    Allocation pops from the top, `free` pushes, so freed pages are reused
    first and no page is ever held by two live slots.
  v8=True: v_pages is the coarse E4M3 plane, v_res the residual plane and
    v_scale the per-cache power-of-two scale (fixed by the first write).
  depth: per-page key summaries (kmax, kmin, ksum, ksumsq) drive the page
    cut and its mass estimate (see `pallas_kernels.decode.kernel`).
  kv_dtype=float8_e4m3fn / float8_e5m2: k_pages and v_pages hold FP8 entries
    and k_scales, v_scales float32 [num_pages, n_kv_heads] one power-of-two
    scale per (page, KV head), computed from that page's own filled tokens
    when it is written (`pallas_kernels.decode.fp8` has the rule). Prefill
    quantises each page once; an append that needs a larger scale re-quantises
    the page's stored entries to it (entry * old / new, rounded to FP8) and
    rewrites the whole page (zeros past the new token), so a page's bits
    depend only on its sequence's tokens and the order they were written in,
    never on the batch or the pool. anchors then hold the dequantised first
    keys (in `dtype`). Non-finite values are stored as NaN and do not enter
    any scale.

Errors and `jax.jit`
--------------------
Appending past `max_len` or past the pool, prefilling a slot that is not
empty, or naming a slot that does not exist is checked before any write:
outside `jax.jit` (concrete lengths) it raises ValueError and the cache you
hold is untouched. Under `jax.jit` nothing can raise, so the operation becomes
a no-op on every slot (no page, length or table entry changes) and the sticky
error word `cache.error` gets the matching bit (ERR_* below); call
`cache.check()` outside jit (or read `cache.error`) to surface it.

Numerics
--------
Decoding is exact attention (`depth=None, v8=False`) through a kernel whose
partials add against a declared reference, so the result does not depend on
the split count, the batch, or where pages live (see the kernel docs). The
bits do depend on `page_size` and `chunk_tokens` (where partial sums are cut)
and on the shipped tile table.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_api import _validation as val
from jax_api.contract import common as _ck
from jax_api.contract import kvcache as _ckv
from jax_api._backend import _gpu_capability, resolve_backend
from jax_api._xla_decode import xla_decode
from jax_api.dense import fold_attn_varlen_func
from pallas_kernels.decode import (DEFAULT_V8_DEPTH, MAX_DRAFT, encode_v8,
                                   head_dim_pad, page_summaries, paged_decode,
                                   v8_scale_for)
from jax_api._kvcache_fp8 import append_one_fp8 as _append_one_fp8
from pallas_kernels.decode.fp8 import (FP8_DTYPES, dequantise,
                                       dequantise_pages, quantise_pages)
from pallas_kernels.decode.kernel import V8_RES_SHIFT

ERR_MAX_LEN = 1    # a sequence would grow past max_len
ERR_POOL = 2       # the page pool is exhausted
ERR_NOT_EMPTY = 4  # prefill into a slot that already holds tokens
ERR_BAD_SLOT = 8   # a slot id outside [0, batch) or named twice
ERROR_NAMES = {ERR_MAX_LEN: "append past max_len", ERR_POOL: "page pool "
              "exhausted", ERR_NOT_EMPTY: "prefill into a non-empty slot",
              ERR_BAD_SLOT: "invalid or repeated slot id"}


def _concrete(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _cdiv(a, b):
  return -(-a // b)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
  """Static (hashable) description of a cache; the pytree's aux data."""

  batch: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  max_len: int
  page_size: int
  num_pages: int
  dtype: str
  depth: int | None
  v8: bool
  chunk_tokens: int
  v8_depth: int
  kv_dtype: str | None = None  # an FP8 dtype name, or None (pages in dtype)

  @property
  def fp8(self) -> bool:
    return self.kv_dtype is not None

  @property
  def d_pad(self) -> int:
    return head_dim_pad(self.head_dim)

  @property
  def max_pages(self) -> int:
    return _cdiv(self.max_len, self.page_size)

  @property
  def summaries(self) -> bool:
    return self.depth is not None


_check_int = _ck.check_int


@jax.tree_util.register_pytree_node_class
class FoldKVCache:
  """One layer's paged KV cache (a pytree; see the module docstring)."""

  _FIELDS = ("k_pages", "v_pages", "v_res", "v_scale", "summaries", "anchors",
             "block_table", "lengths_", "free_pages", "n_free", "error",
             "k_scales", "v_scales")

  def __init__(self, *, config: CacheConfig, k_pages, v_pages, v_res,
               v_scale, summaries, anchors, block_table, lengths_, free_pages,
               n_free, error, k_scales=None, v_scales=None):
    self.config = config
    self.k_scales = k_scales
    self.v_scales = v_scales
    self.anchors = anchors
    self.k_pages = k_pages
    self.v_pages = v_pages
    self.v_res = v_res
    self.v_scale = v_scale
    self.summaries = summaries
    self.block_table = block_table
    self.lengths_ = lengths_
    self.free_pages = free_pages
    self.n_free = n_free
    self.error = error

  # -- pytree ----------------------------------------------------------------
  def tree_flatten(self):
    return tuple(getattr(self, f) for f in self._FIELDS), self.config

  @classmethod
  def tree_unflatten(cls, config, children):
    return cls(config=config, **dict(zip(cls._FIELDS, children)))

  def _replace(self, **kw):
    d = {f: getattr(self, f) for f in self._FIELDS}
    d.update(kw)
    return FoldKVCache(config=self.config, **d)

  def __repr__(self):
    c = self.config
    return (f"FoldKVCache(batch={c.batch}, n_heads={c.n_heads}, n_kv_heads="
            f"{c.n_kv_heads}, head_dim={c.head_dim}, max_len={c.max_len}, "
            f"page_size={c.page_size}, num_pages={c.num_pages}, dtype="
            f"{c.dtype}, depth={c.depth}, v8={c.v8}, kv_dtype={c.kv_dtype})")

  # -- construction ------------------------------------------------------------
  @classmethod
  def create(cls, batch: int, n_heads: int, n_kv_heads: int, head_dim: int,
             max_len: int, *, page_size: int = 256, dtype=jnp.bfloat16,
             depth: int | None = None, v8: bool = False,
             num_pages: int | None = None, chunk_tokens: int | None = None,
             v8_depth: int = DEFAULT_V8_DEPTH,
             kv_dtype=None) -> "FoldKVCache":
    """An empty cache of `batch` slots.

    Args:
      batch: sequence slots. n_heads, n_kv_heads: query and KV heads
        (n_heads % n_kv_heads == 0). head_dim: 1..256. max_len: most tokens
        per slot.
      page_size: tokens per page (a power of two >= 16).
      dtype: key/value dtype (bf16, fp16 or fp32); queries must match it.
      depth: None (exact) or an int > 0: keys whose weight is below 2^-depth
        of the row's declared reference leave the numerator (their mass stays
        in the denominator; pages whose bound is below the cut are not read
        and their mass is estimated). Tiles with nothing left skip V.
      v8: store values as two E4M3 planes (coarse + residual).
      num_pages: pool size (default batch * ceil(max_len / page_size), enough
        for every slot at max_len; smaller pools share memory and can run
        out, see the module docstring).
      chunk_tokens: keys per partial sum (a multiple of page_size; default
        the multiple of page_size nearest 1024 from above). Part of the
        numerics: results are bitwise reproducible for a fixed value.
      v8_depth: with v8, keys whose weight is below 2^-v8_depth of the
        reference are decoded from the coarse plane only (tiles where no
        weight reaches it never read the residual plane).
      kv_dtype: None (K/V pages in `dtype`), jnp.float8_e4m3fn or
        jnp.float8_e5m2: K and V pages in FP8 with a float32 scale per (page,
        KV head) (about half the bytes of bf16; see the module docstring).
        Decoding dequantises in registers and computes in `dtype`. Not
        combined with v8 or depth.
    """
    batch = _check_int("batch", batch)
    n_heads = _check_int("n_heads", n_heads)
    n_kv_heads = _check_int("n_kv_heads", n_kv_heads)
    head_dim = _check_int("head_dim", head_dim)
    max_len = _check_int("max_len", max_len)
    page_size = _check_int("page_size", page_size)
    if n_heads % n_kv_heads:
      raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads"
                       f" ({n_kv_heads}).")
    if head_dim > val.MAX_HEAD_DIM:
      raise ValueError(f"head_dim is {head_dim}; supported head dims are "
                       f"1..{val.MAX_HEAD_DIM}.")
    if page_size < 16 or page_size & (page_size - 1):
      raise ValueError(f"page_size must be a power of two >= 16; got "
                       f"{page_size}.")
    dt = jnp.dtype(dtype)
    if dt not in val.SUPPORTED_DTYPES:
      raise TypeError(f"dtype {dt} is not supported; use one of "
                      f"{', '.join(map(str, val.SUPPORTED_DTYPES))}.")
    if depth is not None:
      depth = _check_int("depth", depth)
    if not isinstance(v8, (bool, np.bool_)):
      raise TypeError(f"v8 must be a bool; got {v8!r}.")
    max_pages = _cdiv(max_len, page_size)
    if num_pages is None:
      num_pages = batch * max_pages
    num_pages = _check_int("num_pages", num_pages)
    if chunk_tokens is None:
      chunk_tokens = page_size * max(1, _cdiv(1024, page_size))
    chunk_tokens = _check_int("chunk_tokens", chunk_tokens)
    if chunk_tokens % page_size:
      raise ValueError(f"chunk_tokens ({chunk_tokens}) must be a multiple of "
                       f"page_size ({page_size}).")
    v8_depth = _check_int("v8_depth", v8_depth, lo=0)
    kv_name = None
    if kv_dtype is not None:
      try:
        kv_name = jnp.dtype(kv_dtype).name
      except TypeError:
        kv_name = repr(kv_dtype)
      if kv_name not in FP8_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not supported; use None, "
                         "jnp.float8_e4m3fn or jnp.float8_e5m2.")
      if v8 or depth is not None:
        raise ValueError(f"kv_dtype={kv_name} cannot be combined with v8 or "
                         "depth (use kv_dtype=None for those).")
    cfg = CacheConfig(batch, n_heads, n_kv_heads, head_dim, max_len,
                      page_size, num_pages, dt.name, depth, bool(v8),
                      chunk_tokens, v8_depth, kv_name)
    shape = (num_pages, page_size, n_kv_heads, cfg.d_pad)
    e4m3 = jnp.float8_e4m3fn
    summ = None
    if cfg.summaries:
      sshape = (num_pages, n_kv_heads, cfg.d_pad)
      summ = (jnp.zeros(sshape, dt), jnp.zeros(sshape, dt),
              jnp.zeros(sshape, jnp.float32), jnp.zeros(sshape, jnp.float32))
    kv_dt = jnp.dtype(kv_name) if kv_name else dt
    # Two buffers (not one shared) so that the cache can be donated.
    scales = (lambda: jnp.zeros((num_pages, n_kv_heads), jnp.float32)
              if kv_name else None)
    return cls(
        config=cfg,
        k_scales=scales(),
        v_scales=scales(),
        k_pages=jnp.zeros(shape, kv_dt),
        v_pages=jnp.zeros(shape, e4m3 if v8 else kv_dt),
        v_res=jnp.zeros(shape, e4m3) if v8 else None,
        v_scale=jnp.zeros((), jnp.float32) if v8 else None,
        summaries=summ,
        anchors=jnp.zeros((batch, max_pages, n_kv_heads, cfg.d_pad), dt),
        block_table=jnp.zeros((batch, max_pages), jnp.int32),
        lengths_=jnp.zeros((batch,), jnp.int32),
        # Popping from the top hands out pages 0, 1, 2, ... first.
        free_pages=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32),
        n_free=jnp.asarray(num_pages, jnp.int32),
        error=jnp.zeros((), jnp.int32))

  # -- queries -------------------------------------------------------------------
  @property
  def lengths(self) -> jax.Array:
    """int32 [batch]: tokens held by each slot."""
    return self.lengths_

  @property
  def dtype(self):
    return jnp.dtype(self.config.dtype)

  def check(self) -> "FoldKVCache":
    """Raises ValueError if an operation under jit hit an error (see
    `error`); returns the cache otherwise."""
    if not _concrete(self.error):
      return self
    err = int(self.error)
    if err:
      what = [n for bit, n in ERROR_NAMES.items() if err & bit]
      raise ValueError(f"FoldKVCache.error = {err}: an operation under "
                       f"jax.jit was refused ({'; '.join(what)}); those "
                       "operations left the cache unchanged.")
    return self

  # -- writing ---------------------------------------------------------------
  def append(self, k, v, *, active=None) -> "FoldKVCache":
    """Appends tokens: k, v [batch, n_kv_heads, head_dim] (one token per
    slot) or [batch, n, n_kv_heads, head_dim] (n tokens per slot).

    active: optional bool [batch]; slots with False are left alone (default:
    every slot gets the tokens). Raises (eagerly) or flags (under jit) when
    a slot would pass max_len or the pool runs out; nothing is written then.
    """
    cfg = self.config
    k, v, active = _check_append(cfg, k, v, active)
    if _concrete(self.lengths_, self.n_free, active):
      over_len, over_pool, need, new_len = (
          np.asarray(x) for x in _append_capacity(self, k.shape[1], active))
      if over_len:
        raise ValueError(
            f"append would grow slot(s) "
            f"{np.flatnonzero(new_len > cfg.max_len).tolist()} past max_len "
            f"= {cfg.max_len}; the cache is unchanged.")
      if over_pool:
        raise ValueError(f"append needs {int(need)} new page(s) but only "
                         f"{int(self.n_free)} of {cfg.num_pages} are free; "
                         "the cache is unchanged.")
    return _append_core(self, k, v, active)

  def prefill(self, q, k, v, cu_seqlens, *, seq_ids=None, max_seqlen=None,
              softmax_scale=None, sinks=None, window_size=(-1, -1),
              softcap: float = 0.0, backend: str = "auto"):
    """Causal attention over packed prompts, then writes their K/V.

    Args:
      q: [total, n_heads, head_dim]; k, v: [total, n_kv_heads, head_dim]
        (packed, FlashAttention's varlen layout).
      cu_seqlens: int32 [num_seqs + 1].
      seq_ids: int [num_seqs], the (empty) slot of each prompt; default
        0 .. num_seqs - 1.
      max_seqlen: longest prompt (a Python int; needed under jit for speed).
      Attention options as `fold_attn_varlen_func` (causal is implied).

    Returns:
      (out [total, n_heads, head_dim], new cache). Raises (eagerly) or flags
      (under jit, writing nothing) when a slot is not empty, a prompt is
      longer than max_len, the pool is too small or a slot id is invalid.
    """
    cfg = self.config
    val.check_qkv(q, k, v, packed=True)
    _ckv.check_prefill_heads(q.shape, k.shape, n_heads=cfg.n_heads,
                             n_kv_heads=cfg.n_kv_heads,
                             head_dim=cfg.head_dim)
    if jnp.dtype(k.dtype) != self.dtype:
      raise TypeError(f"k has dtype {k.dtype}; the cache stores "
                      f"{self.dtype} (they must match: cast k, v first).")
    val.check_cu_seqlens("cu_seqlens", cu_seqlens, k.shape[0])
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    n_seq = cu.shape[0] - 1
    if seq_ids is None:
      if n_seq > cfg.batch:
        raise ValueError(f"cu_seqlens describes {n_seq} prompts but the cache "
                         f"has {cfg.batch} slots.")
      seq_ids = jnp.arange(n_seq, dtype=jnp.int32)
    else:
      val.check_array("seq_ids", seq_ids, ndim=1, layout="[num_seqs]")
      _ckv.check_seq_ids("seq_ids", seq_ids.shape, seq_ids.dtype, n_seq)
      seq_ids = jnp.asarray(seq_ids, jnp.int32)
    mq = val.concrete_max_seqlen("max_seqlen", cu_seqlens, max_seqlen)
    if _concrete(cu, seq_ids, self.lengths_, self.n_free):
      ids_ok, not_empty, too_long, over_pool, total = (
          np.asarray(x) for x in _prompt_checks(self, cu, seq_ids))
      if not ids_ok:
        raise ValueError(f"seq_ids must be distinct slots in [0, {cfg.batch})"
                         f"; got {np.asarray(seq_ids).tolist()}.")
      if not_empty:
        lens = np.asarray(self.lengths_)
        busy = [int(i) for i in np.asarray(seq_ids) if lens[int(i)] > 0]
        raise ValueError(f"prefill needs empty slots; slot(s) {busy} hold "
                         "tokens (free them first). The cache is unchanged.")
      if too_long:
        raise ValueError(f"a prompt of {int(np.max(np.diff(np.asarray(cu))))}"
                         f" tokens exceeds max_len = {cfg.max_len}; the cache "
                         "is unchanged.")
      if over_pool:
        raise ValueError(f"the prompts need {int(total)} page(s) but only "
                         f"{int(self.n_free)} of {cfg.num_pages} are free; "
                         "the cache is unchanged.")
    out = _prefill_attention(q, k, v, cu, sinks, max_seqlen=mq,
                             softmax_scale=softmax_scale,
                             window_size=tuple(window_size), softcap=softcap,
                             backend=backend)
    mp = cfg.max_pages if mq is None else min(cfg.max_pages,
                                              _cdiv(int(mq), cfg.page_size))
    return out, _prefill_core(self, k, v, cu, seq_ids, mp=mp)

  def free(self, seq_ids) -> "FoldKVCache":
    """Returns the pages of slots `seq_ids` (int [n]) to the pool and empties
    the slots. Raises (eagerly) or flags (under jit, freeing nothing) on a
    slot outside [0, batch) or named twice."""
    cfg = self.config
    ids = jnp.atleast_1d(jnp.asarray(seq_ids))
    if ids.ndim != 1 or not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"seq_ids must be an int array [n]; got "
                      f"{getattr(seq_ids, 'shape', seq_ids)!r}.")
    ids = ids.astype(jnp.int32)
    if _concrete(ids) and not bool(_slot_ok(cfg, ids)[1]):
      raise ValueError(f"seq_ids must be distinct slots in [0, {cfg.batch}); "
                       f"got {np.asarray(ids).tolist()}.")
    return _free_core(self, ids)

  # -- reading -------------------------------------------------------------------
  def attend(self, q, *, softmax_scale=None, sinks=None,
             window_size=(-1, -1), softcap: float = 0.0, num_splits=None,
             backend: str = "auto"):
    """Decode attention of q over the cache (no append): q [batch, n_heads,
    head_dim], or [batch, q_len, n_heads, head_dim] for a draft whose tokens
    are the last q_len cached ones (causal within the draft)."""
    return _decode(self, q, softmax_scale=softmax_scale, sinks=sinks,
                   window_size=window_size, softcap=softcap,
                   num_splits=num_splits, backend=backend)


# ----------------------------------------------------------------------------
# Jitted cores (one dispatch per call eagerly; inlined under an outer jit)
# ----------------------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=(
    "max_seqlen", "softmax_scale", "window_size", "softcap", "backend"))
def _prefill_attention(q, k, v, cu, sinks, *, max_seqlen, softmax_scale,
                       window_size, softcap, backend):
  return fold_attn_varlen_func(q, k, v, cu, max_seqlen_q=max_seqlen,
                               causal=True, softmax_scale=softmax_scale,
                               sinks=sinks, window_size=window_size,
                               softcap=softcap, backend=backend)


_xla_decode_jit = jax.jit(xla_decode, static_argnames=(
    "softmax_scale", "window_left", "softcap", "depth", "v8_depth",
    "return_reference"))


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
def _append_capacity(cache: FoldKVCache, n: int, active):
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


def _encode_values(cache: FoldKVCache, v, valid):
  """(value-plane data, residual-plane data or None, scale) for the pool.
  v8: the scale is set by the first write (from its largest |value|)."""
  if not cache.config.v8:
    return v.astype(cache.dtype), None, cache.v_scale
  vf = jnp.asarray(v, jnp.float32)
  mx = jnp.max(jnp.where(valid, jnp.abs(vf), 0.0))
  scale = jnp.where(cache.v_scale > 0, cache.v_scale, v8_scale_for(mx))
  c, r = encode_v8(vf, scale)
  return c, r, scale


@jax.jit
def _append_core(cache: FoldKVCache, k, v, active):
  cfg = cache.config
  over_len, over_pool, _, _ = _append_capacity(cache, k.shape[1], active)
  ok = ~(over_len | over_pool)
  err = (jnp.where(over_len, ERR_MAX_LEN, 0) |
         jnp.where(over_pool, ERR_POOL, 0)).astype(jnp.int32)
  cache = cache._replace(error=cache.error | err)
  act = active & ok
  for i in range(k.shape[1]):
    cache = _append_one(cache, k[:, i], v[:, i], act)
  return cache


def _append_one(cache: FoldKVCache, k, v, act):
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
  slot_w = jnp.where(need, rows, cfg.batch)  # a page's first key: its anchor
  if cfg.fp8:
    return _append_one_fp8(cache, kp, _pad_kv(cfg, v).astype(cache.dtype),
                           act, need, page, page_w, off, lp, bt, need_i)
  vc, vr, scale = _encode_values(cache, _pad_kv(cfg, v), act[:, None, None])
  upd = dict(
      k_pages=cache.k_pages.at[page_w, off].set(kp, mode="drop"),
      v_pages=cache.v_pages.at[page_w, off].set(vc, mode="drop"),
      anchors=cache.anchors.at[slot_w, lp].set(kp, mode="drop"),
      block_table=bt,
      lengths_=pos + act.astype(jnp.int32),
      n_free=cache.n_free - jnp.sum(need_i))
  if cfg.v8:
    upd["v_res"] = cache.v_res.at[page_w, off].set(vr, mode="drop")
    upd["v_scale"] = scale
  if cfg.summaries:
    kmax, kmin, ksum, ksq = cache.summaries
    pg = jnp.clip(page, 0, p - 1)
    kf = kp.astype(jnp.float32)
    first = need[:, None, None]
    new = (jnp.where(first, kp, jnp.maximum(kmax[pg], kp)),
           jnp.where(first, kp, jnp.minimum(kmin[pg], kp)),
           jnp.where(first, kf, ksum[pg] + kf),
           jnp.where(first, kf * kf, ksq[pg] + kf * kf))
    upd["summaries"] = tuple(x.at[page_w].set(y, mode="drop")
                             for x, y in zip(cache.summaries, new))
  return cache._replace(**upd)


@jax.jit
def _prompt_checks(cache: FoldKVCache, cu, seq_ids):
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
def _prefill_core(cache: FoldKVCache, k, v, cu, seq_ids, *, mp: int):
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
  vd = jnp.where(tmask, _pad_kv(cfg, v)[tok], 0)
  shp = (n_seq * mp, s, cfg.n_kv_heads, cfg.d_pad)
  if cfg.fp8:
    # Each page quantised from its own filled tokens (in the compute dtype).
    kv_dt = jnp.dtype(cfg.kv_dtype)
    counts = jnp.clip(seq_len[:, None] - pidx * s, 0, s).reshape(-1)
    kq, ks = quantise_pages(kd.reshape(shp), counts, kv_dt)
    vq, vs = quantise_pages(vd.astype(cache.dtype).reshape(shp), counts,
                            kv_dt)
    upd = dict(k_pages=cache.k_pages.at[pages_w].set(kq, mode="drop"),
               v_pages=cache.v_pages.at[pages_w].set(vq, mode="drop"),
               k_scales=cache.k_scales.at[pages_w].set(ks, mode="drop"),
               v_scales=cache.v_scales.at[pages_w].set(vs, mode="drop"))
    kd = dequantise(kq, ks[:, None, :, None], cache.dtype).reshape(kd.shape)
  else:
    vc, vr, scale = _encode_values(cache, vd,
                                   tmask & has[..., None, None, None])
    upd = dict(
        k_pages=cache.k_pages.at[pages_w].set(kd.reshape(shp), mode="drop"),
        v_pages=cache.v_pages.at[pages_w].set(vc.reshape(shp), mode="drop"))
  if cfg.v8:
    upd["v_res"] = cache.v_res.at[pages_w].set(vr.reshape(shp), mode="drop")
    upd["v_scale"] = jnp.where(ok, scale, cache.v_scale)
  if cfg.summaries:
    counts = jnp.clip(seq_len[:, None] - pidx * s, 0, s).reshape(-1)
    new = page_summaries(kd.reshape(shp), counts)
    upd["summaries"] = tuple(x.at[pages_w].set(y, mode="drop")
                             for x, y in zip(cache.summaries, new))
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
def _free_core(cache: FoldKVCache, ids):
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


def _decode(cache: FoldKVCache, q, *, softmax_scale, sinks, window_size,
            softcap, num_splits, backend):
  cfg = cache.config
  val.check_array("q", q, ndim=(3, 4), layout="[batch, (q_len,) n_heads, "
                  "head_dim]")
  _ckv.check_decode_q(q.shape, q.dtype, batch=cfg.batch, n_heads=cfg.n_heads,
                      head_dim=cfg.head_dim, cache_dtype=cfg.dtype,
                      max_draft=MAX_DRAFT)
  left, _ = val.check_window(window_size)
  softcap = val.check_softcap(softcap)
  scale = val.check_softmax_scale(softmax_scale, cfg.head_dim)
  val.check_sinks(sinks, cfg.n_heads)
  num_splits = _ckv.check_num_splits(num_splits)
  be = resolve_backend(backend, kernel="fold_attn_with_kvcache")
  kw = dict(softmax_scale=scale, sinks=sinks, window_left=left,
            softcap=softcap, depth=cfg.depth, v_res=cache.v_res,
            v_scale=cache.v_scale, summaries=cache.summaries,
            v8_depth=cfg.v8_depth)
  if be == "xla":
    kpg, vpg = cache.k_pages, cache.v_pages
    if cfg.fp8:
      # The fallback dequantises the pool (exact: power-of-two scales).
      kpg = dequantise_pages(kpg, cache.k_scales, cache.dtype)
      vpg = dequantise_pages(vpg, cache.v_scales, cache.dtype)
    return _xla_decode_jit(q, kpg, vpg, cache.block_table, cache.lengths_,
                           **kw)
  if cfg.fp8:
    kw.update(k_scales=cache.k_scales, v_scales=cache.v_scales)
  interpret = be == "interpret"
  return paged_decode(q, cache.k_pages, cache.v_pages, cache.block_table,
                      cache.lengths_, anchors=cache.anchors,
                      chunk_tokens=cfg.chunk_tokens,
                      num_splits=num_splits, interpret=interpret,
                      compute_capability=None if interpret else
                      _gpu_capability(), **kw)


def fold_attn_with_kvcache(q, cache: FoldKVCache, k=None, v=None, *,
                           softmax_scale=None, sinks=None,
                           window_size=(-1, -1), softcap: float = 0.0,
                           num_splits=None, backend: str = "auto",
                           active=None):
  """Optionally appends k, v to every slot, then attends q over the cache.

  Args:
    q: [batch, n_heads, head_dim] (one new token per slot) or [batch, q_len,
      n_heads, head_dim] (a speculative draft of q_len <= 16 tokens, causal
      within the draft: draft token t sees the cache up to its own position).
    cache: a FoldKVCache.
    k, v: None, or the new tokens: [batch, n_kv_heads, head_dim] or [batch,
      q_len, n_kv_heads, head_dim] (appended first, so the queries see them).
    softmax_scale, sinks ([n_heads] logits in the denominator only), window_
      size (left, right; right is implied 0), softcap: as fold_attn_func.
    num_splits: None (the kernel chooses) or an int; the result is the same
      bits for every value.
    backend: "auto", "pallas", "interpret" or "xla".
    active: optional bool [batch] (slots that get the new tokens).

  Returns:
    (out shaped like q, in q's dtype; the updated cache).
  """
  if (k is None) != (v is None):
    raise ValueError("pass both k and v, or neither.")
  if k is not None:
    cache = cache.append(k, v, active=active)
  out = _decode(cache, q, softmax_scale=softmax_scale, sinks=sinks,
                window_size=window_size, softcap=softcap,
                num_splits=num_splits, backend=backend)
  return out, cache


__all__ = ["FoldKVCache", "fold_attn_with_kvcache", "ERR_MAX_LEN", "ERR_POOL",
           "ERR_NOT_EMPTY", "ERR_BAD_SLOT"]
