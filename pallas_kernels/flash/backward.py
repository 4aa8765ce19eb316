"""Bitwise-deterministic flash-attention backward on an integer grid.

One kernel, one pass, five matrix products per tile pair (FlashAttention-2's
backward without its float atomics):

* dK, dV: a program owns one key tile of one KV head and sums over every query
  tile that sees it and every query head of its GQA group, in a fixed order,
  in registers. No other program touches those rows.
* dQ: the partial products dS_ij K_j of different key tiles go to an int32
  accumulator through integer atomics. Each partial is first quantised onto a
  power-of-two grid fixed for its query row before the reduction starts, so
  the sum is exact and the same in any order; the grid is undone once at the
  end. Integer addition is associative: the bits never depend on scheduling.

The grid of row i (query head h, sequence s) comes from a bound computed by a
preprocess pass over that sequence only (so it never depends on other
sequences of the batch):

    |dQ_i[d]| <= scale * max|K_s| * sum_j |dS_ij|
    sum_j |dS_ij| = sum_j P_ij |dO_i.V_j - D_i| <= ||dO_i|| max_j ||V_j|| + |D_i|

(sum_j P_ij <= 1; soft-capping multiplies dS by 1 - tanh^2 <= 1.) The bound is
widened by 1/8 for the rounding of P and dS, rounded up to a power of two
2^e, and the grid step is 2^(e - 29): every partial and every partial sum
stays below 2^29 in magnitude, a quarter of int32's range.

Error this adds: each of the n key tiles' partials is rounded to the nearest
grid point, so |dQ_i - exact| <= n/2 * 2^(e-29) <= n * 2^-28 * bound_i. For a
16k-token sequence in 128-key tiles (n = 128) that is 2^-21 ~ 5e-7 of the
bound: far below bf16's 2^-9 relative rounding of the stored gradient (the
bound exceeds |dQ| by the ratio of worst to typical alignment; tests check
the end-to-end error against the float32 reference).

D_i = dO_i . O_i - dlse_i and e are per-row reductions; they come from the
fixed-tile Pallas kernels of `pallas_kernels.flash.preprocess`, not from XLA
(whose reduction order and fusion may follow the batch's total shape), so
every value a row's gradients depend on is computed the same way whatever
else is in the batch.

Layouts are those of `pallas_kernels.flash.forward` (packed tokens).

Non-finite inputs, as in the forward: the fast dK/dV and dQ launches flag
the tiles whose result holds a NaN or Inf (and, for the integer-grid dQ,
key tiles holding a non-finite k, whose hidden pairs would send wrong
integer partials); `_contain` launches redo only those tiles, taking the
finite part of q (dK/dV) or k (dQ) and zeroing dS on hidden pairs in
masked steps. Under the integer-grid dQ, every dQ row of a flagged key
tile's sequence and KV head is recomputed by the containing dQ kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pip_triton
from pallas_kernels.flash import preprocess, tiles
from pallas_kernels.flash._atomics import relaxed_atomic_add
from pallas_kernels.flash.tiles import LN2, LOG2E, MaskConfig
from pallas_kernels.flash.config import BlockSizes, head_dim_bucket
from pallas_kernels.flash.forward import dot_precision

# D_i and the grid exponents come from `preprocess` (Pallas, fixed tiles):
# as XLA reductions their bits could depend on the batch's shape.
DQ_GRID_BITS = preprocess.DQ_GRID_BITS
token_sequence_ids = preprocess.token_sequence_ids


def _backward_kernel(cu_q_ref, cu_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                     delta_ref, *refs, cfg: MaskConfig,
                     block_q: int, block_k: int, head_dim: int, group: int,
                     dq_mode: str, order: tiles.LaunchOrder,
                     contain: bool):
  refs = list(refs)
  inv_grid_ref = refs.pop(0) if dq_mode == "atomic" else None
  q_seg_ref = k_seg_ref = None
  if cfg.has_segments:
    q_seg_ref, k_seg_ref = refs.pop(0), refs.pop(0)
  if contain:  # flags in; dK, dV aliased to the fast launch's; no dQ
    flag_ref, _, _, dk_ref, dv_ref = refs
  elif dq_mode == "atomic":
    _, dq_ref, dk_ref, dv_ref, flag_ref = refs  # refs[0]: dq's aliased input
  else:
    dk_ref, dv_ref, flag_ref = refs

  # First key tiles first (not order.reverse): under a causal mask every
  # query sees them, so the longest programs start first.
  k_blk, seq, _ = order.program()
  q_off = cu_q_ref[seq]
  len_q = cu_q_ref[seq + 1] - q_off
  k_off = cu_k_ref[seq]
  len_k = cu_k_ref[seq + 1] - k_off
  k0 = k_blk * block_k
  d_pad = q_ref.shape[-1]
  dtype = q_ref.dtype
  precision = dot_precision(dtype)

  @tiles.when_flagged(k0 < len_k, flag_ref, k_off + k0, contain)
  def _():
    head_mask = tiles.head_dim_mask(head_dim, d_pad)
    k_pos = k0 + jnp.arange(block_k)
    k_valid = k_pos < len_k
    # min() is the identity here (k0 < len_k), but it keeps the k/v tiles'
    # addresses and row mask distinct from the dK/dV stores' (see the
    # forward's q tile): identical expressions would be CSE'd into one
    # [block_k, d_pad] offset tensor and mask kept live across the loops.
    kv_start = jnp.minimum(k_off + k0, k_ref.shape[0] - 1)
    kv_load_mask = tiles.mask_and(k_valid[:, None], head_mask)
    k = tiles.load(k_ref.at[pl.ds(kv_start, block_k), :], mask=kv_load_mask,
                    other=0.0)
    v = tiles.load(v_ref.at[pl.ds(kv_start, block_k), :], mask=kv_load_mask,
                    other=0.0)
    # The atomic dQ's partials take k as it is: a non-finite k flags its
    # tile (checked here, while the tile is in registers).
    k_bad = (tiles.has_non_finite(k) if dq_mode == "atomic" and not contain
             else None)
    k_seg = None
    if cfg.has_segments:
      k_seg = tiles.load(k_seg_ref.at[pl.ds(k_off + k0, block_k)],
                         mask=k_valid, other=-2)

    lo, hi = tiles.query_range(cfg, k0, block_k, len_q, len_k)
    ulo, uhi = tiles.unmasked_query_range(cfg, k0, block_k, len_q, len_k)
    if cfg.has_segments:
      ulo, uhi = hi, hi
    first, n_pre, full_first, n_full, post_first, n_post = tiles.block_split(
        lo, hi, ulo, uhi, block_q)

    def step(g, q_blk, carry, masked: bool):
      dk, dv = carry
      q0 = q_blk * block_q
      rows = pl.ds(q_off + q0, block_q)
      q_pos = q0 + jnp.arange(block_q)
      q_valid = q_pos < len_q
      # Rows past the sequence load as zeros: their dO and D are 0, so they
      # add exact zeros to dK, dV and to other sequences' dQ rows.
      # Unmasked tiles lie inside the sequence: their loads need no masks.
      row_valid = q_valid if masked else None
      row_mask = tiles.mask_and(
          None if row_valid is None else row_valid[:, None], head_mask)
      q = tiles.load(q_ref.at[rows, g, :], mask=row_mask, other=0.0)
      do = tiles.load(do_ref.at[rows, g, :], mask=row_mask, other=0.0)
      lse2 = tiles.load(lse_ref.at[g, rows], mask=row_valid, other=0.0)
      delta = tiles.load(delta_ref.at[g, rows], mask=row_valid, other=0.0)
      inv_grid = None
      if dq_mode == "atomic" and not contain:
        inv_grid = tiles.load(inv_grid_ref.at[g, rows], mask=row_valid,
                              other=0.0)

      if masked and contain:
        # dK's product meets hidden pairs with dS = 0, and 0 * NaN = NaN:
        # it takes q's finite part. A row holding a non-finite q entry has
        # a NaN LSE or D (its forward row is NaN), so its visible pairs
        # still carry NaN into dK through dS.
        q, _ = tiles.finite_part(q)
      s_t = tiles.scores_log2(
          cfg, plgpu.dot(k, q, trans_b=True, precision=precision))
      p_t = jnp.exp2(s_t - lse2[None, :])  # [block_k, block_q]
      if masked:
        q_seg = None
        if cfg.has_segments:
          q_seg = tiles.load(q_seg_ref.at[rows], mask=q_valid, other=-1)
        vis = tiles.visible(cfg, q_pos, k_pos, len_q, len_k, q_seg, k_seg)
        p_t = jnp.where(vis.T, p_t, 0.0)
      dv = dv + plgpu.dot(p_t.astype(dtype), do, precision=precision)
      dp_t = plgpu.dot(v, do, trans_b=True, precision=precision)
      ds_t = p_t * (dp_t - delta[None, :])
      if masked and contain:  # P = 0 does not hide a NaN dP (bad v) or D
        ds_t = jnp.where(vis.T, ds_t, 0.0)
      if cfg.softcap > 0.0:
        t = s_t * (LN2 / cfg.softcap)  # tanh(x / softcap)
        ds_t = ds_t * (1.0 - t * t)
      ds_t = ds_t.astype(dtype)
      dk = dk + plgpu.dot(ds_t, q, precision=precision)
      if dq_mode == "atomic" and not contain:
        dq_part = plgpu.dot(ds_t, k, trans_a=True, precision=precision)
        dq_int = jnp.floor(dq_part * (cfg.scale * inv_grid)[:, None] + 0.5)
        relaxed_atomic_add(dq_ref, (rows, g, slice(None)),
                           dq_int.astype(jnp.int32))
      return dk, dv

    def head(g, carry):
      carry = lax.fori_loop(
          0, n_full, lambda t, c: step(g, full_first + t, c, False), carry)
      return lax.fori_loop(
          0, n_pre + n_post,
          lambda t, c: step(g, jnp.where(t < n_pre, first + t,
                                         post_first + t - n_pre), c, True),
          carry)

    zeros = jnp.zeros((block_k, d_pad), jnp.float32)
    dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
    # Not k_pos < len_k: see kv_start.
    kv_mask = tiles.mask_and((jnp.arange(block_k) < len_k - k0)[:, None],
                              head_mask)
    plgpu.store(dk_ref.at[pl.ds(k_off + k0, block_k), :],
                (dk * cfg.scale).astype(dk_ref.dtype), mask=kv_mask)
    plgpu.store(dv_ref.at[pl.ds(k_off + k0, block_k), :],
                dv.astype(dv_ref.dtype), mask=kv_mask)
    if not contain:
      # A non-finite dK or dV tile may hold a hidden pair's 0 * NaN: the
      # second launch redoes it (and, for the atomic dQ, its sequence's dQ).
      # `|`, not jnp.maximum: see tiles.has_non_finite.
      bad = tiles.has_non_finite(dk) | tiles.has_non_finite(dv)
      if k_bad is not None:
        bad = bad | k_bad
      plgpu.store(flag_ref.at[pl.ds(k_off + k0, block_k)],
                  jnp.broadcast_to(bad, (block_k,)),
                  mask=jnp.arange(block_k) < len_k - k0)


def _dq_kernel(cu_q_ref, cu_k_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
               delta_ref, *refs, cfg: MaskConfig, block_q: int, block_k: int,
               head_dim: int, order: tiles.LaunchOrder, contain: bool):
  """dQ without atomics: a program owns a query tile and recomputes P and dS
  for every key tile it sees (two more products than the atomic path)."""
  refs = list(refs)
  q_seg_ref = k_seg_ref = None
  if cfg.has_segments:
    q_seg_ref, k_seg_ref = refs.pop(0), refs.pop(0)
  if contain:  # flags in; dQ aliased to the fast launch's
    flag_ref, _, dq_ref = refs
  else:
    dq_ref, flag_ref = refs
  # Last query tiles first (order.reverse): under a causal mask they see
  # the most keys, so the longest programs start first.
  q_blk, seq, _ = order.program()
  q_off = cu_q_ref[seq]
  len_q = cu_q_ref[seq + 1] - q_off
  k_off = cu_k_ref[seq]
  len_k = cu_k_ref[seq + 1] - k_off
  q0 = q_blk * block_q
  d_pad = q_ref.shape[-1]
  dtype = q_ref.dtype
  precision = dot_precision(dtype)

  @tiles.when_flagged(q0 < len_q, flag_ref, q_off + q0, contain)
  def _():
    head_mask = tiles.head_dim_mask(head_dim, d_pad)
    q_pos = q0 + jnp.arange(block_q)
    q_valid = q_pos < len_q
    rows = pl.ds(q_off + q0, block_q)
    # min() is the identity (q0 < len_q): it keeps the q/dO tiles' addresses
    # and mask apart from the dQ store's (see _backward_kernel's kv_start).
    load_rows = pl.ds(jnp.minimum(q_off + q0, q_ref.shape[0] - 1), block_q)
    load_mask = tiles.mask_and(q_valid[:, None], head_mask)
    q = tiles.load(q_ref.at[load_rows, :], mask=load_mask, other=0.0)
    do = tiles.load(do_ref.at[load_rows, :], mask=load_mask, other=0.0)
    lse2 = tiles.load(lse_ref.at[rows], mask=q_valid, other=0.0)
    delta = tiles.load(delta_ref.at[rows], mask=q_valid, other=0.0)
    q_seg = None
    if cfg.has_segments:
      q_seg = tiles.load(q_seg_ref.at[rows], mask=q_valid, other=-1)
    lo, hi = tiles.key_range(cfg, q0, block_q, len_q, len_k)
    ulo, uhi = tiles.unmasked_key_range(cfg, q0, block_q, len_q, len_k,
                                         keys_in_bounds=True)
    if cfg.has_segments:
      ulo, uhi = hi, hi
    first, n_pre, full_first, n_full, post_first, n_post = tiles.block_split(
        lo, hi, ulo, uhi, block_k)

    def step(k_blk, dq, masked: bool):
      k0 = k_blk * block_k
      k_pos = k0 + jnp.arange(block_k)
      kv_mask = head_mask
      if masked:
        kv_mask = tiles.mask_and((k_pos < len_k)[:, None], head_mask)
      k = tiles.load(k_ref.at[pl.ds(k_off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      v = tiles.load(v_ref.at[pl.ds(k_off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      if masked and contain:  # dS = 0 meets a non-finite k: its finite part
        k, _ = tiles.finite_part(k)
      s = tiles.scores_log2(
          cfg, plgpu.dot(q, k, trans_b=True, precision=precision))
      p = jnp.exp2(s - lse2[:, None])
      if masked:
        k_seg = None
        if cfg.has_segments:
          k_seg = tiles.load(k_seg_ref.at[pl.ds(k_off + k0, block_k)],
                             mask=k_pos < len_k, other=-2)
        vis = tiles.visible(cfg, q_pos, k_pos, len_q, len_k, q_seg, k_seg)
        p = jnp.where(vis, p, 0.0)
      dp = plgpu.dot(do, v, trans_b=True, precision=precision)
      ds = p * (dp - delta[:, None])
      if masked and contain:  # P = 0 does not hide a NaN dP (bad v)
        ds = jnp.where(vis, ds, 0.0)
      if cfg.softcap > 0.0:
        t = s * (LN2 / cfg.softcap)
        ds = ds * (1.0 - t * t)
      return dq + plgpu.dot(ds.astype(dtype), k, precision=precision)

    dq = jnp.zeros((block_q, d_pad), jnp.float32)
    dq = lax.fori_loop(0, n_full, lambda t, c: step(full_first + t, c, False),
                       dq)
    dq = lax.fori_loop(
        0, n_pre + n_post,
        lambda t, c: step(jnp.where(t < n_pre, first + t,
                                    post_first + t - n_pre), c, True), dq)
    row_mask = tiles.mask_and(
        (jnp.arange(block_q) < len_q - q0)[:, None], head_mask)
    plgpu.store(dq_ref.at[rows, :], (dq * cfg.scale).astype(dq_ref.dtype),
                mask=row_mask)
    if not contain:  # see _backward_kernel's flags
      plgpu.store(flag_ref.at[rows],
                  jnp.broadcast_to(tiles.has_non_finite(dq), (block_q,)),
                  mask=jnp.arange(block_q) < len_q - q0)


@functools.partial(
    jax.jit, static_argnames=("cfg", "blocks", "max_seqlen_q", "max_seqlen_k",
                              "interpret", "dq_mode", "dq_blocks",
                              "all_tokens_in_sequences"))
def flash_backward(q, k, v, out, lse2, do, cu_seqlens_q, cu_seqlens_k,
                   q_segment_ids=None, kv_segment_ids=None, sinks=None,
                   dlse=None, *, cfg: MaskConfig, blocks: BlockSizes,
                   max_seqlen_q: int, max_seqlen_k: int,
                   interpret: bool = False, dq_mode: str = "atomic",
                   dq_blocks: BlockSizes | None = None,
                   all_tokens_in_sequences: bool = False):
  """Gradients of `flash_forward`.

  Args:
    q, k, v, out, do: packed layouts as in `flash_forward` (do like out).
    lse2: float32 [heads_q, total_q] from `flash_forward`.
    dlse: optional float32 [heads_q, total_q] cotangent of the natural-log
      LSE (it enters as dS_ij = P_ij (dP_ij - D_i + dlse_i)).

    dq_mode: "atomic" (one pass, dQ on the integer grid) or "recompute" (a
      second kernel recomputes P and dS per query tile; no atomics at all).
      Both are bitwise deterministic.
    dq_blocks: blocks of the recompute-mode dQ kernel (default
      `blocks.dq_blocks`: `blocks.dq` if set, else `blocks`). Like `blocks`,
      chosen per GPU generation, head dim, dtype and mode only.
    all_tokens_in_sequences: the caller promises cu_seqlens_q[-1] ==
      total_q and cu_seqlens_k[-1] == total_k (a padded batch). Then no
      token lies outside every sequence, and the passes that zero such
      tokens' gradients (a read and write of dq, dk and dv) are skipped.

  Returns:
    dq, dk, dv in the inputs' layouts and dtypes, and dsinks (float32
    [heads_q]) or None.
  """
  if dq_mode not in ("atomic", "recompute"):
    raise ValueError(
        f"dq_mode must be 'atomic' or 'recompute'; got {dq_mode!r}")
  total_q, heads_q, head_dim = q.shape
  total_k, heads_kv, _ = k.shape
  group = heads_q // heads_kv
  num_seqs = cu_seqlens_q.shape[0] - 1
  d_pad = head_dim_bucket(head_dim)
  block_q, block_k = blocks.block_q, blocks.block_k

  # Row-level masks keep tokens outside every sequence (a packed tail whose
  # out/lse were never written) from leaking garbage into dsinks or dq.
  q_in_seq = (token_sequence_ids(cu_seqlens_q, total_q) < num_seqs)[None, :]
  if not all_tokens_in_sequences:
    lse2 = jnp.where(q_in_seq, lse2, jnp.inf)
  # D = rowsum(dO * O) - dlse (0 outside every sequence) and, for the atomic
  # dQ, each row's grid exponent: fixed-tile Pallas reductions, so a row's
  # bits never depend on the batch or packing around it.
  delta, grid_exp = preprocess.backward_rows(
      out, do, dlse, k, v, cu_seqlens_q, cu_seqlens_k,
      softmax_scale=cfg.scale, max_seqlen_q=max_seqlen_q,
      max_seqlen_k=max_seqlen_k, with_grid=dq_mode == "atomic",
      interpret=interpret, compiler=blocks.compiler)
  if dq_mode == "atomic":
    inv_grid = preprocess.pow2(DQ_GRID_BITS - grid_exp)  # 2^(29 - e)

  def grouped(x):  # [total, heads_q, ...] -> [total, heads_kv, group, ...]
    return x.reshape(x.shape[0], heads_kv, group, *x.shape[2:])

  def grouped_rows(x):  # [heads_q, total] -> [heads_kv, group, total]
    return x.reshape(heads_kv, group, x.shape[-1])

  def full(shape):
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))

  # Rows past the last tile of the last sequence absorb a tile's overhang, so
  # the integer atomics need no mask (interpret mode cannot mask atomics).
  dq_rows = total_q + block_q
  dq_acc = jnp.zeros((dq_rows, heads_kv, group, d_pad), jnp.int32)
  # Q and dO of a KV head's group stream through each of its key tiles: the
  # wave of KV heads is sized so that they stay in L2.
  order = tiles.launch_order(
      n_tiles=pl.cdiv(max_seqlen_k, block_k), num_seqs=num_seqs,
      heads=heads_kv, heads_per_wave=blocks.heads_per_wave,
      bytes_per_head=2 * group * pl.cdiv(total_q, num_seqs) * d_pad
      * q.dtype.itemsize, reverse=False)
  kv_head = order.head
  q_spec = pl.BlockSpec((total_q, None, group, d_pad),
                        lambda *ids: (0, kv_head(*ids), 0, 0))
  kv_spec = pl.BlockSpec((total_k, None, d_pad),
                         lambda *ids: (0, kv_head(*ids), 0))
  row_spec = pl.BlockSpec((None, group, total_q),
                          lambda *ids: (kv_head(*ids), 0, 0))
  dq_spec = pl.BlockSpec((dq_rows, None, group, d_pad),
                         lambda *ids: (0, kv_head(*ids), 0, 0))
  in_specs = [full(cu_seqlens_q.shape), full(cu_seqlens_k.shape), q_spec,
              kv_spec, kv_spec, q_spec, row_spec, row_spec]
  args = [cu_seqlens_q, cu_seqlens_k, grouped(q), k, v, grouped(do),
          grouped_rows(lse2), grouped_rows(delta)]
  if dq_mode == "atomic":
    in_specs.append(row_spec)
    args.append(grouped_rows(inv_grid))
  seg_specs, seg_args = [], []
  if cfg.has_segments:
    seg_specs = [full(q_segment_ids.shape), full(kv_segment_ids.shape)]
    seg_args = [q_segment_ids, kv_segment_ids]
  in_specs += seg_specs
  args += seg_args
  kflag_spec = pl.BlockSpec((None, total_k), lambda *ids: (kv_head(*ids), 0))
  kflag_shape = jax.ShapeDtypeStruct((heads_kv, total_k), jnp.int32)
  out_specs = [kv_spec, kv_spec, kflag_spec]
  out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype), kflag_shape]
  aliases = {}
  if dq_mode == "atomic":
    in_specs.append(dq_spec)
    args.append(dq_acc)
    out_specs.insert(0, dq_spec)
    out_shape.insert(0, jax.ShapeDtypeStruct(dq_acc.shape, jnp.int32))
    aliases = {len(args) - 1: 0}
  params = pip_triton.compiler_params(blocks.compiler, blocks.num_warps,
                                       blocks.num_stages)

  def dkdv_kernel(contain):
    return functools.partial(
        _backward_kernel, cfg=cfg, block_q=block_q, block_k=block_k,
        head_dim=head_dim, group=group, order=order, contain=contain,
        dq_mode="recompute" if contain else dq_mode)

  outs = pl.pallas_call(
      dkdv_kernel(False),
      grid=order.grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=params,
      interpret=interpret,
      name="fold_flash_backward_dkdv",
  )(*args)
  *outs, kflags = outs
  # The fast launch lets a non-finite input reach gradients of pairs that
  # never meet (a hidden pair's weight 0 times NaN is NaN); its programs
  # flag the tiles whose result holds a non-finite value, and only those
  # run again, containing it (see `pallas_kernels.flash.forward`).
  dk, dv = outs[-2:]
  # The twin takes the fast launch's tensor inputs (not the atomic dQ's
  # grid or accumulator): the first eight, then the segments.
  base_args = args[:8] + seg_args
  base_specs = in_specs[:8] + seg_specs
  n_in = len(base_args) + 3
  dk, dv = pl.pallas_call(
      dkdv_kernel(True),
      grid=order.grid,
      in_specs=base_specs + [kflag_spec, kv_spec, kv_spec],
      out_specs=[kv_spec, kv_spec],
      out_shape=out_shape[-3:-1],
      input_output_aliases={n_in - 2: 0, n_in - 1: 1},
      compiler_params=params,
      interpret=interpret,
      name="fold_flash_backward_dkdv_contain",
  )(*base_args, kflags, dk, dv)

  dqb = dq_blocks if dq_blocks is not None else blocks.dq_blocks
  # K and V stream through every query tile, as in the forward.
  dq_order = tiles.query_tile_order(
      k, d_pad, n_tiles=pl.cdiv(max_seqlen_q, dqb.block_q),
      num_seqs=num_seqs, heads_q=heads_q, heads_per_wave=dqb.heads_per_wave)
  q_head = dq_order.head
  head_spec = pl.BlockSpec((total_q, None, d_pad),
                           lambda *ids: (0, q_head(*ids), 0))
  kvh_spec = pl.BlockSpec((total_k, None, d_pad),
                          lambda *ids: (0, q_head(*ids) // group, 0))
  rows_spec = pl.BlockSpec((None, total_q), lambda *ids: (q_head(*ids), 0))
  dq_in_specs = [full(cu_seqlens_q.shape), full(cu_seqlens_k.shape),
                 head_spec, kvh_spec, kvh_spec, head_spec, rows_spec,
                 rows_spec, *seg_specs]
  dq_args = [cu_seqlens_q, cu_seqlens_k, q, k, v, do, lse2, delta, *seg_args]

  def dq_launch(contain, *extra):
    out_specs = [head_spec] if contain else [head_spec, rows_spec]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if not contain:
      out_shape.append(jax.ShapeDtypeStruct((heads_q, total_q), jnp.int32))
    n_in = len(dq_args) + len(extra)
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, block_q=dqb.block_q,
                          block_k=dqb.block_k, head_dim=head_dim,
                          order=dq_order, contain=contain),
        grid=dq_order.grid,
        in_specs=dq_in_specs + ([rows_spec, head_spec] if contain else []),
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={n_in - 1: 0} if contain else {},
        compiler_params=pip_triton.compiler_params(
            dqb.compiler, dqb.num_warps, dqb.num_stages),
        interpret=interpret,
        name="fold_flash_backward_dq_contain" if contain else
        "fold_flash_backward_dq",
    )(*dq_args, *extra)

  if dq_mode == "atomic":
    dq_acc = outs[0]
    grid_step = preprocess.pow2(grid_exp - DQ_GRID_BITS)  # 2^(e - 29)
    dq = dq_acc[:total_q, :, :, :head_dim].reshape(total_q, heads_q, head_dim)
    # int32 sums cannot carry NaN: a row that reads a non-finite value (its
    # own q, or a k or v it sees) has a non-finite D or a NaN LSE (+inf is a
    # row that sees no key), and its dQ is NaN, as the float path gives.
    poisoned = jnp.logical_not(jnp.isfinite(delta)) | jnp.isnan(lse2)
    dq = jnp.where(poisoned.T[:, :, None], jnp.nan,
                   dq.astype(jnp.float32) * grid_step.T[:, :, None])
    dq = dq.astype(q.dtype)
    # A flagged key tile may have sent a wrong partial (a hidden pair's
    # 0 * NaN, made an arbitrary integer) to any dQ row of its sequence and
    # KV head: those rows are recomputed, containing it.
    seq_k = token_sequence_ids(cu_seqlens_k, total_k)
    seq_q = token_sequence_ids(cu_seqlens_q, total_q)
    # (Keys outside every sequence have no flag written: never read.)
    kflags = jnp.where(seq_k[None, :] < num_seqs, kflags, 0)
    seq_bad = jnp.zeros((heads_kv, num_seqs + 1), jnp.int32).at[
        :, seq_k].max(kflags)
    qflags = jnp.repeat(seq_bad, group, axis=0)[:, seq_q]
    dq = dq_launch(True, qflags, dq)[0]
  else:
    dq, qflags = dq_launch(False)
    dq = dq_launch(True, qflags, dq)[0]
    # Tokens outside every sequence are never written by the dQ kernel.
    if not all_tokens_in_sequences:
      dq = jnp.where(q_in_seq[0][:, None, None], dq, 0).astype(q.dtype)
  # Nor are keys outside every sequence written by the dK/dV kernel.
  if not all_tokens_in_sequences:
    k_in_seq = (token_sequence_ids(cu_seqlens_k, total_k) <
                num_seqs)[:, None, None]
    dk = jnp.where(k_in_seq, dk, 0).astype(k.dtype)
    dv = jnp.where(k_in_seq, dv, 0).astype(v.dtype)

  dsinks = None
  if sinks is not None:
    # d lse_i / d sink = exp(sink - lse_i); d out_i / d sink = -P_sink,i out_i.
    # Rows that saw no key and a -inf sink have a non-finite LSE: P_sink = 0
    # there (as in the XLA backward), not exp2(-inf - -inf) = NaN.
    p_sink = jnp.where(
        jnp.isfinite(lse2),
        jnp.exp2(sinks.astype(jnp.float32)[:, None] * LOG2E - lse2), 0.0)
    dsinks = -jnp.sum(p_sink * delta, axis=1)
  return dq, dk, dv, dsinks
