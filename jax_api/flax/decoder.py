"""`DecoderAttention`: causal self-attention for decoder LMs, linen and nnx.

    from jax_api.flax import DecoderAttention            # flax.linen
    from jax_api.flax.nnx import DecoderAttention        # flax.nnx
                                                         # (= DecoderAttentionNNX)

Grouped-query attention (`num_kv_heads`), rotary position embeddings,
optional sliding window, learned attention sinks and logit soft-cap.

Training (causal) runs `fold_attn_func` (x [batch, seq, features], optional
segment ids for packed rows) or `fold_attn_varlen_func` (x [total, features]
with `cu_seqlens`). Incremental decoding runs on a `FoldKVCache`:

    cache = attn.init_cache(batch, max_len)              # a FoldKVCache
    out, cache = attn.prefill(x_prompt, cache)            # [batch, t, feat]
    out, cache = attn.decode_step(x_token, cache)         # [batch, feat]

(linen: `module.apply(params, x, cache, method="prefill")`; the cache is a
pytree you carry, jit and donate). The nnx module can also keep the cache
itself: `attn.init_cache(batch, max_len, store=True)`, then
`attn(x, decode=True)` prefills (x with more than one token, empty cache) or
appends one token.

Parameters follow Flax's `MultiHeadAttention`: `query`, `key`, `value`
(DenseGeneral / LinearGeneral to [heads, head_dim]; kernel [features, heads,
head_dim]), `out` (kernel [heads, head_dim, features]); `use_bias=True` by
default as there, so a stock module's weights load unchanged (with
`rope_base=None`, causal `DecoderAttention` equals a stock module with a
causal mask). `sinks` ([num_heads], zeros at init) exists when
`use_sinks=True`.

Conventions
-----------
* RoPE: rotate-half (GPT-NeoX / Llama) on the full head dim, frequencies
  `rope_base ** (-2i / head_dim)`, in float32. Positions are the token index
  within its sequence (restarting at each segment or varlen sequence, and at
  0 for a prefilled prompt), the cache length for a decoded token; or pass
  `positions`.
* `sliding_window=w`: a query at position i sees keys i - w .. i
  (`window_size=(w, 0)`).
* softmax scale 1/sqrt(head_dim); softcap as `fold_attn_func`.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from jax_api.dense import fold_attn_func, fold_attn_varlen_func
from jax_api.kvcache import FoldKVCache, fold_attn_with_kvcache
from pallas_kernels.varlen import token_seq_ids_clipped

__all__ = ["DecoderAttention", "DecoderAttentionNNX", "apply_rope",
           "segment_positions", "varlen_positions"]

IMPLS = ("fold", "jax:xla", "jax:cudnn")


# ------------------------------------------------------------ helpers ----


def apply_rope(x, positions, base: float):
  """Rotate-half RoPE. x [..., seq, heads, head_dim], positions int [...,
  seq] (broadcastable). Returns x's dtype."""
  d = x.shape[-1]
  if d % 2:
    raise ValueError(f"RoPE needs an even head_dim; got {d}.")
  half = d // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / d)
  ang = jnp.asarray(positions, jnp.float32)[..., None, None] * freq
  cos, sin = jnp.cos(ang), jnp.sin(ang)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         axis=-1).astype(x.dtype)


def segment_positions(segment_ids):
  """Index of each token within its run of equal segment ids: int [b, s]."""
  seg = jnp.asarray(segment_ids)
  s = seg.shape[-1]
  idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), seg.shape)
  starts = jnp.concatenate(
      [jnp.ones(seg.shape[:-1] + (1,), bool), seg[..., 1:] != seg[..., :-1]],
      axis=-1)
  start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=seg.ndim - 1)
  return idx - start_idx


def varlen_positions(cu_seqlens, total: int):
  """Index of each packed token within its sequence: int [total] (tokens
  past cu_seqlens[-1] get positions past the last sequence's end)."""
  cu = jnp.asarray(cu_seqlens, jnp.int32)
  t = jnp.arange(total, dtype=jnp.int32)
  seq = token_seq_ids_clipped(cu, total)
  return t - cu[seq]


class _Spec:
  """What both modules share: shapes and attention options."""

  def __init__(self, *, num_heads, num_kv_heads, head_dim, rope_base,
               sliding_window, softcap, backend, impl):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of "
                       f"num_kv_heads ({num_kv_heads}).")
    if impl not in IMPLS:
      raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}.")
    if sliding_window is not None and sliding_window < 0:
      raise ValueError(f"sliding_window must be >= 0 or None; got "
                       f"{sliding_window}.")
    self.num_heads = num_heads
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.rope_base = rope_base
    self.window = ((-1, -1) if sliding_window is None
                   else (int(sliding_window), 0))
    self.softcap = float(softcap)
    self.backend = backend
    self.impl = impl

  def rope(self, x, positions):
    if self.rope_base is None:
      return x
    return apply_rope(x, positions, self.rope_base)

  def kw(self, sinks):
    return dict(sinks=sinks, window_size=self.window, softcap=self.softcap)

  # -- training --------------------------------------------------------------
  def train_attention(self, q, k, v, sinks, *, positions, segment_ids,
                      cu_seqlens, max_seqlen):
    """q/k/v after projection: [b, s, h, d] or packed [total, h, d]."""
    if cu_seqlens is not None:
      if positions is None:
        positions = varlen_positions(cu_seqlens, q.shape[0])
      q, k = self.rope(q, positions), self.rope(k, positions)
      if self.impl != "fold":
        raise ValueError("cu_seqlens needs impl='fold'.")
      return fold_attn_varlen_func(q, k, v, cu_seqlens, max_seqlen_q=max_seqlen,
                                   causal=True, backend=self.backend,
                                   **self.kw(sinks))
    if positions is None:
      if segment_ids is not None:
        positions = segment_positions(segment_ids)
      else:
        positions = jnp.arange(q.shape[-3], dtype=jnp.int32)
    q, k = self.rope(q, positions), self.rope(k, positions)
    if self.impl != "fold":
      return self._jax_attention(q, k, v, sinks, segment_ids)
    return fold_attn_func(q, k, v, causal=True, segment_ids=segment_ids,
                          backend=self.backend, **self.kw(sinks))

  def _jax_attention(self, q, k, v, sinks, segment_ids):
    """jax.nn.dot_product_attention (benchmark baselines)."""
    if sinks is not None or self.softcap > 0 or segment_ids is not None:
      raise ValueError("impl='jax:*' supports neither sinks, softcap nor "
                       "segment_ids (jax.nn.dot_product_attention has none).")
    window = None if self.window == (-1, -1) else self.window
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, local_window_size=window,
        implementation=self.impl.split(":")[1])

  # -- decoding ----------------------------------------------------------------
  def make_cache(self, batch, max_len, *, dtype, page_size, **kw):
    if page_size is None:  # one page for short caches, else FoldKVCache's 256
      page_size = min(256, max(16, 1 << (int(max_len) - 1).bit_length()))
    return FoldKVCache.create(batch, self.num_heads, self.num_kv_heads,
                              self.head_dim, max_len, page_size=page_size,
                              dtype=dtype, **kw)

  def prefill(self, q, k, v, sinks, cache: FoldKVCache, lengths):
    """q/k/v [b, t, h, d] (before RoPE); right-padded prompts of `lengths`
    tokens (None: all t). Returns (out [b, t, h, d], cache)."""
    b, t = q.shape[:2]
    pos = jnp.arange(t, dtype=jnp.int32)
    q, k = self.rope(q, pos), self.rope(k, pos)
    if lengths is None:
      cu = jnp.arange(b + 1, dtype=jnp.int32) * t
      pack = lambda x: x.reshape((b * t,) + x.shape[2:])
      unpack = lambda x: x.reshape((b, t) + x.shape[1:])
    else:
      lengths = jnp.asarray(lengths, jnp.int32)
      cu = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(lengths)])
      valid = jnp.arange(t)[None, :] < lengths[:, None]
      dst = jnp.where(valid, cu[:-1, None] + jnp.arange(t)[None, :], b * t)

      def pack(x):
        z = jnp.zeros((b * t,) + x.shape[2:], x.dtype)
        return z.at[dst.reshape(-1)].set(x.reshape((b * t,) + x.shape[2:]),
                                         mode="drop")

      def unpack(x):
        y = x[jnp.clip(dst, 0, b * t - 1)]
        return jnp.where(valid[..., None, None], y, 0).astype(x.dtype)
    out, cache = cache.prefill(pack(q), pack(k), pack(v), cu, max_seqlen=t,
                               backend=self.backend, **self.kw(sinks))
    return unpack(out), cache

  def decode_step(self, q, k, v, sinks, cache: FoldKVCache):
    """q/k/v [b, h, d] of one new token per slot (before RoPE)."""
    pos = cache.lengths[:, None]
    q = self.rope(q[:, None], pos)[:, 0]
    k = self.rope(k[:, None], pos)[:, 0]
    return fold_attn_with_kvcache(q, cache, k, v, backend=self.backend,
                                  **self.kw(sinks))


# -------------------------------------------------------------- linen ----


class DecoderAttention(nn.Module):
  """Causal GQA self-attention with RoPE, window, sinks and soft-cap (linen).

  Attributes:
    num_heads: query heads. num_kv_heads: key/value heads (default
      num_heads; must divide it).
    qkv_features: num_heads * head_dim (default: the input features).
    head_dim: overrides qkv_features // num_heads.
    out_features: default the input features.
    rope_base: RoPE base (None: no rotary embedding).
    sliding_window: None, or w: query i sees keys i - w .. i.
    use_sinks: learned per-head sink logits (param `sinks`, zeros at init).
    softcap: logit soft-cap (0 disables).
    use_bias, dtype, param_dtype, kernel_init, bias_init: as
      `nn.MultiHeadDotProductAttention`.
    backend: "auto", "pallas", "interpret" or "xla".
    impl: "fold" (default); "jax:xla" / "jax:cudnn" run
      `jax.nn.dot_product_attention` in training (benchmark baselines).
  """

  num_heads: int
  num_kv_heads: int | None = None
  qkv_features: int | None = None
  head_dim: int | None = None
  out_features: int | None = None
  rope_base: float | None = 10000.0
  sliding_window: int | None = None
  use_sinks: bool = False
  softcap: float = 0.0
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros_init()
  backend: str = "auto"
  impl: str = "fold"

  def _spec(self, features: int) -> _Spec:
    hd = self.head_dim or (self.qkv_features or features) // self.num_heads
    return _Spec(num_heads=self.num_heads,
                 num_kv_heads=self.num_kv_heads or self.num_heads,
                 head_dim=hd, rope_base=self.rope_base,
                 sliding_window=self.sliding_window, softcap=self.softcap,
                 backend=self.backend, impl=self.impl)

  def _dense(self, heads, hd, name):
    return nn.DenseGeneral(features=(heads, hd), axis=-1, dtype=self.dtype,
                           param_dtype=self.param_dtype,
                           kernel_init=self.kernel_init,
                           bias_init=self.bias_init, use_bias=self.use_bias,
                           name=name)

  def _project(self, x):
    spec = self._spec(x.shape[-1])
    q = self._dense(spec.num_heads, spec.head_dim, "query")(x)
    k = self._dense(spec.num_kv_heads, spec.head_dim, "key")(x)
    v = self._dense(spec.num_kv_heads, spec.head_dim, "value")(x)
    sinks = None
    if self.use_sinks:
      sinks = self.param("sinks", nn.initializers.zeros_init(),
                         (spec.num_heads,), self.param_dtype)
      sinks = sinks.astype(jnp.float32)
    dt = jnp.result_type(q.dtype, k.dtype, v.dtype)
    return spec, q.astype(dt), k.astype(dt), v.astype(dt), sinks

  def _out(self, y, features):
    return nn.DenseGeneral(features=self.out_features or features,
                           axis=(-2, -1), dtype=self.dtype,
                           param_dtype=self.param_dtype,
                           kernel_init=self.kernel_init,
                           bias_init=self.bias_init, use_bias=self.use_bias,
                           name="out")(y)

  @nn.compact
  def __call__(self, x, cache: FoldKVCache | None = None, *, lengths=None,
               decode: bool = False, positions=None, segment_ids=None,
               cu_seqlens=None, max_seqlen: int | None = None):
    """Without `cache`: causal attention over x [batch, seq, features]
    (optional segment_ids [batch, seq] for packed rows; positions default to
    the index within each segment) or packed x [total, features] with
    cu_seqlens (int32 [num_seqs + 1]; pass max_seqlen under jit). Returns
    out shaped like x.

    With `cache`: `prefill` (decode=False) or `decode_step` (decode=True);
    returns (out, cache). Prefer those two methods.
    """
    if cache is None:
      spec, q, k, v, sinks = self._project(x)
      y = spec.train_attention(q, k, v, sinks, positions=positions,
                               segment_ids=segment_ids, cu_seqlens=cu_seqlens,
                               max_seqlen=max_seqlen)
      return self._out(y, x.shape[-1])
    if not decode:
      spec, q, k, v, sinks = self._project(x)
      y, cache = spec.prefill(q, k, v, sinks, cache, lengths)
      return self._out(y, x.shape[-1]), cache
    squeeze = x.ndim == 2
    x3 = x[:, None] if squeeze else x
    if x3.shape[1] != 1:
      raise ValueError(f"decode_step takes one token per slot: x [batch, "
                       f"features] or [batch, 1, features]; got {x.shape}.")
    spec, q, k, v, sinks = self._project(x3)
    y, cache = spec.decode_step(q[:, 0], k[:, 0], v[:, 0], sinks, cache)
    out = self._out(y[:, None], x.shape[-1])
    return (out[:, 0] if squeeze else out), cache

  def prefill(self, x, cache: FoldKVCache, lengths=None):
    """x [batch, t, features] prompts (right-padded to t; `lengths` int
    [batch], default t) into empty cache slots 0..batch-1. Returns (out
    [batch, t, features] (0 past each length), cache)."""
    return self(x, cache, lengths=lengths)

  def decode_step(self, x, cache: FoldKVCache):
    """One new token per slot: x [batch, features] or [batch, 1, features].
    Returns (out shaped like x, cache)."""
    return self(x, cache, decode=True)

  def init_cache(self, batch: int, max_len: int, features: int, *,
                 dtype=None, page_size: int | None = None, **kw) -> FoldKVCache:
    """An empty FoldKVCache for this module (no params needed; `features`
    is the input width, used when head_dim/qkv_features are not set).
    dtype defaults to the module dtype or float32 (it must equal the
    compute dtype of q). page_size defaults to max_len rounded up to a power
    of two in [16, 256] (one page for short caches). Extra keywords go to
    `FoldKVCache.create`."""
    spec = self._spec(features)
    dt = dtype or self.dtype or jnp.float32
    return spec.make_cache(batch, max_len, dtype=dt, page_size=page_size, **kw)


# ---------------------------------------------------------------- nnx ----


class DecoderAttentionNNX(nnx.Module):
  """The nnx twin of `DecoderAttention` (same options, same parameter names
  as `nnx.MultiHeadAttention`: query, key, value, out LinearGeneral; sinks).

  Functional decoding: `prefill(x, cache)` / `decode_step(x, cache)` return
  (out, cache). Stateful decoding: `init_cache(batch, max_len, store=True)`
  then `__call__(x, decode=True)`.
  """

  def __init__(self, num_heads: int, in_features: int, *,
               num_kv_heads: int | None = None,
               qkv_features: int | None = None, head_dim: int | None = None,
               out_features: int | None = None,
               rope_base: float | None = 10000.0,
               sliding_window: int | None = None, use_sinks: bool = False,
               softcap: float = 0.0, use_bias: bool = True, dtype=None,
               param_dtype=jnp.float32,
               kernel_init=nnx.initializers.lecun_normal(),
               bias_init=nnx.initializers.zeros_init(),
               backend: str = "auto", impl: str = "fold",
               rngs: nnx.Rngs):
    hd = head_dim or (qkv_features or in_features) // num_heads
    self.spec = _Spec(num_heads=num_heads,
                      num_kv_heads=num_kv_heads or num_heads, head_dim=hd,
                      rope_base=rope_base, sliding_window=sliding_window,
                      softcap=softcap, backend=backend, impl=impl)
    self.in_features = in_features
    self.dtype = dtype
    lin = lambda heads: nnx.LinearGeneral(
        in_features, (heads, hd), dtype=dtype, param_dtype=param_dtype,
        kernel_init=kernel_init, bias_init=bias_init, use_bias=use_bias,
        rngs=rngs)
    self.query = lin(self.spec.num_heads)
    self.key = lin(self.spec.num_kv_heads)
    self.value = lin(self.spec.num_kv_heads)
    self.out = nnx.LinearGeneral((self.spec.num_heads, hd),
                                 out_features or in_features, axis=(-2, -1),
                                 dtype=dtype, param_dtype=param_dtype,
                                 kernel_init=kernel_init, bias_init=bias_init,
                                 use_bias=use_bias, rngs=rngs)
    self.sinks = (nnx.Param(jnp.zeros((self.spec.num_heads,), param_dtype))
                  if use_sinks else nnx.data(None))
    self.cache = nnx.data(None)

  def _project(self, x):
    q, k, v = self.query(x), self.key(x), self.value(x)
    dt = jnp.result_type(q.dtype, k.dtype, v.dtype)
    sinks = None if self.sinks is None else self.sinks[...].astype(
        jnp.float32)
    return q.astype(dt), k.astype(dt), v.astype(dt), sinks

  def __call__(self, x, *, positions=None, segment_ids=None, cu_seqlens=None,
               max_seqlen: int | None = None, decode: bool = False):
    """Causal attention (as the linen module), or with decode=True through
    the stored cache: x [batch, t > 1, features] prefills empty slots,
    x [batch, 1, features] appends one token per slot."""
    if decode:
      if self.cache is None:
        raise ValueError("decode=True needs init_cache(..., store=True) "
                         "first.")
      if x.shape[-2] == 1:
        out, cache = self.decode_step(x, self.cache.get_value())
      else:
        out, cache = self.prefill(x, self.cache.get_value())
      self.cache.set_value(cache)
      return out
    q, k, v, sinks = self._project(x)
    y = self.spec.train_attention(q, k, v, sinks, positions=positions,
                                  segment_ids=segment_ids,
                                  cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    return self.out(y)

  def prefill(self, x, cache: FoldKVCache, lengths=None):
    """As `DecoderAttention.prefill`."""
    q, k, v, sinks = self._project(x)
    y, cache = self.spec.prefill(q, k, v, sinks, cache, lengths)
    return self.out(y), cache

  def decode_step(self, x, cache: FoldKVCache):
    """As `DecoderAttention.decode_step`."""
    squeeze = x.ndim == 2
    x3 = x[:, None] if squeeze else x
    q, k, v, sinks = self._project(x3)
    y, cache = self.spec.decode_step(q[:, 0], k[:, 0], v[:, 0], sinks, cache)
    out = self.out(y[:, None])
    return (out[:, 0] if squeeze else out), cache

  def init_cache(self, batch: int, max_len: int, *, dtype=None,
                 page_size: int | None = None, store: bool = False, **kw):
    """An empty FoldKVCache for this module (dtype and page_size as the
    linen `init_cache`); with store=True it is kept as `self.cache` (an
    `nnx.Cache`) for `__call__(x, decode=True)`."""
    dt = dtype or self.dtype or jnp.float32
    cache = self.spec.make_cache(batch, max_len, dtype=dt,
                                 page_size=page_size, **kw)
    if store:
      self.cache = nnx.Cache(cache)
    return cache
