"""Parity of the DeBERTa-v2/v3 disentangled-attention reference with HF."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from pallas_kernels.reference.deberta import (
    build_relative_position,
    deberta_att_span,
    disentangled_attention_reference,
    make_log_position_buckets,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf  # noqa: E402

# Float32 everywhere (HF in torch, reference in jnp at HIGHEST precision); the
# only differences are summation order and k/scale vs. scores/scale rounding.
RTOL = 1e-5
ATOL = 5e-6  # outputs are O(1) (max |out| ~ 3-4); observed max error 1.5e-6

HIDDEN, HEADS = 32, 4
HEAD_DIM = HIDDEN // HEADS
BUCKETS, MAX_REL = 8, 16  # att_span 8; bucket mid 4


def _model(pos_att_type, share_att_key, position_buckets=BUCKETS,
           max_relative_positions=MAX_REL, seed=0):
  torch.manual_seed(seed)
  cfg = transformers.DebertaV2Config(
      vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2,
      num_attention_heads=HEADS, intermediate_size=64,
      max_position_embeddings=128, relative_attention=True,
      position_buckets=position_buckets,
      max_relative_positions=max_relative_positions,
      pos_att_type=list(pos_att_type), share_att_key=share_att_key,
      norm_rel_ebd="layer_norm", position_biased_input=False,
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
  model = hf.DebertaV2Model(cfg).float().eval()
  # HF's init (std 0.02, unit LayerNorm) gives near-uniform attention, which
  # would hide index/scale bugs; O(1) scores make every term visible.
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0.0, 0.25)
  return model


def _proj(lin, x):
  w = lin.weight.detach().numpy().astype(np.float32)
  b = lin.bias.detach().numpy().astype(np.float32)
  y = x @ w.T + b
  return y.reshape(*x.shape[:-1], HEADS, HEAD_DIM)


def _hf_and_inputs(model, layer, hidden, mask):
  """HF context [b, s, h, d] and reference inputs for one layer."""
  enc = model.encoder
  attn = enc.layer[layer].attention.self
  h_t = torch.from_numpy(hidden)
  m_t = torch.from_numpy(mask.astype(np.int64))
  with torch.no_grad():
    rel_emb = enc.get_rel_embedding()
    ctx, _ = attn(h_t, enc.get_attention_mask(m_t),
                  relative_pos=enc.get_rel_pos(h_t),
                  rel_embeddings=rel_emb)
  b, s, _ = hidden.shape
  ctx = ctx.numpy().reshape(b, s, HEADS, HEAD_DIM)

  span = attn.pos_ebd_size
  rel_np = rel_emb.detach().numpy()[: 2 * span]
  q = _proj(attn.query_proj, hidden)
  k = _proj(attn.key_proj, hidden)
  v = _proj(attn.value_proj, hidden)
  if attn.share_att_key:
    pk = _proj(attn.key_proj, rel_np)
    pq = _proj(attn.query_proj, rel_np)
  else:
    pk = (_proj(attn.pos_key_proj, rel_np) if "c2p" in attn.pos_att_type
          else None)
    pq = (_proj(attn.pos_query_proj, rel_np) if "p2c" in attn.pos_att_type
          else None)
  return ctx, (q, k, v, pk, pq)


def _ragged_mask(lengths, seq):
  return (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(
      np.int32)


# ---------------------------------------------------------------------------
# Relative positions.


@pytest.mark.parametrize("bucket_size,max_position", [
    (256, 512), (8, 16), (4, 16), (16, 64), (6, 10), (2, 5)])
def test_log_buckets_match_hf(bucket_size, max_position):
  # |r| = 17852 at (256, 512) is where XLA's float32 log flips HF's ceil.
  r = np.arange(-20000, 20001)
  want = hf.make_log_bucket_position(
      torch.from_numpy(r), bucket_size, max_position).to(torch.long).numpy()
  got = make_log_position_buckets(r, bucket_size, max_position)
  np.testing.assert_array_equal(np.asarray(got), want)
  got_jit = jax.jit(make_log_position_buckets, static_argnums=(1, 2))(
      jnp.asarray(r, jnp.int32), bucket_size, max_position)
  np.testing.assert_array_equal(np.asarray(got_jit), want)


@pytest.mark.parametrize("size", [1, 7, 40])
@pytest.mark.parametrize("bucket_size,max_position",
                         [(-1, -1), (8, 16), (256, 512), (8, -1)])
def test_build_relative_position_matches_hf(size, bucket_size, max_position):
  x = torch.zeros(size, 1)
  want = hf.build_relative_position(x, x, bucket_size, max_position).numpy()
  got = np.asarray(build_relative_position(size, size, bucket_size,
                                           max_position))
  assert got.shape == want.shape == (1, size, size)
  np.testing.assert_array_equal(got, want)


def test_att_span():
  assert deberta_att_span(256, 512) == 256
  assert deberta_att_span(-1, 512) == 512
  with pytest.raises(ValueError):
    deberta_att_span(-1, -1)


# ---------------------------------------------------------------------------
# HF parity at the attention level.

CONFIGS = [
    (("c2p", "p2c"), True),
    (("c2p", "p2c"), False),
    (("c2p",), True),
    (("c2p",), False),
    (("p2c",), True),
    (("p2c",), False),
]


@pytest.mark.parametrize("pos_att_type,share_att_key", CONFIGS)
def test_matches_hf_padded(pos_att_type, share_att_key):
  model = _model(pos_att_type, share_att_key)
  seq = 24  # > bucket mid 4 and > att_span 8: log buckets and clamping
  rel = np.asarray(build_relative_position(seq, seq, BUCKETS, MAX_REL))
  assert np.abs(rel).max() > BUCKETS // 2
  assert (rel + BUCKETS).max() > 2 * BUCKETS - 1
  rng = np.random.default_rng(1)
  hidden = rng.standard_normal((3, seq, HIDDEN)).astype(np.float32)
  mask = _ragged_mask([seq, 13, 0], seq)

  for layer in range(2):
    ctx, (q, k, v, pk, pq) = _hf_and_inputs(model, layer, hidden, mask)
    out = disentangled_attention_reference(
        q, k, v, pk, pq, attention_mask=mask, position_buckets=BUCKETS,
        max_relative_positions=MAX_REL, pos_att_type=pos_att_type)
    out = np.asarray(out)
    assert out.dtype == np.float32 and out.shape == q.shape
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ctx[valid], rtol=RTOL, atol=ATOL)
    # Padded queries see no key: package convention is exact zeros ...
    assert np.all(out[~valid] == 0.0)
    # ... while HF (masked_fill(finfo.min) + softmax) averages all of v.
    for bi, si in zip(*np.nonzero(~valid)):
      np.testing.assert_allclose(ctx[bi, si], v[bi].mean(0), rtol=1e-5,
                                 atol=1e-5)


def test_matches_hf_no_mask_and_explicit_relative_pos():
  pos_att_type = ("c2p", "p2c")
  model = _model(pos_att_type, True, seed=3)
  seq = 19
  rng = np.random.default_rng(2)
  hidden = rng.standard_normal((2, seq, HIDDEN)).astype(np.float32)
  ones = np.ones((2, seq), np.int32)
  ctx, (q, k, v, pk, pq) = _hf_and_inputs(model, 0, hidden, ones)
  kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL,
            pos_att_type=pos_att_type)
  out = disentangled_attention_reference(q, k, v, pk, pq, **kw)
  np.testing.assert_allclose(np.asarray(out), ctx, rtol=RTOL, atol=ATOL)
  rel = build_relative_position(seq, seq, BUCKETS, MAX_REL)
  out2 = disentangled_attention_reference(q, k, v, pk, pq, relative_pos=rel,
                                          **kw)
  np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))


@pytest.mark.parametrize("pos_att_type", [("c2p", "p2c"), ("p2c",)])
def test_matches_hf_asymmetric_relative_pos(pos_att_type):
  # A non-antisymmetric relative_pos separates HF's p2c index
  # clip(-rel[j, i] + span) from the naive clip(-rel[i, j] + span).
  model = _model(pos_att_type, False, seed=4)
  seq = 12
  rng = np.random.default_rng(5)
  rel = rng.integers(-2 * BUCKETS - 3, 2 * BUCKETS + 3, (1, seq, seq))
  hidden = rng.standard_normal((2, seq, HIDDEN)).astype(np.float32)
  mask = _ragged_mask([seq, 9], seq)
  attn = model.encoder.layer[0].attention.self
  with torch.no_grad():
    ctx, _ = attn(torch.from_numpy(hidden),
                  model.encoder.get_attention_mask(torch.from_numpy(mask)),
                  relative_pos=torch.from_numpy(rel),
                  rel_embeddings=model.encoder.get_rel_embedding())
  ctx = ctx.numpy().reshape(2, seq, HEADS, HEAD_DIM)
  _, (q, k, v, pk, pq) = _hf_and_inputs(model, 0, hidden, mask)
  kw = dict(attention_mask=mask, position_buckets=BUCKETS,
            max_relative_positions=MAX_REL, pos_att_type=pos_att_type)
  out = np.asarray(disentangled_attention_reference(
      q, k, v, pk, pq, relative_pos=rel, **kw))
  valid = mask.astype(bool)
  np.testing.assert_allclose(out[valid], ctx[valid], rtol=RTOL, atol=ATOL)
  naive = np.asarray(disentangled_attention_reference(
      q, k, v, pk, pq, relative_pos=-np.swapaxes(rel, -1, -2), **kw))
  assert not np.allclose(naive[valid], ctx[valid], rtol=1e-3, atol=1e-3)


def test_matches_hf_unbucketed():
  # position_buckets <= 0: att_span = max_relative_positions, no log buckets.
  pos_att_type = ("c2p", "p2c")
  model = _model(pos_att_type, True, position_buckets=-1,
                 max_relative_positions=6, seed=6)
  seq = 15  # |i - j| up to 14 > 6: clamping only
  rng = np.random.default_rng(7)
  hidden = rng.standard_normal((2, seq, HIDDEN)).astype(np.float32)
  mask = _ragged_mask([15, 4], seq)
  ctx, (q, k, v, pk, pq) = _hf_and_inputs(model, 1, hidden, mask)
  out = np.asarray(disentangled_attention_reference(
      q, k, v, pk, pq, attention_mask=mask, position_buckets=-1,
      max_relative_positions=6, pos_att_type=pos_att_type))
  valid = mask.astype(bool)
  np.testing.assert_allclose(out[valid], ctx[valid], rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------
# Packed varlen and gradients.


def _random_inputs(rng, b, s, h, d, span, dtype=np.float32):
  q, k, v = (rng.standard_normal((b, s, h, d)).astype(dtype) for _ in range(3))
  pk, pq = (rng.standard_normal((2 * span, h, d)).astype(dtype)
            for _ in range(2))
  return q, k, v, pk, pq


def test_varlen_matches_padded():
  rng = np.random.default_rng(8)
  lengths = [5, 17, 1, 11]
  seq, h, d = max(lengths), 2, 8
  q, k, v, pk, pq = _random_inputs(rng, len(lengths), seq, h, d, BUCKETS)
  mask = _ragged_mask(lengths, seq)
  kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)
  out, lse = disentangled_attention_reference(
      q, k, v, pk, pq, attention_mask=mask, return_lse=True, **kw)

  valid = mask.astype(bool)
  tail = 3  # tokens past cu_seqlens[-1]: fully masked
  pack = lambda x: np.concatenate(
      [x[valid], rng.standard_normal((tail,) + x.shape[2:]).astype(x.dtype)])
  qp, kp, vp = pack(q), pack(k), pack(v)
  cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)

  out_p, lse_p = disentangled_attention_reference(
      qp, kp, vp, pk, pq, cu_seqlens=cu, return_lse=True, **kw)
  assert out_p.shape == qp.shape and lse_p.shape == (h, qp.shape[0])
  n = int(cu[-1])
  np.testing.assert_allclose(np.asarray(out_p)[:n], np.asarray(out)[valid],
                             rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lse_p)[:, :n],
                             np.asarray(lse).transpose(0, 2, 1)[valid].T,
                             rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(out_p)[n:] == 0.0)
  assert np.all(np.isneginf(np.asarray(lse_p)[:, n:]))
  assert np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[~valid]))

  # [1, total, h, d] layout, under jit (traced cu_seqlens).
  f = jax.jit(lambda *a: disentangled_attention_reference(
      *a[:5], cu_seqlens=a[5], **kw))
  out_4d = f(qp[None], kp[None], vp[None], pk, pq, cu)
  np.testing.assert_allclose(np.asarray(out_4d)[0], np.asarray(out_p),
                             rtol=1e-6, atol=1e-6)


def test_half_precision_inputs_compute_in_float32():
  rng = np.random.default_rng(9)
  q, k, v, pk, pq = _random_inputs(rng, 1, 6, 2, 8, BUCKETS)
  kw = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)
  bf = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, pk, pq)]
  out = disentangled_attention_reference(*bf, **kw)
  assert out.dtype == jnp.float32
  ref = disentangled_attention_reference(
      *[np.asarray(x.astype(jnp.float32)) for x in bf], **kw)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


def test_missing_position_projection_raises():
  rng = np.random.default_rng(10)
  q, k, v, pk, _ = _random_inputs(rng, 1, 4, 2, 8, BUCKETS)
  with pytest.raises(ValueError):
    disentangled_attention_reference(q, k, v, pk, None,
                                     position_buckets=BUCKETS,
                                     max_relative_positions=MAX_REL)
  disentangled_attention_reference(q, k, v, pk, None, pos_att_type=("c2p",),
                                   position_buckets=BUCKETS,
                                   max_relative_positions=MAX_REL)


def test_gradients():
  buckets, max_rel = 4, 8  # span 4, seq 7 > mid 2: log buckets + clamping
  mask = _ragged_mask([7, 3, 0], 7)

  def f(q, k, v, pk, pq):
    return disentangled_attention_reference(
        q, k, v, pk, pq, attention_mask=mask, position_buckets=buckets,
        max_relative_positions=max_rel)

  with jax.enable_x64(True):
    rng = np.random.default_rng(11)
    args = _random_inputs(rng, 3, 7, 2, 4, buckets, dtype=np.float64)
    args = tuple(jnp.asarray(a) for a in args)
    assert f(*args).dtype == jnp.float64
    check_grads(f, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6,
                eps=1e-6)
    # Fully masked rows/keys: zero output, zero gradient, never NaN.
    g = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2, 3, 4))(
        *args)
    for gi in g:
      assert np.all(np.isfinite(np.asarray(gi)))
    valid = mask.astype(bool)
    for gi in g[:3]:
      assert np.all(np.asarray(gi)[~valid] == 0.0)
