"""The "xla" backend of the dense op as a differentiable function: the
`jax.custom_vjp` wiring of `pallas_kernels.flash.xla` (its forward and its
chunked recompute backward)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.flash import xla
from pallas_kernels.reference.dense import MaskSpec

__all__ = ["xla_attention"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, q, k, v, q_spec, k_spec, sinks):
  return xla.forward(cfg, q, k, v, q_spec, k_spec, sinks)


def _attention_fwd(cfg, q, k, v, q_spec, k_spec, sinks):
  out, lse = xla.forward(cfg, q, k, v, q_spec, k_spec, sinks)
  return (out, lse), (q, k, v, q_spec, k_spec, sinks, out, lse)


def _attention_bwd(cfg, res, cts):
  q, k, v, q_spec, k_spec, sinks, out, lse = res
  dout, dlse = cts
  dq, dk, dv, dsinks = xla.backward(cfg, q, k, v, q_spec, k_spec, sinks, out,
                                    lse, dout, dlse)
  spec_ct = MaskSpec(None, None, None)  # integer inputs
  return dq, dk, dv, spec_ct, spec_ct, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def xla_attention(q, k, v, q_spec: MaskSpec, k_spec: MaskSpec, sinks=None, *,
                  causal: bool, window_size: tuple[int, int], softcap: float,
                  softmax_scale: float | None, chunk_size: int = 512
                  ) -> tuple[jax.Array, jax.Array]:
  """Memory-efficient exact attention in pure JAX, differentiable.

  Args:
    q: [batch, seq_q, heads_q, head_dim].
    k, v: [batch, seq_k, heads_kv, head_dim]; heads_q % heads_kv == 0.
    q_spec, k_spec: MaskSpecs with [batch, seq_q] / [batch, seq_k] int fields.
    sinks: [heads_q] sink logits, or None.
    causal, window_size, softcap: as in `attention_reference`.
    softmax_scale: score scale (None: 1 / sqrt(head_dim)).
    chunk_size: query-block and key-chunk length (clipped to the sequence
      lengths); peak memory is O(batch * heads_q * chunk_size**2) beyond the
      inputs, outputs and O(seq) statistics.

  Returns:
    out: [batch, seq_q, heads_q, head_dim] in q.dtype.
    lse: [batch, heads_q, seq_q] float32 (natural log; -inf for fully masked
      rows without sinks).

  Differentiable in q, k, v, sinks and through both outputs (the lse
  cotangent included); the MaskSpec arrays get no gradient.
  """
  cfg = xla.make_config(q, k, v, sinks, causal=causal,
                        window_size=window_size, softcap=softcap,
                        softmax_scale=softmax_scale, chunk_size=chunk_size)
  q_spec = MaskSpec(*(jnp.asarray(a, jnp.int32) for a in q_spec))
  k_spec = MaskSpec(*(jnp.asarray(a, jnp.int32) for a in k_spec))
  if sinks is not None:
    sinks = jnp.asarray(sinks)
  return _attention(cfg, q, k, v, q_spec, k_spec, sinks)
