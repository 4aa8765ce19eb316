"""The JAX functions the DeBERTa torch op calls: one jitted forward and one
jitted backward (`jax.vjp` of `jax_api.deberta.disentangled_attention`)
per static configuration."""

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


def _jax_attention(cfg: DebertaConfig, q, k, v, pk, pq, mask, cu, seed):
  import jax
  from jax_api.deberta import disentangled_attention
  types = tuple(t for t, on in (("c2p", cfg.c2p), ("p2c", cfg.p2c)) if on)
  rng = None if seed is None else jax.random.key(seed)
  return disentangled_attention(
      q, k, v, pk, pq, attention_mask=mask, cu_seqlens=cu,
      max_seqlen=cfg.max_seqlen or None,
      position_buckets=cfg.position_buckets,
      max_relative_positions=cfg.max_relative_positions, pos_att_type=types,
      dropout_rate=cfg.dropout_rate, dropout_rng=rng, backend=cfg.backend)


@functools.cache
def _forward_fn(cfg: DebertaConfig):
  import jax
  return jax.jit(functools.partial(_jax_attention, cfg))


@functools.cache
def _backward_fn(cfg: DebertaConfig):
  import jax

  def bwd(q, k, v, pk, pq, mask, cu, seed, dout):
    f = lambda q, k, v, pk, pq: _jax_attention(cfg, q, k, v, pk, pq, mask,
                                               cu, seed)
    _, vjp = jax.vjp(f, q, k, v, pk, pq)
    return vjp(dout.astype(q.dtype))

  return jax.jit(bwd)
