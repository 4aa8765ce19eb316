"""Flash-attention forward kernel over a packed token layout.

Dense batches are packed too ([batch, seq] -> [batch * seq] with cu_seqlens =
arange(batch + 1) * seq, a free reshape), so one kernel body serves dense,
varlen, causal, windowed, GQA, segment-masked, sink and soft-capped attention
through static arguments.

Layouts:
  q: [total_q, heads_q, head_dim]     k, v: [total_k, heads_kv, head_dim]
  cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1]
  q_segment_ids: int32 [total_q], kv_segment_ids: int32 [total_k] (optional)
  sinks: float32 [heads_q] (optional)
Outputs:
  out: [total_q, heads_q, head_dim] (rows outside every sequence unwritten)
  lse2: float32 [heads_q, total_q], log-sum-exp in base 2; +inf for a row that
    sees no key and has no sink (so the backward's exp2(s - lse2) is 0 there).

Programs: one per (query tile of the longest sequence, sequence, query
head), launched in `tiles.LaunchOrder` (waves of heads, costliest tiles
first). Each program
owns one query tile of one head and walks the key tiles its rows can see:
first the unmasked band interior, then the masked edges; tiles no row can
see are never visited.

Non-finite inputs, two launches of one body: a masked tile still meets its
hidden pairs in P @ V with weight 0, and 0 * NaN = NaN would reach rows that
never see a bad v. The fast launch (`contain=False`) runs as if inputs were
finite and writes, per row, a flag (int32 [heads_q, total_q], one value per
tile) set where its tile's output holds a NaN or Inf. The second launch
(`contain=True`, `fold_flash_forward_contain`, outputs aliased) redoes only
the flagged tiles with masked steps that multiply by v's finite part and
mark the rows that see a bad v (out NaN, LSE kept); its other programs read
one flag and end. A branch inside one kernel would do the same work but
changes how the fast loops compile (more spills), so the twin is a second
kernel. Rows of clean tiles keep the fast launch's bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
# Imported eagerly: interpret mode imports it lazily on first use, which
# changes a jit cache key and recompiles the first call a second time.
import jax.experimental.pallas.fuser  # noqa: F401

from pallas_kernels import pip_triton
from pallas_kernels.flash import tiles
from pallas_kernels.flash.tiles import LOG2E, MaskConfig
from pallas_kernels.flash.config import BlockSizes, head_dim_bucket


def dot_precision(dtype):
  """fp32 inputs get full-precision dots (Triton would use TF32 otherwise)."""
  return (lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None)


def _folded_scale(cfg: MaskConfig):
  """The base-2 score scale to apply late, or None (soft-cap, scale <= 0).

  Without a soft-cap the scores are qk * c with c = scale * log2(e). For c > 0
  rounding is monotone, so max_j(round(qk_j * c)) == round(max_j(qk_j) * c):
  the kernel takes the row max of the raw products and scales only the
  [block_q] maxima, and p = exp2(qk * c - m) is one FMA per score (the GPU
  already contracted the old round(qk * c) - m into that FMA). Same values,
  one multiply per score fewer.
  """
  c = cfg.scale * LOG2E
  if cfg.softcap > 0.0 or not c > 0.0:
    return None
  return c


def _forward_kernel(cu_q_ref, cu_k_ref, q_ref, k_ref, v_ref, *refs,
                    cfg: MaskConfig, block_q: int, block_k: int, head_dim: int,
                    has_sinks: bool, order: tiles.LaunchOrder,
                    contain: bool):
  refs = list(refs)
  q_seg_ref = k_seg_ref = sinks_ref = None
  if cfg.has_segments:
    q_seg_ref, k_seg_ref = refs.pop(0), refs.pop(0)
  if has_sinks:
    sinks_ref = refs.pop(0)
  if contain:  # flags in; out and lse aliased to the fast launch's
    flag_ref, _, _, o_ref, lse_ref = refs
  else:
    o_ref, lse_ref, flag_ref = refs

  # Last query tiles first (order.reverse): under a causal mask they see the
  # most keys, so the longest programs start first.
  q_blk, seq, head = order.program()
  q_off = cu_q_ref[seq]
  len_q = cu_q_ref[seq + 1] - q_off
  k_off = cu_k_ref[seq]
  len_k = cu_k_ref[seq + 1] - k_off
  q0 = q_blk * block_q
  d_pad = q_ref.shape[-1]
  precision = dot_precision(q_ref.dtype)

  # Programs past their sequence write no flag and read none.
  @tiles.when_flagged(q0 < len_q, flag_ref, q_off + q0, contain)
  def _():
    head_mask = tiles.head_dim_mask(head_dim, d_pad)
    q_pos = q0 + jnp.arange(block_q)
    # min() is the identity here (q0 < len_q), but it keeps the q tile's
    # addresses and row mask distinct from the output store's: identical
    # expressions are CSE'd into one [block_q, d_pad] offset tensor and mask
    # kept live across both key loops (at 4 warps that spilled in the loop).
    q_start = jnp.minimum(q_off + q0, q_ref.shape[0] - 1)
    q = tiles.load(q_ref.at[pl.ds(q_start, block_q), :],
                    mask=tiles.mask_and((q_pos < len_q)[:, None], head_mask),
                    other=0.0)
    q_seg = None
    if cfg.has_segments:
      q_seg = tiles.load(q_seg_ref.at[pl.ds(q_off + q0, block_q)],
                         mask=q_pos < len_q, other=-1)

    lo, hi = tiles.key_range(cfg, q0, block_q, len_q, len_k)
    ulo, uhi = tiles.unmasked_key_range(cfg, q0, block_q, len_q, len_k,
                                         keys_in_bounds=True)
    if cfg.has_segments:  # segments can cut any tile: mask them all
      ulo, uhi = hi, hi
    first, n_pre, full_first, n_full, post_first, n_post = tiles.block_split(
        lo, hi, ulo, uhi, block_k)
    fold = _folded_scale(cfg)

    def step(k_blk, carry, masked: bool):
      acc, m_prev, l_prev, poison = carry
      k0 = k_blk * block_k
      k_pos = k0 + jnp.arange(block_k)
      kv_mask = head_mask
      if masked:
        kv_mask = tiles.mask_and((k_pos < len_k)[:, None], head_mask)
      k = tiles.load(k_ref.at[pl.ds(k_off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      qk = plgpu.dot(q, k, trans_b=True, precision=precision)
      # s: raw products when the base-2 scale is folded (see _folded_scale),
      # else scores already in the base-2 domain.
      s = qk if fold is not None else tiles.scores_log2(cfg, qk)
      if masked:
        k_seg = None
        if cfg.has_segments:
          k_seg = tiles.load(k_seg_ref.at[pl.ds(k_off + k0, block_k)],
                             mask=k_pos < len_k, other=-2)
        vis = tiles.visible(cfg, q_pos, k_pos, len_q, len_k, q_seg, k_seg)
        s = jnp.where(vis, s, -jnp.inf)
      row_max = jnp.max(s, axis=1)
      if fold is not None:
        row_max = row_max * fold
      m_next = jnp.maximum(m_prev, row_max)
      if masked:  # a row may still have seen nothing: keep exp2 away from NaN
        m_next_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
      else:
        m_next_safe = m_next
      alpha = jnp.exp2(m_prev - m_next_safe)
      if fold is not None:  # one FMA per score: s * fold - m
        p = jnp.exp2(s * fold - m_next_safe[:, None])
      else:
        p = jnp.exp2(s - m_next_safe[:, None])
      l_next = l_prev * alpha + jnp.sum(p, axis=1)
      v = tiles.load(v_ref.at[pl.ds(k_off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      if masked and contain:
        # A hidden pair still meets in P @ V with P_ij = 0, and 0 * NaN =
        # NaN: multiply by the finite part of v and mark the rows that see a
        # non-finite v row instead (their out is NaN, their LSE unchanged).
        v, bad_row = tiles.finite_part(v)
        poison = jnp.maximum(poison, tiles.rows_that_see(vis, bad_row))
      acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v,
                                             precision=precision)
      return acc, m_next, l_next, poison

    acc = jnp.zeros((block_q, d_pad), jnp.float32)
    if has_sinks:
      # The sink joins the denominator: start from m = sink, l = exp2(0) = 1.
      m = jnp.full((block_q,), sinks_ref[head] * LOG2E, jnp.float32)
      l = jnp.ones((block_q,), jnp.float32)
    else:
      m = jnp.full((block_q,), -jnp.inf, jnp.float32)
      l = jnp.zeros((block_q,), jnp.float32)
    # 1.0 on rows that see a non-finite v entry in a masked tile (unmasked
    # tiles propagate it through the product by themselves); contain only.
    poison = jnp.zeros((block_q,), jnp.float32)
    carry = (acc, m, l, poison)
    carry = lax.fori_loop(
        0, n_full, lambda t, c: step(full_first + t, c, False), carry)
    carry = lax.fori_loop(
        0, n_pre + n_post,
        lambda t, c: step(jnp.where(t < n_pre, first + t,
                                    post_first + t - n_pre), c, True), carry)
    acc, m, l, poison = carry
    if contain:
      # l == 0, not !(l > 0): a row with a NaN score has l = NaN and must
      # keep a NaN LSE (the backward's P of that row is then NaN, as in the
      # reference, whatever finite part of q it recomputes with). Rows that
      # see a non-finite v get out = NaN and keep their LSE.
      seen = l != 0.0
      l_safe = jnp.where(seen, l, 1.0)
      out = acc / jnp.where(poison > 0.0, jnp.nan, l_safe)[:, None]
    else:  # a NaN here flags the tile: the second launch redoes it
      seen = l > 0.0
      l_safe = jnp.where(seen, l, 1.0)
      out = acc / l_safe[:, None]
    lse2 = jnp.where(seen, m + jnp.log2(l_safe), jnp.inf)
    q_valid = jnp.arange(block_q) < len_q - q0  # not q_pos < len_q: see q
    plgpu.store(o_ref.at[pl.ds(q_off + q0, block_q), :],
                out.astype(o_ref.dtype),
                mask=tiles.mask_and(q_valid[:, None], head_mask))
    plgpu.store(lse_ref.at[pl.ds(q_off + q0, block_q)], lse2, mask=q_valid)
    if not contain:
      plgpu.store(flag_ref.at[pl.ds(q_off + q0, block_q)],
                  jnp.broadcast_to(tiles.has_non_finite(out), (block_q,)),
                  mask=q_valid)


@functools.partial(
    jax.jit,
    static_argnames=("cfg", "blocks", "max_seqlen_q", "interpret"))
def flash_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, q_segment_ids=None,
                  kv_segment_ids=None, sinks=None, *, cfg: MaskConfig,
                  blocks: BlockSizes, max_seqlen_q: int,
                  interpret: bool = False):
  """Returns (out [total_q, heads_q, head_dim], lse2 [heads_q, total_q])."""
  total_q, heads_q, head_dim = q.shape
  total_k, heads_kv, _ = k.shape
  group = heads_q // heads_kv
  num_seqs = cu_seqlens_q.shape[0] - 1
  d_pad = head_dim_bucket(head_dim)
  block_q, block_k = blocks.block_q, blocks.block_k

  order = tiles.query_tile_order(
      k, d_pad, n_tiles=pl.cdiv(max_seqlen_q, block_q), num_seqs=num_seqs,
      heads_q=heads_q, heads_per_wave=blocks.heads_per_wave)
  head_of = order.head

  def full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

  q_spec = pl.BlockSpec((total_q, None, d_pad),
                        lambda *ids: (0, head_of(*ids), 0))
  kv_spec = pl.BlockSpec((total_k, None, d_pad),
                         lambda *ids: (0, head_of(*ids) // group, 0))
  in_specs = [full(cu_seqlens_q.shape), full(cu_seqlens_k.shape), q_spec,
              kv_spec, kv_spec]
  args = [cu_seqlens_q, cu_seqlens_k, q, k, v]
  if cfg.has_segments:
    in_specs += [full(q_segment_ids.shape), full(kv_segment_ids.shape)]
    args += [q_segment_ids, kv_segment_ids]
  if sinks is not None:
    in_specs.append(full(sinks.shape))
    args.append(sinks.astype(jnp.float32))
  flag_shape = (heads_q, total_q)
  rows_spec = pl.BlockSpec((None, total_q), lambda *ids: (head_of(*ids), 0))
  out_specs = [q_spec, rows_spec]
  out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype),
               jax.ShapeDtypeStruct((heads_q, total_q), jnp.float32)]
  params = pip_triton.compiler_params(blocks.compiler, blocks.num_warps,
                                      blocks.num_stages)

  def launch(contain, extra_specs, extra_args, aliases, outs):
    kernel = functools.partial(
        _forward_kernel, cfg=cfg, block_q=block_q, block_k=block_k,
        head_dim=head_dim, has_sinks=sinks is not None, order=order,
        contain=contain)
    return pl.pallas_call(
        kernel, grid=order.grid, in_specs=in_specs + extra_specs,
        out_specs=outs[0], out_shape=outs[1], input_output_aliases=aliases,
        compiler_params=params, interpret=interpret,
        name="fold_flash_forward_contain" if contain else
        "fold_flash_forward")(*args, *extra_args)

  # The fast launch lets a non-finite v entry reach rows that never see it
  # (a hidden pair meets it in P @ V with weight 0, and 0 * NaN = NaN); its
  # programs flag the tiles whose out holds a non-finite value. Only those
  # run again, with the masked steps containing it (a program of the second
  # launch that finds no flag ends at once). Clean tiles keep the fast bits.
  out, lse2, flags = launch(
      False, [], [], {},
      (out_specs + [rows_spec],
       out_shape + [jax.ShapeDtypeStruct(flag_shape, jnp.int32)]))
  n_in = len(args) + 3
  out, lse2 = launch(True, [rows_spec] + out_specs,
                     [flags, out, lse2], {n_in - 2: 0, n_in - 1: 1},
                     (out_specs, out_shape))
  return out, lse2
