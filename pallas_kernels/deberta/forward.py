"""DeBERTa disentangled-attention forward kernel (packed token layout).

Layouts (as `pallas_kernels.flash.forward`):
  q, k, v: [total, heads, head_dim]; cu_seqlens: int32 [num_seqs + 1]
  c2p table: [total, heads, 2*span]  = Q . Kpos^T  (row: query token)
  p2c table: [total, heads, 2*span]  = K . Qpos^T  (row: key token)
  slot_table: int32 [width] (see `layout`)
  token_mask (optional): int32 [total], pair (i, j) visible iff both != 0
  seq_lens (optional): int32 [num_seqs], the tokens each sequence uses from
    the start of its cu_seqlens slot (FlashAttention's `seqused`); the rest
    of the slot is padding: never attended to, written as 0 (lse2 +inf),
    and its tiles are not computed. Those n tokens are all valid: the token
    mask is not read for the sequence. MASKED_ROW (-1) instead: the
    sequence uses its whole slot and the token mask says which of its
    tokens are valid
  seed (optional): uint32 [1]
Outputs: out [total, heads, head_dim] (rows outside every sequence
unwritten), lse2 float32 [heads, total] (base 2; +inf for rows that see no
key).

A right-padded batch row with its token mask gives the same bits with
seq_lens = its valid length as without (the skipped key tiles only ever
added exact zeros; every tile runs the same float operations, and inside
the valid prefix the mask selects everything), so the padded-batch API
passes seq_lens computed on the device from the mask: a row's length when
its valid tokens are a prefix, MASKED_ROW otherwise. Not reading the mask
saves 8% of a layer (both position tables and this kernel) at B16 L512 and
21% at B4 L2048 (DeBERTa-v3-base shapes, H200, pip Triton's compile;
a tile sweep of the direct launch without the mask, since removed: see git history).

Score of (i, j), in base 2:
  (q_i . k_j + c2p[i, slot(i - j)] + p2c[j, slot(i - j)]) * log2(e) / c
with c = sqrt(head_dim * n_terms). The two tables are [*, L, 2*span] GEMMs
done by XLA; the kernel gathers from them per tile with pointer tensors
(`cm.load(ref.at[rows_2d, cols_2d])`, an int-array NDIndexer that Pallas'
Triton lowering turns into one `tt.load` of a pointer tensor).

Grid: (query tiles of the longest sequence, num_seqs, heads). A program owns
one query tile of one head and walks its sequence's key tiles in increasing
order, in three contiguous ranges: tiles whose pairs all have
i - j >= r_pos (saturated: every position term is one column, loaded once
per row or per key tile as a vector, no gather), the band tiles (gathers),
and tiles with i - j <= -r_neg (saturated at column 0). Only the partial last
key tile (or every tile when a token mask is given) applies masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.deberta import _common as cm
from pallas_kernels.deberta import dropout_hash
from pallas_kernels.deberta.config import KernelConfig, head_dim_pad
from pallas_kernels.flash.tiles import LOG2E, mask_and
from pallas_kernels.flash.config import BlockSizes
from pallas_kernels.flash.forward import dot_precision

# seq_lens entry of a sequence whose token mask is not a valid prefix.
MASKED_ROW = -1


def _forward_kernel(cu_ref, slot_ref, *refs, cfg: KernelConfig, block_q: int,
                    block_k: int, has_lens: bool):
  refs = list(refs)
  mask_ref = refs.pop(0) if cfg.has_mask else None
  lens_ref = refs.pop(0) if has_lens else None
  seed_ref = refs.pop(0) if cfg.has_dropout else None
  q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  c_ref = refs.pop(0) if cfg.c2p else None
  p_ref = refs.pop(0) if cfg.p2c else None
  o_ref, lse_ref = refs

  q_blk, seq, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  off = cu_ref[seq]
  n_slot = cu_ref[seq + 1] - off
  n = n_slot
  row_masked = None  # static None: every row reads the mask (if any)
  if has_lens:
    used = lens_ref[seq]
    row_masked = used < 0  # MASKED_ROW
    n = jnp.where(row_masked, n_slot, jnp.minimum(n_slot, used))
  q0 = q_blk * block_q
  total, d_pad = q_ref.shape
  precision = dot_precision(q_ref.dtype)
  scale_log2 = cfg.scale * LOG2E
  g = cfg.geometry
  head_mask = cm.head_dim_mask(cfg.head_dim, d_pad)
  q_pos = q0 + jnp.arange(block_q, dtype=jnp.int32)
  # Rows written: the slot's (padding rows past seq_lens as 0 / +inf).
  q_store = mask_and((q_pos < n_slot)[:, None], head_mask)

  if has_lens:
    @pl.when((q0 >= n) & (q0 < n_slot))
    def _():
      plgpu.store(o_ref.at[pl.ds(off + q0, block_q), :],
                  jnp.zeros((block_q, d_pad), o_ref.dtype), mask=q_store)
      plgpu.store(lse_ref.at[pl.ds(off + q0, block_q)],
                  jnp.full((block_q,), jnp.inf, jnp.float32),
                  mask=q_pos < n_slot)

  @pl.when(q0 < n)
  def _():
    q_valid = q_pos < n
    q_rows = jnp.minimum(off + q_pos, total - 1)
    q = cm.load(q_ref.at[pl.ds(off + q0, block_q), :],
                   mask=mask_and(q_valid[:, None], head_mask), other=0.0)
    c_vec = {}
    if cfg.c2p:
      for kind, col in (("hi", g.slots - 1), ("lo", 0)):
        c_vec[kind] = cm.load(
            c_ref.at[pl.ds(off + q0, block_q), jnp.int32(col)], mask=q_valid,
            other=0.0).astype(jnp.float32)
    row_h = None
    if cfg.has_dropout:
      key = dropout_hash.program_key(seed_ref[0], seq, head)
      row_h = dropout_hash.row_hash(key, q_pos)

    n_kt = cm.cdiv(n, block_k)
    n_full = lax.div(n, block_k)

    def step(k_blk, carry, kind, masked, mq):
      acc, m_prev, l_prev = carry
      k0 = k_blk * block_k
      k_pos = k0 + jnp.arange(block_k, dtype=jnp.int32)
      k_valid = k_pos < n
      kv_mask = mask_and(k_valid[:, None] if masked else None, head_mask)
      k = cm.load(k_ref.at[pl.ds(off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      s = plgpu.dot(q, k, trans_b=True, precision=precision)
      bias, _ = cm.position_bias(
          cfg, kind, slot_ref=slot_ref, c_ref=c_ref, p_ref=p_ref,
          q_pos=q_pos, k_pos=k_pos, q_rows=q_rows,
          k_rows=jnp.minimum(off + k_pos, total - 1), c_sat=c_vec.get(kind),
          p_sat=cm.table_column_vec(cfg, kind, p_ref, off + k0, block_k,
                                    k_valid if masked else None),
          k_major=False)
      if bias is not None:
        s = s + bias
      # Every tile runs the same float operations (the select is applied
      # even where nothing is masked; `masked` only drops load masks), so a
      # padded batch and its packed form give the same bits.
      vis = k_valid[None, :]
      if has_lens:  # padding query rows of the partial tile see nothing
        vis = vis & q_valid[:, None]
      if mq is not None:
        mk = cm.load(mask_ref.at[pl.ds(off + k0, block_k)],
                     mask=k_valid, other=0) != 0
        vis = vis & mk[None, :] & mq[:, None]
      s = jnp.where(vis, s, -jnp.inf)
      s = s * scale_log2
      m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
      m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
      alpha = jnp.exp2(m_prev - m_safe)
      p = jnp.exp2(s - m_safe[:, None])
      l_next = l_prev * alpha + jnp.sum(p, axis=1)
      if cfg.has_dropout:
        keep = dropout_hash.keep(row_h[:, None], k_pos[None, :],
                             dropout_hash.threshold(cfg.dropout_rate))
        p = jnp.where(keep, p * cfg.keep_scale, 0.0)
      v = cm.load(v_ref.at[pl.ds(off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v,
                                             precision=precision)
      return acc, m_next, l_next

    carry = (jnp.zeros((block_q, d_pad), jnp.float32),
             jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))
    ranges = cm.q_major_ranges(cfg, q0, block_q, block_k, n_kt)

    def key_loop(read_mask: bool):
      mq = None
      if read_mask:
        mq = cm.load(mask_ref.at[pl.ds(off + q0, block_q)], mask=q_valid,
                     other=0) != 0
      return cm.run_ranges(
          cfg, ranges, n_full,
          lambda t, c, kind, masked: step(t, c, kind, masked, mq), carry)

    if cfg.has_mask and row_masked is not None:
      # Two copies of the loop: rows whose valid tokens are a prefix (the
      # common right padding) never load the mask.
      acc, m, l = lax.cond(row_masked, lambda: key_loop(True),
                           lambda: key_loop(False))
    else:
      acc, m, l = key_loop(cfg.has_mask)
    seen = l > 0.0
    l_safe = jnp.where(seen, l, 1.0)
    out = acc / l_safe[:, None]
    lse2 = jnp.where(seen, m + jnp.log2(l_safe), jnp.inf)
    plgpu.store(o_ref.at[pl.ds(off + q0, block_q), :], out.astype(o_ref.dtype),
                mask=q_store)
    plgpu.store(lse_ref.at[pl.ds(off + q0, block_q)], lse2,
                mask=q_pos < n_slot)


@functools.partial(jax.jit, static_argnames=("cfg", "blocks", "max_seqlen",
                                             "interpret"))
def disentangled_forward(q, k, v, c2p_table, p2c_table, cu_seqlens,
                         token_mask=None, seed=None, seq_lens=None, *,
                         cfg: KernelConfig,
                         blocks: BlockSizes, max_seqlen: int,
                         interpret: bool = False):
  """Returns (out [total, heads, head_dim], lse2 float32 [heads, total])."""
  total, heads, head_dim = q.shape
  num_seqs = cu_seqlens.shape[0] - 1
  d_pad = head_dim_pad(head_dim)
  bq, bk = blocks.block_q, blocks.block_k
  slot = jnp.asarray(cfg.geometry.slot_table())
  full = cm.full_spec
  tok = pl.BlockSpec((total, None, d_pad), lambda i, s, h: (0, h, 0))
  tab = pl.BlockSpec((total, None, cfg.geometry.slots),
                     lambda i, s, h: (0, h, 0))
  in_specs = [full(cu_seqlens.shape), full(slot.shape)]
  args = [cu_seqlens, slot]
  if cfg.has_mask:
    in_specs.append(full(token_mask.shape))
    args.append(token_mask)
  if seq_lens is not None:
    in_specs.append(full((num_seqs,)))
    args.append(jnp.asarray(seq_lens, jnp.int32))
  if cfg.has_dropout:
    in_specs.append(full((1,)))
    args.append(jnp.reshape(seed, (1,)).astype(jnp.uint32))
  in_specs += [tok, tok, tok]
  args += [q, k, v]
  if cfg.c2p:
    in_specs.append(tab)
    args.append(c2p_table)
  if cfg.p2c:
    in_specs.append(tab)
    args.append(p2c_table)
  kernel = functools.partial(_forward_kernel, cfg=cfg, block_q=bq, block_k=bk,
                             has_lens=seq_lens is not None)
  out, lse2 = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(max_seqlen, bq), num_seqs, heads),
      in_specs=in_specs,
      out_specs=[tok, pl.BlockSpec((None, total), lambda i, s, h: (h, 0))],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((heads, total), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages),
      interpret=interpret,
      name="fold_deberta_forward",
  )(*args)
  return out, lse2


def _table_kernel(x_ref, pos_ref, o_ref, *, block_rows: int, block_cols: int,
                  head_dim: int):
  blk = pl.program_id(0)
  total, d_pad = x_ref.shape
  n_cols = pos_ref.shape[0]
  head_mask = cm.head_dim_mask(head_dim, d_pad)
  r0 = blk * block_rows
  rows = pl.ds(r0, block_rows)
  r_valid = (r0 + jnp.arange(block_rows)) < total
  x = cm.load(x_ref.at[rows, :], mask=mask_and(r_valid[:, None], head_mask),
              other=0.0)
  precision = dot_precision(x_ref.dtype)
  for c0 in range(0, n_cols, block_cols):  # static: 2*span columns
    c_valid = (c0 + jnp.arange(block_cols)) < n_cols
    p = cm.load(pos_ref.at[pl.ds(c0, block_cols), :],
                mask=mask_and(c_valid[:, None], head_mask), other=0.0)
    t = plgpu.dot(x, p, trans_b=True, precision=precision)
    plgpu.store(o_ref.at[rows, pl.ds(c0, block_cols)], t.astype(o_ref.dtype),
                mask=r_valid[:, None] & c_valid[None, :])


@functools.partial(jax.jit, static_argnames=("blocks", "interpret"))
def position_table(x, pos, *, blocks: BlockSizes, interpret: bool = False):
  """x [total, heads, d] . pos [rows, heads, d]^T -> [total, heads, rows] in
  x's dtype (float32 accumulation): the c2p (x = q, pos = Kpos) or p2c
  (x = k, pos = Qpos) table. A Pallas GEMM with fixed tiles, so each token's
  row has the same bits whatever the batch (an XLA GEMM may pick its
  algorithm by shape)."""
  total, heads, head_dim = x.shape
  n_cols = pos.shape[0]
  d_pad = head_dim_pad(head_dim)
  return pl.pallas_call(
      functools.partial(_table_kernel, block_rows=blocks.block_q,
                        block_cols=blocks.block_k, head_dim=head_dim),
      grid=(pl.cdiv(total, blocks.block_q), heads),
      in_specs=[pl.BlockSpec((total, None, d_pad), lambda i, h: (0, h, 0)),
                pl.BlockSpec((n_cols, None, d_pad), lambda i, h: (0, h, 0))],
      out_specs=pl.BlockSpec((total, None, n_cols), lambda i, h: (0, h, 0)),
      out_shape=jax.ShapeDtypeStruct((total, heads, n_cols), x.dtype),
      compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps,
                                           num_stages=blocks.num_stages),
      interpret=interpret,
      name="fold_deberta_position_table",
  )(x, pos)
