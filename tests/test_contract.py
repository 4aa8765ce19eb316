"""The input contract (`jax_api.contract`) through every public function.

A catalogue of bad inputs: each row calls one public function of `jax_api`
or `torch_bridge` (dense, varlen, KV cache create / prefill / append /
decode / free, DeBERTa attention, the Flax modules, the torch custom ops)
with one thing wrong, and asserts the exception type (TypeError: wrong kind
of thing, ValueError: right kind, wrong value) and that the message names
the argument. Validation runs before any kernel, so nothing here compiles a
Pallas kernel; valid parts use backend="xla" and tiny shapes.

Not covered on CPU (said where it applies): CUDA tensors for the direct
launch and two *CUDA* devices (two devices are checked with a `meta`
tensor); `backend="pallas"` is checked on this machine only when it has no
supported GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch_bridge as tb  # noqa: F401  (before JAX starts, see its docs)
import torch

from jax_api import (FoldKVCache, disentangled_attention, fold_attn_func,
                     fold_attn_varlen_func, fold_attn_with_kvcache)
from jax_api._backend import _gpu_capability

B, S, HQ, HKV, D = 1, 4, 2, 1, 16
F32 = jnp.float32
X = dict(backend="xla")
CU = np.array([0, 1, 4], np.int32)


def z(*shape, dtype=F32):
  return jnp.zeros(shape, dtype)


def qkv(b=B, sq=S, sk=S, hq=HQ, hkv=HKV, d=D, dtype=F32):
  return z(b, sq, hq, d, dtype=dtype), z(b, sk, hkv, d, dtype=dtype), \
      z(b, sk, hkv, d, dtype=dtype)


def pqkv(t=S, hq=HQ, hkv=HKV, d=D, dtype=F32):
  return z(t, hq, d, dtype=dtype), z(t, hkv, d, dtype=dtype), \
      z(t, hkv, d, dtype=dtype)


def dense(**kw):
  q, k, v = kw.pop("qkv", None) or qkv()
  return fold_attn_func(q, k, v, **{**X, **kw})


def varlen(cu=CU, cu_k=None, mq=None, mk=None, parts=None, **kw):
  q, k, v = parts or pqkv()
  return fold_attn_varlen_func(q, k, v, jnp.asarray(cu), cu_k, mq, mk,
                               **{**X, **kw})


# --- KV cache ---------------------------------------------------------------
CB, CMAX, PAGE = 2, 32, 16  # 2 slots of 32 tokens, pages of 16


def cache(**kw):
  kw = {"page_size": PAGE, "dtype": F32, **kw}
  return FoldKVCache.create(CB, HQ, HKV, D, CMAX, **kw)


def full_cache(n=CMAX):
  c = cache()
  return c.append(z(CB, n, HKV, D), z(CB, n, HKV, D))


def tok(n=None, d=D, dtype=F32, b=CB):
  shape = (b, HKV, d) if n is None else (b, n, HKV, d)
  return z(*shape, dtype=dtype)


def prefill(c=None, cu=(0, 2, 4), t=4, seq_ids=None, dtype=F32, hq=HQ,
            **kw):
  c = c or cache()
  q, k, v = pqkv(t, hq=hq, dtype=dtype)
  return c.prefill(q, k, v, jnp.asarray(cu, jnp.int32), seq_ids=seq_ids,
                   **{**X, **kw})


def decode(c=None, q=None, **kw):
  c = c or full_cache(4)
  q = z(CB, HQ, D) if q is None else q
  return c.attend(q, **{**X, **kw})


# --- DeBERTa ----------------------------------------------------------------
PB, MR = 4, 8  # position_buckets, max_relative_positions: att_span 4


def deb(q=None, pk=None, pq=None, **kw):
  q = z(B, S, HQ, D) if q is None else q
  pk = z(2 * PB, HQ, D) if pk is None else pk
  pq = z(2 * PB, HQ, D) if pq is None else pq
  kw = {"position_buckets": PB, "max_relative_positions": MR, **X, **kw}
  k = kw.pop("k", q)
  return disentangled_attention(q, k, k, pk, pq, **kw)


# --- Flax ---------------------------------------------------------------------
def flax_attention_fn(**kw):
  from jax_api.flax import attention_fn
  q, k, v = qkv()
  return attention_fn(q, k, v, **{**X, **kw})


def decoder_module(x=None, **kw):
  from jax_api.flax import DecoderAttention
  call = kw.pop("call", {})
  m = DecoderAttention(**{"num_heads": HQ, "num_kv_heads": HKV,
                          "head_dim": D, **X, **kw})
  x = z(B, S, HQ * D) if x is None else x
  return m.init(jax.random.key(0), x, **call)


def deberta_module(**cfg):
  from jax_api.deberta import DebertaV2Config, DebertaV2SelfAttention
  c = DebertaV2Config(**{"hidden_size": HQ * D, "num_attention_heads": HQ,
                         "relative_attention": True, "position_buckets": PB,
                         "max_relative_positions": MR,
                         "pos_att_type": ("c2p", "p2c"), **cfg})
  m = DebertaV2SelfAttention(c, backend="xla")
  x = z(B, S, HQ * D)
  rel = z(2 * max(PB, 1), HQ * D)
  return m.init(jax.random.key(0), x, None, rel)


NO_PALLAS = pytest.mark.skipif(
    _gpu_capability() is not None,
    reason="this machine has a GPU; 'pallas' is not a bad input here")

# (id, call, exception, fragment the message must contain: the argument)
JAX_CASES = [
    # dense: ranks, shapes, heads, dims, dtypes
    ("dense-q-rank", lambda: dense(qkv=(z(S, HQ, D),) + qkv()[1:]),
     ValueError, "q must have rank 4"),
    ("dense-k-rank", lambda: dense(qkv=(qkv()[0], z(1, 1, S, HKV, D),
                                        qkv()[2])), ValueError, "k must"),
    ("dense-v-rank", lambda: dense(qkv=qkv()[:2] + (z(S, D),)),
     ValueError, "v must"),
    ("dense-batch", lambda: dense(qkv=(z(2, S, HQ, D),) + qkv()[1:]),
     ValueError, "batch"),
    ("dense-kv-seq", lambda: dense(qkv=qkv()[:2] + (z(B, S + 1, HKV, D),)),
     ValueError, "k and v"),
    ("dense-kv-heads", lambda: dense(qkv=qkv()[:2] + (z(B, S, 2, D),)),
     ValueError, "k and v"),
    ("dense-head-dim-mismatch", lambda: dense(qkv=(z(B, S, HQ, 32),) +
                                              qkv()[1:]), ValueError,
     "head_dim"),
    ("dense-gqa", lambda: dense(qkv=qkv(hq=3, hkv=2)), ValueError,
     "heads_q"),
    ("dense-head-dim-512", lambda: dense(qkv=qkv(d=512)), ValueError,
     "head_dim"),
    ("dense-float64", lambda: dense(qkv=tuple(np.zeros(x.shape, np.float64)
                                              for x in qkv())),
     TypeError, "q has dtype float64"),
    ("dense-int", lambda: dense(qkv=qkv(dtype=jnp.int32)), TypeError,
     "q has dtype int32"),
    ("dense-mixed", lambda: dense(qkv=(qkv()[0].astype(jnp.bfloat16),) +
                                  qkv()[1:]), TypeError, "share one dtype"),
    ("dense-not-array", lambda: dense(qkv=([[0.0]],) + qkv()[1:]),
     TypeError, "q must be an array"),
    ("dense-seq-0", lambda: dense(qkv=qkv(sq=0)), ValueError,
     "sequence lengths"),
    ("window-below-minus-1", lambda: dense(window_size=(-2, -1)), ValueError,
     "window_size"),
    ("window-type", lambda: dense(window_size=3), TypeError, "window_size"),
    ("window-bool", lambda: dense(window_size=(True, -1)), TypeError,
     "window_size"),
    ("scale-zero", lambda: dense(softmax_scale=0.0), ValueError,
     "softmax_scale"),
    ("scale-negative", lambda: dense(softmax_scale=-1.0), ValueError,
     "softmax_scale"),
    ("scale-nan", lambda: dense(softmax_scale=float("nan")), ValueError,
     "softmax_scale"),
    ("scale-inf", lambda: dense(softmax_scale=float("inf")), ValueError,
     "softmax_scale"),
    ("scale-str", lambda: dense(softmax_scale="0.1"), TypeError,
     "softmax_scale"),
    ("sinks-shape", lambda: dense(sinks=z(3)), ValueError, "sinks"),
    ("sinks-rank", lambda: dense(sinks=z(1, HQ)), ValueError, "sinks"),
    ("sinks-int", lambda: dense(sinks=z(HQ, dtype=jnp.int32)), TypeError,
     "sinks"),
    ("softcap-negative", lambda: dense(softcap=-1.0), ValueError, "softcap"),
    ("softcap-nan", lambda: dense(softcap=float("nan")), ValueError,
     "softcap"),
    ("softcap-inf", lambda: dense(softcap=float("inf")), ValueError,
     "softcap"),
    ("softcap-str", lambda: dense(softcap="1"), TypeError, "softcap"),
    ("segment-ids-shape", lambda: dense(segment_ids=z(B, S + 1,
                                                      dtype=jnp.int32)),
     ValueError, "segment_ids"),
    ("segment-ids-float", lambda: dense(segment_ids=z(B, S)), TypeError,
     "segment_ids"),
    ("backend-unknown", lambda: dense(backend="cuda"), ValueError,
     "backend"),
    pytest.param("backend-pallas-no-gpu", lambda: dense(backend="pallas"),
                 ValueError, "backend='pallas'", marks=NO_PALLAS),
    # varlen
    ("varlen-q-rank", lambda: varlen(parts=(z(1, S, HQ, D),) + pqkv()[1:]),
     ValueError, "q must have rank 3"),
    ("varlen-gqa", lambda: varlen(parts=pqkv(hq=3, hkv=2)), ValueError,
     "heads_q"),
    ("cu-first-not-0", lambda: varlen(cu=[1, 2, 4]), ValueError,
     "cu_seqlens_q[0]"),
    ("cu-not-monotone", lambda: varlen(cu=[0, 3, 2]), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ("cu-past-tokens", lambda: varlen(cu=[0, 2, 5]), ValueError,
     "cu_seqlens_q[-1]"),
    ("cu-k-past-tokens", lambda: varlen(cu_k=jnp.array([0, 2, 9],
                                                       jnp.int32)),
     ValueError, "cu_seqlens_k[-1]"),
    ("cu-float", lambda: varlen(cu=np.array([0., 2., 4.], np.float32)),
     TypeError, "cu_seqlens_q"),
    ("cu-rank", lambda: varlen(cu=np.zeros((2, 2), np.int32)), ValueError,
     "cu_seqlens_q"),
    ("cu-one-entry", lambda: varlen(cu=np.array([0], np.int32)), ValueError,
     "cu_seqlens_q"),
    ("cu-q-k-count", lambda: varlen(cu_k=jnp.array([0, 4], jnp.int32)),
     ValueError, "cu_seqlens_q and cu_seqlens_k"),
    ("max-seqlen-too-small", lambda: varlen(mq=2), ValueError,
     "max_seqlen_q"),
    ("max-seqlen-k-too-small", lambda: varlen(cu_k=jnp.asarray(CU), mq=3,
                                              mk=1), ValueError,
     "max_seqlen_k"),
    ("max-seqlen-zero", lambda: varlen(mq=0), ValueError, "max_seqlen_q"),
    ("max-seqlen-str", lambda: varlen(mq="3"), TypeError, "max_seqlen_q"),
    ("varlen-scale-nan", lambda: varlen(softmax_scale=float("nan")),
     ValueError, "softmax_scale"),
    ("varlen-sinks", lambda: varlen(sinks=z(HQ + 1)), ValueError, "sinks"),
    # KV cache: create
    ("cache-gqa", lambda: FoldKVCache.create(1, 3, 2, D, 16), ValueError,
     "n_kv_heads"),
    ("cache-head-dim", lambda: FoldKVCache.create(1, 2, 1, 300, 16),
     ValueError, "head_dim"),
    ("cache-page-size", lambda: cache(page_size=24), ValueError,
     "page_size"),
    ("cache-dtype-int", lambda: cache(dtype=jnp.int8), TypeError, "dtype"),
    ("cache-batch-0", lambda: FoldKVCache.create(0, 2, 1, D, 16), ValueError,
     "batch"),
    ("cache-max-len-str", lambda: FoldKVCache.create(1, 2, 1, D, "16"),
     TypeError, "max_len"),
    ("cache-num-pages-0", lambda: cache(num_pages=0), ValueError,
     "num_pages"),
    # KV cache: append
    ("append-past-max-len", lambda: full_cache().append(tok(), tok()),
     ValueError, "max_len"),
    ("append-pool-exhausted", lambda: cache(num_pages=1).append(
        tok(9), tok(9)), ValueError, "page"),
    ("append-head-dim", lambda: cache().append(tok(d=32), tok(d=32)),
     ValueError, "k must have shape"),
    ("append-dtype", lambda: cache().append(tok(dtype=jnp.bfloat16),
                                            tok(dtype=jnp.bfloat16)),
     TypeError, "k has dtype bfloat16"),
    ("append-int", lambda: cache().append(tok(dtype=jnp.int32),
                                          tok(dtype=jnp.int32)),
     TypeError, "k has dtype int32"),
    ("append-k-v-shape", lambda: cache().append(tok(), tok(2)), ValueError,
     "k and v"),
    ("append-rank", lambda: cache().append(z(CB, D), z(CB, D)), ValueError,
     "k must have rank"),
    ("append-batch", lambda: cache().append(tok(b=3), tok(b=3)),
     ValueError, "k must have shape"),
    ("append-active-shape", lambda: cache().append(tok(), tok(),
                                                   active=jnp.ones(3, bool)),
     ValueError, "active"),
    ("append-only-k", lambda: fold_attn_with_kvcache(z(CB, HQ, D), cache(),
                                                     tok(), None, **X),
     ValueError, "k and v"),
    # KV cache: free (slots out of range or named twice)
    ("free-out-of-range", lambda: cache().free(jnp.array([CB])), ValueError,
     "seq_ids"),
    ("free-negative", lambda: cache().free(jnp.array([-1])), ValueError,
     "seq_ids"),
    ("free-twice-in-one-call", lambda: cache().free(jnp.array([0, 0])),
     ValueError, "seq_ids"),
    ("free-float", lambda: cache().free(jnp.array([0.0])), TypeError,
     "seq_ids"),
    # KV cache: prefill
    ("prefill-busy-slot", lambda: prefill(full_cache(4)), ValueError,
     "empty slots"),
    ("prefill-slot-out-of-range", lambda: prefill(seq_ids=jnp.array(
        [0, CB])), ValueError, "seq_ids"),
    ("prefill-seq-ids-shape", lambda: prefill(seq_ids=jnp.array([0])),
     ValueError, "seq_ids"),
    ("prefill-cu-first", lambda: prefill(cu=(1, 2, 4)), ValueError,
     "cu_seqlens[0]"),
    ("prefill-cu-monotone", lambda: prefill(cu=(0, 3, 2)), ValueError,
     "cu_seqlens"),
    ("prefill-cu-past", lambda: prefill(cu=(0, 2, 6)), ValueError,
     "cu_seqlens[-1]"),
    ("prefill-heads", lambda: prefill(hq=4), ValueError, "prefill expects q"),
    ("prefill-dtype", lambda: prefill(dtype=jnp.bfloat16), TypeError,
     "k has dtype"),
    ("prefill-max-seqlen", lambda: prefill(max_seqlen=1), ValueError,
     "max_seqlen"),
    ("prefill-too-long", lambda: prefill(cu=(0, 40), t=40), ValueError,
     "max_len"),
    ("prefill-too-many", lambda: prefill(cu=(0, 1, 2, 3), t=3), ValueError,
     "slots"),
    # KV cache: decode
    ("decode-dtype", lambda: decode(q=z(CB, HQ, D, dtype=jnp.bfloat16)),
     TypeError, "q has dtype"),
    ("decode-heads", lambda: decode(q=z(CB, HQ + 1, D)), ValueError,
     "q must have shape"),
    ("decode-head-dim", lambda: decode(q=z(CB, HQ, 2 * D)), ValueError,
     "q must have shape"),
    ("decode-rank", lambda: decode(q=z(CB, D)), ValueError, "q must have"),
    ("decode-draft", lambda: decode(q=z(CB, 17, HQ, D)), ValueError,
     "q.shape[1]"),
    ("num-splits-0", lambda: decode(num_splits=0), ValueError, "num_splits"),
    ("num-splits-negative", lambda: decode(num_splits=-2), ValueError,
     "num_splits"),
    ("num-splits-float", lambda: decode(num_splits=2.0), TypeError,
     "num_splits"),
    ("decode-sinks", lambda: decode(sinks=z(HQ + 1)), ValueError, "sinks"),
    ("decode-scale-inf", lambda: decode(softmax_scale=float("inf")),
     ValueError, "softmax_scale"),
    ("decode-window", lambda: decode(window_size=(-3, 0)), ValueError,
     "window_size"),
    ("decode-softcap", lambda: decode(softcap=-0.5), ValueError, "softcap"),
    ("decode-backend", lambda: decode(backend="triton"), ValueError,
     "backend"),
    # DeBERTa
    ("deberta-pos-key-rows", lambda: deb(pk=z(2 * PB - 1, HQ, D)),
     ValueError, "pos_key"),
    ("deberta-pos-key-heads", lambda: deb(pk=z(2 * PB, HQ + 1, D)),
     ValueError, "pos_key"),
    ("deberta-pos-query-rank", lambda: deb(pq=z(2 * PB, HQ * D)),
     ValueError, "pos_query"),
    ("deberta-pos-query-missing", lambda: disentangled_attention(
        *qkv(hkv=HQ), z(2 * PB, HQ, D), None, position_buckets=PB,
        max_relative_positions=MR, **X), TypeError, "pos_query"),
    ("deberta-pos-int", lambda: deb(pk=z(2 * PB, HQ, D, dtype=jnp.int32)),
     TypeError, "pos_key"),
    ("deberta-buckets-gt-max-rel", lambda: deb(position_buckets=16,
                                               pk=z(32, HQ, D),
                                               pq=z(32, HQ, D)),
     ValueError, "position_buckets"),
    ("deberta-max-rel-0", lambda: deb(position_buckets=-1,
                                      max_relative_positions=0),
     ValueError, "max_relative_positions"),
    ("deberta-buckets-float", lambda: deb(position_buckets=4.0), TypeError,
     "position_buckets"),
    ("deberta-pos-att-type", lambda: deb(pos_att_type=("c2p", "q2q")),
     ValueError, "pos_att_type"),
    ("deberta-dropout-no-rng", lambda: deb(dropout_rate=0.1), ValueError,
     "dropout_rng"),
    ("deberta-dropout-1", lambda: deb(dropout_rate=1.0,
                                      dropout_rng=jax.random.key(0)),
     ValueError, "dropout_rate"),
    ("deberta-mask-shape", lambda: deb(attention_mask=np.ones((B, S + 1))),
     ValueError, "attention_mask"),
    ("deberta-cross-attention", lambda: deb(k=z(B, S + 1, HQ, D)),
     ValueError, "q and k"),
    ("deberta-gqa", lambda: deb(k=z(B, S, 1, D)), ValueError, "q and k"),
    ("deberta-cu-monotone", lambda: deb(q=z(S, HQ, D), cu_seqlens=jnp.array(
        [0, 3, 2], jnp.int32)), ValueError, "cu_seqlens"),
    ("deberta-cu-and-mask", lambda: deb(q=z(S, HQ, D), cu_seqlens=jnp.array(
        [0, 4], jnp.int32), attention_mask=np.ones((1, S))), ValueError,
     "attention_mask and cu_seqlens"),
    ("deberta-max-seqlen", lambda: deb(q=z(S, HQ, D), cu_seqlens=jnp.array(
        [0, 4], jnp.int32), max_seqlen=2), ValueError, "max_seqlen"),
    ("deberta-dtype", lambda: deb(q=z(B, S, HQ, D, dtype=jnp.int32)),
     TypeError, "q has dtype"),
    ("deberta-backend", lambda: deb(backend="gpu"), ValueError, "backend"),
    # Flax modules' call paths
    ("flax-attention-fn-bias", lambda: flax_attention_fn(bias=z(1)),
     ValueError, "bias"),
    ("flax-attention-fn-softcap", lambda: flax_attention_fn(softcap=-1.0),
     ValueError, "softcap"),
    ("flax-attention-fn-window", lambda: flax_attention_fn(
        window_size=(-5, 0)), ValueError, "window_size"),
    ("flax-attention-fn-backend", lambda: flax_attention_fn(backend="x"),
     ValueError, "backend"),
    ("flax-decoder-gqa", lambda: decoder_module(num_heads=3, num_kv_heads=2,
                                                x=z(B, S, 3 * D)),
     ValueError, "heads"),
    ("flax-decoder-softcap", lambda: decoder_module(softcap=-1.0),
     ValueError, "softcap"),
    ("flax-decoder-backend", lambda: decoder_module(backend="gpu"),
     ValueError, "backend"),
    ("flax-decoder-cu", lambda: decoder_module(
        x=z(S, HQ * D), call=dict(cu_seqlens=jnp.array([0, 3, 2],
                                                       jnp.int32))),
     ValueError, "cu_seqlens"),
]


def _check(call, exc, fragment):
  with pytest.raises(exc) as info:
    call()
  assert fragment in str(info.value), (
      f"message does not name {fragment!r}: {info.value}")
  # Refused before any compiler ran: the error comes from our checks.
  assert "XlaRuntimeError" not in type(info.value).__name__


def _params(cases):
  return [pytest.param(*c.values, id=c.values[0], marks=c.marks)
          if hasattr(c, "marks") else pytest.param(*c, id=c[0])
          for c in cases]


@pytest.mark.parametrize("name,call,exc,fragment", _params(JAX_CASES))
def test_jax_catalogue(name, call, exc, fragment):
  _check(call, exc, fragment)


# Under jax.jit the shape, dtype and static-option rules raise at trace time.
JIT_CASES = [
    ("jit-dense-gqa", lambda: jax.jit(lambda q, k, v: fold_attn_func(
        q, k, v, **X))(*qkv(hq=3, hkv=2)), ValueError, "heads_q"),
    ("jit-dense-mixed", lambda: jax.jit(lambda q, k, v: fold_attn_func(
        q, k.astype(jnp.bfloat16), v, **X))(*qkv()), TypeError,
     "share one dtype"),
    ("jit-window", lambda: jax.jit(lambda q, k, v: fold_attn_func(
        q, k, v, window_size=(-2, 0), **X))(*qkv()), ValueError,
     "window_size"),
    ("jit-varlen-cu-float", lambda: jax.jit(
        lambda q, k, v, cu: fold_attn_varlen_func(q, k, v, cu, **X))(
            *pqkv(), jnp.array([0., 4.])), TypeError, "cu_seqlens_q"),
    ("jit-decode-num-splits", lambda: jax.jit(
        lambda c, q: c.attend(q, num_splits=0, **X))(full_cache(4),
                                                     z(CB, HQ, D)),
     ValueError, "num_splits"),
    ("jit-append-dtype", lambda: jax.jit(lambda c, k: c.append(k, k))(
        cache(), tok(dtype=jnp.bfloat16)), TypeError, "k has dtype"),
    ("jit-deberta-pos-key", lambda: jax.jit(lambda q, pk: deb(q=q, pk=pk))(
        z(B, S, HQ, D), z(3, HQ, D)), ValueError, "pos_key"),
]


@pytest.mark.parametrize("name,call,exc,fragment", _params(JIT_CASES))
def test_jit_catalogue(name, call, exc, fragment):
  _check(call, exc, fragment)


def test_jit_capacity_errors_set_the_error_word():
  """Under jit a capacity error cannot raise: the cache flags it and
  `check()` raises outside, naming what was refused."""
  c = jax.jit(lambda c, k: c.append(k, k))(full_cache(), tok())
  with pytest.raises(ValueError, match="max_len"):
    c.check()


# ---------------------------------------------------------------- torch --
def t(*shape, dtype=torch.float32, device="cpu"):
  return torch.zeros(shape, dtype=dtype, device=device)


def tqkv(hq=HQ, hkv=HKV, d=D, dtype=torch.float32):
  return t(B, S, hq, d, dtype=dtype), t(B, S, hkv, d, dtype=dtype), \
      t(B, S, hkv, d, dtype=dtype)


def tdense(parts=None, **kw):
  q, k, v = parts or tqkv()
  return tb.fold_attn_func(q, k, v, **{**X, **kw})


def tvarlen(cu=(0, 1, 4), mq=None, parts=None, **kw):
  q, k, v = parts or (t(S, HQ, D), t(S, HKV, D), t(S, HKV, D))
  cu = torch.tensor(cu, dtype=kw.pop("cu_dtype", torch.int32))
  return tb.fold_attn_varlen_func(q, k, v, cu, None, mq, **{**X, **kw})


def tdeb(q=None, pk=None, pq=None, **kw):
  q = t(B, S, HQ, D) if q is None else q
  pk = t(2 * PB, HQ, D) if pk is None else pk
  pq = t(2 * PB, HQ, D) if pq is None else pq
  kw = {"position_buckets": PB, "max_relative_positions": MR, **X, **kw}
  return tb.disentangled_attention(q, q, q, pk, pq, **kw)


def tcache(fill=0):
  c = tb.FoldKVCache.create(CB, HQ, HKV, D, CMAX, page_size=PAGE,
                            dtype=torch.float32, device="cpu")
  if fill:
    c.append(t(CB, fill, HKV, D), t(CB, fill, HKV, D))
  return c


def top(q=None, k=None, v=None, backend="xla", left=-1, right=-1,
        softcap=0.0, scale=0.25):
  q0, k0, v0 = tqkv()
  return torch.ops.foldax.attn_fwd(
      q0 if q is None else q, k0 if k is None else k, v0 if v is None else v,
      None, None, None, None, None, backend, False, left, right, softcap,
      scale, 0, 0)


TORCH_CASES = [
    ("t-q-rank", lambda: tdense((t(S, HQ, D),) + tqkv()[1:]), ValueError,
     "q must have rank 4"),
    ("t-gqa", lambda: tdense(tqkv(hq=3, hkv=2)), ValueError, "heads_q"),
    ("t-head-dim-300", lambda: tdense(tqkv(d=300)), ValueError, "head_dim"),
    ("t-int", lambda: tdense(tqkv(dtype=torch.int32)), TypeError,
     "q has dtype int32"),
    ("t-mixed", lambda: tdense((t(B, S, HQ, D, dtype=torch.float16),) +
                               tqkv()[1:]), TypeError, "share one dtype"),
    ("t-not-tensor", lambda: tdense((np.zeros((B, S, HQ, D)),) + tqkv()[1:]),
     TypeError, "q must be a torch.Tensor"),
    ("t-window", lambda: tdense(window_size=(-2, -1)), ValueError,
     "window_size"),
    ("t-scale-nan", lambda: tdense(softmax_scale=float("nan")), ValueError,
     "softmax_scale"),
    ("t-scale-inf", lambda: tdense(softmax_scale=float("inf")), ValueError,
     "softmax_scale"),
    ("t-scale-zero", lambda: tdense(softmax_scale=0.0), ValueError,
     "softmax_scale"),
    ("t-softcap-neg", lambda: tdense(softcap=-1.0), ValueError, "softcap"),
    ("t-softcap-nan", lambda: tdense(softcap=float("nan")), ValueError,
     "softcap"),
    ("t-sinks", lambda: tdense(sinks=t(3)), ValueError, "sinks"),
    ("t-sinks-int", lambda: tdense(sinks=t(HQ, dtype=torch.int64)),
     TypeError, "sinks"),
    ("t-two-devices", lambda: tdense((tqkv()[0], t(B, S, HKV, D,
                                                   device="meta"),
                                      tqkv()[2])), ValueError, "one device"),
    ("t-sinks-device", lambda: tdense(sinks=t(HQ, device="meta")),
     ValueError, "sinks"),
    ("t-backend-unknown", lambda: tdense(backend="cuda"), ValueError,
     "backend"),
    pytest.param("t-backend-pallas-cpu-tensors",
                 lambda: tdense(backend="pallas"), ValueError,
                 "pallas"),
    ("t-segment-ids-float", lambda: tdense(segment_ids=t(B, S)), TypeError,
     "segment_ids"),
    ("t-cu-first", lambda: tvarlen(cu=(1, 2, 4)), ValueError,
     "cu_seqlens_q[0]"),
    ("t-cu-monotone", lambda: tvarlen(cu=(0, 3, 2)), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ("t-cu-past", lambda: tvarlen(cu=(0, 2, 5)), ValueError,
     "cu_seqlens_q[-1]"),
    ("t-cu-float", lambda: tvarlen(cu_dtype=torch.float32), TypeError,
     "cu_seqlens_q"),
    ("t-max-seqlen", lambda: tvarlen(mq=2), ValueError, "max_seqlen_q"),
    ("t-varlen-rank", lambda: tvarlen(parts=tqkv()), ValueError,
     "q must have rank 3"),
    ("t-deberta-pos-rows", lambda: tdeb(pk=t(3, HQ, D)), ValueError,
     "pos_key"),
    ("t-deberta-buckets", lambda: tdeb(position_buckets=16), ValueError,
     "position_buckets"),
    ("t-deberta-cu", lambda: tdeb(q=t(S, HQ, D), cu_seqlens=torch.tensor(
        [0, 3, 2], dtype=torch.int32)), ValueError, "cu_seqlens"),
    ("t-deberta-mask", lambda: tdeb(attention_mask=t(B, S + 1)), ValueError,
     "attention_mask"),
    ("t-deberta-int", lambda: tdeb(q=t(B, S, HQ, D, dtype=torch.int32)),
     TypeError, "q has dtype"),
    ("t-cache-dtype", lambda: tb.FoldKVCache.create(1, 2, 1, D, 16,
                                                    dtype=torch.int8),
     TypeError, "dtype"),
    ("t-append-past-max-len", lambda: tcache(CMAX).append(
        t(CB, HKV, D), t(CB, HKV, D)), ValueError, "max_len"),
    ("t-append-dtype", lambda: tcache().append(
        t(CB, HKV, D, dtype=torch.float16), t(CB, HKV, D,
                                              dtype=torch.float16)),
     TypeError, "k has dtype float16"),
    ("t-append-head-dim", lambda: tcache().append(t(CB, HKV, 8),
                                                  t(CB, HKV, 8)),
     ValueError, "k must have shape"),
    ("t-append-device", lambda: tcache().append(
        t(CB, HKV, D, device="meta"), t(CB, HKV, D, device="meta")),
     ValueError, "k is on meta"),
    ("t-decode-num-splits", lambda: tb.fold_attn_with_kvcache(
        t(CB, HQ, D), tcache(4), num_splits=0), ValueError, "num_splits"),
    ("t-decode-dtype", lambda: tb.fold_attn_with_kvcache(
        t(CB, HQ, D, dtype=torch.bfloat16), tcache(4)), TypeError,
     "q has dtype"),
    ("t-prefill-cu", lambda: tcache().prefill(
        t(4, HQ, D), t(4, HKV, D), t(4, HKV, D),
        torch.tensor([1, 4], dtype=torch.int32)), ValueError,
     "cu_seqlens[0]"),
    ("t-prefill-busy", lambda: tcache(2).prefill(
        t(4, HQ, D), t(4, HKV, D), t(4, HKV, D),
        torch.tensor([0, 4], dtype=torch.int32)), ValueError, "prefill"),
    ("t-free-out-of-range", lambda: tcache().free([CB]), ValueError,
     "invalid"),
    # The custom ops themselves (what torch.compile calls).
    pytest.param("t-op-rank", lambda: top(q=t(S, HQ, D)), ValueError, "q must have", marks=pytest.mark.xfail(strict=True, reason="open: the custom op bodies "
                        "trust their (already validated) static options")),
    pytest.param("t-op-scale", lambda: top(scale=float("nan")), ValueError,
     "softmax_scale", marks=pytest.mark.xfail(strict=True, reason="open: the custom op bodies "
                        "trust their (already validated) static options")),
    pytest.param("t-op-window", lambda: top(left=-4), ValueError, "window_size", marks=pytest.mark.xfail(strict=True, reason="open: the custom op bodies "
                        "trust their (already validated) static options")),
    ("t-op-backend", lambda: top(backend="cuda"), ValueError, "backend"),
    ("t-deberta-op-rank", lambda: torch.ops.foldax.deberta_fwd(
        t(S, HQ, D), t(S, HQ, D), t(S, HQ, D), None, None, None, None, None,
        "xla", PB, MR, False, False, 0.0, 0), ValueError, "q must have"),
]


@pytest.mark.parametrize("name,call,exc,fragment", _params(TORCH_CASES))
def test_torch_catalogue(name, call, exc, fragment):
  _check(call, exc, fragment)


def test_catalogue_size():
  assert len(JAX_CASES) + len(JIT_CASES) + len(TORCH_CASES) >= 60


@pytest.mark.parametrize("layout", ["transposed", "expanded", "sliced"])
def test_torch_strided_inputs_match_contiguous(layout):
  """Non-contiguous and overlapping-stride (expanded) tensors are accepted
  and copied to contiguous ones: the same bits as contiguous inputs."""
  g = torch.Generator().manual_seed(0)
  q = torch.randn(B, S, HQ, D, generator=g)
  k = torch.randn(B, S, HKV, D, generator=g)
  if layout == "transposed":
    qs = q.transpose(1, 2).contiguous().transpose(1, 2)
  elif layout == "expanded":
    q = q[:, :1].expand(B, S, HQ, D).contiguous()
    qs = q[:, :1].expand(B, S, HQ, D)  # stride 0 over seq: overlapping
  else:
    big = torch.randn(B, S, HQ, 2 * D, generator=g)
    q = big[..., ::2].contiguous()
    qs = big[..., ::2]
  assert not qs.is_contiguous()
  ref = tb.fold_attn_func(q, k, k, causal=True, backend="xla")
  got = tb.fold_attn_func(qs, k, k, causal=True, backend="xla")
  assert torch.equal(ref, got)
