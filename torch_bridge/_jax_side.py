"""The JAX functions the torch ops call: one jitted forward and one jitted
backward per static configuration (cached; `jax.jit` then caches per shape).

The forward returns what the torch side saves for the backward (the output
and the log-sum-exp, plus the kernel's base-2 LSE on the Pallas path), and
the backward feeds those residuals straight to the op's core, the same
functions `jax_api.fold_attn_func`'s VJP rules call
(`pallas_kernels.flash.core.backward`, `pallas_kernels.flash.xla.backward`),
so nothing is recomputed and the gradients are the bits `jax.vjp` of the JAX
API gives.

Shapes (dense): q [b, sq, hq, d], k/v [b, sk, hkv, d], segment ids int32
[b, sq] / [b, sk] or None, sinks [hq] or None; out like q, lse float32
[b, hq, sq], aux (Pallas only) float32 [hq, b * sq] base-2 LSE (+inf on rows
that saw nothing). Varlen: q [tq, hq, d], k/v [tk, hkv, d], cu int32
[n + 1]; lse and aux [hq, tq].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import device
from pallas_kernels.flash import core, xla
from pallas_kernels.flash.tiles import MaskConfig
from pallas_kernels.flash.backward import token_sequence_ids
from pallas_kernels.reference.dense import (dense_mask_spec, varlen_mask_spec,
                                           visibility)

XLA_CHUNK = 512  # jax_api.xla_attention's default chunk


@dataclasses.dataclass(frozen=True)
class AttnConfig:
  """Static options of one bridge call (hashable: the jit cache key)."""

  backend: str  # "xla" | "pallas" | "interpret"
  varlen: bool
  causal: bool
  left: int
  right: int
  softcap: float
  scale: float
  max_seqlen_q: int  # varlen Pallas grid (0 elsewhere)
  max_seqlen_k: int

  @property
  def window(self):
    return (self.left, self.right)


def attn_config(backend, causal, left, right, softcap, scale, mq, mk,
                varlen) -> AttnConfig:
  """AttnConfig from the custom ops' static arguments."""
  return AttnConfig(backend=backend, varlen=varlen, causal=bool(causal),
                    left=int(left), right=int(right), softcap=float(softcap),
                    scale=float(scale), max_seqlen_q=int(mq),
                    max_seqlen_k=int(mk))


# ----------------------------------------------------------------------------
# XLA path
# ----------------------------------------------------------------------------

def _xla_cfg(cfg: AttnConfig, q, k, v, sq: int, sk: int):
  return xla.XlaConfig(causal=cfg.causal, window_size=cfg.window,
                  softcap=cfg.softcap, scale=cfg.scale,
                  q_block=min(XLA_CHUNK, sq), k_block=min(XLA_CHUNK, sk),
                  compute_dtype=jnp.result_type(q.dtype, k.dtype, v.dtype))


def _xla_specs(cfg: AttnConfig, q, k, q_seg, k_seg, cu_q, cu_k):
  if cfg.varlen:
    return (varlen_mask_spec(cu_q, q.shape[0]),
            varlen_mask_spec(cu_k, k.shape[0]))
  return (dense_mask_spec(q.shape[0], q.shape[1], q_seg),
          dense_mask_spec(k.shape[0], k.shape[1], k_seg))


def _as4(cfg, x):
  return x[None] if cfg.varlen else x


def _xla_fwd(cfg: AttnConfig, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k):
  if q.dtype == jnp.float64:
    out, lse = _f64_attention(cfg, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k)
    return out, lse, None
  qs, ks = _xla_specs(cfg, q, k, q_seg, k_seg, cu_q, cu_k)
  q4, k4, v4 = _as4(cfg, q), _as4(cfg, k), _as4(cfg, v)
  xc = _xla_cfg(cfg, q4, k4, v4, q4.shape[1], k4.shape[1])
  out, lse = xla.forward(xc, q4, k4, v4, qs, ks, sinks)
  if cfg.varlen:
    out, lse = out[0], lse[0]
  return out, lse, None


def _xla_bwd(cfg: AttnConfig, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out,
             lse, aux, dout, dlse):
  del aux
  if q.dtype == jnp.float64:
    if dlse is None:
      dlse = jnp.zeros(lse.shape, lse.dtype)
    f = lambda q, k, v, s: _f64_attention(cfg, q, k, v, s, q_seg, k_seg, cu_q,
                                          cu_k)
    _, vjp = jax.vjp(f, q, k, v, sinks)
    return vjp((dout.astype(q.dtype), dlse.astype(lse.dtype)))
  qs, ks = _xla_specs(cfg, q, k, q_seg, k_seg, cu_q, cu_k)
  q4, k4, v4 = _as4(cfg, q), _as4(cfg, k), _as4(cfg, v)
  out4, lse4, do4 = _as4(cfg, out), _as4(cfg, lse), _as4(cfg, dout)
  if dlse is None:
    dlse4 = jnp.zeros(lse4.shape, jnp.float32)
  else:
    dlse4 = _as4(cfg, dlse)
  xc = _xla_cfg(cfg, q4, k4, v4, q4.shape[1], k4.shape[1])
  dq, dk, dv, dsinks = xla.backward(xc, q4, k4, v4, qs, ks, sinks, out4,
                                    lse4, do4, dlse4)
  if cfg.varlen:
    dq, dk, dv = dq[0], dk[0], dv[0]
  return dq, dk, dv, dsinks


def _f64_attention(cfg: AttnConfig, q, k, v, sinks, q_seg, k_seg, cu_q,
                   cu_k):
  """Dense float64 attention for float64 inputs (gradcheck): the package's
  conventions (`pallas_kernels.reference.dense`) computed in float64 end to
  end (the chunked XLA path accumulates in float32), differentiated by
  `jax.vjp`. O(seq_q * seq_k) memory: for checking, not for speed."""
  f64 = jnp.float64
  qs, ks = _xla_specs(cfg, q, k, q_seg, k_seg, cu_q, cu_k)
  q4, k4, v4 = (_as4(cfg, x).astype(f64) for x in (q, k, v))
  b, sq, hq, d = q4.shape
  hkv = k4.shape[2]
  g = hq // hkv
  vis = visibility(qs, ks, causal=cfg.causal, window_size=cfg.window)
  vis = vis[:, None]
  qg = q4.reshape(b, sq, hkv, g, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k4).reshape(b, hq, sq, -1)
  s = s * cfg.scale
  if cfg.softcap > 0:
    s = cfg.softcap * jnp.tanh(s / cfg.softcap)
  s = jnp.where(vis, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sinks is not None:
    sink = sinks.astype(f64)[None, :, None]
    m = jnp.maximum(m, sink)
  m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  p = jnp.where(vis, jnp.exp(s - m[..., None]), 0.0)
  den = jnp.sum(p, axis=-1)
  if sinks is not None:
    den = den + jnp.exp(sink - m)
  ok = den > 0
  safe = jnp.where(ok, den, 1.0)
  pv = (p / safe[..., None]).reshape(b, hkv, g, sq, -1)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", pv, v4).reshape(b, sq, hq, d)
  lse = jnp.where(ok, m + jnp.log(safe), -jnp.inf)
  out = out.astype(q.dtype)
  if cfg.varlen:
    return out[0], lse[0]
  return out, lse


# ----------------------------------------------------------------------------
# Pallas path (the Triton kernel, or the same kernel interpreted on CPU)
# ----------------------------------------------------------------------------

def _mask_cfg(cfg: AttnConfig, has_segments: bool) -> MaskConfig:
  return MaskConfig.make(causal=cfg.causal, window_size=cfg.window,
                         has_segments=has_segments, softcap=cfg.softcap,
                         scale=cfg.scale)


def _flat(cfg: AttnConfig, q, k, v, q_seg, k_seg, cu_q, cu_k):
  """Packed layout + cu_seqlens + (grid) max lengths for the kernel."""
  if cfg.varlen:
    return (q, k, v, None, None, cu_q.astype(jnp.int32),
            cu_k.astype(jnp.int32), cfg.max_seqlen_q or q.shape[0],
            cfg.max_seqlen_k or k.shape[0])
  b, sq = q.shape[:2]
  sk = k.shape[1]
  cq = jnp.arange(b + 1, dtype=jnp.int32) * sq
  ck = jnp.arange(b + 1, dtype=jnp.int32) * sk
  qf = q.reshape(b * sq, *q.shape[2:])
  kf = k.reshape(b * sk, *k.shape[2:])
  vf = v.reshape(b * sk, *v.shape[2:])
  qsf = None if q_seg is None else q_seg.reshape(-1)
  ksf = None if k_seg is None else k_seg.reshape(-1)
  return qf, kf, vf, qsf, ksf, cq, ck, sq, sk


def _plan(q, interpret: bool) -> core.KernelPlan:
  return core.kernel_plan(q.shape[-1], q.dtype, interpret=interpret,
                          compute_capability=None if interpret else
                          device.gpu_capability())


def _in_seq(cu_q, total):
  return token_sequence_ids(cu_q, total) < cu_q.shape[0] - 1


def _pallas_fwd(cfg: AttnConfig, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k):
  interpret = cfg.backend == "interpret"
  qf, kf, vf, qsf, ksf, cq, ck, mq, mk = _flat(cfg, q, k, v, q_seg, k_seg,
                                               cu_q, cu_k)
  mcfg = _mask_cfg(cfg, qsf is not None)
  plan = _plan(q, interpret)
  out, lse, lse2 = core.forward(qf, kf, vf, sinks, cq, ck, qsf, ksf,
                                mask=mcfg, plan=plan, max_seqlen_q=mq,
                                interpret=interpret)
  if cfg.varlen:
    in_seq = _in_seq(cq, q.shape[0])
    out = jnp.where(in_seq[:, None, None], out, 0).astype(q.dtype)
    empty = (-jnp.inf if sinks is None else
             sinks.astype(jnp.float32)[:, None])
    lse = jnp.where(in_seq[None, :], lse, empty)
    return out, lse, lse2
  b, sq, hq, d = q.shape
  out = out.reshape(b, sq, hq, d)
  lse = lse.reshape(hq, b, sq).transpose(1, 0, 2)
  return out, lse, lse2


def _pallas_bwd(cfg: AttnConfig, q, k, v, sinks, q_seg, k_seg, cu_q, cu_k,
                out, lse, aux, dout, dlse):
  del lse
  interpret = cfg.backend == "interpret"
  qf, kf, vf, qsf, ksf, cq, ck, mq, mk = _flat(cfg, q, k, v, q_seg, k_seg,
                                               cu_q, cu_k)
  mcfg = _mask_cfg(cfg, qsf is not None)
  plan = _plan(q, interpret)
  hq = q.shape[-2]
  total_q = qf.shape[0]
  if dlse is None:
    dlse_f = jnp.zeros((hq, total_q), jnp.float32)
  elif cfg.varlen:
    dlse_f = dlse.astype(jnp.float32)
  else:
    dlse_f = dlse.astype(jnp.float32).transpose(1, 0, 2).reshape(hq, total_q)
  do_f = dout.reshape(qf.shape)
  out_f = out.reshape(qf.shape)
  if cfg.varlen:
    in_seq = _in_seq(cq, total_q)
    do_f = jnp.where(in_seq[:, None, None], do_f, 0).astype(do_f.dtype)
    dlse_f = jnp.where(in_seq[None, :], dlse_f, 0.0)
  dq, dk, dv, dsinks = core.backward(
      qf, kf, vf, sinks, cq, ck, qsf, ksf, out_f, aux, do_f, dlse_f,
      mask=mcfg, plan=plan, max_seqlen_q=mq, max_seqlen_k=mk,
      interpret=interpret, all_tokens_in_sequences=not cfg.varlen)
  return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape),
          dsinks)


# ----------------------------------------------------------------------------
# Cached jitted entry points
# ----------------------------------------------------------------------------

@functools.cache
def forward_fn(cfg: AttnConfig):
  """jit(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k) -> (out, lse, aux)."""
  impl = _xla_fwd if cfg.backend == "xla" else _pallas_fwd
  return jax.jit(functools.partial(impl, cfg))


@functools.cache
def backward_fn(cfg: AttnConfig):
  """jit(q, k, v, sinks, q_seg, k_seg, cu_q, cu_k, out, lse, aux, dout,
  dlse) -> (dq, dk, dv, dsinks)."""
  impl = _xla_bwd if cfg.backend == "xla" else _pallas_bwd
  return jax.jit(functools.partial(impl, cfg))
