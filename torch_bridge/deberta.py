"""DeBERTa-v2/v3 in torch on foldax's disentangled-attention kernels.

    import torch_bridge
    model = AutoModel.from_pretrained("microsoft/deberta-v3-base")
    torch_bridge.optimize_deberta(model)      # in place; returns the model

    # packed (padding-free) batch: input_ids [1, total]
    with torch_bridge.deberta.packed(cu_seqlens, max_seqlen):
      out = model(input_ids=packed_ids)

`optimize_deberta` changes the class of every `DisentangledSelfAttention`
in the model to `FoldDisentangledSelfAttention`, a subclass: parameters,
buffers, names and hooks are untouched, so checkpoints load and save
unchanged (`torch_bridge.deberta.restore(model)` switches back). Its forward
projects q/k/v and the relative embeddings with the module's own layers
(HF's `share_att_key`, `pos_att_type`, `position_buckets`, relative-embedding
dropout) and computes attention with `jax_api.deberta.disentangled_attention`
through the bridge (`torch.library.custom_op` `foldax::deberta_fwd` /
`foldax::deberta_bwd`, DLPack hand-off as in `torch_bridge._runtime`).
q/k/v stay in [batch, seq, heads, head_dim]: no transposes or copies.

Masks: HF's encoder hands each layer the outer product of the 2D padding
mask; the module reads its diagonal back (pair (i, j) is visible iff both
tokens are). A padded query row outputs 0 (HF eager: the mean of v). Other
3D/4D masks, `output_attentions=True` or explicit `query_states` fall back
to HF's own forward.

Packed inputs: inside `packed(cu_seqlens, max_seqlen)`, a batch of one row
[1, total] is attended per sequence (relative positions restart at each
sequence's start; tokens past cu_seqlens[-1] output 0).

Training: attention-probability dropout (`attention_probs_dropout_prob`) runs
inside the kernel from a seed drawn from torch's generator on each call (so
`torch.manual_seed` makes runs repeatable); the mask is regenerated in the
backward, never stored.

Direct launch: on CUDA, an inference forward (no dropout, not packed)
launches the Pallas kernels' Triton IR on torch's stream instead
(`torch_bridge._direct_deberta.DebertaPlan`; FOLDAX_TORCH_LAUNCH=jax turns it off).

Backward: the JAX VJP of `disentangled_attention` (jitted, per static
configuration) recomputes the forward it differentiates: one extra forward
per backward, the price of not depending on the kernel's private residual
layout (the dense bridge does reuse its residuals).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Optional

import torch
from torch import Tensor

from torch_bridge import _direct_deberta
from torch_bridge._deberta_jax import (DebertaConfig, _backward_fn,  # noqa: F401
                                      _forward_fn)
from torch_bridge import _runtime as rt
from torch_bridge import settings
from jax_api.contract import deberta as _cdb
from jax_api.contract import dense as _cd
from torch_bridge.attention import (_DTYPE_NAMES, _check_qkv, _check_tensor,
                                    _cu_values, dtype_name, resolve_backend)

_PACKED: contextvars.ContextVar = contextvars.ContextVar("foldax_packed",
                                                         default=None)


@contextlib.contextmanager
def packed(cu_seqlens: Tensor, max_seqlen: int | None = None):
  """Swapped DeBERTa layers attend per sequence of `cu_seqlens` (int32
  [num_seqs + 1]) on a batch of one packed row while this is active."""
  if max_seqlen is None:
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
  token = _PACKED.set((cu_seqlens, int(max_seqlen)))
  try:
    yield
  finally:
    _PACKED.reset(token)


def _static(backend, position_buckets, max_relative_positions, c2p, p2c,
            dropout_rate, max_seqlen):
  return DebertaConfig(backend, int(position_buckets),
                       int(max_relative_positions), bool(c2p), bool(p2c),
                       float(dropout_rate), int(max_seqlen))


def _fwd_impl(q, k, v, pk, pq, mask, cu, seed, cfg: DebertaConfig):
  dp = (_direct_deberta.deberta_plan(cfg, q, pk, pq, mask)
        if _direct_deberta.deberta_eligible(cfg, q, cu, seed) else None)
  if dp is not None:
    return dp.forward(q, k, v, pk, pq, mask)
  target = rt.target_for(q.device, q.dtype, cfg.backend)
  imp = rt.Importer(target)
  out = _forward_fn(cfg)(imp(q), imp(k), imp(v), imp(pk), imp(pq), imp(mask),
                         imp(cu), imp(seed))
  return rt.export([out], target)[0]


def _bwd_impl(dout, q, k, v, pk, pq, mask, cu, seed, cfg: DebertaConfig):
  target = rt.target_for(q.device, q.dtype, cfg.backend)
  imp = rt.Importer(target)
  grads = _backward_fn(cfg)(imp(q), imp(k), imp(v), imp(pk), imp(pq),
                            imp(mask), imp(cu), imp(seed), imp(dout))
  dq, dk, dv, dpk, dpq = rt.export(grads, target)
  empty = q.new_empty((0,))
  return dq, dk, dv, (empty if dpk is None else dpk), (empty if dpq is None
                                                       else dpq)


# ----------------------------------------------------------------------------
# Custom ops (torch.compile) and the eager autograd.Function
# ----------------------------------------------------------------------------

@torch.library.custom_op("foldax::deberta_fwd", mutates_args=())
def deberta_fwd(q: Tensor, k: Tensor, v: Tensor, pos_key: Optional[Tensor],
                pos_query: Optional[Tensor], mask: Optional[Tensor],
                cu: Optional[Tensor], seed: Optional[Tensor], backend: str,
                position_buckets: int, max_relative_positions: int,
                c2p: bool, p2c: bool, dropout_rate: float,
                max_seqlen: int) -> Tensor:
  cfg = _static(backend, position_buckets, max_relative_positions, c2p, p2c,
                dropout_rate, max_seqlen)
  return _fwd_impl(q, k, v, pos_key, pos_query, mask, cu, seed, cfg)


@deberta_fwd.register_fake
def _(q, k, v, pos_key, pos_query, mask, cu, seed, *static):
  return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("foldax::deberta_bwd", mutates_args=())
def deberta_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                pos_key: Optional[Tensor], pos_query: Optional[Tensor],
                mask: Optional[Tensor], cu: Optional[Tensor],
                seed: Optional[Tensor], backend: str, position_buckets: int,
                max_relative_positions: int, c2p: bool, p2c: bool,
                dropout_rate: float, max_seqlen: int
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
  cfg = _static(backend, position_buckets, max_relative_positions, c2p, p2c,
                dropout_rate, max_seqlen)
  return _bwd_impl(dout, q, k, v, pos_key, pos_query, mask, cu, seed, cfg)


@deberta_bwd.register_fake
def _(dout, q, k, v, pos_key, pos_query, mask, cu, seed, *static):
  like = lambda x: (torch.empty_like(x, memory_format=torch.contiguous_format)
                    if x is not None else q.new_empty((0,)))
  return like(q), like(k), like(v), like(pos_key), like(pos_query)


def _setup_context(ctx, inputs, output):
  ctx.save_for_backward(*inputs[:8])
  ctx.static = tuple(inputs[8:])


def _backward(ctx, dout):
  q, k, v, pk, pq, mask, cu, seed = ctx.saved_tensors
  dq, dk, dv, dpk, dpq = torch.ops.foldax.deberta_bwd(
      dout, q, k, v, pk, pq, mask, cu, seed, *ctx.static)
  return (dq, dk, dv, dpk if pk is not None else None,
          dpq if pq is not None else None) + (None,) * 10


deberta_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerDeberta(torch.autograd.Function):

  @staticmethod
  def forward(ctx, q, k, v, pk, pq, mask, cu, seed, cfg):
    ctx.save_for_backward(q, k, v, pk, pq, mask, cu, seed)
    ctx.cfg = cfg
    return _fwd_impl(q, k, v, pk, pq, mask, cu, seed, cfg)

  @staticmethod
  def backward(ctx, dout):
    q, k, v, pk, pq, mask, cu, seed = ctx.saved_tensors
    dq, dk, dv, dpk, dpq = _bwd_impl(dout, q, k, v, pk, pq, mask, cu, seed,
                                     ctx.cfg)
    return (dq, dk, dv, dpk if pk is not None else None,
            dpq if pq is not None else None, None, None, None, None)


def disentangled_attention(q: Tensor, k: Tensor, v: Tensor,
                           pos_key: Tensor | None = None,
                           pos_query: Tensor | None = None, *,
                           attention_mask: Tensor | None = None,
                           cu_seqlens: Tensor | None = None,
                           max_seqlen: int | None = None,
                           position_buckets: int = 256,
                           max_relative_positions: int = 512,
                           pos_att_type=("c2p", "p2c"),
                           dropout_rate: float = 0.0,
                           seed: Tensor | int | None = None,
                           backend: str = "auto") -> Tensor:
  """`jax_api.deberta.disentangled_attention` for torch tensors.

  q, k, v: [batch, seq, heads, head_dim] (or packed [total, heads, head_dim]
  with `cu_seqlens`); pos_key / pos_query: [>= 2*att_span, heads, head_dim]
  (the relative embeddings through the key / query projections);
  attention_mask: [batch, seq] 0/1. dropout_rate > 0 needs `seed` (an int
  or an int32 scalar tensor; drawn from torch's generator when None).
  Differentiable in q, k, v, pos_key and pos_query.
  """
  packed_in = cu_seqlens is not None
  _check_qkv(q, k, v, packed=packed_in)
  _cdb.check_self_attention(tuple(q.shape), tuple(k.shape))
  # A seed is drawn below when none is given, so dropout never lacks one.
  c2p, p2c, _ = _cdb.check_options(position_buckets, max_relative_positions,
                                   pos_att_type, dropout_rate, True)
  span = _cdb.att_span(position_buckets, max_relative_positions)
  for name, pos, on in (("pos_key", pos_key, c2p),
                        ("pos_query", pos_query, p2c)):
    if on:
      if pos is not None:
        _check_tensor(name, pos, 3, "[2*att_span, heads, head_dim]")
      _cdb.check_position_table(
          name, None if pos is None else tuple(pos.shape),
          None if pos is None else dtype_name(pos.dtype), span, q.shape[-2],
          q.shape[-1], allowed=_DTYPE_NAMES)
  if packed_in:
    _cdb.check_packed_mask_exclusive(attention_mask is not None)
    _check_tensor("cu_seqlens", cu_seqlens, 1, "[num_seqs + 1]")
    values = _cu_values(cu_seqlens, need=max_seqlen is None)
    _cd.check_cu_seqlens("cu_seqlens", tuple(cu_seqlens.shape),
                         dtype_name(cu_seqlens.dtype), q.shape[0], values)
    max_seqlen = _cd.check_max_seqlen("max_seqlen", max_seqlen, values) or \
        max_seqlen
  elif attention_mask is not None:
    _check_tensor("attention_mask", attention_mask, 2, "[batch, seq]")
    _cdb.check_attention_mask(tuple(attention_mask.shape), q.shape[:2])
  be = resolve_backend(q, backend)
  if attention_mask is not None:
    attention_mask = rt.derived(
        f"deberta_mask/{q.device}", attention_mask,
        lambda m: m.to(device=q.device, dtype=torch.int32))
  mq = 0
  if cu_seqlens is not None:
    cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    mq = int(max_seqlen) if max_seqlen is not None else int(
        (cu_seqlens[1:] - cu_seqlens[:-1]).max())
  if dropout_rate > 0:
    if seed is None:
      seed = int(torch.randint(0, 2**31 - 1, ()))
    if not isinstance(seed, Tensor):
      seed = torch.tensor(int(seed) & 0x7FFFFFFF, dtype=torch.int32)
    seed = seed.to(device=q.device, dtype=torch.int32)
  else:
    seed = None
  pk = pos_key if c2p else None
  pq = pos_query if p2c else None
  cfg = _static(be, position_buckets, max_relative_positions, c2p, p2c,
                dropout_rate, mq)
  args = (q, k, v, pk, pq, attention_mask, cu_seqlens, seed)
  if torch.compiler.is_compiling():
    return torch.ops.foldax.deberta_fwd(*args, *dataclasses.astuple(cfg))
  if torch.is_grad_enabled() and any(
      x is not None and x.requires_grad for x in (q, k, v, pk, pq)):
    return _EagerDeberta.apply(*args, cfg)
  return _fwd_impl(*args, cfg)


# ----------------------------------------------------------------------------
# The module swap
# ----------------------------------------------------------------------------

def _hf_class():
  from transformers.models.deberta_v2.modeling_deberta_v2 import \
      DisentangledSelfAttention
  return DisentangledSelfAttention


def _padding_mask(mask: Tensor, b: int, s: int):
  """[b, s] token mask from HF's [b, 1, s, s] / [b, s, s] / [b, s] mask, or
  None if it is not an outer product HF builds (not checked: the diagonal
  is read back)."""
  if mask is None:
    return None
  if mask.dim() == 2 and tuple(mask.shape) == (b, s):
    return mask
  if mask.dim() == 4 and mask.shape[1] == 1:
    mask = mask[:, 0]
  if mask.dim() == 3 and tuple(mask.shape) == (b, s, s):
    return mask.diagonal(dim1=-2, dim2=-1)
  return None


class FoldDisentangledSelfAttention(torch.nn.Module):
  """Set as the class of HF `DisentangledSelfAttention` instances by
  `optimize_deberta` (a subclass is made at swap time so that `isinstance`
  checks against HF's class still hold)."""

  def forward(self, hidden_states, attention_mask, output_attentions=False,
              query_states=None, relative_pos=None, rel_embeddings=None):
    hf = _hf_class()
    packed_cfg = _PACKED.get()
    b, s = hidden_states.shape[:2]
    tok_mask = None
    if packed_cfg is None:
      tok_mask = _padding_mask(attention_mask, b, s)
    if (output_attentions or query_states is not None or
        (packed_cfg is None and attention_mask is not None and
         tok_mask is None) or (packed_cfg is not None and b != 1)):
      rt.announce("torch_bridge.deberta: this call needs HF's own attention "
                  "(output_attentions, query_states, a custom mask or a "
                  "packed batch of more than one row); falling back.")
      if attention_mask is not None and attention_mask.dim() <= 2:
        # The swapped encoder passes the [b, s] mask on as it is (see
        # FoldDebertaV2Encoder); HF's attention wants its [b, 1, s, s].
        m = attention_mask.reshape(b, 1, 1, s)
        attention_mask = m * m.squeeze(-2).unsqueeze(-1)
      return hf.forward(self, hidden_states, attention_mask,
                        output_attentions, query_states, relative_pos,
                        rel_embeddings)
    h = self.num_attention_heads
    c2p = self.relative_attention and "c2p" in self.pos_att_type
    p2c = self.relative_attention and "p2c" in self.pos_att_type
    rel = None
    if c2p or p2c:
      rel = self.pos_dropout(rel_embeddings[: 2 * self.pos_ebd_size])
    fused = _fused_projections(self, hidden_states,
                               rel if self.share_att_key else None)
    if fused is not None:
      q, k, v, pq_all, pk_all = fused
    else:
      q, k, v = (m(hidden_states) for m in (self.query_proj, self.key_proj,
                                            self.value_proj))
    q, k, v = (x.view(b, s, h, -1) for x in (q, k, v))
    d = q.shape[-1]
    pk = pq = None
    if c2p or p2c:
      if self.share_att_key and fused is not None:
        pk, pq = (pk_all if c2p else None), (pq_all if p2c else None)
      elif self.share_att_key:
        pk = self.key_proj(rel) if c2p else None
        pq = self.query_proj(rel) if p2c else None
      else:
        pk = self.pos_key_proj(rel) if c2p else None
        pq = self.pos_query_proj(rel) if p2c else None
      pk = None if pk is None else pk.view(-1, h, d)
      pq = None if pq is None else pq.view(-1, h, d)
    types = tuple(t for t, on in (("c2p", c2p), ("p2c", p2c)) if on)
    rate = self.dropout.p if self.training else 0.0
    buckets = self.position_buckets if self.relative_attention else -1
    max_rel = self.max_relative_positions if self.relative_attention else 1
    kw = dict(position_buckets=buckets, max_relative_positions=max_rel,
              pos_att_type=types, dropout_rate=rate)
    if packed_cfg is not None:
      cu, ms = packed_cfg
      out = disentangled_attention(q[0], k[0], v[0], pk, pq, cu_seqlens=cu,
                                   max_seqlen=ms, **kw)[None]
    else:
      out = disentangled_attention(q, k, v, pk, pq, attention_mask=tok_mask,
                                   **kw)
    return out.reshape(b, s, h * d), None


def _plain_linear(m) -> bool:
  return (type(m) is torch.nn.Linear and not m._forward_hooks and
          not m._forward_pre_hooks and not m._backward_hooks)


# Above this many tokens the GPU, not the host, limits an encoder forward,
# and the batched GEMM loses: baddbmm copies its broadcast bias into the
# [3, tokens, hidden] output before the GEMM (39 us a layer at 8192 tokens),
# where nn.Linear adds the bias in cuBLAS's epilogue. Measured on the H200
# (DeBERTa-v3-base, fp16, interleaved rounds against disentangled-flash):
# B16 L512 9.46 ms fused, 8.91 ms with the three modules; ragged 7.61 and
# 7.04 ms. At B1 L2048 (2048 tokens, host-bound) fusing saves four launches
# a layer.
FUSED_PROJECTIONS_MAX_TOKENS = 4096


def _fused_projections(attn, hidden, rel):
  """The query, key and value projections of `hidden` ([b, s, hidden]) and,
  with `rel` ([r, hidden], HF's share_att_key), the query and key
  projections of the relative embeddings, in one batched GEMM (baddbmm over
  the three stacked weights) instead of up to five nn.Linear calls, each of
  which cost about 50 us of host time under cProfile on the H200's host
  (benchmarks/results/h200/bridge-host-2026-12-03/prof-deberta-b1.json;
  the concatenation and stacking around it are plain copies),
  and every result comes out contiguous (row slices of one
  [3, tokens, out] product), as the kernels want it. Returns (q, k, v,
  rel_q, rel_k) as [tokens, out] / [r, out] (rel_*: None without rel), or
  None where the projections are not plain biased nn.Linear layers of one
  shape (adapters, hooks), or past FUSED_PROJECTIONS_MAX_TOKENS tokens:
  the caller runs the modules then (FOLDAX_TORCH_FUSED_PROJECTIONS=0: always).
  Which GEMM projects a token may change its projections' last bits (cuBLAS
  picks kernels by shape for the other layers alike); the attention kernels'
  bits do not depend on it."""
  if (not settings.fused_projections() or
      hidden.numel() // hidden.shape[-1] > FUSED_PROJECTIONS_MAX_TOKENS):
    return None
  mods = (attn.query_proj, attn.key_proj, attn.value_proj)
  if not all(_plain_linear(m) and m.bias is not None for m in mods):
    return None
  w0 = mods[0].weight
  if any(m.weight.shape != w0.shape or m.weight.dtype != w0.dtype
         for m in mods) or hidden.dtype != w0.dtype or (
             rel is not None and rel.dtype != w0.dtype):
    return None
  x = hidden.reshape(-1, hidden.shape[-1])
  n = x.shape[0]
  if rel is not None:
    x = torch.cat([x, rel])
  # Stacked on every call (two small copies), not cached: a cache keyed on
  # the parameters' version counters would miss in-place updates through
  # `.data` (an EMA copy of the weights, for one), and serve stale weights.
  w = torch.stack([m.weight for m in mods]).transpose(1, 2)  # [3, in, out]
  bias = torch.stack([m.bias for m in mods]).unsqueeze(1)   # [3, 1, out]
  y = torch.baddbmm(bias, x.expand(3, *x.shape), w)         # [3, n(+r), out]
  if rel is None:
    return y[0], y[1], y[2], None, None
  return y[0, :n], y[1, :n], y[2, :n], y[0, n:], y[1, n:]


def _hf_encoder_class():
  from transformers.models.deberta_v2.modeling_deberta_v2 import \
      DebertaV2Encoder
  return DebertaV2Encoder


class FoldDebertaV2Encoder(torch.nn.Module):
  """Set as the class of HF `DebertaV2Encoder` instances by
  `optimize_deberta`. HF's encoder builds, before its first layer, a
  [b, 1, s, s] mask and the [1, s, s] bucketed relative positions (the
  latter with CPU scalars that make the host wait for the GPU); the fold
  attention needs neither (it takes the [b, s] token mask and computes
  relative positions in the kernel), so they are not built. HF's own
  attention, where a call falls back to it, rebuilds both."""

  def get_attention_mask(self, attention_mask):
    if attention_mask.dim() <= 2:
      return attention_mask
    return super().get_attention_mask(attention_mask)

  def get_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
    if query_states is None and relative_pos is None:
      return None
    return super().get_rel_pos(hidden_states, query_states, relative_pos)


_swapped: dict = {}


def _fold_class(cls, fold=None):
  fold = fold or FoldDisentangledSelfAttention
  if cls not in _swapped:
    _swapped[cls] = type(f"Fold{cls.__name__}", (fold, cls),
                         {"_foldax_original": cls})
  return _swapped[cls]


def optimize_deberta(model: torch.nn.Module) -> torch.nn.Module:
  """Swaps every `DisentangledSelfAttention` of `model` (in place) for the
  fold kernels; weights, names and state dict are unchanged. Returns model."""
  hf = _hf_class()
  n = 0
  for m in model.modules():
    if isinstance(m, hf) and not isinstance(m, FoldDisentangledSelfAttention):
      m.__class__ = _fold_class(type(m))
      n += 1
  if n == 0 and not any(isinstance(m, FoldDisentangledSelfAttention)
                        for m in model.modules()):
    raise ValueError("optimize_deberta found no DisentangledSelfAttention "
                     "module (is this a DeBERTa-v2/v3 model?).")
  enc = _hf_encoder_class()
  for m in model.modules():
    if isinstance(m, enc) and not isinstance(m, FoldDebertaV2Encoder) and all(
        isinstance(a, FoldDisentangledSelfAttention)
        for a in m.modules() if isinstance(a, hf)):
      m.__class__ = _fold_class(type(m), FoldDebertaV2Encoder)
  return model


def restore(model: torch.nn.Module) -> torch.nn.Module:
  """Undoes `optimize_deberta`."""
  for m in model.modules():
    if isinstance(m, (FoldDisentangledSelfAttention, FoldDebertaV2Encoder)):
      m.__class__ = m._foldax_original
  return model


__all__ = ["optimize_deberta", "restore", "packed", "disentangled_attention",
           "FoldDisentangledSelfAttention", "FoldDebertaV2Encoder"]
