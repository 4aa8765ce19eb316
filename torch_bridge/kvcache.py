"""Paged-KV-cache decoding from torch: `FoldKVCache`, `fold_attn_with_kvcache`.

    cache = torch_bridge.FoldKVCache.create(batch, n_heads, n_kv_heads,
                                            head_dim, max_len,
                                            dtype=torch.bfloat16, device="cuda")
    out = cache.prefill(q, k, v, cu_seqlens, max_seqlen=...)   # packed prompts
    out = torch_bridge.fold_attn_with_kvcache(q_step, cache, k_step, v_step)
    cache.free(torch.tensor([0]))

A thin torch face over `jax_api.kvcache.FoldKVCache` (see its docs for the
page pool, numerics and errors); decoding calls the decode op's core
(`pallas_kernels.decode.core.decode`), as `jax_api` does, after the same
input checks (`jax_api.contract.kvcache`). The cache's storage is JAX's (it
never comes from torch, so every update donates it to the jitted step and
happens in place); q, k, v and the outputs cross through DLPack with the
stream hand-off of `torch_bridge._runtime`. Inference only (no autograd).

Unlike FlashAttention's `flash_attn_with_kvcache`, which writes into torch
tensors the caller owns, this cache object is updated in place by each call
(`cache.jax` is the current JAX pytree).

Errors: an append past `max_len`, an exhausted pool, a prefill into a busy
slot or a bad slot id leave the cache unchanged and set its error word.
With `raise_errors=True` (default) every call reads that word back (one
small device-to-host copy, i.e. a sync per call) and raises ValueError;
with False, call `cache.check()` when convenient.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from torch_bridge import _runtime as rt
from jax_api.contract import dense as _cd
from jax_api.contract import kvcache as _ckv
from torch_bridge.attention import (_check_tensor, _cu_values, dtype_name,
                                    resolve_backend)

_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16",
           torch.float32: "float32"}
_KV_DTYPES = {torch.float8_e4m3fn: "float8_e4m3fn",
              torch.float8_e5m2: "float8_e5m2"}


@functools.cache
def _step_fn(options):
  """jit(cache, q, k, v, sinks, active) -> (out, cache), cache donated: the
  append (when k is given), then the decode op's core with `options` (a
  `pallas_kernels.decode.core.DecodeOptions`)."""
  import jax
  from pallas_kernels.decode import core

  def step(cache, q, k, v, sinks, active):
    if k is not None:
      cache = cache.append(k, v, active=active)
    return core.decode(q, cache.paged_kv, sinks, options=options), cache

  return jax.jit(step, donate_argnums=0)


@functools.cache
def _prefill_fn(opts):
  import jax
  kw = dict(opts)

  def prefill(cache, q, k, v, cu, seq_ids, sinks):
    return cache.prefill(q, k, v, cu, seq_ids=seq_ids, sinks=sinks, **kw)

  return jax.jit(prefill, donate_argnums=0)


@functools.cache
def _append_fn():
  import jax
  return jax.jit(lambda cache, k, v, active: cache.append(k, v,
                                                          active=active),
                 donate_argnums=0)


@functools.cache
def _free_fn():
  import jax
  return jax.jit(lambda cache, ids: cache.free(ids), donate_argnums=0)


def _opts(**kw):
  out = []
  for k, v in sorted(kw.items()):
    if isinstance(v, list):
      v = tuple(v)
    out.append((k, v))
  return tuple(out)


class FoldKVCache:
  """One layer's paged KV cache, driven from torch (see module docs)."""

  def __init__(self, jax_cache, target, raise_errors: bool = True):
    self.jax = jax_cache
    self.target = target
    self.raise_errors = raise_errors

  @classmethod
  def create(cls, batch: int, n_heads: int, n_kv_heads: int, head_dim: int,
             max_len: int, *, page_size: int = 256,
             dtype: torch.dtype = torch.bfloat16, device=None,
             num_pages: int | None = None, chunk_tokens: int | None = None,
             raise_errors: bool = True,
             kv_dtype: torch.dtype | None = None) -> "FoldKVCache":
    """An empty cache on `device` (torch device; default CUDA if available);
    kv_dtype: None, torch.float8_e4m3fn or torch.float8_e5m2 (FP8 K/V pages
    with per-(page, KV head) scales); other arguments as
    `jax_api.kvcache.FoldKVCache.create`."""
    import jax
    from jax_api import kvcache as jkv
    if dtype not in _DTYPES:
      raise TypeError(f"dtype must be one of {list(_DTYPES)}; got {dtype}.")
    if kv_dtype is not None and kv_dtype not in _KV_DTYPES:
      raise ValueError(f"kv_dtype must be None or one of {list(_KV_DTYPES)}"
                       f"; got {kv_dtype!r}.")
    if device is None:
      device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    probe = torch.empty(0, dtype=dtype, device=device)
    target = rt.target_for(device, dtype, resolve_backend(probe))
    with jax.default_device(target.jax_device):
      c = jkv.FoldKVCache.create(batch, n_heads, n_kv_heads, head_dim,
                                 max_len, page_size=page_size,
                                 dtype=_DTYPES[dtype], num_pages=num_pages,
                                 chunk_tokens=chunk_tokens,
                                 kv_dtype=_KV_DTYPES.get(kv_dtype))
    c = jax.device_put(c, target.jax_device)
    return cls(c, target, raise_errors)

  def __repr__(self):
    return f"torch_bridge.{self.jax!r} on {self.target.torch_device}"

  @property
  def config(self):
    return self.jax.config

  @property
  def lengths(self) -> Tensor:
    """int32 [batch]: tokens held by each slot (a torch tensor)."""
    return rt.export([self.jax.lengths], self.target)[0]

  def check(self) -> "FoldKVCache":
    """Raises ValueError if a call was refused (and clears the error)."""
    err = int(self.jax.error)
    if err:
      self.jax = self.jax.clear_error()
      from jax_api.kvcache import ERROR_NAMES
      what = [n for bit, n in ERROR_NAMES.items() if err & bit]
      raise ValueError(f"FoldKVCache refused an operation ({'; '.join(what)});"
                       " the cache was left unchanged.")
    return self

  def _done(self):
    if self.raise_errors:
      self.check()

  def _check_inputs(self, q=None, k=None, v=None, active=None, sinks=None):
    """Tensor kinds and devices (what JAX cannot see after DLPack); the
    shape and dtype rules run in jax_api with the same contract."""
    dev = self.target.torch_device
    for name, x in (("q", q), ("k", k), ("v", v), ("active", active),
                    ("sinks", sinks)):
      if x is None:
        continue
      if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got "
                        f"{type(x).__name__}.")
      if x.device.type != dev.type or (dev.index is not None and
                                       x.device.index != dev.index):
        raise ValueError(f"{name} is on {x.device}; the cache lives on "
                         f"{dev} (move {name} there).")
    if k is not None and q is None:  # an append (prefill: packed k, v)
      c = self.config
      _ckv.check_append(tuple(k.shape), tuple(v.shape), dtype_name(k.dtype),
                        dtype_name(v.dtype), batch=c.batch,
                        n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                        cache_dtype=c.dtype, active_shape=None if active is
                        None else tuple(active.shape))

  def _imp(self):
    return rt.Importer(self.target)

  def prefill(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *,
              seq_ids: Tensor | None = None, max_seqlen: int | None = None,
              softmax_scale: float | None = None, sinks: Tensor | None = None,
              window_size=(-1, -1), softcap: float = 0.0) -> Tensor:
    """Causal attention over packed prompts (q [total, n_heads, head_dim],
    k/v [total, n_kv_heads, head_dim], int32 cu_seqlens [n + 1]) whose K/V
    then fill the (empty) slots `seq_ids` (default 0..n-1). Returns out."""
    self._check_inputs(q=q, k=k, v=v)
    _check_tensor("cu_seqlens", cu_seqlens, 1, "[num_seqs + 1]")
    # The jitted prefill cannot see cu_seqlens' values: check them here
    # (the call syncs anyway when it reads back the error word).
    values = _cu_values(cu_seqlens, need=True)
    _cd.check_cu_seqlens("cu_seqlens", tuple(cu_seqlens.shape),
                         dtype_name(cu_seqlens.dtype), k.shape[0], values)
    max_seqlen = _cd.check_max_seqlen("max_seqlen", max_seqlen, values) or \
        max_seqlen
    if max_seqlen is None:
      max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if seq_ids is not None:
      _check_tensor("seq_ids", seq_ids, 1, "[num_seqs]")
      _ckv.check_seq_ids("seq_ids", tuple(seq_ids.shape),
                         dtype_name(seq_ids.dtype), cu_seqlens.shape[0] - 1)
    if seq_ids is None:
      seq_ids = torch.arange(cu_seqlens.shape[0] - 1, dtype=torch.int32,
                             device=q.device)
    opts = _opts(max_seqlen=int(max_seqlen), softmax_scale=softmax_scale,
                 window_size=tuple(window_size), softcap=float(softcap),
                 backend=self.target.backend)
    imp = self._imp()
    out, self.jax = _prefill_fn(opts)(
        self.jax, imp(q), imp(k), imp(v),
        imp(cu_seqlens.to(device=q.device, dtype=torch.int32)),
        imp(seq_ids.to(device=q.device, dtype=torch.int32)), imp(sinks))
    out = rt.export([out], self.target)[0]
    self._done()
    return out

  def append(self, k: Tensor, v: Tensor, *, active: Tensor | None = None):
    """Appends k, v [batch, (n,) n_kv_heads, head_dim] to the slots."""
    self._check_inputs(k=k, v=v, active=active)
    imp = self._imp()
    act = None if active is None else imp(active.to(torch.bool))
    self.jax = _append_fn()(self.jax, imp(k), imp(v), act)
    self._done()
    return self

  def attend(self, q: Tensor, **kw) -> Tensor:
    """Decode attention of q over the cache without appending."""
    return fold_attn_with_kvcache(q, self, **kw)

  def free(self, seq_ids) -> "FoldKVCache":
    """Empties the slots `seq_ids` (int tensor [n]) and frees their pages."""
    if not isinstance(seq_ids, Tensor):
      seq_ids = torch.tensor(seq_ids)
    seq_ids = torch.atleast_1d(seq_ids).to(dtype=torch.int32)
    self.jax = _free_fn()(self.jax, self._imp()(seq_ids))
    self._done()
    return self


def fold_attn_with_kvcache(q: Tensor, cache: FoldKVCache, k: Tensor | None = None,
                           v: Tensor | None = None, *,
                           softmax_scale: float | None = None,
                           sinks: Tensor | None = None, window_size=(-1, -1),
                           softcap: float = 0.0, num_splits: int | None = None,
                           active: Tensor | None = None) -> Tensor:
  """Appends k, v (if given) to every slot of `cache` (in place), then
  attends q over it.

  q: [batch, n_heads, head_dim] (one token per slot) or [batch, q_len,
  n_heads, head_dim] (a draft, causal within itself); k, v: [batch, (q_len,)
  n_kv_heads, head_dim]. Other options as `jax_api.kvcache.
  fold_attn_with_kvcache`. Returns out shaped like q.
  """
  if (k is None) != (v is None):
    raise ValueError("pass both k and v, or neither.")
  cache._check_inputs(q=None, k=k, v=v, active=active, sinks=sinks)
  if not isinstance(q, Tensor):
    raise TypeError(f"q must be a torch.Tensor; got {type(q).__name__}.")
  options = cache.config.decode_options(
      tuple(q.shape), dtype_name(q.dtype),
      None if sinks is None else tuple(sinks.shape),
      None if sinks is None else dtype_name(sinks.dtype),
      backend=cache.target.backend, softmax_scale=softmax_scale,
      window_size=window_size, softcap=softcap, num_splits=num_splits)
  imp = cache._imp()
  act = None if active is None else imp(active.to(torch.bool))
  out, cache.jax = _step_fn(options)(cache.jax, imp(q), imp(k), imp(v),
                                     imp(sinks), act)
  out = rt.export([out], cache.target)[0]
  cache._done()
  return out


__all__ = ["FoldKVCache", "fold_attn_with_kvcache"]
