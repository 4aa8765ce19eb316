"""torch_bridge: the custom ops against torch's SDPA and a float64 torch
reference (outputs, LSE and every gradient), gradcheck in float64, the custom
op machinery (opcheck, torch.compile), the Pallas glue through the
interpreted kernel, DLPack zero-copy and the allocator setting. CPU runs the
XLA path; the `gpu` tests are for an NVIDIA GPU of compute capability 8.0+.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.nn.functional as F

import torch_bridge as tb
from torch_bridge import _runtime as rt

torch.manual_seed(0)
HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (
    8, 0)


# ----------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------

def _visible(sq, sk, causal, window, q_seg=None, k_seg=None, b=1):
  """bool [b, 1, sq, sk], bottom-right aligned (the package's convention)."""
  left, right = window
  if causal:
    right = 0 if right < 0 else min(right, 0)
  i = torch.arange(sq)[:, None]
  j = torch.arange(sk)[None, :]
  off = sk - sq
  vis = torch.ones(sq, sk, dtype=torch.bool)
  if right >= 0:
    vis &= j <= i + off + right
  if left >= 0:
    vis &= j >= i + off - left
  vis = vis[None, None].expand(b, 1, sq, sk)
  if q_seg is not None:
    same = (q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0)
    vis = vis & same[:, None]
  return vis


def ref_attention(q, k, v, *, causal=False, window=(-1, -1), scale=None,
                  softcap=0.0, sinks=None, q_seg=None, k_seg=None):
  """Float64 torch reference in [b, s, h, d]; returns (out, lse [b, h, sq]).
  A fully masked row gives 0 and lse -inf (or the sink)."""
  q64, k64, v64 = (x.double() for x in (q, k, v))
  b, sq, hq, d = q.shape
  sk, hkv = k.shape[1], k.shape[2]
  g = hq // hkv
  scale = d ** -0.5 if scale is None else scale
  kq = k64.repeat_interleave(g, dim=2)
  vq = v64.repeat_interleave(g, dim=2)
  s = torch.einsum("bqhd,bkhd->bhqk", q64, kq) * scale
  if softcap:
    s = softcap * torch.tanh(s / softcap)
  vis = _visible(sq, sk, causal, window, q_seg, k_seg, b)
  s = s.masked_fill(~vis, float("-inf"))
  if sinks is not None:
    col = sinks.double().reshape(1, hq, 1, 1).expand(b, hq, sq, 1)
    s = torch.cat([s, col], dim=-1)
  m = s.amax(-1, keepdim=True)
  m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
  p = torch.exp(s - m)
  den = p.sum(-1, keepdim=True)
  lse = torch.where(den[..., 0] > 0, (m + torch.log(den))[..., 0],
                    torch.full_like(den[..., 0], float("-inf")))
  p = p / torch.where(den > 0, den, torch.ones_like(den))
  if sinks is not None:
    p = p[..., :-1]
  out = torch.einsum("bhqk,bkhd->bqhd", p, vq)
  return out, lse


def sdpa(q, k, v, *, causal=False, window=(-1, -1), scale=None, q_seg=None,
         k_seg=None):
  """torch SDPA (float32) with the bottom-right mask, [b, s, h, d]."""
  b, sq = q.shape[:2]
  sk = k.shape[1]
  mask = _visible(sq, sk, causal, window, q_seg, k_seg, b)
  out = F.scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
      attn_mask=mask, scale=scale, enable_gqa=q.shape[2] != k.shape[2])
  return out.transpose(1, 2)


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32, grad=True):
  q = torch.randn(b, sq, hq, d, dtype=dtype)
  k = torch.randn(b, sk, hkv, d, dtype=dtype)
  v = torch.randn(b, sk, hkv, d, dtype=dtype)
  return [x.requires_grad_(grad) for x in (q, k, v)]


def _grads(out, inputs, g):
  return torch.autograd.grad(out, inputs, g, allow_unused=True)


def _close(a, b, tol):
  torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)


# ----------------------------------------------------------------------------
# Dense: outputs and gradients against SDPA, float32
# ----------------------------------------------------------------------------

SDPA_CASES = {
    "plain": dict(b=2, sq=6, sk=6, hq=2, hkv=2, d=16),
    "causal": dict(b=2, sq=7, sk=7, hq=2, hkv=2, d=16, causal=True),
    "causal_bottom_right": dict(b=1, sq=4, sk=9, hq=2, hkv=2, d=16,
                                causal=True),
    "cross_noncausal": dict(b=2, sq=5, sk=11, hq=2, hkv=2, d=8),
    "window": dict(b=1, sq=8, sk=8, hq=2, hkv=2, d=16, window=(2, 1)),
    "causal_window_br": dict(b=2, sq=5, sk=9, hq=2, hkv=2, d=16, causal=True,
                             window=(3, 0)),
    "gqa_causal": dict(b=2, sq=6, sk=6, hq=4, hkv=2, d=16, causal=True),
    "mqa": dict(b=1, sq=5, sk=7, hq=4, hkv=1, d=32),
    "scale": dict(b=1, sq=6, sk=6, hq=2, hkv=1, d=16, causal=True,
                  scale=0.3),
    "segments": dict(b=2, sq=8, sk=8, hq=2, hkv=2, d=16, causal=True,
                     segments=True),
}


@pytest.mark.parametrize("name", sorted(SDPA_CASES))
def test_dense_matches_sdpa(name):
  c = dict(SDPA_CASES[name])
  causal = c.pop("causal", False)
  window = c.pop("window", (-1, -1))
  scale = c.pop("scale", None)
  segments = c.pop("segments", False)
  q, k, v = _qkv(**c)
  seg = None
  q_seg = k_seg = None
  if segments:
    ids = torch.zeros(c["b"], c["sq"], dtype=torch.int32)
    ids[:, 3:] = 1
    ids[1, 6:] = 2
    seg, q_seg, k_seg = ids, ids, ids
  out = tb.fold_attn_func(q, k, v, causal=causal, softmax_scale=scale,
                          window_size=window, segment_ids=seg)
  ref = sdpa(q, k, v, causal=causal, window=window, scale=scale, q_seg=q_seg,
             k_seg=k_seg)
  assert out.shape == q.shape and out.dtype == q.dtype
  _close(out, ref, 2e-5)
  g = torch.randn_like(out)
  for a, r in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
    _close(a, r, 5e-5)


def test_bf16_and_fp16_match_sdpa_loosely():
  for dtype, tol in ((torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
    q, k, v = _qkv(2, 6, 8, 4, 2, 32, dtype=dtype)
    out = tb.fold_attn_func(q, k, v, causal=True)
    assert out.dtype == dtype
    q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = sdpa(q32, k32, v32, causal=True)
    _close(out, ref, tol)
    g = torch.randn_like(ref)
    for a, r in zip(_grads(out, (q, k, v), g.to(dtype)),
                    _grads(ref, (q32, k32, v32), g)):
      assert a.dtype == dtype
      _close(a, r, 4 * tol)


# ----------------------------------------------------------------------------
# Sinks, soft-cap, LSE against the float64 torch reference
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("opts", [
    dict(sinks=True),
    dict(softcap=2.0),
    dict(sinks=True, softcap=1.5, causal=True, window=(2, 0)),
], ids=["sinks", "softcap", "sinks_softcap_window"])
def test_sinks_softcap_match_reference(opts):
  opts = dict(opts)
  use_sinks = opts.pop("sinks", False)
  q, k, v = _qkv(2, 5, 7, 4, 2, 16)
  sinks = (torch.randn(4) * 2).requires_grad_() if use_sinks else None
  window = opts.pop("window", (-1, -1))
  out, lse = tb.fold_attn_func(q, k, v, sinks=sinks, window_size=window,
                               return_lse=True, **opts)
  ref, ref_lse = ref_attention(q, k, v, sinks=sinks, window=window, **opts)
  _close(out, ref, 2e-5)
  _close(lse, ref_lse, 2e-5)
  assert lse.shape == (2, 4, 5) and lse.dtype == torch.float32
  g = torch.randn_like(out)
  gl = torch.randn_like(lse)
  ins = (q, k, v) + ((sinks,) if use_sinks else ())
  ours = _grads((out, lse), ins, (g, gl))
  theirs = _grads((ref, ref_lse), ins, (g.double(), gl.double()))
  for a, r in zip(ours, theirs):
    _close(a, r, 5e-5)


def test_fully_masked_rows_are_zero_with_zero_grads():
  # causal with seq_q > seq_k: the first rows see no key.
  q, k, v = _qkv(1, 6, 3, 2, 2, 8)
  out, lse = tb.fold_attn_func(q, k, v, causal=True, return_lse=True)
  assert torch.all(out[:, :3] == 0)
  assert torch.all(torch.isneginf(lse[:, :, :3]))
  ref, _ = ref_attention(q, k, v, causal=True)
  _close(out, ref, 2e-5)
  dq, = _grads(out.sum(), (q,), None)
  assert torch.all(dq[:, :3] == 0) and torch.isfinite(dq).all()


# ----------------------------------------------------------------------------
# Varlen against per-sequence SDPA
# ----------------------------------------------------------------------------

@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)),
                                           (True, (2, 0))])
def test_varlen_matches_per_sequence_sdpa(causal, window):
  cu_q = torch.tensor([0, 3, 8, 12], dtype=torch.int32)
  cu_k = torch.tensor([0, 5, 9, 16], dtype=torch.int32)
  tq, tk = 14, 16  # two query tokens past cu_q[-1] belong to no sequence
  q = torch.randn(tq, 4, 16, requires_grad=True)
  k = torch.randn(tk, 2, 16, requires_grad=True)
  v = torch.randn(tk, 2, 16, requires_grad=True)
  out = tb.fold_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, causal=causal,
                                 window_size=window)
  assert out.shape == q.shape
  assert torch.all(out[12:] == 0)
  parts = []
  for i in range(3):
    qs = q[None, cu_q[i]:cu_q[i + 1]]
    ks = k[None, cu_k[i]:cu_k[i + 1]]
    vs = v[None, cu_k[i]:cu_k[i + 1]]
    parts.append(sdpa(qs, ks, vs, causal=causal, window=window)[0])
  ref = torch.cat(parts + [torch.zeros(2, 4, 16)], dim=0)
  _close(out, ref, 2e-5)
  g = torch.randn_like(out)
  for a, r in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
    _close(a, r, 5e-5)


def test_varlen_defaults_and_lse():
  cu = torch.tensor([0, 4, 9], dtype=torch.int32)
  q, k, v = (torch.randn(9, 2, 8) for _ in range(3))
  sinks = torch.randn(2)
  out, lse = tb.fold_attn_varlen_func(q, k, v, cu, causal=True, sinks=sinks,
                                      return_lse=True)
  assert lse.shape == (2, 9)
  for i in range(2):
    sl = slice(int(cu[i]), int(cu[i + 1]))
    r, rl = ref_attention(q[None, sl], k[None, sl], v[None, sl], causal=True,
                          sinks=sinks)
    _close(out[sl], r[0], 2e-5)
    _close(lse[:, sl], rl[0], 2e-5)


# ----------------------------------------------------------------------------
# gradcheck (float64, XLA path)
# ----------------------------------------------------------------------------

def test_gradcheck_dense_float64():
  q, k, v = _qkv(1, 3, 4, 2, 1, 4, dtype=torch.float64)
  sinks = torch.randn(2, dtype=torch.float64, requires_grad=True)

  def f(q, k, v, sinks):
    out, lse = tb.fold_attn_func(q, k, v, causal=True, sinks=sinks,
                                 softcap=3.0, return_lse=True)
    return out, lse

  out, _ = f(q, k, v, sinks)
  assert out.dtype == torch.float64
  assert torch.autograd.gradcheck(f, (q, k, v, sinks), eps=1e-6, atol=1e-6)


def test_gradcheck_varlen_float64():
  cu = torch.tensor([0, 2, 5], dtype=torch.int32)
  q = torch.randn(5, 2, 4, dtype=torch.float64, requires_grad=True)
  k = torch.randn(5, 1, 4, dtype=torch.float64, requires_grad=True)
  v = torch.randn(5, 1, 4, dtype=torch.float64, requires_grad=True)
  f = lambda q, k, v: tb.fold_attn_varlen_func(q, k, v, cu, window_size=(1,
                                                                         0))
  assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------
# The custom ops: opcheck, the op's own autograd, torch.compile
# ----------------------------------------------------------------------------

def _op_args(q, k, v, sinks=None, backend="xla"):
  d = q.shape[-1]
  return (q, k, v, sinks, None, None, None, None, backend, True, -1, 0, 0.0,
          d ** -0.5, 0, 0)


def test_opcheck_forward_op():
  q, k, v = _qkv(1, 4, 4, 2, 1, 8)
  sinks = torch.randn(2, requires_grad=True)
  torch.library.opcheck(torch.ops.foldax.attn_fwd.default,
                        _op_args(q, k, v, sinks),
                        test_utils=("test_schema",
                                    "test_autograd_registration",
                                    "test_faketensor"))


def test_custom_op_autograd_matches_eager_path():
  q, k, v = _qkv(2, 5, 5, 4, 2, 8)
  sinks = torch.randn(4, requires_grad=True)
  out_op, lse_op, _ = torch.ops.foldax.attn_fwd(*_op_args(q, k, v, sinks))
  out = tb.fold_attn_func(q, k, v, causal=True, sinks=sinks)
  assert torch.equal(out_op, out)
  g = torch.randn_like(out)
  for a, b in zip(_grads(out_op, (q, k, v, sinks), g),
                  _grads(out, (q, k, v, sinks), g)):
    assert torch.equal(a, b)


class _Block(torch.nn.Module):

  def __init__(self, dim=32, heads=4, kv_heads=2):
    super().__init__()
    self.h, self.hkv, self.d = heads, kv_heads, dim // heads
    self.q = torch.nn.Linear(dim, dim)
    self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.d)
    self.sinks = torch.nn.Parameter(torch.zeros(heads))

  def forward(self, x):
    b, s, _ = x.shape
    q = self.q(x).view(b, s, self.h, self.d)
    k, v = self.kv(x).view(b, s, 2, self.hkv, self.d).unbind(2)
    out = tb.fold_attn_func(q, k, v, causal=True, sinks=self.sinks,
                            softcap=5.0)
    return out.reshape(b, s, -1).square().mean()


def test_torch_compile_fullgraph_forward_backward():
  torch.manual_seed(1)
  block = _Block()
  x = torch.randn(2, 8, 32)
  eager_loss = block(x)
  eager_grads = torch.autograd.grad(eager_loss, list(block.parameters()))
  compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
  t0 = time.perf_counter()
  loss = compiled(x)
  grads = torch.autograd.grad(loss, list(block.parameters()))
  assert time.perf_counter() - t0 < 120
  torch.testing.assert_close(loss, eager_loss, atol=1e-6, rtol=1e-6)
  for a, b in zip(grads, eager_grads):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_torch_compile_inductor_fullgraph():
  """The default (inductor) backend: ~55 s of C++ compilation on a 2-core
  CPU, hence slow; the aot_eager test above covers dynamo + AOTAutograd."""
  torch.manual_seed(1)
  block = _Block()
  x = torch.randn(2, 8, 32)
  ref = block(x)
  ref_grads = torch.autograd.grad(ref, list(block.parameters()))
  loss = torch.compile(block, fullgraph=True)(x)
  grads = torch.autograd.grad(loss, list(block.parameters()))
  torch.testing.assert_close(loss, ref, atol=1e-6, rtol=1e-6)
  for a, b in zip(grads, ref_grads):
    torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------
# Pallas glue (the interpreted kernel on CPU) against the XLA path
# ----------------------------------------------------------------------------

def test_interpret_backend_dense_matches_xla():
  q, k, v = _qkv(2, 6, 6, 4, 2, 16)
  sinks = torch.randn(4, requires_grad=True)
  seg = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]],
                     dtype=torch.int32)
  kw = dict(causal=True, sinks=sinks, softcap=4.0, segment_ids=seg,
            return_lse=True)
  out_i, lse_i = tb.fold_attn_func(q, k, v, backend="interpret", **kw)
  out_x, lse_x = tb.fold_attn_func(q, k, v, backend="xla", **kw)
  _close(out_i, out_x, 2e-5)
  _close(lse_i, lse_x, 2e-5)
  g, gl = torch.randn_like(out_i), torch.randn_like(lse_i)
  for a, b in zip(_grads((out_i, lse_i), (q, k, v, sinks), (g, gl)),
                  _grads((out_x, lse_x), (q, k, v, sinks), (g, gl))):
    _close(a, b, 5e-5)


def test_interpret_backend_varlen_matches_xla():
  cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
  cu_k = torch.tensor([0, 4, 9], dtype=torch.int32)
  q = torch.randn(8, 2, 16, requires_grad=True)  # one token past cu_q[-1]
  k = torch.randn(9, 1, 16, requires_grad=True)
  v = torch.randn(9, 1, 16, requires_grad=True)
  kw = dict(causal=True, return_lse=True)
  out_i, lse_i = tb.fold_attn_varlen_func(q, k, v, cu_q, cu_k,
                                          backend="interpret", **kw)
  out_x, lse_x = tb.fold_attn_varlen_func(q, k, v, cu_q, cu_k, backend="xla",
                                          **kw)
  _close(out_i, out_x, 2e-5)
  _close(lse_i, lse_x, 2e-5)
  g = torch.randn_like(out_i)
  for a, b in zip(_grads(out_i, (q, k, v), g), _grads(out_x, (q, k, v), g)):
    _close(a, b, 5e-5)


# ----------------------------------------------------------------------------
# Layout, determinism, validation
# ----------------------------------------------------------------------------

def test_non_contiguous_inputs_and_grad_outputs():
  q, k, v = _qkv(2, 4, 6, 2, 2, 8)
  # [b, h, s, d] views, as transformers would hand them over.
  qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2)
  qt = qt.requires_grad_()
  kt = k.detach().permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
  assert not qt.is_contiguous() and not kt.is_contiguous()
  out_a = tb.fold_attn_func(qt, kt, v, causal=True)
  out_b = tb.fold_attn_func(q, k, v, causal=True)
  assert torch.equal(out_a, out_b)
  g = torch.randn(2, 2, 4, 8).transpose(1, 2)  # non-contiguous cotangent
  assert torch.equal(_grads(out_a, (qt,), g)[0], _grads(out_b, (q,), g)[0])


def test_backward_is_bitwise_repeatable():
  q, k, v = _qkv(2, 9, 9, 4, 2, 16)
  g = torch.randn(2, 9, 4, 16)
  runs = [_grads(tb.fold_attn_func(q, k, v, causal=True), (q, k, v), g)
          for _ in range(2)]
  for a, b in zip(*runs):
    assert torch.equal(a, b)


def test_validation_errors_name_the_argument():
  q, k, v = _qkv(1, 4, 4, 2, 2, 8, grad=False)
  with pytest.raises(ValueError, match="q must have rank 4"):
    tb.fold_attn_func(q[0], k, v)
  with pytest.raises(TypeError, match="share one dtype"):
    tb.fold_attn_func(q.half(), k, v)
  with pytest.raises(ValueError, match="multiple of heads_kv"):
    tb.fold_attn_func(torch.randn(1, 4, 3, 8), k, v)
  with pytest.raises(TypeError, match="window_size"):
    tb.fold_attn_func(q, k, v, window_size=3)
  with pytest.raises(ValueError, match="sinks must have shape"):
    tb.fold_attn_func(q, k, v, sinks=torch.zeros(3))
  with pytest.raises(ValueError, match="backend"):
    tb.fold_attn_func(q, k, v, backend="cuda")
  with pytest.raises(TypeError, match="float64"):
    tb.fold_attn_func(q.double(), k.double(), v.double(), backend="interpret")


# ----------------------------------------------------------------------------
# DLPack and process setup
# ----------------------------------------------------------------------------

def test_cpu_dlpack_is_zero_copy_both_ways():
  import jax.numpy as jnp
  target = rt.target_for(torch.device("cpu"), torch.float32)
  t = torch.randn(2, 8, 4, 16)
  a = rt.Importer(target)(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  b = jnp.ones((3, 5), jnp.float32) * 2
  (tt,) = rt.export([b], target)
  assert tt.data_ptr() == b.unsafe_buffer_pointer()
  assert torch.equal(tt, torch.full((3, 5), 2.0))


def test_cpu_import_hands_over_the_tensor_itself():
  """No `.detach()` alias (its resurrected PyObject would make the capsule's
  deleter need the GIL): requires_grad tensors import zero-copy and keep
  their autograd state; non-contiguous ones are copied."""
  target = rt.target_for(torch.device("cpu"), torch.float32)
  t = torch.randn(4, 8, requires_grad=True)
  h = t * 2  # a non-leaf with a graph
  imp = rt.Importer(target)
  a, b = imp(t), imp(h)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  assert b.unsafe_buffer_pointer() == h.data_ptr()
  assert t.requires_grad and t.grad_fn is None and h.grad_fn is not None
  assert torch.equal(torch.from_dlpack(b), h.detach())
  nc = torch.randn(8, 4).t()
  c = imp(nc)
  assert c.shape == (4, 8) and torch.equal(torch.from_dlpack(c), nc)
  assert imp(None) is None
  (g,) = torch.autograd.grad(h.sum(), t)  # the graph is untouched
  assert torch.equal(g, torch.full_like(t, 2.0))


def test_static_options_cache_still_validates():
  """fold_attn_func's cache of validated options: a repeated call gives the
  same bits; calls that differ in anything validated are checked again."""
  from torch_bridge import attention as A
  q, k, v = _qkv(1, 8, 8, 4, 2, 16, grad=False)
  A._dense_statics.clear()
  o1 = tb.fold_attn_func(q, k, v, causal=True, softcap=1.0)
  o2 = tb.fold_attn_func(q, k, v, causal=True, softcap=1.0)
  assert torch.equal(o1, o2) and len(A._dense_statics) == 1
  for _ in range(2):
    with pytest.raises(TypeError, match="softcap"):
      tb.fold_attn_func(q, k, v, causal=True, softcap=True)
    with pytest.raises(TypeError, match="window_size"):
      tb.fold_attn_func(q, k, v, window_size=(True, -1))
    with pytest.raises(ValueError, match="window_size"):
      tb.fold_attn_func(q, k, v, window_size=(-2, -1))
    with pytest.raises(ValueError, match="head_dim"):
      tb.fold_attn_func(q, k[..., :8], v[..., :8])
    with pytest.raises(TypeError, match="share one dtype"):
      tb.fold_attn_func(q, k.double(), v.double())
  o3 = tb.fold_attn_func(q, k, v, causal=False, softcap=1.0)
  assert not torch.equal(o1, o3) and len(A._dense_statics) == 2


def test_cpu_backend_is_announced_once(caplog):
  from torch_bridge import attention as A
  rt._announced.discard(next((m for m in rt._announced if "XLA path" in m),
                             ""))
  rt._targets.clear()
  A._dense_statics.clear()  # calls seen before would skip the backend choice
  import logging
  with caplog.at_level(logging.WARNING, logger="torch_bridge"):
    q, k, v = _qkv(1, 4, 4, 2, 2, 8, grad=False)
    tb.fold_attn_func(q, k, v)
    tb.fold_attn_func(q, k, v, causal=True)
  msgs = [r.getMessage() for r in caplog.records if "XLA path" in
          r.getMessage()]
  assert len(msgs) == 1 and "CPU" in msgs[0]


# ----------------------------------------------------------------------------
# GPU (the lead's H200 run): pallas backend, zero copy, streams
# ----------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (sm80+)")


@pytest.mark.gpu
@gpu
def test_gpu_zero_copy_both_ways():
  import jax.numpy as jnp
  t = torch.randn(2, 128, 8, 64, device="cuda", dtype=torch.bfloat16)
  target = rt.target_for(t.device, t.dtype)
  assert target.backend == "pallas" and target.cuda
  a = rt.Importer(target)(t)
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  b = jnp.ones((4, 8), jnp.float32)
  b = jax_device_put(b, target.jax_device)
  (tt,) = rt.export([b], target)
  assert tt.device.type == "cuda"
  assert tt.data_ptr() == b.unsafe_buffer_pointer()


def jax_device_put(x, dev):
  import jax
  return jax.device_put(x, dev)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_sdpa(dtype):
  q, k, v = (x.detach().cuda().to(dtype).requires_grad_()
             for x in _qkv(2, 256, 256, 8, 2, 128, grad=False))
  out = tb.fold_attn_func(q, k, v, causal=True)
  ref = F.scaled_dot_product_attention(
      *(x.float().transpose(1, 2) for x in (q, k, v)), is_causal=True,
      enable_gqa=True).transpose(1, 2)
  tol = 2e-2 if dtype == torch.bfloat16 else 2e-4
  _close(out, ref, tol)
  g = torch.randn_like(out)
  a = _grads(out, (q, k, v), g)
  r = _grads(ref, (q, k, v), g.float())
  for x, y in zip(a, r):
    _close(x, y, 5 * tol)
  b = _grads(tb.fold_attn_func(q, k, v, causal=True), (q, k, v), g)
  for x, y in zip(a, b):
    assert torch.equal(x, y)  # bitwise repeatable backward


@pytest.mark.gpu
@gpu
def test_gpu_stream_ordering():
  """Inputs written by a long torch kernel right before the call, outputs
  read right after, on a non-default torch stream: no host sync in between."""
  side = torch.cuda.Stream()
  torch.cuda.synchronize()
  with torch.cuda.stream(side):
    big = torch.randn(4096, 4096, device="cuda")
    q = torch.zeros(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.zeros(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(8):  # keep the stream busy before q/k/v get their values
      big = big @ big * 1e-3
    src = torch.randn(3, 1, 512, 8, 64, device="cuda", dtype=torch.bfloat16)
    q.copy_(src[0]); k.copy_(src[1]); v.copy_(src[2])
    out = tb.fold_attn_func(q, k, v, causal=True)
    res = out.float() * 2  # consumed on the same stream, no sync
  torch.cuda.synchronize()
  ref = tb.fold_attn_func(src[0], src[1], src[2], causal=True)
  assert torch.equal(res, ref.float() * 2)


@pytest.mark.gpu
@gpu
def test_gpu_overhead_report():
  """Bridge time minus the JAX call alone at B1 H16 S128 D128 (target <=
  25 us on the H200); printed, and bounded loosely here."""
  from benchmarks import bridge_calls as bench
  r = bench.overhead(seq=128, iters=200)
  print(r)
  assert r["overhead_us"] < 200


# ----------------------------------------------------------------------------
# Decoding: FoldKVCache / fold_attn_with_kvcache
# ----------------------------------------------------------------------------

def test_kvcache_prefill_and_decode_match_reference():
  torch.manual_seed(7)
  hq, hkv, d = 4, 2, 16
  lens = [5, 3]
  cache = tb.FoldKVCache.create(2, hq, hkv, d, max_len=40, page_size=16,
                                dtype=torch.float32, device="cpu")
  cu = torch.tensor([0, 5, 8], dtype=torch.int32)
  q = torch.randn(8, hq, d)
  k = torch.randn(8, hkv, d)
  v = torch.randn(8, hkv, d)
  out = cache.prefill(q, k, v, cu, max_seqlen=5)
  keys = [k[:5], k[5:]]
  vals = [v[:5], v[5:]]
  for i in range(2):
    sl = slice(int(cu[i]), int(cu[i + 1]))
    ref, _ = ref_attention(q[None, sl], k[None, sl], v[None, sl], causal=True)
    _close(out[sl], ref[0], 2e-5)
  assert cache.lengths.tolist() == lens
  for step in range(3):
    qs = torch.randn(2, hq, d)
    ks = torch.randn(2, hkv, d)
    vs = torch.randn(2, hkv, d)
    o = tb.fold_attn_with_kvcache(qs, cache, ks, vs)
    assert o.shape == qs.shape
    for i in range(2):
      keys[i] = torch.cat([keys[i], ks[i:i + 1]])
      vals[i] = torch.cat([vals[i], vs[i:i + 1]])
      ref, _ = ref_attention(qs[None, i:i + 1], keys[i][None], vals[i][None],
                             causal=True)
      _close(o[i], ref[0, 0], 2e-5)
  assert cache.lengths.tolist() == [8, 6]
  cache.free([0])
  assert cache.lengths.tolist() == [0, 6]


def test_kvcache_errors_raise_and_leave_the_cache_unchanged():
  cache = tb.FoldKVCache.create(1, 2, 1, 8, max_len=4, page_size=16,
                                dtype=torch.float32, device="cpu")
  cache.append(torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8))
  with pytest.raises(ValueError, match="max_len"):
    cache.append(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8))
  assert cache.lengths.tolist() == [3]
  cache.append(torch.randn(1, 1, 8), torch.randn(1, 1, 8))  # usable again
  assert cache.lengths.tolist() == [4]
  # depth pruning was removed (issue 29): the keyword is not accepted.
  with pytest.raises(TypeError, match="depth"):
    tb.FoldKVCache.create(1, 2, 1, 8, max_len=4, page_size=16,
                          dtype=torch.float32, device="cpu", depth=8)


@pytest.mark.gpu
@gpu
def test_gpu_varlen_sinks_softcap_and_compile():
  torch.manual_seed(8)
  cu = torch.tensor([0, 100, 356, 400], dtype=torch.int32, device="cuda")
  q = torch.randn(400, 8, 64, device="cuda", dtype=torch.bfloat16,
                  requires_grad=True)
  k = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16,
                  requires_grad=True)
  v = torch.randn(400, 2, 64, device="cuda", dtype=torch.bfloat16,
                  requires_grad=True)
  sinks = torch.randn(8, device="cuda", requires_grad=True)
  out = tb.fold_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True,
                                 sinks=sinks, softcap=20.0)
  ref = tb.fold_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True,
                                 sinks=sinks, softcap=20.0, backend="xla")
  _close(out, ref, 3e-2)
  g = torch.randn_like(out)
  for a, b in zip(_grads(out, (q, k, v, sinks), g),
                  _grads(ref, (q, k, v, sinks), g)):
    _close(a, b, 0.1)
  block = _Block(dim=256, heads=4, kv_heads=2).cuda()
  x = torch.randn(2, 128, 256, device="cuda")
  loss = torch.compile(block, fullgraph=True)(x)
  loss.backward()
  torch.testing.assert_close(loss, block(x), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_gpu_kvcache_decode_matches_dense():
  torch.manual_seed(9)
  hq, hkv, d = 8, 2, 128
  cache = tb.FoldKVCache.create(2, hq, hkv, d, max_len=1024, page_size=64,
                                dtype=torch.bfloat16, device="cuda")
  cu = torch.tensor([0, 300, 500], dtype=torch.int32, device="cuda")
  mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16)
  q, k, v = mk(500, hq, d), mk(500, hkv, d), mk(500, hkv, d)
  cache.prefill(q, k, v, cu, max_seqlen=300)
  qs, ks, vs = mk(2, hq, d), mk(2, hkv, d), mk(2, hkv, d)
  out = tb.fold_attn_with_kvcache(qs, cache, ks, vs)
  for i, (a, b) in enumerate(((0, 300), (300, 500))):
    kk = torch.cat([k[a:b], ks[i:i + 1]])[None]
    vv = torch.cat([v[a:b], vs[i:i + 1]])[None]
    ref = tb.fold_attn_func(qs[None, i:i + 1], kk, vv, causal=True)
    _close(out[i], ref[0, 0], 2e-2)


# ----------------------------------------------------------------------------
# Direct launch (dense attention on CUDA without PJRT)
# ----------------------------------------------------------------------------

def test_direct_launch_eligibility(monkeypatch):
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  static = ("pallas", True, -1, 0, 0.0, 0.125, 0, 0, False)
  q = torch.zeros(1, 8, 2, 64)
  assert not _direct.eligible(static, q, q, None, None, None)  # CPU tensor
  varlen = static[:8] + (True,)
  assert not _direct.eligible(varlen, q, q, None, None, None)
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "jax")
  assert not _direct.enabled()
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "fast")
  with pytest.raises(ValueError, match="FOLDAX_TORCH_LAUNCH"):
    _direct.enabled()


def test_direct_plan_for_call_is_one_lookup_and_reads_the_switches(
    monkeypatch):
  """plan_for_call decides eligibility and builds the plan once per key;
  the environment switches are read on every call."""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  seen = []
  monkeypatch.setattr(_direct, "eligible", lambda *a: seen.append("e") or True)
  monkeypatch.setattr(_direct, "plan",
                      lambda *a: seen.append("p") or "the plan")
  monkeypatch.setattr(_direct, "_triton_available", lambda: True)
  monkeypatch.setattr(_direct, "_call_plans", {})
  static = ("pallas", True, -1, 0, 0.0, 0.125, 0, 0, False)
  q, k = torch.zeros(1, 8, 4, 64), torch.zeros(1, 8, 2, 64)
  for _ in range(3):
    assert _direct.plan_for_call(static, q, k, None, None, None,
                                 None) == "the plan"
  assert seen == ["e", "p"]
  # another key (sinks given) is decided on its own
  assert _direct.plan_for_call(static, q, k, torch.zeros(4), None, None,
                               None) == "the plan"
  assert seen == ["e", "p"] * 2
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "jax")
  assert _direct.plan_for_call(static, q, k, None, None, None, None) is None
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "direct")
  monkeypatch.setenv("FOLDAX_DQ_MODE", "atomic")
  assert _direct.plan_for_call(static, q, k, None, None, None, None) is None
  monkeypatch.delenv("FOLDAX_DQ_MODE")
  assert _direct.plan_for_call(static, q, k, None, None, None,
                               torch.zeros(2, dtype=torch.int32)) is None
  assert seen == ["e", "p"] * 2


def test_launch_hooks_are_seen_only_when_set():
  """Triton 3.6 always holds (empty) launch hook chains: the lean launch
  must not take them for hooks, and must step aside for a real one."""
  pytest.importorskip("triton")
  from triton import knobs
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  runtime = knobs.runtime
  assert not _direct._hooks_set()

  def hook(metadata):
    del metadata

  enter = runtime.launch_enter_hook
  if hasattr(enter, "add"):  # a HookChain (Triton 3.6)
    enter.add(hook)
    try:
      assert _direct._hooks_set()
    finally:
      enter.remove(hook)
  else:
    runtime.launch_enter_hook = hook
    try:
      assert _direct._hooks_set()
    finally:
      runtime.launch_enter_hook = enter
  assert not _direct._hooks_set()


def test_direct_launch_failure_is_said_once_and_falls_back(caplog):
  """A plan that cannot be built is tried once; the error is logged once
  and the calls take the general path (plan None)."""
  import logging
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  calls = []

  def build():
    calls.append(1)
    raise RuntimeError("no ptxas here")

  key = ("test_direct_launch_failure", len(_direct._plans))
  with caplog.at_level(logging.WARNING):
    assert _direct._cached_plan(key, build, "a test kernel") is None
    assert _direct._cached_plan(key, build, "a test kernel") is None
  assert calls == [1]
  said = [r.getMessage() for r in caplog.records
          if "no ptxas here" in r.getMessage()]
  assert len(said) == 1 and "JAX and DLPack" in said[0]
  _direct._plans.pop(key)


@pytest.mark.parametrize("has_sinks,has_segments,compile_kernels", [
    (False, False, True), (True, False, False), (False, True, False)])
def test_direct_launch_captures_every_kernel(fake_h200, monkeypatch, has_sinks,
                                             has_segments, compile_kernels):
  """The direct launch's contract with Pallas' lowering, checked on CPU for
  sm_90 (GPU query stubbed): each kernel of the dense forward and backward
  is captured, with as many pointer parameters as the launch passes, on the
  grid the JAX path uses; pip Triton compiles them to cubins."""
  if compile_kernels:
    pytest.importorskip("triton")
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  static = ("pallas", True, 64, 0, 0.0, 0.125, 0, 0, False)
  shape = _direct._Shape(2, 96, 80, 8, 2, 64, torch.bfloat16, has_sinks,
                         has_segments)
  plan = _direct.DensePlan(static, shape, (9, 0),
                           compile_kernels=compile_kernels)
  assert set(plan.ir) == set(_direct.DensePlan._FWD)  # the backward's: lazily
  plan.ensure_backward()
  assert set(plan.ir) == set(_direct._KERNELS)
  # (heads per wave, tiles, sequences x waves): query heads except for dK/dV
  # (KV heads); these small heads fit one wave.
  grids = {n: (g[0], g[2]) for n, g in plan.grids.items()}
  assert grids["fold_flash_forward"] == (8, 2)
  assert grids["fold_flash_backward_dkdv"] == (2, 2)
  assert grids["fold_flash_backward_dq"] == (8, 2)
  # The plan is built again for a second, identical call (JAX's lowering
  # cache must not hide the kernels from the capture).
  again = _direct.DensePlan(static, shape, (9, 0), compile_kernels=False)
  again.ensure_backward()
  assert again.ir == plan.ir
  if compile_kernels:
    assert set(plan.kernels) == set(_direct._KERNELS)
    assert all(len(k.asm["cubin"]) > 0 for k in plan.kernels.values())


def test_backward_code_choice(monkeypatch):
  """FOLDAX_TORCH_BWD_CODE: XLA's compile of the backward by default
  without GQA, pip Triton's with it; either when asked; a clear error
  otherwise."""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  monkeypatch.delenv("FOLDAX_TORCH_BWD_CODE", raising=False)
  assert _direct._xla_code_wanted(gqa=False)
  assert not _direct._xla_code_wanted(gqa=True)
  monkeypatch.setenv("FOLDAX_TORCH_BWD_CODE", "xla")
  assert _direct._xla_code_wanted(gqa=True)
  monkeypatch.setenv("FOLDAX_TORCH_BWD_CODE", "triton")
  assert not _direct._xla_code_wanted(gqa=False)
  monkeypatch.setenv("FOLDAX_TORCH_BWD_CODE", "cuda")
  with pytest.raises(ValueError, match="FOLDAX_TORCH_BWD_CODE"):
    _direct._xla_code_wanted(gqa=False)


def test_xla_cubin_reading(fake_h200):
  """`_xla_cubin` on pip Triton's cubins of the backward (sm_90, compiled on
  CPU): whole images are found among other bytes, with their kernels and
  parameter layouts (the pointers the launch passes plus Triton's two
  scratch pointers); XLA's launch dimensions are read from a thunk dump."""
  pytest.importorskip("triton")
  from torch_bridge import _direct, _xla_cubin
  static = ("pallas", True, -1, 0, 0.0, 0.125, 0, 0, False)
  shape = _direct._Shape(1, 64, 64, 4, 2, 64, torch.bfloat16, False, False)
  plan = _direct.DensePlan(static, shape, (9, 0))
  plan.ensure_backward()
  assert plan.xla == {}  # no GPU JAX backend here: pip Triton's code
  names = _direct.DensePlan._BWD
  cubins = [plan.kernels[n].kernel for n in names]
  blob = b"\x7fELF-not-an-image" + b"pad".join(cubins) + b"\x7fELF"
  assert _xla_cubin.elf_images(blob) == cubins

  def snappy_literals(data):  # a valid Snappy block of literals only
    out = bytearray()
    n = len(data)
    while True:
      out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
      n >>= 7
      if not n:
        break
    for i in range(0, len(data), 4096):
      piece = data[i:i + 4096]
      out += bytes([61 << 2]) + (len(piece) - 1).to_bytes(2, "little")
      out += piece
    return bytes(out)

  # PJRT's layout: a Riegeli file (a 24-byte block header, the first
  # holding the signature, every 64 KiB) whose Snappy-compressed record
  # holds the cubin.
  data = snappy_literals(b"record:" + cubins[1])
  riegeli = _xla_cubin._RIEGELI_SIGNATURE + bytes(16)
  while data:
    room = 65536 - len(riegeli) % 65536
    riegeli += data[:room]
    data = data[room:]
    if data:
      riegeli += bytes(24)
  parts = list(_xla_cubin._unpacked(b"prefix" + riegeli))
  assert [e for p in parts for e in _xla_cubin.elf_images(p)] == [cubins[1]]
  params = {"fold_flash_backward_preprocess": 6,
            "fold_flash_backward_dkdv": 11, "fold_flash_backward_dq": 10,
            "fold_flash_backward_dkdv_contain": 13,
            "fold_flash_backward_dq_contain": 11}
  for name, elf in zip(names, cubins):
    assert _xla_cubin.functions(elf) == [name]
    layout = _xla_cubin.param_layout(elf, name)
    assert layout == [(i, 8 * i, 8) for i in range(params[name] + 2)]
    assert _xla_cubin.param_layout(elf, "another_kernel") == []
  with tempfile.TemporaryDirectory() as d:
    with open(os.path.join(d, "module_1.jit_f.thunk_sequence.txt"), "w") as f:
      f.write("005: kCustomKernel [prev=004 (1) | sink        ] "
              "fold_flash_backward_dkdv grid: [8, 64, 2] threads: "
              "[128, 1, 1]  shared_memory: 99328 bytes\n")
    assert _xla_cubin._launch_dims(d) == {
        "fold_flash_backward_dkdv": ((8, 64, 2), 128, 99328)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("causal,window,softcap,has_sinks,segments,bwd_code", [
    (True, (-1, -1), 0.0, False, False, "xla"),
    (False, (64, 32), 0.0, True, False, "xla"),
    (True, (-1, -1), 30.0, False, False, "xla"),
    (True, (-1, -1), 0.0, False, True, "xla"),
    (True, (-1, -1), 0.0, False, False, "triton")])
def test_gpu_direct_launch_matches_jax_path(monkeypatch, causal, window,
                                            softcap, has_sinks, segments,
                                            bwd_code):
  """The direct launch against the same kernels through JAX and DLPack:
  outputs, LSE and every gradient agree to rounding, and repeated calls
  give the same bits. bwd_code "triton": the backward runs pip Triton's
  compile, whose lean launch must give the bits of Triton's own launcher."""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  # Which compile the backward runs (the default: XLA's without GQA only).
  monkeypatch.setenv("FOLDAX_TORCH_BWD_CODE", bwd_code)
  monkeypatch.setattr(_direct, "_plans", {})
  monkeypatch.setattr(_direct, "_call_plans", {})
  torch.manual_seed(0)
  q, k, v = (x.detach().cuda().to(torch.bfloat16).requires_grad_()
             for x in _qkv(2, 200, 200, 8, 2, 128, grad=False))
  sinks = (torch.randn(8, device="cuda").requires_grad_() if has_sinks
           else None)
  g = torch.randn(2, 200, 8, 128, device="cuda", dtype=torch.bfloat16)
  ins = (q, k, v) + ((sinks,) if has_sinks else ())
  seg = None
  if segments:  # row 1: two segments (positions 0-36 and 37-199)
    seg = torch.ones(2, 200, dtype=torch.int32, device="cuda")
    seg[1, :37] = 0

  def run():
    out, lse = tb.fold_attn_func(q, k, v, causal=causal, window_size=window,
                                 sinks=sinks, softcap=softcap,
                                 segment_ids=seg, return_lse=True)
    return (out, lse) + tuple(_grads(out, ins, g))

  n_plans = len(_direct._plans)
  direct = run()
  assert len(_direct._plans) == n_plans + 1  # it took the direct path
  plan = list(_direct._plans.values())[-1]
  assert isinstance(plan, _direct.DensePlan)  # and building did not fail
  assert set(plan.kernels) == set(_direct._KERNELS)
  # The backward's kernels run the compile asked for (XLA's: what jax.jit
  # runs), each through the lean launcher: no hooks are set.
  assert set(plan.xla) == (set(_direct.DensePlan._BWD) if bwd_code == "xla"
                           else set())
  assert set(plan._fast) == set(_direct._KERNELS)
  again = run()
  for a, b in zip(direct, again):
    assert torch.equal(a, b)
  if bwd_code == "triton":
    # Triton's own launcher (a fresh plan without the lean one): the bits
    # of the same compiled kernels.
    monkeypatch.setenv("FOLDAX_TORCH_LEAN_LAUNCH", "0")
    monkeypatch.setattr(_direct, "_plans", {})
    monkeypatch.setattr(_direct, "_call_plans", {})
    full_path = run()
    assert not list(_direct._plans.values())[-1]._fast
    for a, b in zip(direct, full_path):
      assert torch.equal(a, b)
    monkeypatch.delenv("FOLDAX_TORCH_LEAN_LAUNCH")
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "jax")
  via_jax = run()
  for a, b in zip(direct, via_jax):
    scale = b.float().abs().max().item() + 1e-6
    torch.testing.assert_close(a.float() / scale, b.float() / scale,
                               atol=2e-2, rtol=0)
  # The same cubins on the same inputs: the JAX path's bits (the output,
  # by pip Triton on both paths, and dq, dk, dv, by XLA's compile).
  same = (0, 2, 3, 4) if bwd_code == "xla" else (0,)
  for i in same:
    assert torch.equal(direct[i], via_jax[i])


def test_graph_capture_refuses_what_it_cannot_record(monkeypatch):
  """While torch's stream is capturing a CUDA graph, building kernels and a
  plan's first constants raise (they would run once, at capture, and never
  on replay); plans already built are still served. (GPU queries stubbed;
  the GPU test captures for real.)"""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  from torch_bridge import _runtime as rt
  rt.refuse_in_graph_capture(torch.device("cpu"), "x")  # no CUDA: no-op
  monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
  monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
  monkeypatch.setattr(_direct, "_plans", {("built", 0): "plan"})
  built = []
  with pytest.raises(RuntimeError, match="CUDA graph.*warm-up"):
    _direct._cached_plan(("new", 0), lambda: built.append(1), "a test plan")
  assert not built and ("new", 0) not in _direct._plans
  assert _direct._cached_plan(("built", 0), None, "a built plan") == "plan"
  plan = object.__new__(_direct.DensePlan)
  plan._cu_cache, plan._zero_cache = {}, {}
  for make in (plan._cu, plan._zero_rows):
    with pytest.raises(RuntimeError, match="CUDA graph"):
      make(torch.device("cuda", 0))


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graphs_replay_the_eager_bits(monkeypatch):
  """The direct launch records into CUDA graphs: a forward+backward made
  with torch.cuda.make_graphed_callables, and a whole step captured with
  torch.cuda.graph, replay on new inputs with the eager call's bits. A call
  through JAX refuses capture with an error rather than being recorded as
  nothing."""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  monkeypatch.setattr(_direct, "_plans", {})
  monkeypatch.setattr(_direct, "_call_plans", {})
  torch.manual_seed(0)
  shape = (2, 160, 8, 64)

  def attn(q, k, v):
    return tb.fold_attn_func(q, k, v, causal=True)

  def fresh(grad=True):
    return torch.randn(shape, device="cuda", dtype=torch.bfloat16,
                       requires_grad=grad)

  def eager(q, k, v, g):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = attn(q, k, v)
    return (out,) + torch.autograd.grad(out, (q, k, v), g)

  graphed = torch.cuda.make_graphed_callables(attn, (fresh(), fresh(),
                                                     fresh()))
  assert isinstance(list(_direct._plans.values())[-1], _direct.DensePlan)
  for _ in range(2):  # new data on every replay
    q, k, v = fresh(), fresh(), fresh()
    g = fresh(grad=False)
    out = graphed(q, k, v)
    got = (out.clone(),) + torch.autograd.grad(out, (q, k, v), g)
    for a, b in zip(got, eager(q, k, v, g)):
      assert torch.equal(a, b)

  # A whole step in one graph (static inputs, gradients set to None first).
  sq, sk, sv, sg = fresh(), fresh(), fresh(), fresh(grad=False)

  def step():
    out = attn(sq, sk, sv)
    out.backward(sg)
    return out

  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(side):
    for _ in range(2):
      step()
  torch.cuda.current_stream().wait_stream(side)
  for x in (sq, sk, sv):
    x.grad = None
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.graph(graph):
    static_out = step()
  for _ in range(2):
    with torch.no_grad():
      for x in (sq, sk, sv, sg):
        x.copy_(torch.randn_like(x))
    graph.replay()
    want = eager(sq, sk, sv, sg)
    for a, b in zip((static_out, sq.grad, sk.grad, sv.grad), want):
      assert torch.equal(a, b)

  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "jax")
  with torch.no_grad():
    attn(sq, sk, sv)  # the JAX path compiled, outside any capture
    with pytest.raises(RuntimeError, match="CUDA graph"):
      with torch.cuda.graph(torch.cuda.CUDAGraph()):
        attn(sq, sk, sv)


@pytest.mark.gpu
@gpu
def test_gpu_compile_reduce_overhead_matches_eager(monkeypatch):
  """torch.compile(mode="reduce-overhead") (inductor's CUDA graph trees)
  of a block calling the bridge records the custom ops into graphs (a skip
  is an error here) and its replays, forward and backward, match eager."""
  import torch._inductor.config as inductor_config
  from torch._dynamo.utils import counters
  monkeypatch.setattr(inductor_config.triton, "cudagraph_or_error", True)
  counters.clear()
  torch.manual_seed(0)

  class Block(torch.nn.Module):
    def __init__(self):
      super().__init__()
      self.proj = torch.nn.Linear(64, 64, device="cuda", dtype=torch.bfloat16)

    def forward(self, x):  # x: [b, s, h, d]
      return tb.fold_attn_func(self.proj(x), x, x, causal=True)

  block = Block()
  compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
  for _ in range(4):  # warm-up, recording, then replays
    torch.compiler.cudagraph_mark_step_begin()
    x = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    g = torch.randn_like(x)
    out = compiled(x)
    got = (out.detach().clone(),) + tuple(
        t.clone() for t in torch.autograd.grad(out, (x,) + tuple(
            block.parameters()), g))
    out_e = block(x)
    want = (out_e.detach(),) + torch.autograd.grad(
        out_e, (x,) + tuple(block.parameters()), g)
    for a, b in zip(got, want):
      scale = b.float().abs().max().item() + 1e-6
      torch.testing.assert_close(a.float() / scale, b.float() / scale,
                                 atol=2e-2, rtol=0)
  assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.parametrize("c2p,p2c,has_mask,compile_kernels", [
    (True, True, True, True), (True, False, False, False),
    (False, True, True, False)])
def test_direct_launch_captures_deberta_kernels(fake_h200, monkeypatch, c2p, p2c,
                                                has_mask, compile_kernels):
  """The DeBERTa direct forward's contract with Pallas' lowering, on CPU for
  sm_90 (GPU queries stubbed): the position-table GEMM (once per position
  term, one IR) and the disentangled forward are captured with as many
  pointers as the launch passes; pip Triton compiles them."""
  if compile_kernels:
    pytest.importorskip("triton")
  import jax_api._backend
  import jax_api.deberta.attention
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  from torch_bridge.deberta import DebertaConfig
  for mod in (jax_api._backend, jax_api.deberta.attention):
    monkeypatch.setattr(mod, "_gpu_capability", lambda: (9, 0))
  cfg = DebertaConfig("pallas", 32, 64, c2p, p2c, 0.0, 0)
  shape = _direct_deberta._DebertaShape(2, 96, 4, 64, torch.float16, has_mask, 80)
  plan = _direct_deberta.DebertaPlan(cfg, shape, (9, 0),
                             compile_kernels=compile_kernels)
  assert set(plan.ir) == {"fold_deberta_position_table",
                          "fold_deberta_forward"}
  assert plan.slots == 64
  assert plan.grids["fold_deberta_forward"][1:] == (2, 4)
  # Captured at pip Triton's tiles (64 x 64), not XLA's (64 x 128), and
  # with direct gathers: the only transpose left is K's for Q K^T (16-bit),
  # none of a float32 position-term tile.
  fwd_ir = plan.ir["fold_deberta_forward"]
  assert "tensor<64x128xf32" not in fwd_ir
  assert "tt.trans" in fwd_ir
  assert not re.search(r"tt\.trans[^\n]*xf32>", fwd_ir)
  if compile_kernels:
    assert set(plan.kernels) == set(plan.ir)


def test_deberta_used_lengths_match_the_jax_side():
  """The direct launch computes the kernel's used lengths in torch: the
  same as the JAX path's (right-padded rows: their length; others:
  MASKED_ROW, -1)."""
  import jax.numpy as jnp
  from pallas_kernels.deberta.core import used_lengths as _used_lengths
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  s = 12
  mask = torch.ones(5, s, dtype=torch.int32)
  mask[1, 7:] = 0
  mask[2, :3] = 0
  mask[3] = 0
  mask[4, 5] = 0
  got = _direct_deberta._used_lengths(mask != 0, s)
  cu = jnp.arange(6, dtype=jnp.int32) * s
  want = _used_lengths(jnp.asarray(mask.numpy().reshape(-1)), cu, s)
  assert got.tolist() == [12, 7, -1, 0, -1] == [int(x) for x in want]


@pytest.mark.gpu
@gpu
def test_gpu_deberta_direct_forward_matches_jax_path(monkeypatch):
  """The DeBERTa direct forward (padding mask, both position terms) against
  the same kernels through JAX and DLPack; repeated calls give the same
  bits."""
  from torch_bridge import _direct, _direct_deberta  # noqa: F401
  from torch_bridge.deberta import disentangled_attention as attn
  torch.manual_seed(0)
  b, s, h, d = 4, 200, 4, 64
  q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
             for _ in range(3))
  pk, pq = (torch.randn(512, h, d, device="cuda", dtype=torch.float16)
            for _ in range(2))
  mask = torch.ones(b, s, dtype=torch.int32, device="cuda")
  mask[1, 150:] = 0  # right-padded: its padding tiles are skipped
  mask[2, :40] = 0   # left-padded: the token mask over the whole row
  mask[3] = 0        # nothing visible

  def run():
    return attn(q, k, v, pk, pq, attention_mask=mask)

  n_plans = len(_direct._plans)
  direct = run()
  assert len(_direct._plans) == n_plans + 1  # it took the direct path
  assert isinstance(list(_direct._plans.values())[-1], _direct_deberta.DebertaPlan)
  assert torch.equal(direct, run())
  assert not direct[mask == 0].any()  # padded rows are written as 0
  monkeypatch.setenv("FOLDAX_TORCH_LAUNCH", "jax")
  via_jax = run()
  torch.testing.assert_close(direct.float(), via_jax.float(), atol=1e-2,
                             rtol=1e-2)


def test_derived_is_recomputed_for_another_or_modified_tensor():
  """`_runtime.derived` (the per-layer mask casts): reused for the same,
  unmodified tensor; recomputed when the tensor changes in place or is
  another one with the same contents."""
  from torch_bridge import _runtime as rt
  calls = []

  def fn(t):
    calls.append(1)
    return t.to(torch.int32)

  m = torch.tensor([[1, 1, 0]])
  a = rt.derived("test_derived", m, fn)
  assert rt.derived("test_derived", m, fn) is a and len(calls) == 1
  m[0, 2] = 1  # in place: the version counter moves
  b = rt.derived("test_derived", m, fn)
  assert len(calls) == 2 and b.tolist() == [[1, 1, 1]]
  c = rt.derived("test_derived", m.clone(), fn)
  assert len(calls) == 3 and c.tolist() == [[1, 1, 1]]
