"""`attention_fn`: a drop-in `attention_fn` for Flax's multi-head attention.

    from flax import nnx, linen as nn
    from jax_api.flax import attention_fn

    nnx.MultiHeadAttention(num_heads=8, in_features=512, decode=False,
                           attention_fn=attention_fn, rngs=nnx.Rngs(0))
    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=attention_fn)
    # options: functools.partial(attention_fn, backend="interpret", softcap=30.)

It takes what `flax.nnx.dot_product_attention` takes (query, key, value
[batch..., length, heads, head_dim], bias, mask, broadcast_dropout,
dropout_rng, dropout_rate, deterministic, dtype, precision, module,
promote_dtype, is_causal) plus what linen passes (force_fp32_for_softmax and
the AQT einsum overrides), and runs `jax_api.fold_attn_func`.

Masks
-----
`mask` (True keeps; broadcastable to [batch..., heads, q_len, kv_len]) is
analysed with jnp ops, so it works on traced masks under `jax.jit`. From the
mask the function derives per-token segment ids (a query row's id is the index
of the first key it sees, a key's id is the id of the first query that sees
it; rows that see nothing and keys nobody sees get ids that match nothing) and
rebuilds the mask from them, with and without the kernel's causal rule
(bottom-right aligned: key j is visible to query i iff j <= i + kv_len -
q_len). The rebuilt mask is compared with the given one (`jnp.all`), and
`lax.switch` runs

  * the kernel with `causal=True` and those segment ids, if the causal rebuild
    equals the mask (causal masks, causal + padding, causal packed segments);
  * the kernel with those segment ids, if the plain rebuild equals the mask
    (padding masks [batch, 1, 1, kv_len] and/or [batch, 1, q_len, 1], block-
    diagonal segment masks, nnx/linen decode cache masks);
  * otherwise a float32 reference (materialises the [q_len, kv_len] scores)
    with a one-time warning (`FallbackWarning`).

Every branch is exact, so there is no silent wrongness: an unrecognised mask
is slower, never wrong. A mask that differs across heads also takes the
reference. `is_causal=True` (nnx passes it) is flax's top-left `tril(q_len,
kv_len)`; for q_len == kv_len that is the kernel's causal rule and needs no
mask analysis. With a concrete (non-traced) mask the branch is chosen in
Python and only that branch is traced.

Convention: **a query row that sees no key (a fully masked, e.g. padded, row)
gives output 0** (and zero gradients), in every branch; flax's default
attention returns the mean of all values there instead. Valid rows agree.

What it refuses (ValueError), rather than ignoring: `bias` (the kernel has no
additive bias; turn boolean structure into `mask`), attention dropout
(`dropout_rate > 0` with `deterministic=False`), and the AQT einsum
overrides. `precision` and `force_fp32_for_softmax` are accepted: the kernels
always accumulate and take the softmax in float32 (float32 inputs use
full-precision dots). `module` (flax's `sow_weights=True`) is honoured: the
attention weights are computed with the float32 reference and sown under
`attention_weights` (nnx: `nnx.Intermediate`; linen: 'intermediates'); the
output still comes from the kernel.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from jax import lax

from jax_api import _validation as val
from jax_api.dense import fold_attn_func

__all__ = ["attention_fn", "mask_to_kernel_args", "reference_attention",
           "FallbackWarning"]

_HIGHEST = lax.Precision.HIGHEST
_NEG = -1e30  # finite "minus infinity" for masked float32 scores


class FallbackWarning(UserWarning):
  """`attention_fn` ran the float32 reference instead of the kernel."""


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
  if reason in _warned:
    return
  _warned.add(reason)
  warnings.warn(
      f"jax_api.flax.attention_fn: {reason}; running the float32 reference "
      "attention (exact, but it materialises the [q_len, kv_len] scores). "
      "This warning is shown once.", FallbackWarning, stacklevel=3)


def _is_tracer(x) -> bool:
  return isinstance(x, jax.core.Tracer)


# ------------------------------------------------------------ reference ----


def _visible(q_len: int, kv_len: int, window_size, causal: bool):
  """Static [q_len, kv_len] visibility of causal/window rules (bottom-right)."""
  i = jnp.arange(q_len)[:, None] + (kv_len - q_len)
  j = jnp.arange(kv_len)[None, :]
  vis = jnp.ones((q_len, kv_len), bool)
  left, right = window_size
  if causal:
    vis &= j <= i
  if left >= 0:
    vis &= j >= i - left
  if right >= 0:
    vis &= j <= i + right
  return vis


def _reference_weights(q, k, mask, *, scale, window_size, sinks, softcap,
                       causal=False):
  """float32 attention weights [b, heads, q, k] (and the sink's share out of
  the softmax). q [b, q, h, d], k [b, k, hkv, d], mask None or bool
  broadcastable to [b, h, q, k]."""
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  qf = q.astype(jnp.float32).reshape(b, sq, hkv, g, d)
  kf = k.astype(jnp.float32)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qf, kf, precision=_HIGHEST) * scale
  s = s.reshape(b, hq, sq, sk)
  if softcap > 0.0:
    s = softcap * jnp.tanh(s / softcap)
  vis = _visible(sq, sk, window_size, causal)[None, None]
  if mask is not None:
    vis = vis & mask
  vis = jnp.broadcast_to(vis, s.shape)
  s = jnp.where(vis, s, _NEG)
  mx = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    sk_ = sinks.astype(jnp.float32)[None, :, None, None]
    mx = jnp.maximum(mx, sk_)
  mx = lax.stop_gradient(jnp.where(mx > _NEG / 2, mx, 0.0))
  p = jnp.where(vis, jnp.exp(s - mx), 0.0)
  den = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    den = den + jnp.exp(sk_ - mx)
  return p / jnp.where(den > 0, den, 1.0)


def reference_attention(q, k, v, mask=None, *, softmax_scale=None,
                        window_size=(-1, -1), sinks=None, softcap=0.0,
                        causal=False):
  """float32 reference with `attention_fn`'s conventions: q [b, q, h, d],
  k/v [b, k, hkv, d(v)], mask bool broadcastable to [b, h, q, k] (True
  keeps), causal/window bottom-right aligned, fully masked rows give 0.
  Returns [b, q, h, dv] in q's dtype."""
  scale = (1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None
           else float(softmax_scale))
  w = _reference_weights(q, k, mask, scale=scale, window_size=window_size,
                         sinks=sinks, softcap=softcap, causal=causal)
  b, hq, sq, sk = w.shape
  hkv = k.shape[2]
  w = w.reshape(b, hkv, hq // hkv, sq, sk)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", w, v.astype(jnp.float32),
                   precision=_HIGHEST)
  return out.reshape(b, sq, hq, v.shape[-1]).astype(q.dtype)


# -------------------------------------------------------- mask analysis ----


def mask_to_kernel_args(mask):
  """Analyses a boolean mask [batch, q_len, kv_len] (jnp ops; works traced).

  Returns (q_seg int32 [batch, q_len], kv_seg int32 [batch, kv_len],
  ok_causal, ok_plain): the candidate segment ids and whether
  `q_seg[i] == kv_seg[j]` (and j <= i + kv_len - q_len, for ok_causal)
  reproduces the mask exactly, over the whole batch.
  """
  m = jnp.asarray(mask).astype(bool)
  sq, sk = m.shape[-2:]
  row_any = jnp.any(m, axis=-1)
  q_seg = jnp.where(row_any, jnp.argmax(m, axis=-1), -1).astype(jnp.int32)
  col_any = jnp.any(m, axis=-2)
  first_row = jnp.argmax(m, axis=-2)
  kv_seg = jnp.where(col_any, jnp.take_along_axis(q_seg, first_row, axis=-1),
                     -2).astype(jnp.int32)
  eq = q_seg[:, :, None] == kv_seg[:, None, :]
  tri = _visible(sq, sk, (-1, -1), causal=True)[None]
  ok_plain = jnp.all(eq == m)
  ok_causal = jnp.all((eq & tri) == m)
  return q_seg, kv_seg, ok_causal, ok_plain


# ------------------------------------------------------------ the entry ----


def _static_fallback(q, k, v) -> str | None:
  """A reason the kernel cannot run these inputs at all (known at trace)."""
  if k.shape[-1] != v.shape[-1]:
    return (f"value head dim {v.shape[-1]} differs from the key's "
            f"{k.shape[-1]}")
  if q.shape[-1] > val.MAX_HEAD_DIM:
    return f"head_dim {q.shape[-1]} > {val.MAX_HEAD_DIM}"
  if jnp.dtype(q.dtype) not in val.SUPPORTED_DTYPES:
    return f"dtype {q.dtype} is not a kernel dtype"
  return None


def attention_fn(query, key, value, bias=None, mask=None,
                 broadcast_dropout: bool = True, dropout_rng=None,
                 dropout_rate: float = 0.0, deterministic: bool = False,
                 dtype=None, precision=None, module=None, promote_dtype=None,
                 is_causal: bool = False, force_fp32_for_softmax: bool = False,
                 qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                 *, backend: str = "auto", softmax_scale: float | None = None,
                 window_size: tuple[int, int] = (-1, -1), sinks=None,
                 softcap: float = 0.0):
  """Drop-in for `flax.nnx.dot_product_attention` /
  `flax.linen.dot_product_attention` running the foldax kernels.

  Args (flax's): query [batch..., q_len, heads, head_dim], key/value
    [batch..., kv_len, kv_heads, head_dim] (GQA when kv_heads < heads); mask
    (bool/0-1, True keeps, broadcastable to [batch..., heads, q_len, kv_len]);
    is_causal (top-left tril); dtype (inputs are promoted to it, as flax
    does); module (sow the weights). bias, attention dropout and the einsum
    overrides raise ValueError (see the module docstring).
  Extra keyword options (bind them with functools.partial): backend ("auto",
    "pallas", "interpret", "xla"), softmax_scale (default 1/sqrt(head_dim),
    as flax), window_size (left, right), sinks ([heads] logits), softcap.

  Returns:
    [batch..., q_len, heads, head_dim] in the promoted dtype. Query rows that
    see no key are 0.
  """
  del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
  if bias is not None:
    raise ValueError(
        "jax_api.flax.attention_fn: `bias` (an additive attention bias) is "
        "not supported by the foldax kernels; express boolean structure as "
        "`mask`, or use flax's default attention_fn for biased attention.")
  if dropout_rate and dropout_rate > 0.0 and not deterministic:
    raise ValueError(
        f"jax_api.flax.attention_fn: attention dropout (dropout_rate="
        f"{dropout_rate}, deterministic=False) cannot be honoured by the "
        "foldax kernels; set dropout_rate=0 or deterministic=True.")
  if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
    raise ValueError("jax_api.flax.attention_fn: the qk_attn_weights_einsum / "
                     "attn_weights_value_einsum overrides (AQT) are not "
                     "supported by the foldax kernels.")
  if promote_dtype is None:
    from flax.nnx.nn import dtypes as _dtypes
    promote_dtype = _dtypes.promote_dtype
  query, key, value = promote_dtype((query, key, value), dtype=dtype)
  if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
    raise ValueError(
        "query, key and value must be [batch..., length, heads, head_dim] "
        f"with the same rank; got {query.shape}, {key.shape}, {value.shape}.")
  batch_shape = query.shape[:-3]
  if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
    raise ValueError(f"query, key and value batch dims must match; got "
                     f"{query.shape}, {key.shape}, {value.shape}.")
  if key.shape[-3] != value.shape[-3]:
    raise ValueError(f"key and value lengths must match; got {key.shape} and "
                     f"{value.shape}.")
  b = math.prod(batch_shape)
  sq, hq, d = query.shape[-3:]
  sk = key.shape[-3]
  q = query.reshape(b, sq, hq, d)
  k = key.reshape(b, sk, *key.shape[-2:])
  v = value.reshape(b, sk, *value.shape[-2:])
  scale = (1.0 / math.sqrt(d) if softmax_scale is None
           else float(softmax_scale))
  opts = dict(softmax_scale=scale, window_size=tuple(window_size),
              sinks=sinks, softcap=float(softcap))

  # Mask as bool [b, heads_m, sq, sk] (heads_m 1 or hq); None if absent.
  m = None
  if mask is not None:
    m = jnp.asarray(mask)
    if m.ndim > query.ndim:
      raise ValueError(f"mask has rank {m.ndim}; expected at most "
                       f"{query.ndim} ([batch..., heads, q_len, kv_len]).")
    m = m.reshape((1,) * (query.ndim - m.ndim) + m.shape) != 0
    hm = m.shape[-3]
    m = jnp.broadcast_to(m, batch_shape + (hm, sq, sk)).reshape(b, hm, sq, sk)
  if is_causal:
    tril = jnp.tril(jnp.ones((sq, sk), bool))
    if m is None and sq == sk:
      pass  # the kernel's causal rule; handled below without analysis
    else:
      m = (jnp.broadcast_to(tril, (b, 1, sq, sk)) if m is None
           else m & tril)

  def kernel(causal, segs):
    return fold_attn_func(q, k, v, causal=causal, segment_ids=segs,
                          backend=backend, **opts)

  def reference():
    return reference_attention(q, k, v, m, **opts)

  if module is not None:
    w = _reference_weights(q, k, m, scale=scale, window_size=opts[
        "window_size"], sinks=sinks, softcap=opts["softcap"])
    w = w.reshape(batch_shape + w.shape[1:]).astype(query.dtype)
    _sow(module, w)

  reason = _static_fallback(q, k, v)
  if reason is not None:
    _warn_once(reason)
    out = reference()
  elif m is None:
    out = kernel(bool(is_causal), None)
  else:
    m0 = m[:, 0]
    q_seg, kv_seg, ok_causal, ok_plain = mask_to_kernel_args(m0)
    same_heads = jnp.all(m == m[:, :1]) if m.shape[1] > 1 else True
    ok_causal = ok_causal & same_heads
    ok_plain = ok_plain & same_heads
    segs = (q_seg, kv_seg)
    branches = (lambda: kernel(True, segs), lambda: kernel(False, segs),
                reference)
    if not any(_is_tracer(x) for x in (ok_causal, ok_plain)):
      idx = 0 if bool(ok_causal) else 1 if bool(ok_plain) else 2
      if idx == 2:
        _warn_once("the mask is not a causal/padding/segment mask")
      out = branches[idx]()
    else:
      idx = jnp.where(ok_causal, 0, jnp.where(ok_plain, 1, 2))

      def ref_branch():
        jax.debug.callback(
            lambda: _warn_once("the mask is not a causal/padding/segment mask"))
        return reference()

      out = lax.switch(idx, (branches[0], branches[1], ref_branch))
  return out.reshape(batch_shape + out.shape[1:])


def _sow(module, weights) -> None:
  try:
    from flax import nnx
    if isinstance(module, nnx.Module):
      module.sow(nnx.Intermediate, "attention_weights", weights)
      return
  except ImportError:  # pragma: no cover
    pass
  module.sow("intermediates", "attention_weights", weights)
