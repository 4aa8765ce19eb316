"""`jax_api.flax.DecoderAttention` (linen) and its nnx twin: incremental
decoding through FoldKVCache equals full causal attention; packed and
padded layouts; weights load from Flax's stock MultiHeadAttention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from jax_api.flax import DecoderAttention, DecoderAttentionNNX
from jax_api.flax.decoder import segment_positions, varlen_positions
from jax_api.flax.nnx import DecoderAttention as NNXDecoderAttention

B, T, F, H, KV = 2, 10, 32, 4, 2
OPTS = dict(num_heads=H, num_kv_heads=KV, use_sinks=True, sliding_window=4,
            softcap=5.0)


def _x(seed=0, shape=(B, T, F)):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _close(a, b, tol=2e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol,
                             rtol=tol)


def _perturbed(params, seed=5):
  # Non-zero sinks and biases, so every option matters.
  return jax.tree.map(
      lambda a: a + 0.3 * jax.random.normal(jax.random.key(seed), a.shape),
      params)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_linen_incremental_decoding_equals_full(backend):
  m = DecoderAttention(backend=backend, **OPTS)
  x = _x()
  p = _perturbed(jax.jit(m.init)(jax.random.key(1), x))
  full = jax.jit(m.apply)(p, x)
  cache = m.init_cache(B, 16, F)
  prompt = 4
  out, cache = jax.jit(functools.partial(m.apply, method="prefill"))(
      p, x[:, :prompt], cache)
  step = jax.jit(functools.partial(m.apply, method="decode_step"))
  outs = [out]
  for t in range(prompt, T):
    o, cache = step(p, x[:, t], cache)
    outs.append(o[:, None])
  cache.check()
  assert np.array_equal(np.asarray(cache.lengths), [T, T])
  _close(jnp.concatenate(outs, 1), full)


def test_nnx_stateful_decoding_equals_full():
  m = NNXDecoderAttention(H, F, num_kv_heads=KV, use_sinks=True,
                          sliding_window=4, softcap=5.0, backend="xla",
                          rngs=nnx.Rngs(0))
  assert isinstance(m, DecoderAttentionNNX)
  m.sinks[...] = jnp.array([0.5, -1.0, 1.5, 0.0])
  x = _x(1)
  full = nnx.jit(lambda m, x: m(x))(m, x)
  m.init_cache(B, 16, store=True)
  f = nnx.jit(lambda m, x: m(x, decode=True))
  outs = [f(m, x[:, :3])] + [f(m, x[:, t:t + 1]) for t in range(3, T)]
  _close(jnp.concatenate(outs, 1), full)
  # Functional API on a fresh cache: same result.
  cache = m.init_cache(B, 16)
  o, cache = nnx.jit(lambda m, x, c: m.prefill(x, c))(m, x[:, :T - 1], cache)
  o2, cache = nnx.jit(lambda m, x, c: m.decode_step(x, c))(m, x[:, T - 1],
                                                            cache)
  _close(o2, full[:, T - 1])


def test_prefill_of_right_padded_prompts():
  m = DecoderAttention(num_heads=H, num_kv_heads=KV, backend="xla")
  apply = jax.jit(m.apply)
  x = _x(2)
  p = jax.jit(m.init)(jax.random.key(1), x)
  lens = [6, 3]
  cache = m.init_cache(B, 16, F)
  out, cache = jax.jit(functools.partial(m.apply, method="prefill"))(
      p, x, cache, jnp.array(lens))
  assert np.array_equal(np.asarray(cache.lengths), lens)
  full = apply(p, x)  # causal: row b's first n outputs are its prompt's
  for b, n in enumerate(lens):
    _close(out[b, :n], full[b, :n])
    assert np.all(np.asarray(out[b, n:]) == 0)
  # Decoding continues each row at its own position.
  xt = _x(3, (B, F))
  o, cache = jax.jit(functools.partial(m.apply, method="decode_step"))(
      p, xt, cache)
  seq = np.array(x)
  for b, n in enumerate(lens):
    seq[b, n] = xt[b]
  ref = apply(p, jnp.asarray(seq))
  for b, n in enumerate(lens):
    _close(o[b], ref[b, n])


def test_packed_segments_and_varlen_match_separate_sequences():
  m = DecoderAttention(backend="xla", **OPTS)
  apply = jax.jit(m.apply, static_argnames="max_seqlen")
  lens = [3, 5, 2]
  x = _x(4, (1, sum(lens), F))
  p = _perturbed(jax.jit(m.init)(jax.random.key(1), x))
  seg = jnp.asarray(np.repeat(np.arange(3), lens)[None], jnp.int32)
  cu = jnp.asarray(np.cumsum([0] + lens), jnp.int32)
  packed = apply(p, x, segment_ids=seg)
  varlen = apply(p, x[0], cu_seqlens=cu, max_seqlen=max(lens))
  _close(varlen, packed[0])
  # Each sequence alone (right-padded into one batch; causal, so the
  # padding does not reach the valid rows).
  sep = np.zeros((3, max(lens), F), np.float32)
  for i, n in enumerate(lens):
    sep[i, :n] = x[0, int(cu[i]):int(cu[i]) + n]
  alone = apply(p, jnp.asarray(sep))
  for i, n in enumerate(lens):
    _close(packed[0, int(cu[i]):int(cu[i]) + n], alone[i, :n])
  assert segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
  assert varlen_positions(cu, 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]


def test_weights_swap_with_stock_multihead_attention():
  """rope_base=None: causal DecoderAttention == stock module + causal mask,
  with the stock module's parameters (linen and nnx)."""
  x = _x(5)
  causal = nn.make_causal_mask(jnp.ones((B, T)))
  stock = nn.MultiHeadDotProductAttention(num_heads=H)
  params = jax.jit(stock.init)(jax.random.key(2), x)
  ours = DecoderAttention(num_heads=H, rope_base=None, backend="xla")
  assert (jax.tree.structure(jax.eval_shape(ours.init, jax.random.key(0), x))
          == jax.tree.structure(params))
  _close(jax.jit(ours.apply)(params, x),
         jax.jit(stock.apply)(params, x, mask=causal))

  stock_n = nnx.MultiHeadAttention(num_heads=H, in_features=F, decode=False,
                                   rngs=nnx.Rngs(3))
  ours_n = DecoderAttentionNNX(H, F, rope_base=None, backend="xla",
                               rngs=nnx.Rngs(4))
  nnx.update(ours_n, nnx.state(stock_n, nnx.Param))
  call = nnx.jit(lambda m, x, mask=None: m(x) if mask is None else
                 m(x, mask=mask))
  _close(call(ours_n, x), call(stock_n, x, causal))
  # linen and nnx twins agree given the same weights (GQA, RoPE, options).
  lin = DecoderAttention(backend="xla", **OPTS)
  nx = DecoderAttentionNNX(H, F, num_kv_heads=KV, use_sinks=True,
                           sliding_window=4, softcap=5.0, backend="xla",
                           rngs=nnx.Rngs(0))
  p = _perturbed(jax.jit(lin.init)(jax.random.key(1), x))["params"]
  for name in ("query", "key", "value", "out"):
    getattr(nx, name).kernel[...] = p[name]["kernel"]
    getattr(nx, name).bias[...] = p[name]["bias"]
  nx.sinks[...] = p["sinks"]
  _close(call(nx, x), jax.jit(lin.apply)({"params": p}, x))
