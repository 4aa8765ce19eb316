"""The DeBERTa op's framework-neutral core: configuration, forward and
backward of the Pallas kernels, and the layout glue around them, shared by
`jax_api.deberta` (its `jax.custom_vjp`) and `torch_bridge.deberta` (its
custom ops and the direct launch's captured IR).

Layout: packed tokens. q, k, v [total, heads, head_dim]; pos_key /
pos_query [2*att_span, heads, head_dim] in q's dtype (or None); cu int32
[num_seqs + 1]; token_mask int32 [total] (a padded batch's 0/1 mask) or
None; seed uint32 scalar (`dropout_hash.seed_from_rng`) or None. A padded
batch [batch, seq, ...] is a packed batch of equal lengths (`padded_tokens`).

Residuals: the forward returns `Residuals` (its inputs, out and the
kernel's base-2 LSE); the backward recomputes the two position tables (two
small GEMMs) rather than keeping them alive between the passes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import device, settings
from pallas_kernels.deberta.backward import disentangled_backward
from pallas_kernels.deberta.config import (DebertaBlocks, KernelConfig,
                                           blocks_for, gather_orientation)
from pallas_kernels.deberta.forward import (MASKED_ROW, disentangled_forward,
                                            position_table)
from pallas_kernels.deberta.layout import geometry

__all__ = ["Residuals", "kernel_config", "kernel_blocks", "position_rows",
           "position_tables", "used_lengths", "padded_tokens",
           "zero_outside", "forward", "backward"]


class Residuals(NamedTuple):
  """What the backward needs of a forward (a pytree; None where absent)."""

  q: jax.Array
  k: jax.Array
  v: jax.Array
  pos_key: jax.Array | None
  pos_query: jax.Array | None
  cu: jax.Array
  token_mask: jax.Array | None
  seed: jax.Array | None
  out: jax.Array
  lse2: jax.Array  # float32 [heads, total]


def kernel_config(position_buckets: int, max_relative_positions: int, *,
                  c2p: bool, p2c: bool, token_mask: bool,
                  dropout_rate: float, head_dim: int,
                  interpret: bool) -> KernelConfig:
  """The kernels' static options under the current settings.

  token_mask: the call passes a padded batch's token mask. Full tiles
  without load masks are on for GPUs and off in interpret mode (half the
  traced loop bodies); KernelSettings.deberta_split_tiles forces them. The
  bits do not depend on it (the same float operations either way)."""
  split = settings.current().deberta_split_tiles
  if split is None:
    split = not interpret
  geo = geometry(int(position_buckets), int(max_relative_positions))
  return KernelConfig(geo, bool(c2p), bool(p2c), bool(token_mask),
                      float(dropout_rate), int(head_dim), split,
                      gather_orientation())


def kernel_blocks(head_dim: int, dtype, *, interpret: bool) -> DebertaBlocks:
  """The shipped tiles for the default device (or interpret mode)."""
  return blocks_for(head_dim=head_dim, dtype=dtype, interpret=interpret,
                    compute_capability=None if interpret else
                    device.gpu_capability())


def position_rows(pos, cfg: KernelConfig, dtype):
  """[>= 2*att_span, heads, head_dim] -> the 2*att_span rows the kernels
  read, in `dtype` (HF slices the rest off too); None stays None."""
  if pos is None:
    return None
  return jnp.asarray(pos)[: cfg.geometry.slots].astype(dtype)


def position_tables(q, k, pos_key, pos_query, cfg: KernelConfig,
                    blocks: DebertaBlocks, interpret: bool):
  """c2p = Q Kpos^T and p2c = K Qpos^T, [total, heads, 2*span] in q's dtype
  (float32 accumulation; what HF computes with two bmm), by a fixed-tile
  Pallas GEMM so that each token's row is batch-independent."""
  c = p = None
  if cfg.c2p:
    c = position_table(q, pos_key, blocks=blocks.table, interpret=interpret)
  if cfg.p2c:
    p = position_table(k, pos_query, blocks=blocks.table,
                       interpret=interpret)
  return c, p


def used_lengths(token_mask, cu, max_seqlen: int):
  """int32 [num_seqs]: a right-padded (or unpadded) row's valid length,
  else MASKED_ROW (computed on the device: no host sync). The forward and
  the backward then skip a right-padded row's padding tiles and do not read
  its mask, with the same bits (see `pallas_kernels.deberta.forward`).
  token_mask: int [num_seqs * max_seqlen]; cu: the padded batch's."""
  b = cu.shape[0] - 1
  m = token_mask.reshape(b, max_seqlen) != 0
  n = jnp.sum(m, axis=1, dtype=jnp.int32)
  prefix = jnp.arange(max_seqlen, dtype=jnp.int32)[None, :] < n[:, None]
  return jnp.where(jnp.all(m == prefix, axis=1), n, MASKED_ROW)


def padded_tokens(batch: int, seq: int, attention_mask=None):
  """A padded batch as packed tokens: (cu int32 [batch + 1], token_mask
  int32 [batch * seq] or None) from attention_mask [batch, seq] 0/1."""
  cu = jnp.arange(batch + 1, dtype=jnp.int32) * seq
  if attention_mask is None:
    return cu, None
  return cu, (jnp.asarray(attention_mask) != 0).astype(jnp.int32).reshape(-1)


def zero_outside(out, cu):
  """Packed out [total, heads, head_dim] with the tokens past cu[-1] (in no
  sequence) set to 0."""
  in_seq = jnp.arange(out.shape[0]) < cu[-1]
  return jnp.where(in_seq[:, None, None], out, 0).astype(out.dtype)


def forward(q, k, v, pos_key, pos_query, cu, token_mask, seed, *,
            cfg: KernelConfig, blocks: DebertaBlocks, max_seqlen: int,
            interpret: bool) -> tuple[jax.Array, Residuals]:
  """(out [total, heads, head_dim] in q's dtype, Residuals)."""
  c, p = position_tables(q, k, pos_key, pos_query, cfg, blocks, interpret)
  lens = (None if token_mask is None else
          used_lengths(token_mask, cu, max_seqlen))
  out, lse2 = disentangled_forward(q, k, v, c, p, cu, token_mask, seed, lens,
                                   cfg=cfg, blocks=blocks.fwd,
                                   max_seqlen=max_seqlen, interpret=interpret)
  return out, Residuals(q, k, v, pos_key, pos_query, cu, token_mask, seed,
                        out, lse2)


def backward(res: Residuals, dout, *, cfg: KernelConfig,
             blocks: DebertaBlocks, max_seqlen: int, interpret: bool):
  """(dq, dk, dv, dpos_key, dpos_query) of `forward`, bitwise
  deterministic; dpos_* are None where the position input is."""
  q, k, v, pos_key, pos_query, cu, token_mask, seed, out, lse2 = res
  # The barrier (with dO) keeps XLA from merging this recomputation with
  # the forward's identical one (CSE) or scheduling it before the backward
  # reaches this layer, either of which would keep the tables alive from
  # the forward to the backward.
  (tq, tk, tpk, tpq), dout = jax.lax.optimization_barrier(
      ((q, k, pos_key, pos_query), dout))
  c, p = position_tables(tq, tk, tpk, tpq, cfg, blocks, interpret)
  lens = (None if token_mask is None else
          used_lengths(token_mask, cu, max_seqlen))
  dq, dk, dv, dpk, dpq = disentangled_backward(
      q, k, v, pos_key, pos_query, c, p, out, lse2, dout.astype(q.dtype), cu,
      token_mask, seed, lens, cfg=cfg, blocks=blocks, max_seqlen=max_seqlen,
      interpret=interpret)
  dpk = None if pos_key is None else dpk.astype(pos_key.dtype)
  dpq = None if pos_query is None else dpq.astype(pos_query.dtype)
  return dq, dk, dv, dpk, dpq
