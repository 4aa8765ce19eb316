"""Ring attention inside `shard_map`, bitwise identical across device counts.

Call on local sequence shards (q, k, v: [batch, seq_local, heads, head_dim])
inside `jax.shard_map` over a mesh axis `axis_name` of n devices. K/V travel
round the ring with `jax.lax.ppermute` (the next transfer is issued before
the current block's compute, so XLA can overlap them).

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
Compute is float32 (inputs are upcast); the output has q's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_api import _backend
from jax_api.sharding import _grid
from jax_api.sharding.zigzag import local_positions
from pallas_kernels.reference.dense import MaskSpec, visibility

__all__ = ["ring_attention"]

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


def _dot(spec, a, b):
  return jnp.einsum(spec, a, b, precision=_HI, preferred_element_type=_F32)


def _blocks(x, bs):  # [b, L, ...] -> [L // bs, b, bs, ...]
  b, L = x.shape[:2]
  return jnp.moveaxis(x.reshape((b, L // bs, bs) + x.shape[2:]), 1, 0)


def _unblocks(x):
  x = jnp.moveaxis(x, 0, 1)
  return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _pair(cfg, qb, qp, qs, kb, kp, ks):
  """Scores of one (query block, key block) pair.

  qb [b, B, hkv, g, d]; kb [b, B, hkv, d]; qp/kp [B] positions; qs/ks [b, B]
  segments -> (s [b, hkv, g, B, B] masked -inf, vis, tanh term or None)."""
  s = _dot("bqhgd,bkhd->bhgqk", qb, kb) * cfg.scale
  t = None
  if cfg.softcap > 0.0:
    t = jnp.tanh(s / cfg.softcap)
    s = cfg.softcap * t
  b = qs.shape[0]
  length = jnp.full((b, cfg.block), cfg.seq, jnp.int32)
  qspec = MaskSpec(qs, jnp.broadcast_to(qp, (b, cfg.block)), length)
  kspec = MaskSpec(ks, jnp.broadcast_to(kp, (b, cfg.block)), length)
  vis = visibility(qspec, kspec, causal=cfg.causal,
                   window_size=cfg.window)[:, None, None]
  return jnp.where(vis, s, -jnp.inf), vis, t


def _ring_step(cfg, x, direction):
  n = cfg.n
  perm = [(i, (i + direction) % n) for i in range(n)]
  return jax.tree.map(lambda a: jax.lax.ppermute(a, cfg.axis_name, perm), x)


def _row_max(cfg, qB, qpB, qsB, k, kpos, kseg):
  """Pass 1: exact row max [nq, b, hkv, g, B] over every visible key."""
  def over_keys(kv):
    kB, kpB, ksB = _blocks(kv[0], cfg.block), kv[1].reshape(-1, cfg.block), \
        _blocks(kv[2], cfg.block)

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
  k, v = k.astype(_F32), v.astype(_F32)
  R = _row_max(cfg, qB, qpB, qsB, k, qpos, qseg)
  if sinks is not None:
    R = jnp.maximum(R, sinks.reshape(1, 1, hkv, g, 1))
  R_safe = jnp.where(jnp.isfinite(R), R, 0.0)
  e_acc = _grid.unit_exponent(
      jax.lax.pmax(jnp.max(jnp.abs(v)), cfg.axis_name) * cfg.block)
  e_l = _grid.unit_exponent(float(cfg.block))

  def over_keys(acc, kv):
    kB, vB = _blocks(kv[0], cfg.block), _blocks(kv[1], cfg.block)
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
    block_size: tokens per fixed block (default min(128, chunk)); bits are
      identical across device counts for equal block_size.
    segment_ids: int [batch, seq_local] local shard, or None.
    sinks: [heads_q] or None. Other options as `fold_attn_func`.
  Returns out [batch, seq_local, heads_q, head_dim] (and lse [batch,
  heads_q, seq_local] float32 if return_lse).
  """
  if backend not in ("auto", "xla"):
    raise ValueError(f"backend must be 'auto' or 'xla' for ring_attention "
                     f"(the per-block Pallas kernel is not wired); got "
                     f"{backend!r}.")
  if backend == "auto":
    _backend._announce("jax_api: ring_attention runs its per-block XLA path.")
  try:
    n = jax.lax.axis_size(axis_name)
    idx = jax.lax.axis_index(axis_name)
  except NameError as err:
    raise ValueError(f"axis_name {axis_name!r} is not a mesh axis bound by "
                     f"the enclosing shard_map ({err}).") from None
  b, L, hq, d = q.shape
  if k.shape[:2] != (b, L) or v.shape != k.shape or hq % k.shape[2]:
    raise ValueError(f"incompatible q {q.shape}, k {k.shape}, v {v.shape}: "
                     "need equal [batch, seq_local] and heads_q % heads_kv "
                     "== 0.")
  layout = layout or ("zigzag" if causal else "contiguous")
  if layout not in ("zigzag", "contiguous"):
    raise ValueError(f"layout must be 'zigzag' or 'contiguous'; got "
                     f"{layout!r}.")
  chunk = L // 2 if layout == "zigzag" else L
  if layout == "zigzag" and L % 2:
    raise ValueError(f"causal zig-zag needs the sequence length divisible "
                     f"by 2 x devices = {2 * n}; got seq {L * n} on {n} "
                     "devices.")
  bs = int(block_size or min(128, chunk))
  if bs < 1 or chunk % bs:
    raise ValueError(f"block_size must divide the zig-zag/local chunk "
                     f"({chunk} tokens); got {bs}.")
  if L * n > 2**_grid.MAX_TERMS_LOG2:
    raise ValueError(f"sequence length {L * n} exceeds 2^24 tokens.")
  left, right = window_size
  scale = 1.0 / d**0.5 if softmax_scale is None else float(softmax_scale)
  cfg = _Cfg(axis_name, int(n), bool(causal), (int(left), int(right)),
             float(softcap or 0.0), scale, bs, L * n)
  qpos = local_positions(L, idx, n, layout)
  qseg = (jnp.zeros((b, L), jnp.int32) if segment_ids is None else
          jnp.asarray(segment_ids, jnp.int32))
  if sinks is not None:
    sinks = jnp.asarray(sinks, _F32)
  out, lse = _no_grad_yet(cfg, q, k, v, qpos, qseg, sinks)
  return (out, lse) if return_lse else out


# The grid's floor/int steps have no useful derivative: until the ring
# backward lands, differentiating must fail loudly, never give wrong zeros.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _no_grad_yet(cfg, q, k, v, qpos, qseg, sinks):
  return _forward(cfg, q, k, v, qpos, qseg, sinks)


def _ngy_fwd(cfg, q, k, v, qpos, qseg, sinks):
  return _forward(cfg, q, k, v, qpos, qseg, sinks), None


def _ngy_bwd(cfg, res, cts):
  raise NotImplementedError(
      "ring_attention has no backward yet (issue 26: the dK/dV ring pass is "
      "not implemented); use it for inference only.")


_no_grad_yet.defvjp(_ngy_fwd, _ngy_bwd)
