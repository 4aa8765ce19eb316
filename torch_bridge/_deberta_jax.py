"""The JAX functions the DeBERTa torch op calls: one jitted forward and one
jitted backward per static configuration, both on the op's framework-neutral
core (`pallas_kernels.deberta.core`, the functions `jax_api.deberta`'s VJP
rules call; `pallas_kernels.deberta.xla` on the "xla" backend), so the
gradients are the bits `jax.vjp` of `jax_api.deberta.disentangled_attention`
gives. The torch side has validated the inputs.

Shapes: q, k, v [b, s, h, d] (mask int32 [b, s] or None) or packed [t, h, d]
(cu int32 [n + 1]); pk / pq [>= 2*att_span, h, d] or None; seed int32 scalar
or None (dropout off).
"""

from __future__ import annotations

import dataclasses
import functools


@dataclasses.dataclass(frozen=True)
class DebertaConfig:
  backend: str
  position_buckets: int
  max_relative_positions: int
  c2p: bool
  p2c: bool
  dropout_rate: float
  max_seqlen: int  # packed only (0 otherwise)


def _prepare(cfg: DebertaConfig, q, pk, pq, mask, cu, seed):
  """(kernel config, the position rows the kernels read, the kernels'
  uint32 seed)."""
  import jax
  from pallas_kernels.deberta import core, dropout_hash
  kc = core.kernel_config(
      cfg.position_buckets, cfg.max_relative_positions, c2p=cfg.c2p,
      p2c=cfg.p2c, token_mask=mask is not None and cu is None,
      dropout_rate=cfg.dropout_rate, head_dim=q.shape[-1],
      interpret=cfg.backend == "interpret")
  if seed is not None:
    seed = dropout_hash.seed_from_rng(jax.random.key(seed))
  return (kc, core.position_rows(pk, kc, q.dtype),
          core.position_rows(pq, kc, q.dtype), seed)


def _kernel_forward(cfg: DebertaConfig, q, k, v, pk, pq, mask, cu, seed):
  """(out like q, core residuals, the core's static keywords)."""
  from pallas_kernels.deberta import core
  kc, pk, pq, seed = _prepare(cfg, q, pk, pq, mask, cu, seed)
  interpret = cfg.backend == "interpret"
  *lead, h, d = q.shape
  blocks = core.kernel_blocks(d, q.dtype, interpret=interpret)
  packed = cu is not None
  if packed:
    ms, tm = cfg.max_seqlen or q.shape[0], None
  else:
    (b, ms), t = lead, lead[0] * lead[1]
    cu, tm = core.padded_tokens(b, ms, mask)
    q, k, v = (x.reshape(t, h, d) for x in (q, k, v))
  kw = dict(cfg=kc, blocks=blocks, max_seqlen=ms, interpret=interpret)
  out, res = core.forward(q, k, v, pk, pq, cu, tm, seed, **kw)
  if packed:
    out = core.zero_outside(out, cu)
  return out.reshape(*lead, h, d), res, kw


def _jax_attention(cfg: DebertaConfig, q, k, v, pk, pq, mask, cu, seed):
  """out like q, in q's dtype."""
  if cfg.backend != "xla":
    return _kernel_forward(cfg, q, k, v, pk, pq, mask, cu, seed)[0]
  from pallas_kernels.deberta import xla
  kc, pk, pq, seed = _prepare(cfg, q, pk, pq, mask, cu, seed)
  return xla.forward(q, k, v, pk, pq, attention_mask=mask, cu_seqlens=cu,
                     seed=seed, cfg=kc)


@functools.cache
def _forward_fn(cfg: DebertaConfig):
  import jax
  return jax.jit(functools.partial(_jax_attention, cfg))


def _position_grad(g, pos):
  """The kernels' gradient of pos[: 2*att_span].astype(q's dtype) as a
  gradient of `pos`: zero on the rows past 2*att_span."""
  if pos is None:
    return None
  import jax.numpy as jnp
  g = g.astype(pos.dtype)
  if g.shape[0] == pos.shape[0]:
    return g
  return jnp.zeros(pos.shape, pos.dtype).at[: g.shape[0]].set(g)


@functools.cache
def _backward_fn(cfg: DebertaConfig):
  """jit(q, k, v, pk, pq, mask, cu, seed, dout) -> (dq, dk, dv, dpk, dpq).
  The Pallas path recomputes the forward's residuals (the torch op keeps
  only its inputs) and runs the core's backward on them."""
  import jax

  def xla_bwd(q, k, v, pk, pq, mask, cu, seed, dout):
    f = lambda q, k, v, pk, pq: _jax_attention(cfg, q, k, v, pk, pq, mask,
                                               cu, seed)
    _, vjp = jax.vjp(f, q, k, v, pk, pq)
    return vjp(dout.astype(q.dtype))

  def kernel_bwd(q, k, v, pk, pq, mask, cu, seed, dout):
    from pallas_kernels.deberta import core
    _, res, kw = _kernel_forward(cfg, q, k, v, pk, pq, mask, cu, seed)
    do = dout.astype(q.dtype).reshape(res.q.shape)
    if cu is not None:
      do = core.zero_outside(do, cu)
    dq, dk, dv, dpk, dpq = core.backward(res, do, **kw)
    return (dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape),
            _position_grad(dpk, pk), _position_grad(dpq, pq))

  return jax.jit(xla_bwd if cfg.backend == "xla" else kernel_bwd)
