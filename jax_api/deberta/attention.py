"""`disentangled_attention`: DeBERTa-v2/v3 attention with a custom VJP over
the Pallas kernels (`pallas_kernels.deberta`), or a chunked XLA path.

Conventions are those of `pallas_kernels.reference.deberta` (HF's scale and
index placement; a fully masked query row gives 0 and zero gradients).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jax_api import _validation as val
from jax_api.contract import deberta as _cdb
from jax_api._backend import _gpu_capability, resolve_backend
from pallas_kernels import settings
from pallas_kernels.varlen import token_seq_ids
from pallas_kernels.deberta import dropout_hash
from pallas_kernels.deberta.layout import geometry
from pallas_kernels.deberta.backward import disentangled_backward
from pallas_kernels.deberta.config import (DebertaBlocks, KernelConfig,
                                           blocks_for, gather_orientation)
from pallas_kernels.deberta.forward import (MASKED_ROW, disentangled_forward,
                                            position_table)
from jax_api.deberta._xla import xla_disentangled

_HIGHEST = jax.lax.Precision.HIGHEST


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _kernel_attention(q, k, v, pos_key, pos_query, cu, token_mask, seed,
                      cfg: KernelConfig, blocks: DebertaBlocks,
                      max_seqlen: int, interpret: bool):
  return _fwd(q, k, v, pos_key, pos_query, cu, token_mask, seed, cfg, blocks,
              max_seqlen, interpret)[0]


def _used_lengths(token_mask, cu, max_seqlen: int):
  """int32 [num_seqs]: a right-padded (or unpadded) row's valid length,
  else MASKED_ROW (computed on the device: no host sync). The forward and
  the backward then skip a right-padded row's padding tiles and do not read
  its mask, with the same bits (see `pallas_kernels.deberta.forward`)."""
  b = cu.shape[0] - 1
  m = token_mask.reshape(b, max_seqlen) != 0
  n = jnp.sum(m, axis=1, dtype=jnp.int32)
  prefix = jnp.arange(max_seqlen, dtype=jnp.int32)[None, :] < n[:, None]
  return jnp.where(jnp.all(m == prefix, axis=1), n, MASKED_ROW)


def _fwd(q, k, v, pos_key, pos_query, cu, token_mask, seed, cfg, blocks,
         max_seqlen, interpret):
  c, p = position_tables(q, k, pos_key, pos_query, cfg, blocks,
                         interpret)
  lens = (None if token_mask is None else
          _used_lengths(token_mask, cu, max_seqlen))
  out, lse2 = disentangled_forward(q, k, v, c, p, cu, token_mask, seed, lens,
                                   cfg=cfg, blocks=blocks.fwd,
                                   max_seqlen=max_seqlen, interpret=interpret)
  # The position tables are recomputed in the backward (two small GEMMs)
  # rather than kept alive between the passes.
  return out, (q, k, v, pos_key, pos_query, cu, token_mask, seed, out, lse2)


def _bwd(cfg, blocks, max_seqlen, interpret, res, do):
  q, k, v, pos_key, pos_query, cu, token_mask, seed, out, lse2 = res
  # The barrier (with dO) keeps XLA from merging this recomputation with
  # the forward's identical one (CSE) or scheduling it before the backward
  # reaches this layer, either of which would keep the tables alive from
  # the forward to the backward.
  (tq, tk, tpk, tpq), do = jax.lax.optimization_barrier(
      ((q, k, pos_key, pos_query), do))
  c, p = position_tables(tq, tk, tpk, tpq, cfg, blocks, interpret)
  lens = (None if token_mask is None else
          _used_lengths(token_mask, cu, max_seqlen))
  dq, dk, dv, dpk, dpq = disentangled_backward(
      q, k, v, pos_key, pos_query, c, p, out, lse2, do.astype(q.dtype), cu,
      token_mask, seed, lens, cfg=cfg, blocks=blocks, max_seqlen=max_seqlen,
      interpret=interpret)
  dpk = None if pos_key is None else dpk.astype(pos_key.dtype)
  dpq = None if pos_query is None else dpq.astype(pos_query.dtype)
  return dq, dk, dv, dpk, dpq, None, None, None


_kernel_attention.defvjp(_fwd, _bwd)


def _check_pos(name, pos, span, h, d, dtype):
  if pos is not None:
    val.check_array(name, pos, ndim=3, layout="[2*att_span, heads, head_dim]")
  _cdb.check_position_table(name, None if pos is None else pos.shape,
                            None if pos is None else pos.dtype, span, h, d)
  return jnp.asarray(pos)[: 2 * span].astype(dtype)


def _check_options(position_buckets, max_relative_positions, pos_att_type,
                   dropout_rate, dropout_rng):
  return _cdb.check_options(position_buckets, max_relative_positions,
                            pos_att_type, dropout_rate,
                            dropout_rng is not None)


@settings.accepts_config
def disentangled_attention(
    q: jax.Array, k: jax.Array, v: jax.Array,
    pos_key: jax.Array | None = None, pos_query: jax.Array | None = None, *,
    attention_mask: jax.Array | None = None,
    cu_seqlens: jax.Array | None = None, max_seqlen: int | None = None,
    position_buckets: int = 256, max_relative_positions: int = 512,
    pos_att_type: Sequence[str] = ("c2p", "p2c"),
    dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
    backend: str = "auto") -> jax.Array:
  """DeBERTa-v2/v3 disentangled self-attention (HF `DisentangledSelfAttention`
  from projected q/k/v on), differentiable in q, k, v, pos_key and pos_query.

  Args:
    q, k, v: [batch, seq, heads, head_dim] (bf16, fp16 or fp32), or with
      `cu_seqlens` packed [total, heads, head_dim].
    pos_key: [>= 2*att_span, heads, head_dim]: the relative embeddings
      (HF `encoder.get_rel_embedding()`) through the key projection (or
      `pos_key_proj`); needed iff "c2p" in pos_att_type. Rows past
      2*att_span are ignored (HF slices them off too).
    pos_query: the same through the query projection (or `pos_query_proj`);
      needed iff "p2c" in pos_att_type.
    attention_mask: [batch, seq] 0/1 (or bool); pair (i, j) is visible iff
      both tokens are. A fully masked row outputs 0 (HF outputs the mean of
      v there). Not with cu_seqlens.
    cu_seqlens: int32 [num_seqs + 1] cumulative lengths of packed sequences;
      positions restart at 0 in each; tokens past cu_seqlens[-1] output 0.
    max_seqlen: longest packed sequence (static int); taken from concrete
      cu_seqlens when omitted (pass it under jit).
    position_buckets, max_relative_positions: as in DebertaV2Config
      (max_relative_positions already resolved to >= 1).
    pos_att_type: subset of ("c2p", "p2c") (or HF's "c2p|p2c" string).
    dropout_rate, dropout_rng: attention-probability dropout; the mask is a
      counter-based hash of (seed from dropout_rng, sequence, head, i, j),
      regenerated in the backward, never stored.
    backend: "auto", "pallas", "interpret" or "xla" (jax_api._backend).
      "xla" is a chunked pure-JAX path (one [batch, heads, 128, seq] score
      block at a time, autodiff backward, not bitwise deterministic on GPU).
    config: a `jax_api.KernelSettings` (compiler, tiles); None: the
      documented defaults (`pallas_kernels.settings`).

  Returns:
    out shaped like q, in q's dtype.
  """
  packed = cu_seqlens is not None
  val.check_qkv(q, k, v, packed=packed)
  _cdb.check_self_attention(q.shape, k.shape)
  c2p, p2c, rate = _check_options(position_buckets, max_relative_positions,
                                  pos_att_type, dropout_rate, dropout_rng)
  geo = geometry(int(position_buckets), int(max_relative_positions))
  *lead, h, d = q.shape
  pk = _check_pos("pos_key", pos_key, geo.span, h, d, q.dtype) if c2p else None
  pq = (_check_pos("pos_query", pos_query, geo.span, h, d, q.dtype)
        if p2c else None)
  if packed:
    _cdb.check_packed_mask_exclusive(attention_mask is not None)
    val.check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[0])
    val.concrete_max_seqlen("max_seqlen", cu_seqlens, max_seqlen)
  elif attention_mask is not None:
    val.check_array("attention_mask", attention_mask, ndim=2,
                    layout="[batch, seq]")
    _cdb.check_attention_mask(attention_mask.shape, lead)
  seed = (dropout_hash.seed_from_rng(dropout_rng) if rate > 0 else None)
  be = resolve_backend(backend, kernel="disentangled_attention")
  # Full tiles without load masks: on for GPUs, off in interpret mode (half
  # the traced loop bodies); KernelSettings.deberta_split_tiles forces it.
  # The bits do not depend on it (same float operations either way).
  split = settings.current().deberta_split_tiles
  if split is None:
    split = be != "interpret"
  cfg = KernelConfig(geo, c2p, p2c, attention_mask is not None and not packed,
                     rate, d, split, gather_orientation())

  if be == "xla":
    if packed:
      cu = jnp.asarray(cu_seqlens, jnp.int32)
      t = jnp.arange(q.shape[0], dtype=jnp.int32)
      sid = token_seq_ids(cu, q.shape[0])
      valid = t < cu[-1]
      sid = jnp.where(valid, sid, -1)
      pos = t - cu[jnp.clip(sid, 0, cu.shape[0] - 2)]
      out = xla_disentangled(q[None], k[None], v[None], pk, pq, sid[None],
                             pos[None], valid[None], seed, cfg=cfg)[0]
      return jnp.where(valid[:, None, None], out, 0).astype(q.dtype)
    b, s = lead
    seg = jnp.broadcast_to(jnp.arange(b, dtype=jnp.int32)[:, None], (b, s))
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    valid = (jnp.ones((b, s), bool) if attention_mask is None
             else jnp.asarray(attention_mask) != 0)
    return xla_disentangled(q, k, v, pk, pq, seg, pos, valid, seed, cfg=cfg)

  interpret = be == "interpret"
  cc = None if interpret else _gpu_capability()
  blocks = blocks_for(head_dim=d, dtype=q.dtype, interpret=interpret,
                      compute_capability=cc)
  if packed:
    ms = val.concrete_max_seqlen("max_seqlen", cu_seqlens, max_seqlen)
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    out = _kernel_attention(q, k, v, pk, pq, cu, None, seed, cfg, blocks,
                            ms or q.shape[0], interpret)
    in_seq = jnp.arange(q.shape[0]) < cu[-1]
    return jnp.where(in_seq[:, None, None], out, 0).astype(q.dtype)
  b, s = lead
  cu = jnp.arange(b + 1, dtype=jnp.int32) * s
  tm = None
  if attention_mask is not None:
    tm = (jnp.asarray(attention_mask) != 0).astype(jnp.int32).reshape(-1)
  out = _kernel_attention(q.reshape(b * s, h, d), k.reshape(b * s, h, d),
                          v.reshape(b * s, h, d), pk, pq, cu, tm, seed, cfg,
                          blocks, s, interpret)
  return out.reshape(b, s, h, d)
