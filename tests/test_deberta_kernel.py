"""Disentangled-attention kernels (interpret mode on CPU) vs the float32
reference: forward, all gradients, masks, packing, dropout, determinism, and
Triton lowering for an H200 without a GPU.

Shapes are tiny and the interpret tiles are 16 x 16, so every test crosses
the kernels' three key-tile ranges (saturated-high, band, saturated-low) and
the partial last tile. Position config 8 buckets / 16 positions: att_span 8,
saturation at i - j >= 10 and i - j <= -16.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api.deberta import disentangled_attention
from pallas_kernels.deberta import dropout_hash
from pallas_kernels.deberta.layout import geometry
from pallas_kernels.deberta.reference import (
    disentangled_attention_dropout_reference)
from pallas_kernels.reference.deberta import disentangled_attention_reference

BUCKETS, MAX_REL = 8, 16
POS = dict(position_buckets=BUCKETS, max_relative_positions=MAX_REL)
# float32: the kernels and the reference differ in summation order only;
# observed errors are ~1e-6 on O(1) outputs and gradients.
ATOL_F32 = 2e-5
RTOL_F32 = 2e-5
SPLIT_ENV = "FOLDAX_DEBERTA_SPLIT_TILES"


def _inputs(seed, shape, n_pos, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 6)
  *_, h, d = shape
  q, k, v, do = (jax.random.normal(ks[i], shape, jnp.float32) for i in
                 range(4))
  pk, pq = (jax.random.normal(ks[4 + i], (n_pos, h, d), jnp.float32) for i in
            range(2))
  cast = lambda x: x.astype(dtype)
  return tuple(map(cast, (q, k, v, pk, pq))), do


def _ragged(lengths, seq):
  return (np.arange(seq)[None, :] < np.asarray(lengths)[:, None]).astype(
      np.int32)


@functools.lru_cache(maxsize=None)
def _vg(fn_key):
  """jit(value_and_grad) of sum(f(...) * w), cached per configuration."""
  kind, kw, _ = fn_key
  kw = dict(kw)

  def f(q, k, v, pk, pq, w, extra):
    if kind in ("interpret", "xla"):
      out = disentangled_attention(q, k, v, pk, pq, backend=kind, **extra,
                                   **kw)
    elif kind == "ref":
      out = disentangled_attention_reference(q, k, v, pk, pq, **extra, **kw)
    else:
      out = disentangled_attention_dropout_reference(q, k, v, pk, pq,
                                                     **extra, **kw)
    return jnp.sum(out.astype(jnp.float32) * w), out

  return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))


def _run(kind, q, k, v, pk, pq, w, extra=None, split=False, **kw):
  """Output and the five gradients. split=True runs the kernels' GPU tile
  split (unmasked loads on full tiles) in interpret mode too."""
  fn = _vg((kind, tuple(sorted(kw.items())), split))
  old = os.environ.get(SPLIT_ENV)
  os.environ[SPLIT_ENV] = "1" if split else "0"
  try:
    (_, out), grads = fn(q, k, v, pk, pq, w, extra or {})
  finally:
    if old is None:
      del os.environ[SPLIT_ENV]
    else:
      os.environ[SPLIT_ENV] = old
  return out, grads


def _assert_close(got, want, valid_rows=None, atol=ATOL_F32, rtol=RTOL_F32,
                  what=""):
  got = np.asarray(got, np.float32)
  want = np.asarray(want, np.float32)
  if valid_rows is not None:
    got, want = got[valid_rows], want[valid_rows]
  np.testing.assert_allclose(got, want, atol=atol, rtol=rtol, err_msg=what)


def _check_all(out, grads, r_out, r_grads, valid=None, **tol):
  _assert_close(out, r_out, valid, what="out", **tol)
  for name, g, rg in zip(NAMES, grads, r_grads):
    assert g.shape == rg.shape, name
    if tol:
      scale = max(1.0, float(np.abs(np.asarray(rg, np.float32)).max()))
      _assert_close(g, rg, atol=tol["atol"] * scale, rtol=tol["rtol"],
                    what=name)
    else:
      _assert_close(g, rg, what=name)


NAMES = ("dq", "dk", "dv", "dpos_key", "dpos_query")
BOTH = ("c2p", "p2c")

# The ragged batch most tests share (one compile): full, partial and fully
# padded rows; 45 = 2 full 16-tiles + a partial one.
RAGGED = (3, 45, 2, 16)
RAGGED_LENGTHS = [45, 29, 0]


def _ragged_case():
  b, s, h, d = RAGGED
  (q, k, v, pk, pq), do = _inputs(1, RAGGED, 2 * BUCKETS + 3)
  mask = _ragged(RAGGED_LENGTHS, s)
  w = do * mask[:, :, None, None]  # the loss ignores padded rows
  return (q, k, v, pk, pq), w, mask


def test_ragged_padded_matches_reference_and_is_repeatable():
  (q, k, v, pk, pq), w, mask = _ragged_case()
  valid = mask.astype(bool)
  extra = {"attention_mask": mask}
  kw = dict(pos_att_type=BOTH, **POS)
  out, grads = _run("interpret", q, k, v, pk, pq, w, extra, **kw)
  r_out, r_grads = _run("ref", q, k, v, pk, pq, w, extra, **kw)
  assert out.shape == q.shape and out.dtype == q.dtype
  _check_all(out, grads, r_out, r_grads, valid)
  # Padded rows (including the fully padded sequence) output exact zeros
  # (HF averages v there; only visible rows are comparable).
  assert np.all(np.asarray(out)[~valid] == 0.0)
  for g in grads[:3]:
    assert np.all(np.asarray(g)[2] == 0.0)
  # Rows past 2*att_span of the position inputs get zero gradient.
  assert not np.any(np.asarray(grads[3])[2 * BUCKETS:])
  # Bitwise repeatable.
  out2, grads2 = _run("interpret", q, k, v, pk, pq, w, extra, **kw)
  np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
  for a, c in zip(grads, grads2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.parametrize("split", [False, True])
def test_used_lengths_skip_padding_with_the_same_bits(split):
  """The padded API's forward passes each right-padded row's valid length
  (`seq_lens`): the kernel skips the padding tiles, writes those rows as
  0 / +inf and does not read their token mask. Same bits as the token mask
  alone; rows that are not right-padded (left padding, a hole) keep their
  whole slot and their mask (MASKED_ROW)."""
  from pallas_kernels.deberta.core import used_lengths as _used_lengths
  from pallas_kernels.deberta.config import KernelConfig, blocks_for
  from pallas_kernels.deberta.forward import disentangled_forward
  b, s, h, d = 5, 45, 2, 16
  (q, k, v, pk, pq), _ = _inputs(3, (b, s, h, d), 2 * BUCKETS + 3)
  mask = _ragged([45, 29, 0, 16, 45], s)
  mask[3] = mask[3][::-1]          # left-padded
  mask[4, 20] = 0                  # a hole
  tm = jnp.asarray(mask.reshape(-1))
  cu = jnp.arange(b + 1, dtype=jnp.int32) * s
  lens = _used_lengths(tm, cu, s)
  np.testing.assert_array_equal(np.asarray(lens), [45, 29, 0, -1, -1])
  g = geometry(BUCKETS, MAX_REL)
  cfg = KernelConfig(g, True, True, True, 0.0, d, split)
  blocks = blocks_for(head_dim=d, dtype=q.dtype, interpret=True)
  flat = [x.reshape(b * s, h, d) for x in (q, k, v)]
  c = jnp.einsum("thd,phd->thp", flat[0], pk[: 2 * g.span])
  p = jnp.einsum("thd,phd->thp", flat[1], pq[: 2 * g.span])
  fwd = functools.partial(disentangled_forward, cfg=cfg, blocks=blocks.fwd,
                          max_seqlen=s, interpret=True)
  # Interpret mode fills unwritten outputs with NaN: every row of every
  # slot must be written.
  o1, l1 = jax.jit(fwd)(*flat, c, p, cu, tm, None, None)
  o2, l2 = jax.jit(fwd)(*flat, c, p, cu, tm, None, lens)
  assert not np.any(np.isnan(np.asarray(o2))), "unwritten rows"
  np.testing.assert_array_equal(np.asarray(o2), np.asarray(o1))
  np.testing.assert_array_equal(np.asarray(l2), np.asarray(l1))
  valid = mask.reshape(-1).astype(bool)
  assert np.all(np.asarray(o2)[~valid] == 0)
  assert np.all(np.isinf(np.asarray(l2)[:, ~valid]))
  # The backward likewise: the same bits with seq_lens as without, and
  # every gradient row written (zeros on the padding).
  from pallas_kernels.deberta.backward import disentangled_backward
  do = jax.random.normal(jax.random.key(7), flat[0].shape, q.dtype)
  bwd = jax.jit(functools.partial(disentangled_backward, cfg=cfg,
                                  blocks=blocks, max_seqlen=s,
                                  interpret=True))
  g1 = bwd(*flat, pk, pq, c, p, o1, l1, do, cu, tm, None, None)
  g2 = bwd(*flat, pk, pq, c, p, o1, l1, do, cu, tm, None, lens)
  for name, a, e in zip(NAMES, g2, g1):
    assert not np.any(np.isnan(np.asarray(a))), f"unwritten rows of {name}"
    np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
  for a in g2[:3]:
    assert np.all(np.asarray(a)[~valid] == 0)
  # And the public API (which passes seq_lens) matches the reference there.
  r = disentangled_attention_reference(q, k, v, pk, pq, attention_mask=mask,
                                       pos_att_type=BOTH, **POS)
  out = disentangled_attention(q, k, v, pk, pq, attention_mask=mask,
                               pos_att_type=BOTH, backend="interpret", **POS)
  _assert_close(out, r, mask.astype(bool))


def _pack(x, lengths):
  return jnp.concatenate([x[i, :n] for i, n in enumerate(lengths)])


def test_packed_matches_reference_padded_and_alone_bitwise():
  (q, k, v, pk, pq), w, mask = _ragged_case()
  valid = mask.astype(bool)
  lengths = RAGGED_LENGTHS
  kw = dict(pos_att_type=BOTH, **POS)
  tail = 5  # tokens past cu_seqlens[-1]: they belong to no sequence
  t = sum(lengths) + tail
  pad_tail = lambda x: jnp.concatenate(
      [x, jnp.ones((t - x.shape[0],) + x.shape[1:], x.dtype)])
  packed = [pad_tail(_pack(x, lengths)) for x in (q, k, v, w)]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  extra = {"cu_seqlens": cu}
  # split=True: the GPU's unmasked full tiles, here in interpret mode.
  out_p, grads_p = _run("interpret", *packed[:3], pk, pq, packed[3], extra,
                        split=True, max_seqlen=45, **kw)
  r_out, r_grads = _run("ref", *packed[:3], pk, pq, packed[3],
                        {"cu_seqlens": cu}, **kw)
  _check_all(out_p, grads_p, r_out, r_grads)
  assert np.all(np.asarray(out_p)[-tail:] == 0)
  for g in grads_p[:3]:
    assert np.all(np.asarray(g)[-tail:] == 0)

  # Padded form (token mask, no tile split): the same bits on real tokens.
  out, grads = _run("interpret", q, k, v, pk, pq, w,
                    {"attention_mask": mask}, **kw)
  n = sum(lengths)
  np.testing.assert_array_equal(np.asarray(out)[valid],
                                np.asarray(out_p)[:n])
  for name, a, a_p in zip(NAMES[:3], grads[:3], grads_p[:3]):
    np.testing.assert_array_equal(np.asarray(a)[valid],
                                  np.asarray(a_p)[:n], err_msg=name)
  # Position gradients sum over the batch: equal up to summation order.
  for a, a_p in zip(grads[3:], grads_p[3:]):
    _assert_close(a, a_p, atol=1e-5)

  # Sequence 1 alone (same array shapes, so the same compiled kernels).
  n1 = lengths[1]
  alone = [pad_tail(x[1, :n1]) for x in (q, k, v, w)]
  cu1 = jnp.asarray([0, n1, n1, n1], jnp.int32)
  out_a, grads_a = _run("interpret", *alone[:3], pk, pq, alone[3],
                        {"cu_seqlens": cu1}, split=True, max_seqlen=45,
                        **kw)
  off = lengths[0]
  np.testing.assert_array_equal(np.asarray(out_a)[:n1],
                                np.asarray(out_p)[off:off + n1])
  for a, c in zip(grads_a[:3], grads_p[:3]):
    np.testing.assert_array_equal(np.asarray(a)[:n1],
                                  np.asarray(c)[off:off + n1])


@pytest.mark.parametrize("shape,lengths,types", [
    ((2, 70, 2, 16), [70, 17], ("c2p",)),
    ((1, 70, 1, 32), None, ("p2c",)),
])
def test_single_position_term_matches_reference(shape, lengths, types):
  b, s, h, d = shape
  (q, k, v, pk, pq), do = _inputs(s + d, shape, 2 * BUCKETS)
  mask = None if lengths is None else _ragged(lengths, s)
  valid = np.ones((b, s), bool) if mask is None else mask.astype(bool)
  w = do * valid[:, :, None, None]
  extra = {} if mask is None else {"attention_mask": mask}
  kw = dict(pos_att_type=types, **POS)
  out, grads = _run("interpret", q, k, v, pk, pq, w, extra, **kw)
  r_out, r_grads = _run("ref", q, k, v, pk, pq, w, extra, **kw)
  _check_all(out, grads, r_out, r_grads, valid)
  unused = 3 if "c2p" not in types else 4
  assert not np.any(np.asarray(grads[unused]))


@pytest.mark.slow
def test_no_position_terms():
  # pos_att_type=(): plain attention with HF's 1/sqrt(head_dim) scale.
  (q, k, v, _, _), do = _inputs(17, (2, 30, 1, 16), 16)
  mask = _ragged([30, 11], 30)
  w = do * mask[:, :, None, None]
  kw = dict(pos_att_type=(), **POS)
  extra = {"attention_mask": mask}
  out, grads = _run("interpret", q, k, v, None, None, w, extra, **kw)
  r_out, r_grads = _run("ref", q, k, v, None, None, w, extra, **kw)
  _assert_close(out, r_out, mask.astype(bool))
  for name, a, r in zip(NAMES[:3], grads[:3], r_grads[:3]):
    _assert_close(a, r, what=name)


def test_no_log_buckets_geometry():
  # position_buckets <= 0: relative positions are only clamped (span 12).
  (q, k, v, pk, pq), do = _inputs(7, (1, 40, 1, 16), 24)
  kw = dict(position_buckets=-1, max_relative_positions=12, pos_att_type=BOTH)
  g = geometry(-1, 12)
  assert (g.span, g.r_pos, g.r_neg) == (12, 11, 12)
  out, grads = _run("interpret", q, k, v, pk, pq, do, **kw)
  r_out, r_grads = _run("ref", q, k, v, pk, pq, do, **kw)
  _check_all(out, grads, r_out, r_grads)


def test_dropout_same_mask_forward_and_backward():
  b, s, h, d = 2, 40, 2, 16
  rate = 0.25
  (q, k, v, pk, pq), do = _inputs(5, (b, s, h, d), 2 * BUCKETS)
  mask = _ragged([40, 26], s)
  valid = mask.astype(bool)
  w = do * valid[:, :, None, None]
  rng = jax.random.key(42)
  kw = dict(pos_att_type=BOTH, **POS)
  extra = {"attention_mask": mask, "dropout_rng": rng}
  out, grads = _run("interpret", q, k, v, pk, pq, w, extra,
                    dropout_rate=rate, **kw)
  keep = dropout_hash.keep_mask_padded(dropout_hash.seed_from_rng(rng), h, b, s, rate)
  frac = float(jnp.mean(keep))
  assert abs(frac - (1 - rate)) < 0.03, frac
  # Reference with the same explicit mask: forward and all gradients agree,
  # so the backward regenerated the forward's mask.
  r_out, r_grads = _run("dropref", q, k, v, pk, pq, w,
                        {"attention_mask": mask, "keep": keep},
                        dropout_rate=rate, **kw)
  _check_all(out, grads, r_out, r_grads, valid)
  # Dropout-free reference is far: the mask matters.
  plain = disentangled_attention_reference(q, k, v, pk, pq,
                                           attention_mask=mask, **kw)
  assert np.abs(np.asarray(plain - r_out)[valid]).max() > 0.1
  # The XLA backend draws the same mask.
  x_out, x_grads = _run("xla", q, k, v, pk, pq, w, extra, dropout_rate=rate,
                        **kw)
  _check_all(x_out, x_grads, r_out, r_grads, valid)
  # Another seed gives another mask.
  out_b, _ = _run("interpret", q, k, v, pk, pq, w,
                  {"attention_mask": mask, "dropout_rng": jax.random.key(43)},
                  dropout_rate=rate, **kw)
  assert not np.allclose(np.asarray(out_b), np.asarray(out))


def test_dropout_reference_without_dropout_is_the_reference():
  (q, k, v, pk, pq), w, mask = _ragged_case()
  kw = dict(pos_att_type=BOTH, attention_mask=mask, **POS)
  a = disentangled_attention_dropout_reference(q, k, v, pk, pq, **kw)
  b_ = disentangled_attention_reference(q, k, v, pk, pq, **kw)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b_), atol=1e-6)


def test_xla_backend_matches_reference():
  (q, k, v, pk, pq), w, mask = _ragged_case()
  kw = dict(pos_att_type=BOTH, **POS)
  extra = {"attention_mask": mask}
  out, grads = _run("xla", q, k, v, pk, pq, w, extra, **kw)
  r_out, r_grads = _run("ref", q, k, v, pk, pq, w, extra, **kw)
  _check_all(out, grads, r_out, r_grads, mask.astype(bool))


def test_bfloat16_close_to_float32_reference():
  b, s, h, d = 2, 37, 1, 32
  dtype = jnp.bfloat16
  (q, k, v, pk, pq), do = _inputs(9, (b, s, h, d), 2 * BUCKETS, dtype)
  mask = _ragged([37, 20], s)
  valid = mask.astype(bool)
  w = do * valid[:, :, None, None]
  kw = dict(pos_att_type=BOTH, **POS)
  extra = {"attention_mask": mask}
  out, grads = _run("interpret", q, k, v, pk, pq, w, extra, **kw)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  f32 = lambda x: x.astype(jnp.float32)
  r_out, r_grads = _run("ref", *map(f32, (q, k, v, pk, pq)), w, extra, **kw)
  # bf16 inputs, bf16 P and dS before the products, bf16 position tables:
  # a few bf16 ulps (2^-8) of the largest values.
  _check_all(out, grads, r_out, r_grads, valid, atol=4e-2, rtol=4e-2)


def test_standard_buckets_long_sequence():
  # DeBERTa-v3's 256 buckets / 512 positions: saturation at i - j >= 506
  # and <= -512 needs sequences past 512.
  b, s, h, d = 2, 600, 1, 32
  (q, k, v, pk, pq), do = _inputs(13, (b, s, h, d), 512)
  mask = _ragged([600, 555], s)
  valid = mask.astype(bool)
  w = do * valid[:, :, None, None]
  kw = dict(pos_att_type=BOTH, position_buckets=256,
            max_relative_positions=512)
  extra = {"attention_mask": mask}
  out, grads = _run("interpret", q, k, v, pk, pq, w, extra, **kw)
  r_out, r_grads = _run("ref", q, k, v, pk, pq, w, extra, **kw)
  _check_all(out, grads, r_out, r_grads, valid)


# ---------------------------------------------------------------------------
# Validation (no kernels run).


def test_validation_errors():
  (q, k, v, pk, pq), _ = _inputs(0, (1, 8, 1, 16), 2 * BUCKETS)
  call = functools.partial(disentangled_attention, backend="interpret", **POS)
  with pytest.raises(ValueError, match="pos_key"):
    call(q, k, v, pk[:5], pq)
  with pytest.raises(ValueError, match="pos_att_type"):
    call(q, k, v, pk, pq, pos_att_type=("c2p", "x"))
  with pytest.raises(ValueError, match="dropout_rng"):
    call(q, k, v, pk, pq, dropout_rate=0.1)
  with pytest.raises(ValueError, match="dropout_rate"):
    call(q, k, v, pk, pq, dropout_rate=1.0, dropout_rng=jax.random.key(0))
  with pytest.raises(ValueError, match="attention_mask"):
    call(q, k, v, pk, pq, attention_mask=np.ones((1, 7), np.int32))
  with pytest.raises(ValueError, match="exclusive"):
    call(q[0], k[0], v[0], pk, pq, cu_seqlens=jnp.array([0, 8], jnp.int32),
         attention_mask=np.ones((1, 8), np.int32))
  with pytest.raises(ValueError, match="max_relative_positions"):
    disentangled_attention(q, k, v, pk, pq, position_buckets=8,
                           max_relative_positions=0)
  with pytest.raises(TypeError):
    call(q, k.astype(jnp.bfloat16), v, pk, pq)
  with pytest.raises(ValueError, match="self-attention"):
    call(q, k[:, :4], v[:, :4], pk, pq)


def test_geometry_standard_config():
  g = geometry(256, 512)
  assert (g.span, g.r_pos, g.r_neg, g.width) == (256, 506, 512, 1019)
  t = g.slot_table()
  assert t[0] == 0 and t[-1] == 511 and t[g.r_neg] == 256
  assert np.all(np.diff(t) >= 0)


# ---------------------------------------------------------------------------
# Triton lowering on CPU (no GPU): the kernels lower for an H200.


@pytest.mark.parametrize("dtype,head_dim,types,masked,rate", [
    (jnp.bfloat16, 64, ("c2p", "p2c"), True, 0.1),
    (jnp.float16, 128, ("c2p",), False, 0.0),
    (jnp.float32, 32, ("p2c",), True, 0.0),
])
def test_triton_lowering(fake_h200, dtype, head_dim, types, masked, rate):
  from pallas_kernels.deberta.backward import disentangled_backward
  from pallas_kernels.deberta.config import KernelConfig, blocks_for
  from pallas_kernels.deberta.forward import (disentangled_forward,
                                              position_table)
  g = geometry(256, 512)
  cfg = KernelConfig(g, "c2p" in types, "p2c" in types, masked, rate,
                     head_dim)
  blocks = blocks_for(head_dim=head_dim, dtype=dtype, interpret=False,
                      compute_capability=(9, 0))
  t, h = 1024, 4
  sds = jax.ShapeDtypeStruct
  tok = sds((t, h, head_dim), dtype)
  tab = sds((t, h, 2 * g.span), dtype)
  pos = sds((2 * g.span, h, head_dim), dtype)
  cu = sds((3,), jnp.int32)
  tm = sds((t,), jnp.int32) if masked else None
  seed = sds((), jnp.uint32) if rate else None
  fwd = functools.partial(disentangled_forward, cfg=cfg, blocks=blocks.fwd,
                          max_seqlen=512, interpret=False)
  lowered = jax.jit(fwd).trace(tok, tok, tok, tab, tab, cu, tm, seed).lower(
      lowering_platforms=("cuda",))
  assert "fold_deberta_forward" in lowered.as_text()
  table = functools.partial(position_table, blocks=blocks.table,
                            interpret=False)
  lowered = jax.jit(table).trace(tok, pos).lower(lowering_platforms=("cuda",))
  assert "fold_deberta_position_table" in lowered.as_text()
  bwd = functools.partial(disentangled_backward, cfg=cfg, blocks=blocks,
                          max_seqlen=512, interpret=False)
  bwd_args = (tok, tok, tok, pos, pos, tab, tab, tok,
              sds((h, t), jnp.float32), tok, cu, tm, seed)
  lowered = jax.jit(bwd).trace(*bwd_args).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  for name in ("fold_deberta_backward_dkdv", "fold_deberta_backward_dq",
               "fold_deberta_band_product"):
    assert name in text
  # No signed min/max on i1 (see triton_ir.signed_i1_minmax).
  from pallas_kernels import triton_ir
  for fn, args in ((fwd, (tok, tok, tok, tab, tab, cu, tm, seed)),
                   (bwd, bwd_args)):
    for name, ttir, _ in triton_ir.capture_triton_ir(jax.jit(fn), args):
      assert not triton_ir.signed_i1_minmax(ttir), name


# ---------------------------------------------------------------------------
# GPU (the lead's H200 run): the real Triton kernels.


def _has_gpu():
  try:
    return jax.devices()[0].platform == "gpu"
  except RuntimeError:
    return False


gpu = pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,atol", [(jnp.float32, 2e-4),
                                        (jnp.bfloat16, 6e-2),
                                        (jnp.float16, 1e-2)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_gpu_pallas_matches_reference(dtype, atol, head_dim):
  b, s, h = 2, 700, 2
  (q, k, v, pk, pq), do = _inputs(head_dim, (b, s, h, head_dim), 512, dtype)
  mask = _ragged([700, 333], s)
  valid = mask.astype(bool)
  w = do * valid[:, :, None, None]
  kw = dict(pos_att_type=("c2p", "p2c"), position_buckets=256,
            max_relative_positions=512)

  def loss(fn, *args):
    out = fn(*args, attention_mask=mask, **kw)
    return jnp.sum(out.astype(jnp.float32) * w), out

  ker = lambda *a, **k: disentangled_attention(*a, backend="pallas", **k)
  (_, out), grads = jax.jit(jax.value_and_grad(
      functools.partial(loss, ker), argnums=(0, 1, 2, 3, 4), has_aux=True))(
          q, k, v, pk, pq)
  f32 = lambda x: x.astype(jnp.float32)
  (_, r_out), r_grads = jax.jit(jax.value_and_grad(
      functools.partial(loss, disentangled_attention_reference),
      argnums=(0, 1, 2, 3, 4), has_aux=True))(*map(f32, (q, k, v, pk, pq)))
  _assert_close(out, r_out, valid, atol=atol, rtol=atol)
  for name, a, r in zip(NAMES, grads, r_grads):
    scale = float(np.abs(np.asarray(r)).max())
    _assert_close(a, r, atol=atol * max(1.0, scale), rtol=atol, what=name)
  # Bitwise repeatable.
  (_, out2), grads2 = jax.jit(jax.value_and_grad(
      functools.partial(loss, ker), argnums=(0, 1, 2, 3, 4), has_aux=True))(
          q, k, v, pk, pq)
  np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
  for a, c in zip(grads, grads2):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


@pytest.mark.gpu
@gpu
def test_gpu_pallas_packed_equals_padded_bitwise():
  lengths = [700, 333, 1200]
  b, s, h, d = 3, 1200, 4, 64
  (q, k, v, pk, pq), do = _inputs(1, (b, s, h, d), 512, jnp.bfloat16)
  mask = _ragged(lengths, s)
  valid = mask.astype(bool)
  kw = dict(position_buckets=256, max_relative_positions=512,
            backend="pallas", dropout_rate=0.1,
            dropout_rng=jax.random.key(0))
  w = (do * valid[:, :, None, None]).astype(jnp.float32)

  def loss_pad(q, k, v, pk, pq):
    o = disentangled_attention(q, k, v, pk, pq, attention_mask=mask, **kw)
    return jnp.sum(o.astype(jnp.float32) * w), o

  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
  wp = _pack(w, lengths)

  def loss_pack(q, k, v, pk, pq):
    o = disentangled_attention(q, k, v, pk, pq, cu_seqlens=cu,
                               max_seqlen=max(lengths), **kw)
    return jnp.sum(o.astype(jnp.float32) * wp), o

  vg = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2),
                                            has_aux=True))
  (_, o1), g1 = vg(loss_pad)(q, k, v, pk, pq)
  (_, o2), g2 = vg(loss_pack)(*(_pack(x, lengths) for x in (q, k, v)), pk, pq)
  np.testing.assert_array_equal(np.asarray(o1)[valid], np.asarray(o2))
  for a, c in zip(g1, g2):
    np.testing.assert_array_equal(np.asarray(a)[valid], np.asarray(c))


def test_blocks_follow_the_compiler(monkeypatch):
  """pip Triton (the torch bridge's direct launch, inside
  compiled_by("triton")) gets its own forward tiles; XLA's path keeps the
  table's, whatever FOLDAX_KERNEL_COMPILER says (DeBERTa's JAX path is
  always compiled by XLA)."""
  from pallas_kernels.deberta.config import blocks_for
  from pallas_kernels.flash.config import BlockSizes, compiled_by
  monkeypatch.delenv("FOLDAX_DEBERTA_BLOCKS", raising=False)
  kw = dict(dtype=jnp.float16, interpret=False, compute_capability=(9, 0))
  xla = blocks_for(head_dim=64, **kw)
  xla_128 = blocks_for(head_dim=128, **kw)
  assert xla.fwd == BlockSizes(64, 128, 4, 2)
  with compiled_by("triton"):
    pip = blocks_for(head_dim=64, **kw)
    # Measured at head_dim 64 only: larger heads keep XLA's rule.
    assert blocks_for(head_dim=128, **kw).fwd == xla_128.fwd
  assert pip.fwd == BlockSizes(64, 64, 4, 2)
  assert pip.table == xla.table and pip.bwd_kv == xla.bwd_kv
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "triton")
  assert blocks_for(head_dim=64, **kw).fwd == xla.fwd


def test_gather_orientations_give_the_same_bits(monkeypatch):
  """KernelConfig.gather (`config.gather_orientation`) only changes how the
  band tiles read the second table (directly, or transposed through shared
  memory): forward and every gradient have the same bits either way, and
  match the reference."""
  b, s, h, d = 2, 37, 2, 16
  (q, k, v, pk, pq), _ = _inputs(5, (b, s, h, d), 2 * BUCKETS + 3)
  mask = _ragged([37, 22], s)
  dout = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)

  def run():
    def loss(q, k, v, pk, pq):
      o = disentangled_attention(q, k, v, pk, pq, attention_mask=mask,
                                 pos_att_type=BOTH, backend="interpret",
                                 **POS)
      return jnp.sum(o * dout), o
    (_, o), g = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4),
                                   has_aux=True)(q, k, v, pk, pq)
    return [np.asarray(x) for x in (o, *g)]

  got = {}
  for mode in ("direct", "transposed"):
    monkeypatch.setenv("FOLDAX_DEBERTA_GATHER", mode)
    got[mode] = run()
  for a, c in zip(got["direct"], got["transposed"]):
    np.testing.assert_array_equal(a, c)
  r = disentangled_attention_reference(q, k, v, pk, pq, attention_mask=mask,
                                       pos_att_type=BOTH, **POS)
  _assert_close(got["direct"][0], r, mask.astype(bool))
  monkeypatch.setenv("FOLDAX_DEBERTA_GATHER", "sideways")
  with pytest.raises(ValueError, match="FOLDAX_DEBERTA_GATHER"):
    run()
