"""The dense op's framework-neutral core: plan, forward and backward of the
Pallas kernels, shared by `jax_api` (its `jax.custom_vjp`) and
`torch_bridge` (its autograd Function and direct launch).

Layout: packed tokens. q [total_q, heads_q, head_dim], k/v [total_k,
heads_kv, head_dim], cu_q / cu_k int32 [num_seqs + 1], segment ids int32
[total] or None, sinks float [heads_q] or None. A padded batch is a packed
batch of equal lengths (a free reshape).

Residuals: the forward returns the kernel's base-2 LSE `lse2` [heads_q,
total_q] (+inf on rows that saw nothing, so exp2(s - lse2) = 0 in the
backward) beside the natural-log LSE users see; the backward takes `out`
and `lse2` back, so nothing is recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels import settings
from pallas_kernels.flash.backward import flash_backward
from pallas_kernels.flash.config import BlockSizes, block_sizes_for
from pallas_kernels.flash.forward import flash_forward
from pallas_kernels.flash.tiles import LN2, MaskConfig

__all__ = ["KernelPlan", "MaskConfig", "kernel_plan", "forward", "backward",
           "natural_lse"]

_log = logging.getLogger("pallas_kernels")


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """Tiles of the forward and backward kernels and the dQ reduction."""

  fwd: BlockSizes
  bwd: BlockSizes
  dq_mode: str


def kernel_plan(head_dim: int, dtype, *, interpret: bool,
                compute_capability: tuple[int, int] | None) -> KernelPlan:
  """The shipped table's plan under the current settings
  (`pallas_kernels.settings`)."""
  s = settings.current()
  bwd_mode = "bwd_atomic" if s.dq_mode == "atomic" else "bwd"
  look = functools.partial(block_sizes_for,
                           compute_capability=compute_capability,
                           head_dim=head_dim, dtype=dtype,
                           interpret=interpret)
  plan = KernelPlan(look(mode="fwd"), look(mode=bwd_mode), s.dq_mode)
  if not interpret:
    _announce_compilers(plan.fwd.compiler, plan.bwd.compiler,
                        plan.bwd.dq_blocks.compiler,
                        settings.compiler_setting())
  return plan


@functools.cache
def _announce_compilers(fwd: str, bwd: str, dq: str, setting: str) -> None:
  """Says once per combination which compiler builds the kernels (and,
  where pip Triton would have compiled one but cannot, why not)."""
  from pallas_kernels import pip_triton
  why = pip_triton.auto_ready() if setting == "auto" else None
  _log.warning(
      f"pallas_kernels: flash kernels compiled by forward={fwd}, "
      f"backward={bwd}/dq={dq} (compiler setting {setting})" +
      (f"; pip Triton unused: {why}" if why else "") + ".")


def natural_lse(lse2: jax.Array) -> jax.Array:
  """Base-2 kernel LSE -> natural log, -inf (log 0) for rows that saw
  nothing."""
  return jnp.where(lse2 == jnp.inf, -jnp.inf, lse2 * LN2)


def forward(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, *, mask: MaskConfig,
            plan: KernelPlan, max_seqlen_q: int, interpret: bool):
  """(out [total_q, heads_q, head_dim], lse [heads_q, total_q] natural log,
  lse2 [heads_q, total_q] base 2: the backward's residual)."""
  out, lse2 = flash_forward(q, k, v, cu_q, cu_k, q_seg, k_seg, sinks,
                            cfg=mask, blocks=plan.fwd,
                            max_seqlen_q=max_seqlen_q, interpret=interpret)
  return out, natural_lse(lse2), lse2


def backward(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, out, lse2, dout,
             dlse, *, mask: MaskConfig, plan: KernelPlan, max_seqlen_q: int,
             max_seqlen_k: int, interpret: bool,
             all_tokens_in_sequences: bool):
  """(dq, dk, dv, dsinks) of `forward`, bitwise deterministic.

  dlse: [heads_q, total_q] cotangent of the natural-log LSE (non-finite
  entries count as 0). all_tokens_in_sequences: cu_q[-1] is the token count
  (a padded batch), so tokens outside every sequence need no zeroing."""
  dlse = jnp.where(jnp.isfinite(dlse), dlse, 0.0).astype(jnp.float32)
  dq, dk, dv, dsinks = flash_backward(
      q, k, v, out, lse2, dout.astype(q.dtype), cu_q, cu_k, q_seg, k_seg,
      sinks, dlse, cfg=mask, blocks=plan.bwd, max_seqlen_q=max_seqlen_q,
      max_seqlen_k=max_seqlen_k, interpret=interpret, dq_mode=plan.dq_mode,
      all_tokens_in_sequences=all_tokens_in_sequences)
  if sinks is not None:
    dsinks = dsinks.astype(sinks.dtype)
  return dq, dk, dv, dsinks
