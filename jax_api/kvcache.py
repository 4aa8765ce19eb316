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
`cache.check()` outside jit (or read `cache.error`) to surface it, and
`cache.clear_error()` to reset it.

Numerics
--------
Decoding is exact attention through a kernel whose partials add against a declared reference, so the result does not depend on
the split count, the batch, or where pages live (see the kernel docs). The
bits do depend on `page_size` and `chunk_tokens` (where partial sums are cut)
and on the shipped tile table (`config=`, a `jax_api.KernelSettings`, on
`fold_attn_with_kvcache`, `attend` and `prefill` chooses the tiles).

Modules: this one is the cache and its eager checks; `jax_api._kvcache_config`
its static description and error bits, `jax_api._kvcache_write` the jitted
append / prefill / free, `jax_api._kvcache_decode` the decode call into the
op's core (`pallas_kernels.decode.core`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_api import _validation as val
from jax_api._kvcache_config import (ERR_BAD_SLOT, ERR_MAX_LEN,
                                     ERR_NOT_EMPTY, ERR_POOL, ERROR_NAMES,
                                     CacheConfig)
from jax_api._kvcache_config import cdiv as _cdiv
from jax_api._kvcache_config import concrete as _concrete
from jax_api._kvcache_decode import attend as _attend
from jax_api._kvcache_write import (_append_capacity, _append_core,
                                    _check_append, _free_core,
                                    _prefill_attention, _prefill_core,
                                    _prompt_checks, _slot_ok)
from jax_api.contract import common as _ck
from jax_api.contract import kvcache as _ckv
from pallas_kernels import settings
from pallas_kernels.decode.core import PagedKV
from pallas_kernels.decode.fp8 import FP8_DTYPES

_check_int = _ck.check_int


@jax.tree_util.register_pytree_node_class
class FoldKVCache:
  """One layer's paged KV cache (a pytree; see the module docstring)."""

  _FIELDS = ("k_pages", "v_pages", "anchors", "block_table", "lengths_",
             "free_pages", "n_free", "error", "k_scales", "v_scales")

  def __init__(self, *, config: CacheConfig, k_pages, v_pages, anchors, block_table, lengths_, free_pages, n_free, error,
               k_scales=None, v_scales=None):
    self.config = config
    self.k_scales = k_scales
    self.v_scales = v_scales
    self.anchors = anchors
    self.k_pages = k_pages
    self.v_pages = v_pages
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
            f"{c.dtype}, kv_dtype={c.kv_dtype})")

  # -- construction ------------------------------------------------------------
  @classmethod
  def create(cls, batch: int, n_heads: int, n_kv_heads: int, head_dim: int,
             max_len: int, *, page_size: int = 256, dtype=jnp.bfloat16,
             num_pages: int | None = None, chunk_tokens: int | None = None,
             kv_dtype=None) -> "FoldKVCache":
    """An empty cache of `batch` slots.

    Args:
      batch: sequence slots. n_heads, n_kv_heads: query and KV heads
        (n_heads % n_kv_heads == 0). head_dim: 1..256. max_len: most tokens
        per slot.
      page_size: tokens per page (a power of two >= 16).
      dtype: key/value dtype (bf16, fp16 or fp32); queries must match it.
      num_pages: pool size (default batch * ceil(max_len / page_size), enough
        for every slot at max_len; smaller pools share memory and can run
        out, see the module docstring).
      chunk_tokens: keys per partial sum (a multiple of page_size; default
        the multiple of page_size nearest 1024 from above). Part of the
        numerics: results are bitwise reproducible for a fixed value.
      kv_dtype: None (K/V pages in `dtype`), jnp.float8_e4m3fn or
        jnp.float8_e5m2: K and V pages in FP8 with a float32 scale per (page,
        KV head) (about half the bytes of bf16; see the module docstring).
        Decoding dequantises in registers and computes in `dtype`.
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
    kv_name = None
    if kv_dtype is not None:
      try:
        kv_name = jnp.dtype(kv_dtype).name
      except TypeError:
        kv_name = repr(kv_dtype)
      if kv_name not in FP8_DTYPES:
        raise ValueError(f"kv_dtype {kv_dtype!r} is not supported; use None, "
                         "jnp.float8_e4m3fn or jnp.float8_e5m2.")
    cfg = CacheConfig(batch, n_heads, n_kv_heads, head_dim, max_len,
                      page_size, num_pages, dt.name, chunk_tokens, kv_name)
    shape = (num_pages, page_size, n_kv_heads, cfg.d_pad)
    kv_dt = jnp.dtype(kv_name) if kv_name else dt
    # Two buffers (not one shared) so that the cache can be donated.
    scales = (lambda: jnp.zeros((num_pages, n_kv_heads), jnp.float32)
              if kv_name else None)
    return cls(
        config=cfg,
        k_scales=scales(),
        v_scales=scales(),
        k_pages=jnp.zeros(shape, kv_dt),
        v_pages=jnp.zeros(shape, kv_dt),
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

  @property
  def paged_kv(self) -> PagedKV:
    """The arrays decoding reads, as the decode op's core takes them
    (`pallas_kernels.decode.core.decode`)."""
    return PagedKV(self.k_pages, self.v_pages, self.block_table,
                   self.lengths_, self.anchors, self.k_scales, self.v_scales)

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

  def clear_error(self) -> "FoldKVCache":
    """The cache with its error word reset to 0 (after `check` raised, or
    once `error` has been read): the refused operations changed nothing."""
    return self._replace(error=jnp.zeros((), jnp.int32))

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
              softcap: float = 0.0, backend: str = "auto", config=None):
    """Causal attention over packed prompts, then writes their K/V.

    Args:
      q: [total, n_heads, head_dim]; k, v: [total, n_kv_heads, head_dim]
        (packed, FlashAttention's varlen layout).
      cu_seqlens: int32 [num_seqs + 1].
      seq_ids: int [num_seqs], the (empty) slot of each prompt; default
        0 .. num_seqs - 1.
      max_seqlen: longest prompt (a Python int; needed under jit for speed).
      Attention options (and config, a `jax_api.KernelSettings`) as
        `fold_attn_varlen_func` (causal is implied).

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
                             backend=backend, config=config)
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
  @settings.accepts_config
  def attend(self, q, *, softmax_scale=None, sinks=None,
             window_size=(-1, -1), softcap: float = 0.0, num_splits=None,
             backend: str = "auto"):
    """Decode attention of q over the cache (no append): q [batch, n_heads,
    head_dim], or [batch, q_len, n_heads, head_dim] for a draft whose tokens
    are the last q_len cached ones (causal within the draft). Options (and
    config=) as `fold_attn_with_kvcache`."""
    return _attend(self, q, softmax_scale=softmax_scale, sinks=sinks,
                   window_size=window_size, softcap=softcap,
                   num_splits=num_splits, backend=backend)


@settings.accepts_config
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
    config: a `jax_api.KernelSettings` (its decode_blocks choose the decode
      tiles, part of the trace key), or None for the defaults.

  Returns:
    (out shaped like q, in q's dtype; the updated cache).
  """
  if (k is None) != (v is None):
    raise ValueError("pass both k and v, or neither.")
  if k is not None:
    cache = cache.append(k, v, active=active)
  out = _attend(cache, q, softmax_scale=softmax_scale, sinks=sinks,
                window_size=window_size, softcap=softcap,
                num_splits=num_splits, backend=backend)
  return out, cache


__all__ = ["FoldKVCache", "fold_attn_with_kvcache", "CacheConfig",
           "ERROR_NAMES", "ERR_MAX_LEN", "ERR_POOL", "ERR_NOT_EMPTY",
           "ERR_BAD_SLOT"]
