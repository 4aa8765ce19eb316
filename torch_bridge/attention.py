"""`fold_attn_func` and `fold_attn_varlen_func` for torch tensors.

Both are `torch.library.custom_op`s (`foldax::attn_fwd`, `foldax::attn_bwd`)
with fake (meta) implementations and a registered autograd formula, so they
work eagerly, under autograd (including double-backward-free training loops
and `torch.utils.checkpoint`) and under `torch.compile(fullgraph=True)`.
Each op hands its tensors to a jit-compiled JAX function through DLPack (no
copy; see `torch_bridge._runtime` for the stream and lifetime rules) and
returns JAX's outputs as torch tensors; dense (non-varlen)
attention on CUDA skips PJRT and launches the same Pallas kernels' Triton
IR on torch's stream (`torch_bridge._direct`; FOLDAX_TORCH_LAUNCH=jax turns
that off). The backward op feeds the saved
output and log-sum-exp to the same VJP the JAX API uses; nothing is
recomputed and the gradients are bitwise deterministic.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import Tensor

from jax_api.contract import common as _cc
from jax_api.contract import dense as _cd
from torch_bridge import _direct
from torch_bridge import _runtime as rt


# ----------------------------------------------------------------------------
# The two custom ops
# ----------------------------------------------------------------------------

class _X64:
  """`jax.enable_x64` around float64 calls (the XLA path's gradcheck)."""

  def __init__(self, on: bool):
    self.on = on
    self.cm = None

  def __enter__(self):
    if self.on:
      import jax
      self.cm = jax.enable_x64(True)
      self.cm.__enter__()

  def __exit__(self, *exc):
    if self.cm is not None:
      self.cm.__exit__(*exc)


_NO_X64 = contextlib.nullcontext()


def _lse_shape(q: Tensor, varlen: bool):
  if varlen:
    return (q.shape[1], q.shape[0])
  return (q.shape[0], q.shape[2], q.shape[1])


def _aux_shape(q: Tensor, varlen: bool, backend: str):
  if backend == "xla":
    return (0,)
  total = q.shape[0] if varlen else q.shape[0] * q.shape[1]
  return (q.shape[-2], total)


class _Plan:
  """Everything static about one configuration of a call: the jitted JAX
  functions, the target device and whether float64 needs `enable_x64`."""

  __slots__ = ("fwd", "bwd", "target", "x64", "backend")

  def __init__(self, static, device, dtype):
    from torch_bridge._jax_side import attn_config, backward_fn, forward_fn
    cfg = attn_config(*static)
    backend = static[0]
    self.fwd = forward_fn(cfg)
    self.bwd = backward_fn(cfg)
    self.target = rt.target_for(device, dtype, backend)
    self.x64 = dtype == torch.float64
    self.backend = backend


_plans: dict = {}


def _plan(static, device, dtype) -> _Plan:
  key = (static, device, dtype)
  p = _plans.get(key)
  if p is None:
    p = _plans[key] = _Plan(static, device, dtype)
  return p


def _fwd_impl(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, static,
              keep: bool = False, aux_tensor: bool = True,
              need_lse: bool = True):
  """Runs the jitted forward. keep=True also returns the JAX arrays of the
  inputs and outputs (the eager backward reuses them instead of importing
  them again); aux_tensor=False leaves the XLA path's aux as None;
  need_lse=False (eager calls that do not return it) hands torch only the
  output (lse and aux come back as None; each export costs host time)."""
  dp = _direct.plan_for_call(static, q, k, sinks, q_seg, k_seg, cu_q)
  if dp is not None:
    out, lse, aux = dp.forward(q, k, v, sinks, q_seg, k_seg,
                               need_lse=need_lse)
    if keep:
      return (out, lse, aux), dp  # the backward reuses the plan
    return out, lse, aux
  p = _plan(static, q.device, q.dtype)
  with (_X64(True) if p.x64 else _NO_X64):
    imp = rt.Importer(p.target)
    ins = (imp(q), imp(k), imp(v), imp(sinks), imp(q_seg), imp(k_seg),
           imp(cu_q), imp(cu_k))
    res = p.fwd(*ins)
    if need_lse:
      out, lse, aux = rt.export(res, p.target)
    else:
      (out,), lse, aux = rt.export(res[:1], p.target), None, None
  if aux is None and aux_tensor:
    aux = q.new_empty((0,), dtype=torch.float32)
  if keep:
    return (out, lse, aux), (ins, res)
  return out, lse, aux


def _bwd_impl(dout, dlse, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse,
              aux, static, kept=None, ds_tensor: bool = True):
  """Runs the jitted backward. kept: what the eager forward kept, the
  direct launch's plan or the forward's JAX arrays (nothing but dout/dlse is
  imported); ds_tensor=False leaves a missing dsinks as None."""
  dp = None
  if isinstance(kept, _direct.DensePlan):
    dp, kept = kept, None
  elif (kept is None and aux is not None and aux.numel() and
        _direct.eligible(static, q, k, q_seg, k_seg, cu_q)):
    dp = _direct.plan(static, q, k, sinks, q_seg)
  if dp is not None and dp.backward_ready():
    dq, dk, dv, ds = dp.backward(q, k, v, sinks, out, aux, dout, dlse, q_seg,
                                 k_seg)
    if ds is not None:
      ds = ds.to(sinks.dtype)
    elif ds_tensor:
      ds = q.new_empty((0,), dtype=torch.float32)
    return dq, dk, dv, ds
  p = _plan(static, q.device, q.dtype)
  with (_X64(True) if p.x64 else _NO_X64):
    imp = rt.Importer(p.target)
    if kept is None:
      ins = (imp(q), imp(k), imp(v), imp(sinks), imp(q_seg), imp(k_seg),
             imp(cu_q), imp(cu_k))
      res = (imp(out), imp(lse), None if p.backend == "xla" else imp(aux))
    else:
      ins, res = kept
    grads = p.bwd(*ins, *res, imp(dout), imp(dlse))
    dq, dk, dv, ds = rt.export(grads, p.target)
  if ds is None and ds_tensor:
    ds = q.new_empty((0,), dtype=torch.float32)
  return dq, dk, dv, ds


@torch.library.custom_op("foldax::attn_fwd", mutates_args=())
def attn_fwd(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
             q_seg: Optional[Tensor], k_seg: Optional[Tensor],
             cu_q: Optional[Tensor], cu_k: Optional[Tensor], backend: str,
             causal: bool, left: int, right: int, softcap: float,
             scale: float, max_seqlen_q: int, max_seqlen_k: int
             ) -> tuple[Tensor, Tensor, Tensor]:
  """out, lse (float32), aux (the Pallas kernel's base-2 LSE, or empty)."""
  static = (backend, causal, left, right, softcap, scale, max_seqlen_q,
            max_seqlen_k, cu_q is not None)
  return _fwd_impl(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, static)


@attn_fwd.register_fake
def _(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, backend, causal, left, right,
      softcap, scale, max_seqlen_q, max_seqlen_k):
  varlen = cu_q is not None
  out = torch.empty_like(q, memory_format=torch.contiguous_format)
  lse = q.new_empty(_lse_shape(q, varlen), dtype=torch.float32)
  aux = q.new_empty(_aux_shape(q, varlen, backend), dtype=torch.float32)
  return out, lse, aux


@torch.library.custom_op("foldax::attn_bwd", mutates_args=())
def attn_bwd(dout: Tensor, dlse: Optional[Tensor], q: Tensor, k: Tensor,
             v: Tensor, sinks: Optional[Tensor], q_seg: Optional[Tensor],
             k_seg: Optional[Tensor], cu_q: Optional[Tensor],
             cu_k: Optional[Tensor], out: Tensor, lse: Tensor, aux: Tensor,
             backend: str, causal: bool, left: int, right: int,
             softcap: float, scale: float, max_seqlen_q: int,
             max_seqlen_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
  """dq, dk, dv, dsinks (empty when there are no sinks)."""
  static = (backend, causal, left, right, softcap, scale, max_seqlen_q,
            max_seqlen_k, cu_q is not None)
  return _bwd_impl(dout, dlse, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out,
                   lse, aux, static)


@attn_bwd.register_fake
def _(dout, dlse, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse, aux,
      backend, causal, left, right, softcap, scale, max_seqlen_q,
      max_seqlen_k):
  ds = (torch.empty_like(sinks) if sinks is not None else
        q.new_empty((0,), dtype=torch.float32))
  return (torch.empty_like(q, memory_format=torch.contiguous_format),
          torch.empty_like(k, memory_format=torch.contiguous_format),
          torch.empty_like(v, memory_format=torch.contiguous_format), ds)


_N_STATIC = 8  # backend .. max_seqlen_k


def _setup_context(ctx, inputs, output):
  q, k, v, sinks, q_seg, k_seg, cu_q, cu_k = inputs[:8]
  out, lse, aux = output
  ctx.save_for_backward(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse,
                        aux)
  ctx.static = tuple(inputs[8:])


def _backward(ctx, dout, dlse, daux):
  del daux
  q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse, aux = ctx.saved_tensors
  need = ctx.needs_input_grad
  if not any(need[:4]):
    return (None,) * (8 + _N_STATIC)
  if dout is None:
    dout = torch.zeros_like(out)
  dq, dk, dv, ds = torch.ops.foldax.attn_bwd(
      dout, dlse, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse, aux,
      *ctx.static)
  return ((dq if need[0] else None), (dk if need[1] else None),
          (dv if need[2] else None),
          (ds if sinks is not None and need[3] else None),
          *(None,) * (4 + _N_STATIC))


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttn(torch.autograd.Function):
  """The same forward/backward as the custom ops without the dispatcher's
  Python round trips: what eager calls use (torch.compile traces the ops).
  apply(q, k, v, sinks, rest) with rest = (q_seg, k_seg, cu_q, cu_k,
  static, need_lse): the arguments that get no gradient travel as one
  (autograd inspects every argument of `apply`). Returns out, or (out, lse)
  when need_lse."""

  @staticmethod
  def forward(ctx, q, k, v, sinks, rest):
    q_seg, k_seg, cu_q, cu_k, static, need_lse = rest
    # Contiguous once: the forward and the backward read the same copies
    # (a no-op for contiguous inputs, which are then saved themselves).
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    (out, lse, aux), kept = _fwd_impl(q, k, v, sinks, q_seg, k_seg, cu_q,
                                      cu_k, static, keep=True,
                                      aux_tensor=False, need_lse=need_lse)
    # The torch tensors are saved for autograd's in-place (version) checks;
    # the JAX arrays of the same buffers spare the backward their import
    # (kept until the graph is freed: a retain_graph backward runs again,
    # and lse may exist only on the JAX side). aux is private to the call
    # (never returned), so it needs no check.
    ctx.save_for_backward(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse)
    ctx.kept = kept
    ctx.aux = aux
    ctx.static = static
    ctx.set_materialize_grads(False)
    return (out, lse) if need_lse else out

  @staticmethod
  def backward(ctx, dout, dlse=None):
    q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse = ctx.saved_tensors
    need = ctx.needs_input_grad
    if dout is None and dlse is None:
      return None, None, None, None, None
    if dout is None:
      dout = torch.zeros_like(out)
    dq, dk, dv, ds = _bwd_impl(dout, dlse, q, k, v, sinks, q_seg, k_seg,
                               cu_q, cu_k, out, lse, ctx.aux, ctx.static,
                               kept=ctx.kept, ds_tensor=False)
    return ((dq if need[0] else None), (dk if need[1] else None),
            (dv if need[2] else None),
            (ds if sinks is not None and need[3] else None), None)


def _call(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, static,
          need_lse: bool = True):
  """Dispatches to the custom op (compiling), the autograd.Function (eager
  with grad) or the forward alone (no grad). need_lse=False: eager calls
  may return lse as None."""
  if torch.compiler.is_compiling():
    return torch.ops.foldax.attn_fwd(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k,
                                     *static[:8])
  if torch.is_grad_enabled() and (
      q.requires_grad or k.requires_grad or v.requires_grad or
      (sinks is not None and sinks.requires_grad)):
    res = _EagerAttn.apply(q, k, v, sinks,
                           (q_seg, k_seg, cu_q, cu_k, static, need_lse))
    return (res + (None,)) if need_lse else (res, None, None)
  return _fwd_impl(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, static,
                   aux_tensor=False, need_lse=need_lse)


# ----------------------------------------------------------------------------
# Validation and backend choice (torch side)
# ----------------------------------------------------------------------------

@torch._dynamo.assume_constant_result
def _resolve_backend(device_type: str, index, dtype, backend: str) -> str:
  device = torch.device(device_type, index) if index is not None else \
      torch.device(device_type)
  return rt.target_for(device, dtype, backend).backend


def resolve_backend(t: Tensor, backend: str = "auto") -> str:
  """"xla", "pallas" or "interpret" for tensors like `t` (logged once)."""
  return _resolve_backend(t.device.type, t.device.index, t.dtype, backend)


def dtype_name(dtype) -> str:
  """The contract's name of a torch dtype ("bfloat16", "int32", ...)."""
  return str(dtype).removeprefix("torch.")


# float64 runs on the XLA path only (for gradcheck); `rt.target_for` refuses
# it for the Pallas backends.
_DTYPE_NAMES = _cc.SUPPORTED_DTYPE_NAMES + ("float64",)


def _check_tensor(name, x, ndim, layout):
  if not isinstance(x, Tensor):
    raise TypeError(f"{name} must be a torch.Tensor with layout {layout}; got "
                    f"{type(x).__name__}.")
  _cc.check_rank(name, tuple(x.shape), ndim, layout)


def _check_qkv(q, k, v, packed: bool):
  lq, lk = _cd.layouts(packed)
  for name, x, layout in (("q", q, lq), ("k", k, lk), ("v", v, lk)):
    if not isinstance(x, Tensor):
      raise TypeError(f"{name} must be a torch.Tensor with layout {layout}; "
                      f"got {type(x).__name__}.")
  _cd.check_qkv(tuple(q.shape), tuple(k.shape), tuple(v.shape),
                dtype_name(q.dtype), dtype_name(k.dtype), dtype_name(v.dtype),
                packed=packed, allowed=_DTYPE_NAMES)
  if not (q.device == k.device == v.device):
    raise ValueError(f"q, k and v must be on one device; got q {q.device}, "
                     f"k {k.device}, v {v.device}.")


def _check_options(q, window_size, softcap, softmax_scale, sinks, causal):
  left, right = _cc.check_window(window_size)
  if causal:
    right = 0 if right < 0 else min(right, 0)
  softcap = _cc.check_softcap(0.0 if softcap is None else softcap)
  scale = _cc.check_softmax_scale(softmax_scale, q.shape[-1])
  if sinks is not None:
    _check_tensor("sinks", sinks, 1, "[heads_q]")
    _cc.check_sinks(tuple(sinks.shape), dtype_name(sinks.dtype), q.shape[-2],
                    allowed=_DTYPE_NAMES)
    if sinks.device != q.device:
      raise ValueError(f"sinks is on {sinks.device}, q on {q.device}; move "
                       "sinks to q's device.")
  return left, right, softcap, scale


def _segments(segment_ids, b, sq, sk, device):
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise TypeError("segment_ids must be a tensor [batch, seq] or a pair "
                      "(q_segment_ids, kv_segment_ids).")
    qs, ks = segment_ids
  else:
    qs = ks = segment_ids
  for name, s, n in (("segment_ids (queries)", qs, sq),
                     ("segment_ids (keys)", ks, sk)):
    _check_tensor(name, s, 2, "[batch, seq]")
    _cd.check_segment_ids(name, tuple(s.shape), dtype_name(s.dtype), b, n)
  return (qs.to(device=device, dtype=torch.int32),
          ks.to(device=device, dtype=torch.int32))


def _cu_values(cu: Tensor, need: bool):
  """cu_seqlens on the host for the contract's value checks: free for CPU
  tensors; for CUDA ones only when `need` (max_seqlen was not given, so the
  host reads the lengths anyway). None under torch.compile."""
  if torch.compiler.is_compiling():
    return None
  if cu.device.type == "cpu" or need:
    return cu.detach().cpu().numpy()
  return None


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------

def fold_attn_func(q: Tensor, k: Tensor, v: Tensor, causal: bool = False,
                   softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1),
                   sinks: Tensor | None = None, softcap: float = 0.0, *,
                   segment_ids=None, return_lse: bool = False,
                   backend: str = "auto"):
  """Exact attention with a deterministic backward, FlashAttention's layout.

  Args:
    q: [batch, seq_q, heads_q, head_dim] (bf16, fp16, fp32; fp64 on the XLA
      path, for gradcheck).
    k, v: [batch, seq_k, heads_kv, head_dim]; heads_q % heads_kv == 0
      (GQA/MQA natively: k/v are never repeated).
    causal: bottom-right aligned (query i sees keys j <= i + seq_k - seq_q).
    softmax_scale: default 1/sqrt(head_dim).
    window_size: (left, right) sliding window, -1 = unbounded.
    sinks: float [heads_q] logits joining each row's softmax denominator
      (differentiable).
    softcap: if > 0, scores become softcap * tanh(scores / softcap).
    segment_ids: int [batch, seq] (seq_q == seq_k) or a pair (q ids
      [batch, seq_q], kv ids [batch, seq_k]); tokens attend within equal ids.
      Negative ids on queries that match no key id give output 0.
    return_lse: also return the log-sum-exp, float32 [batch, heads_q, seq_q]
      (differentiable).
    backend: "auto" (Pallas on CUDA GPUs of compute capability 8.0+, else
      XLA; logged once), "pallas", "interpret" (the kernel on CPU) or "xla".

  Returns:
    out [batch, seq_q, heads_q, head_dim] in q's dtype (and lse). A query
    that sees no key gets 0.
  """
  key = None
  if (sinks is None and segment_ids is None and type(q) is Tensor and
      type(k) is Tensor and type(v) is Tensor and
      type(window_size) is tuple and len(window_size) == 2 and
      type(window_size[0]) is int and type(window_size[1]) is int and
      not torch.compiler.is_compiling()):
    # Eager calls with the common options: the validated static options of
    # an identical earlier call (everything the checks read is in the key).
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device,
           k.device, v.device, bool(causal), window_size, type(softcap),
           softcap, type(softmax_scale), softmax_scale, backend)
    try:
      static = _dense_statics.get(key)
    except TypeError:  # an unhashable option: let the checks speak
      key = static = None
    if static is not None:
      out, lse, _ = _call(q, k, v, None, None, None, None, None, static,
                          return_lse)
      return (out, lse) if return_lse else out
  _check_qkv(q, k, v, packed=False)
  static = _dense_static(q, causal, window_size, softcap, softmax_scale,
                         sinks, backend)
  qs, ks = _segments(segment_ids, q.shape[0], q.shape[1], k.shape[1],
                     q.device)
  if key is not None:
    if len(_dense_statics) >= 4096:
      _dense_statics.clear()
    _dense_statics[key] = static
  out, lse, _ = _call(q, k, v, sinks, qs, ks, None, None, static,
                      return_lse)
  return (out, lse) if return_lse else out


_dense_statics: dict = {}


def _dense_static(q: Tensor, causal: bool = False, window_size=(-1, -1),
                  softcap: float = 0.0, softmax_scale=None, sinks=None,
                  backend: str = "auto") -> tuple:
  """The validated static options of a dense call (what `_plan` and the
  custom ops take); raises like `fold_attn_func`."""
  left, right, softcap, scale = _check_options(q, window_size, softcap,
                                               softmax_scale, sinks, causal)
  return (resolve_backend(q, backend), bool(causal), left, right, softcap,
          scale, 0, 0, False)


def _max_seqlen(cu: Tensor, given) -> int:
  if given is not None:
    given = int(given)
    if given < 1:
      raise ValueError(f"max_seqlen must be >= 1; got {given}.")
    return given
  # A device-to-host read: pass max_seqlen_q/k to avoid it (and under
  # torch.compile).
  return max(1, int((cu[1:] - cu[:-1]).max()))


def fold_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor,
                          cu_seqlens_q: Tensor,
                          cu_seqlens_k: Tensor | None = None,
                          max_seqlen_q: int | None = None,
                          max_seqlen_k: int | None = None,
                          causal: bool = False,
                          softmax_scale: float | None = None,
                          window_size: tuple[int, int] = (-1, -1),
                          sinks: Tensor | None = None, softcap: float = 0.0,
                          *, return_lse: bool = False, backend: str = "auto"):
  """Packed variable-length attention (FlashAttention's varlen layout).

  Args:
    q: [total_q, heads_q, head_dim]; k, v: [total_k, heads_kv, head_dim].
    cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] cumulative lengths
      (cu_seqlens_k defaults to cu_seqlens_q). Tokens past cu_seqlens_q[-1]
      get output 0.
    max_seqlen_q, max_seqlen_k: longest sequence (Python ints). The Pallas
      kernel's grid needs them; when omitted they are read from cu_seqlens
      (one device-to-host copy). Ignored by the XLA path.
    Other options as `fold_attn_func` (causal and windows bottom-right per
    sequence).

  Returns:
    out [total_q, heads_q, head_dim] (and lse float32 [heads_q, total_q]).
  """
  _check_qkv(q, k, v, packed=True)
  left, right, softcap, scale = _check_options(q, window_size, softcap,
                                               softmax_scale, sinks, causal)
  if cu_seqlens_k is None:
    cu_seqlens_k = cu_seqlens_q
    if max_seqlen_k is None:
      max_seqlen_k = max_seqlen_q
  be = resolve_backend(q, backend)
  ms = {}
  for name, cu, total, given in (
      ("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
      ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
    _check_tensor(name, cu, 1, "[num_seqs + 1]")
    values = _cu_values(cu, need=given is None and be != "xla")
    _cd.check_cu_seqlens(name, tuple(cu.shape), dtype_name(cu.dtype), total,
                         values)
    ms[name] = _cd.check_max_seqlen("max_seqlen" + name[-2:], given, values)
  _cd.check_same_num_seqs(cu_seqlens_q.shape, cu_seqlens_k.shape)
  cu_q = cu_seqlens_q.to(device=q.device, dtype=torch.int32)
  cu_k = cu_seqlens_k.to(device=q.device, dtype=torch.int32)
  mq = mk = 0
  if be != "xla":
    mq = ms["cu_seqlens_q"] or _max_seqlen(cu_q, max_seqlen_q)
    mk = ms["cu_seqlens_k"] or _max_seqlen(cu_k, max_seqlen_k)
  static = (be, bool(causal), left, right, softcap, scale, mq, mk, True)
  out, lse, _ = _call(q, k, v, sinks, None, None, cu_q, cu_k, static,
                      return_lse)
  return (out, lse) if return_lse else out
