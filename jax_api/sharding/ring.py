"""Ring attention inside `shard_map`, bitwise identical across device counts.

Call on local sequence shards (q, k, v: [batch, seq_local, heads, head_dim])
inside `jax.shard_map(..., check_vma=False)` over a mesh axis `axis_name` of
n devices. K/V travel round the ring with `jax.lax.ppermute` (the next
transfer is issued before the current block's compute, so XLA can overlap
them). Differentiable (`jax.custom_vjp`): the backward sends K/V and their
dK/dV accumulators round the ring the other way.

Bitwise identity (1, 2, 4, 8 devices give the same bits):
  * blocks are fixed in absolute token positions: queries and keys are cut
    into blocks of `block_size` tokens, so every (query block, key block)
    partial is the same fixed-shape computation on the same values whatever
    the device count;
  * the softmax reference is declared before the reduction: a first ring
    pass computes each row's exact max R over visible keys (and the sink);
    max is exact and order-free;
  * partials (numerators, denominators; dQ, dK, dV, dsinks) are summed on an
    exact integer grid (`_grid`, units fixed from exact global maxima), so
    the order in which blocks arrive round the ring does not matter.
Masks, lse and fully masked rows follow `pallas_kernels.reference.dense`.

Two implementations of a step (`backend`): "xla", the pair blocks below in
float32 (each block upcast where it is used; K/V travel round the ring in
their own dtype); "pallas" / "interpret", the Pallas ring step
(`pallas_kernels.flash.ring_step`): one launch per pass over the shard,
bf16/fp16 tiles on the tensor cores, each (query row, key block) partial
put on the grid inside the kernel. The output has q's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_api import _backend
from jax_api import _validation as val
from jax_api.sharding import _grid
from jax_api.sharding.zigzag import local_positions
from pallas_kernels.flash import preprocess, ring_step, xla
from pallas_kernels.flash.config import head_dim_bucket
from pallas_kernels.flash.tiles import LN2, LOG2E, MaskConfig
from pallas_kernels.reference.dense import MaskSpec, visibility

__all__ = ["ring_attention", "default_block_size"]

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


class _Cfg(NamedTuple):
  axis_name: str
  n: int
  causal: bool
  window: tuple
  softcap: float
  scale: float
  block: int
  seq: int  # global sequence length
  xla: xla.XlaConfig  # per-pair scores/mask/backward of the dense XLA path
  kernel: str  # "xla": pair blocks in XLA; "pallas"/"interpret": ring_step
  has_segments: bool


def _dot(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=_F32)


def _blocks(x, bs):  # [b, L, ...] -> [L // bs, b, bs, ...]
  b, L = x.shape[:2]
  return jnp.moveaxis(x.reshape((b, L // bs, bs) + x.shape[2:]), 1, 0)


def _unblocks(x):
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _pair(cfg, qb, qp, qs, kb, kp, ks):
  """Scores of one (query block, key block) pair, by the dense XLA path's
  own `scores`/`mask` (`pallas_kernels.flash.xla`).

  qb [b, B, hkv, g, d]; kb [b, B, hkv, d]; qp/kp [B] positions; qs/ks [b, B]
  segments -> (s [b, hkv, g, B, B] masked -inf, vis, tanh term or None)."""
  s, t = cfg.xla.scores(qb, kb)
  vis = cfg.xla.mask(_spec(cfg, qp, qs), _spec(cfg, kp, ks))
  return jnp.where(vis, s, -jnp.inf), vis, t


def _spec(cfg, pos, seg):
  """MaskSpec of one block: absolute positions in one sequence of the
  global length (segments split it further)."""
  b = seg.shape[0]
  return MaskSpec(seg, jnp.broadcast_to(pos, (b, cfg.block)),
                  jnp.full((b, cfg.block), cfg.seq, jnp.int32))


def _ring_step(cfg, x, direction):
  n = cfg.n
  perm = [(i, (i + direction) % n) for i in range(n)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, cfg.axis_name, perm), x)


def _row_max(cfg, qB, qpB, qsB, k, kpos, kseg):
  """Pass 1: exact row max [nq, b, hkv, g, B] over every visible key."""
  def over_keys(kv):
    kB, kpB, ksB = (_blocks(kv[0].astype(_F32), cfg.block),
                    kv[1].reshape(-1, cfg.block), _blocks(kv[2], cfg.block))

    def per_q(xs):
      qb, qp, qs = xs

      def per_k(m, ys):
        s, _, _ = _pair(cfg, qb, qp, qs, *ys)
        return jnp.maximum(m, jnp.max(s, -1)), None
      m0 = jnp.full(qb.shape[:1] + qb.shape[2:4] + (cfg.block,), -jnp.inf,
                    _F32)
      return jax.lax.scan(per_k, m0, (kB, kpB, ksB))[0]
    return jax.lax.map(per_q, (qB, qpB, qsB))

  def step(carry, _):
    m, kv = carry
    nxt = _ring_step(cfg, kv, +1)
    return (jnp.maximum(m, over_keys(kv)), nxt), None
  m0 = jnp.full(qB.shape[:2] + qB.shape[3:5] + (cfg.block,), -jnp.inf, _F32)
  (m, _), _ = jax.lax.scan(step, (m0, (k, kpos, kseg)), None, length=cfg.n)
  return m


def _forward(cfg, q, k, v, qpos, qseg, sinks):
  b, L, hq, d = q.shape
  hkv = k.shape[2]
  g = hq // hkv
  qB = _blocks(q.astype(_F32).reshape(b, L, hkv, g, d), cfg.block)
  qpB, qsB = qpos.reshape(-1, cfg.block), _blocks(qseg, cfg.block)
  R = _row_max(cfg, qB, qpB, qsB, k, qpos, qseg)
  if sinks is not None:
    R = jnp.maximum(R, sinks.reshape(1, 1, hkv, g, 1))
  R_safe = jnp.where(jnp.isfinite(R), R, 0.0)
  e_acc = _grid.unit_exponent(
      jax.lax.pmax(jnp.max(jnp.abs(v)).astype(_F32), cfg.axis_name) *
      cfg.block)
  e_l = _grid.unit_exponent(float(cfg.block))

  def over_keys(acc, kv):
    kB, vB = (_blocks(x.astype(_F32), cfg.block) for x in kv[:2])
    kpB, ksB = kv[2].reshape(-1, cfg.block), _blocks(kv[3], cfg.block)

    def per_q(xs):
      qb, qp, qs, r, a0, l0 = xs

      def per_k(c, ys):
        kb, vb, kp, ks = ys
        s, vis, _ = _pair(cfg, qb, qp, qs, kb, kp, ks)
        p = jnp.where(vis, jnp.exp(s - r[..., None]), 0.0)
        a = _grid.add(c[0], _grid.to_grid(
            _dot("bhgqk,bkhd->bhgqd", p, vb), e_acc))
        l = _grid.add(c[1], _grid.to_grid(jnp.sum(p, -1), e_l))
        return (a, l), None
      return jax.lax.scan(per_k, (a0, l0), (kB, vB, kpB, ksB))[0]
    return jax.lax.map(per_q, (qB, qpB, qsB, R_safe) + acc)

  def step(carry, _):
    acc, kv = carry
    nxt = _ring_step(cfg, kv, +1)
    return (over_keys(acc, kv), nxt), None
  nq = qB.shape[0]
  acc0 = (_grid.zeros((nq, b, hkv, g, cfg.block, d)),
          _grid.zeros((nq, b, hkv, g, cfg.block)))
  ((a, l), _), _ = jax.lax.scan(step, (acc0, (k, v, qpos, qseg)), None,
                                length=cfg.n)
  if sinks is not None:
    sink_p = jnp.exp(sinks.reshape(1, 1, hkv, g, 1) - R_safe)
    l = _grid.add(l, _grid.to_grid(sink_p, e_l))
  a = _grid.from_grid(a, e_acc)
  l = _grid.from_grid(l, e_l)
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  out = a / safe[..., None]  # [nq, b, hkv, g, B, d]
  lse = jnp.where(ok, R_safe + jnp.log(safe), -jnp.inf)
  out = _unblocks(jnp.moveaxis(out, 4, 2)).reshape(b, L, hq, d)
  lse = jnp.moveaxis(lse, 0, 3).reshape(b, hq, L)
  return out.astype(q.dtype), lse


def _backward_units(cfg, q, k, v, dout, dlse):
  """(dlse with non-finite entries 0, the bound on |D|, and the grid
  exponents of dq, dk, dv): from exact global maxima, so the same on every
  device count. A dq partial sums one key block, a dk/dv partial at most
  one block of queries over the g heads of a GQA group."""
  d, g, B = q.shape[3], q.shape[2] // k.shape[2], cfg.block
  dlse = jnp.where(jnp.isfinite(dlse), dlse, 0.0).astype(_F32)

  def gmax(x):
    return jax.lax.pmax(jnp.max(jnp.abs(x.astype(_F32))), cfg.axis_name)
  m_do, m_v, m_dl = gmax(dout), gmax(v), gmax(dlse)
  # |dP| <= d |dO| |V|, |D| <= d |dO| |V| + |dlse| (|out| <= max |V|).
  m_delta = d * m_do * m_v + m_dl
  m_ds = abs(cfg.scale) * (d * m_do * m_v + m_delta)
  return (dlse, m_delta, _grid.unit_exponent(B * m_ds * gmax(k)),
          _grid.unit_exponent(B * g * m_ds * gmax(q)),
          _grid.unit_exponent(B * g * m_do))


def _backward(cfg, q, k, v, qpos, qseg, sinks, out, lse, dout, dlse):
  """(dq, dk, dv, dsinks) of `_forward`, the same bits on any device count.

  K/V go round the ring the other way from the forward (direction -1),
  each shard's dK/dV grid accumulators travelling with it, so after n steps
  they are back on the owner. Every (query block, key block) pair runs the
  dense XLA path's backward (`xla.backward`: P from the saved global lse,
  dS = P (dP - D)); its dq/dk/dv partials are added on the integer grid
  with units fixed from exact global maxima, so neither the ring's arrival
  order nor the device count changes a bit. Rows that see no key have
  P = 0 in every pair: their gradients are exactly 0."""
  b, B = q.shape[0], cfg.block
  dlse, m_delta, e_dq, e_dk, e_dv = _backward_units(cfg, q, k, v, dout, dlse)

  def rows(x):  # [b, hq, L] -> [nq, b, B, hq]
    return _blocks(jnp.moveaxis(x, 2, 1), B)
  qB, oB, doB = (_blocks(x.astype(_F32), B) for x in (q, out, dout))
  lB, dlB = rows(lse), rows(dlse)
  qpB, qsB = qpos.reshape(-1, B), _blocks(qseg, B)
  k_dtype, v_dtype = k.dtype, v.dtype

  def pair(qi, kj):
    qb, ob, dob, lb, dlb, qp, qs = qi
    kb, vb, kp, ks = kj
    qspec, kspec = _spec(cfg, qp, qs), _spec(cfg, kp, ks)
    vis = visibility(qspec, kspec, causal=cfg.causal,
                     window_size=cfg.window)

    def run(_):
      return xla.backward(cfg.xla, qb, kb, vb, qspec, kspec, None, ob,
                          jnp.moveaxis(lb, 1, 2), dob,
                          jnp.moveaxis(dlb, 1, 2))[:3]

    def skip(_):  # a fully masked pair adds exact zeros
      return jnp.zeros_like(qb), jnp.zeros_like(kb), jnp.zeros_like(vb)
    return jax.lax.cond(jnp.any(vis), run, skip, None)

  def over_keys(dq_acc, kv):
    kB, vB = (_blocks(x.astype(_F32), B) for x in kv[:2])
    kpB, ksB = kv[2].reshape(-1, B), _blocks(kv[3], B)

    def per_k(dq_acc, kj):
      def per_q(c, xs):
        dq_ij, dk_ij, dv_ij = pair(xs[:-1], kj)
        return ((_grid.add(c[0], _grid.to_grid(dk_ij, e_dk)),
                 _grid.add(c[1], _grid.to_grid(dv_ij, e_dv))),
                _grid.add(xs[-1], _grid.to_grid(dq_ij, e_dq)))
      z = _grid.zeros(kj[0].shape)
      (dk_j, dv_j), dq_acc = jax.lax.scan(
          per_q, (z, z), (qB, oB, doB, lB, dlB, qpB, qsB, dq_acc))
      return dq_acc, (dk_j, dv_j)
    dq_acc, (dk_s, dv_s) = jax.lax.scan(per_k, dq_acc, (kB, vB, kpB, ksB))
    return dq_acc, _unblocks(dk_s), _unblocks(dv_s)

  def step(carry, _):
    dq_acc, kv, dkv = carry
    nxt = _ring_step(cfg, kv, -1)  # issued before this step's compute
    dq_acc, dk_s, dv_s = over_keys(dq_acc, kv)
    dkv = _ring_step(cfg, (_grid.add(dkv[0], dk_s), _grid.add(dkv[1], dv_s)),
                     -1)
    return (dq_acc, nxt, dkv), None
  zkv = _grid.zeros(k.shape)
  (dq_acc, _, (dk, dv)), _ = jax.lax.scan(
      step, (_grid.zeros(qB.shape), (k, v, qpos, qseg), (zkv, zkv)), None,
      length=cfg.n)
  dq = _unblocks(_grid.from_grid(dq_acc, e_dq)).astype(q.dtype)
  dk = _grid.from_grid(dk, e_dk).astype(k_dtype)
  dv = _grid.from_grid(dv, e_dv).astype(v_dtype)
  dsinks = None
  if sinks is not None:
    dsinks = _dsinks(cfg, sinks, oB, doB, lB, dlB, m_delta * b * B)
  return dq, dk, dv, dsinks


def _dsinks(cfg, sinks, oB, doB, lB, dlB, bound):
  """d/dsinks = -sum_rows exp(sink - lse) D: per-block float sums (fixed
  shapes), added on the grid, then an exact integer psum."""
  e = _grid.unit_exponent(bound)

  def per_q(acc, xs):
    ob, dob, lb, dlb = xs
    delta = jnp.sum(dob * ob, -1) - dlb  # [b, B, hq]
    p = jnp.where(jnp.isfinite(lb),
                  jnp.exp(sinks - jnp.where(jnp.isfinite(lb), lb, 0.0)), 0.0)
    return _grid.add(acc, _grid.to_grid(-jnp.sum(p * delta, (0, 1)), e)), None
  acc, _ = jax.lax.scan(per_q, _grid.zeros(sinks.shape), (oB, doB, lB, dlB))
  total = _grid.from_grid(_grid.psum(acc, cfg.axis_name), e)
  # sinks enter the shard_map replicated over the ring axis, so its
  # transpose psums the per-device cotangents (in whatever order): the exact
  # total sits on device 0 and the others add exact zeros.
  return jnp.where(jax.lax.axis_index(cfg.axis_name) == 0, total, 0.0)


# --- The Pallas ring step (`pallas_kernels.flash.ring_step`) -------------
# Same algorithm as the pair blocks above (declared row max, partials on the
# integer grid per (query row, key block), K/V and dK/dV round the ring),
# with each step one launch per pass over the whole local shard.


def _packed(x, d_pad):
  """[b, L, h, d] -> [b * L, h, d_pad] (zero head-dim padding adds exact
  zeros to every product)."""
  b, L, h, d = x.shape
  if d_pad != d:
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, d_pad - d)))
  return x.reshape(b * L, h, d_pad)


def _kernel_args(cfg, q):
  mask = MaskConfig.make(causal=cfg.causal, window_size=cfg.window,
                         has_segments=cfg.has_segments, softcap=cfg.softcap,
                         scale=cfg.scale)
  return dict(cfg=mask, block=cfg.block, batch=q.shape[0],
              interpret=cfg.kernel == "interpret")


def _limbs_last(x):  # [3, ...] -> [..., 3], the `_grid` layout
  return jnp.moveaxis(x, 0, -1)


def _seg_args(cfg, q_seg, k_seg):
  """(q_seg, k_seg) for the kernels: None, None without segment ids."""
  return (q_seg, k_seg) if cfg.has_segments else (None, None)


def _forward_kernel(cfg, q, k, v, qpos, qseg, sinks):
  b, L, hq, d = q.shape
  d_pad = head_dim_bucket(d)
  qp, kp, vp = (_packed(x, d_pad) for x in (q, k, v))
  seg = qseg.reshape(b * L)
  kw = _kernel_args(cfg, q)

  def max_step(carry, _):  # only K travels: the row max reads no V
    m, kv = carry
    nxt = _ring_step(cfg, kv, +1)
    m = jnp.maximum(m, ring_step.query_pass(
        qp, kv[0], kv[0], qpos, kv[1], *_seg_args(cfg, seg, kv[2]),
        mode="max", **kw))
    return (m, nxt), None
  m0 = jnp.full((hq, b * L), -jnp.inf, _F32)
  (ref2, _), _ = jax.lax.scan(max_step, (m0, (kp, qpos, seg)), None,
                              length=cfg.n)
  sink2 = None
  if sinks is not None:
    sink2 = (sinks * LOG2E)[:, None]  # [hq, 1]
    ref2 = jnp.maximum(ref2, sink2)
  ref2 = jnp.where(jnp.isfinite(ref2), ref2, 0.0)
  e_acc = _grid.unit_exponent(
      jax.lax.pmax(jnp.max(jnp.abs(v)).astype(_F32), cfg.axis_name) *
      cfg.block)
  e_l = _grid.unit_exponent(float(cfg.block))
  units = jnp.stack([_grid.pow2(-e_acc), _grid.pow2(-e_l)])

  def step(carry, _):
    acc, den, kv = carry
    nxt = _ring_step(cfg, kv, +1)
    acc, den = ring_step.query_pass(
        qp, kv[0], kv[1], qpos, kv[2], *_seg_args(cfg, seg, kv[3]), ref2,
        units, acc, den, mode="forward", **kw)
    return (acc, den, nxt), None
  acc0 = jnp.zeros((3, b * L, hq, d_pad), jnp.int32)
  den0 = jnp.zeros((3, hq, b * L), jnp.int32)
  (acc, den, _), _ = jax.lax.scan(step, (acc0, den0, (kp, vp, qpos, seg)),
                                  None, length=cfg.n)
  den = _limbs_last(den)
  if sinks is not None:
    den = _grid.add(den, _grid.to_grid(jnp.exp2(sink2 - ref2), e_l))
  a = _grid.from_grid(_limbs_last(acc), e_acc)[..., :d]  # [b*L, hq, d]
  l = _grid.from_grid(den, e_l)  # [hq, b*L]
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  out = (a / safe.T[:, :, None]).reshape(b, L, hq, d)
  lse = jnp.where(ok, (ref2 + jnp.log2(safe)) * LN2, -jnp.inf)
  return out.astype(q.dtype), jnp.moveaxis(lse.reshape(hq, b, L), 1, 0)


def _backward_kernel(cfg, q, k, v, qpos, qseg, sinks, out, lse, dout, dlse):
  """`_backward` with the ring step in Pallas: dQ partials per (query row,
  key block) and dK/dV partials per (query tile, key row) on the grid."""
  b, L, hq, d = q.shape
  hkv = k.shape[2]
  B = cfg.block
  d_pad = head_dim_bucket(d)
  dlse, m_delta, e_dq, e_dk, e_dv = _backward_units(cfg, q, k, v, dout, dlse)
  qp, kp, vp, dop = (_packed(x, d_pad) for x in (q, k, v, dout))
  rows = lambda x: jnp.moveaxis(x, 0, 1).reshape(hq, b * L)  # [b, hq, L]
  lse2 = rows(jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf))
  cu = jnp.arange(b + 1, dtype=jnp.int32) * L
  # D per row from fixed tiles (a row's bits do not follow the shard size).
  delta, _ = preprocess.backward_rows(
      out.reshape(b * L, hq, d), dout.reshape(b * L, hq, d), rows(dlse),
      None, None, cu, cu,
      softmax_scale=cfg.scale, max_seqlen_q=L, max_seqlen_k=L,
      with_grid=False, interpret=cfg.kernel == "interpret")
  seg = qseg.reshape(b * L)
  kw = _kernel_args(cfg, q)
  unit_dq = _grid.pow2(-e_dq)[None]
  unit_kv = jnp.stack([_grid.pow2(-e_dk), _grid.pow2(-e_dv)])

  def step(carry, _):
    dq_acc, kv, dkv = carry
    nxt = _ring_step(cfg, kv, -1)  # issued before this step's compute
    s_q, s_k = _seg_args(cfg, seg, kv[3])
    dq_acc = ring_step.query_pass(
        qp, kv[0], kv[1], qpos, kv[2], s_q, s_k, dop, lse2, delta, unit_dq,
        dq_acc, mode="dq", **kw)
    dkv = ring_step.key_pass(qp, kv[0], kv[1], qpos, kv[2], s_q, s_k, dop,
                             lse2, delta, unit_kv, *dkv, **kw)
    return (dq_acc, nxt, _ring_step(cfg, tuple(dkv), -1)), None
  zkv = jnp.zeros((3, b * L, hkv, d_pad), jnp.int32)
  (dq_acc, _, (dk, dv)), _ = jax.lax.scan(
      step, (jnp.zeros((3, b * L, hq, d_pad), jnp.int32),
             (kp, vp, qpos, seg), (zkv, zkv)), None, length=cfg.n)
  unpack = lambda x, e, h, dt: _grid.from_grid(_limbs_last(x), e)[
      ..., :d].reshape(b, L, h, d).astype(dt)
  dq = unpack(dq_acc, e_dq, hq, q.dtype)
  dk = unpack(dk, e_dk, hkv, k.dtype)
  dv = unpack(dv, e_dv, hkv, v.dtype)
  dsinks = None
  if sinks is not None:
    oB, doB = (_blocks(x.astype(_F32), B) for x in (out, dout))
    lB, dlB = (_blocks(jnp.moveaxis(x, 2, 1), B) for x in (lse, dlse))
    dsinks = _dsinks(cfg, sinks, oB, doB, lB, dlB, m_delta * b * B)
  return dq, dk, dv, dsinks


def ring_backend(backend: str) -> str:
  """The ring step's implementation for `backend`: "pallas" / "interpret"
  (the Pallas ring step) or "xla" (the pair blocks). "auto": the Pallas
  step on an NVIDIA GPU of compute capability 8.0+ (38-51x faster than the
  pair blocks on an H100, `benchmarks/results/h100/session-2026-12-08`),
  else the pair blocks; said once."""
  if backend != "auto":
    return _backend.resolve_backend(backend, kernel="ring_attention")
  cc = _backend._gpu_capability()
  if cc is not None and cc >= (8, 0):
    _backend._announce("jax_api: ring_attention runs the Pallas ring step on "
                       f"this GPU (compute capability {cc[0]}.{cc[1]}).")
    return "pallas"
  _backend._announce("jax_api: ring_attention runs its per-block XLA path "
                     "(no supported GPU; backend='interpret' runs the Pallas "
                     "ring step on CPU).")
  return "xla"


def default_block_size(seq: int) -> int:
  """Block tokens for a global length `seq`: min(128, 2^k / 16), 2^k the
  largest power of two dividing seq. It divides every zig-zag chunk
  seq / (2 n) for n = 1, 2, 4, 8, so those device counts give the same
  bits without the caller choosing a block."""
  return max(1, min(128, (seq & -seq) // 16))


def ring_attention(q, k, v, *, axis_name, causal=False, softmax_scale=None,
                   window_size=(-1, -1), sinks=None, softcap=0.0,
                   segment_ids=None, backend="auto", layout=None,
                   block_size=None, return_lse=False):
  """Exact attention over a sequence sharded on mesh axis `axis_name`.

  Call inside `jax.shard_map`. Args:
    q: [batch, seq_local, heads_q, head_dim] local shard; k, v: [batch,
      seq_local, heads_kv, head_dim]; heads_q % heads_kv == 0.
    layout: "zigzag" (default when causal: the global arrays were reordered
      by `zigzag(x, n)`) or "contiguous" (default otherwise).
    block_size: tokens per fixed block; bits are identical across device
      counts for equal block_size. Default `default_block_size(seq)`, a
      function of the global length only.
    segment_ids: int [batch, seq_local] local shard, or None.
    sinks: [heads_q] or None. Other options as `fold_attn_func`.
    backend: "xla" (pair blocks), "pallas" (the Pallas ring step, NVIDIA
      GPU), "interpret" (the same kernels on CPU) or "auto" ("pallas" on a
      GPU of compute capability 8.0+, else "xla"; said once).
  Returns out [batch, seq_local, heads_q, head_dim] (and lse [batch,
  heads_q, seq_local] float32 if return_lse).
  """
  kernel = ring_backend(backend)
  try:
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
  except NameError as err:
    raise ValueError(f"axis_name {axis_name!r} is not a mesh axis bound by "
                     f"the enclosing shard_map ({err}).") from None
  val.check_qkv(q, k, v, packed=False)
  b, L, hq, d = q.shape
  if k.shape[1] != L:
    raise ValueError(f"k and v must have q's local sequence length {L}; got "
                     f"k {k.shape}.")
  layout = layout or ("zigzag" if causal else "contiguous")
  if layout not in ("zigzag", "contiguous"):
    raise ValueError(f"layout must be 'zigzag' or 'contiguous'; got "
                     f"{layout!r}.")
  chunk = L // 2 if layout == "zigzag" else L
  if layout == "zigzag" and L % 2:
    raise ValueError(f"q: causal zig-zag needs the sequence length divisible "
                     f"by 2 x devices = {2 * n}; got seq {L * n} on {n} "
                     "devices.")
  bs = default_block_size(L * n) if block_size is None else int(block_size)
  if bs < 1 or chunk % bs:
    raise ValueError(f"block_size must divide the {layout} chunk of {chunk} "
                     f"tokens (seq {L * n} on {n} devices); got {bs}"
                     + (" (the default)" if block_size is None else "") +
                     ". Pass a block_size that divides it.")
  if L * n > 2**_grid.MAX_TERMS_LOG2:
    raise ValueError(f"q: sequence length {L * n} exceeds 2^24 tokens.")
  window = val.check_window(window_size)
  softcap = val.check_softcap(softcap)
  scale = val.check_softmax_scale(softmax_scale, d)
  val.check_sinks(sinks, hq)
  xcfg = xla.XlaConfig(causal=bool(causal), window_size=window,
                       softcap=softcap, scale=scale, q_block=bs, k_block=bs,
                       compute_dtype=_F32)
  cfg = _Cfg(axis_name, int(n), bool(causal), window, softcap, scale, bs,
             L * n, xcfg, kernel, segment_ids is not None)
  qpos = local_positions(L, idx, n, layout)
  qseg = (jnp.zeros((b, L), jnp.int32) if segment_ids is None else
          jnp.asarray(segment_ids, jnp.int32))
  if sinks is not None:
    sinks = jnp.asarray(sinks, _F32)
  out, lse = _ring(cfg, q, k, v, qpos, qseg, sinks)
  return (out, lse) if return_lse else out


# The custom_vjp: the grid's floor/int steps have no useful derivative, so
# the backward is the ring pass of `_backward`, never autodiff of `_forward`.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg, q, k, v, qpos, qseg, sinks):
  return _ring_forward(cfg)(cfg, q, k, v, qpos, qseg, sinks)


def _ring_forward(cfg):
  return _forward if cfg.kernel == "xla" else _forward_kernel


def _ring_fwd(cfg, q, k, v, qpos, qseg, sinks):
  out, lse = _ring_forward(cfg)(cfg, q, k, v, qpos, qseg, sinks)
  return (out, lse), (q, k, v, qpos, qseg, sinks, out, lse)


def _ring_bwd(cfg, res, cts):
  q, k, v, qpos, qseg, sinks, out, lse = res
  backward = _backward if cfg.kernel == "xla" else _backward_kernel
  dq, dk, dv, dsinks = backward(cfg, q, k, v, qpos, qseg, sinks, out, lse,
                                 *cts)
  return dq, dk, dv, None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)
