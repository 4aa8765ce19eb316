"""Bitwise-deterministic backward of the disentangled-attention kernel.

With S_ij = (q_i.k_j + C[i, slot_ij] + P[j, slot_ij]) / c (C = Q Kpos^T,
P = K Qpos^T, slot_ij = slot(i - j)) and G_ij = dL/d(c S_ij) = P_ij (dP_ij -
D_i) / c, the gradients are

  dq_i = sum_j G_ij k_j + sum_r dC[i, r] Kpos[r],   dC[i, r] = sum_{j: slot_ij = r} G_ij
  dk_j = sum_i G_ij q_i + sum_r dP[j, r] Qpos[r],   dP[j, r] = sum_{i: slot_ij = r} G_ij
  dv_j = sum_i P~_ij dO_i                     (P~: P with the dropout mask)
  dKpos[r] = sum_i dC[i, r] q_i,  dQpos[r] = sum_j dP[j, r] k_j.

dC and dP are scatter-adds over buckets. They are made deterministic by the
band layout of `layout`: each pair (i, j) has a band column w(i - j), and
the non-saturated columns hold exactly one pair per row. So

* `_dq_kernel` (owns a query tile, walks key tiles in a fixed order) runs
  first: it computes D_i = dO_i . O_i for its rows (in-kernel, so the bits
  never depend on an XLA reduction's shape-dependent order), dq_i without
  the band term, stores G_ij to BandC[i, w(i - j)] (plain stores: no two
  pairs share an address) and sums the saturated pairs (w = 0 or
  width - 1; most pairs at long lengths) per row in registers, storing
  them once at the end;
* `_dkdv_kernel` (owns a key tile, reads D) does the same for dk, dv and
  BandP[j, w(i - j)];
* `_band_kernel` contracts each token's band row with the band-expanded
  position table Kpos[slot[w]] (Qpos[slot[w]]) in fixed column chunks:
  dq_i += sum_w BandC[i, w] Kpos[slot[w]] (dk_j likewise);
* XLA finishes dKpos = onehot(slot)^T (BandC^T Q) and dQpos likewise (plain
  matmuls, no scatter).

No atomics anywhere; every sum has a fixed order, and the per-token sums
(dq, dk, dv) depend only on the token's own sequence (tiles start at each
sequence's start; the band layout depends only on the position config; the
masked and unmasked tile variants run the same float operations). The band
scratch is [total, heads, width] (width = r_neg + r_pos + 1 = 1019 for
DeBERTa-v3's 256 buckets / 512 positions), bfloat16 for bf16 inputs and
float32 otherwise, zero-initialised (entries of pairs outside the sequence
are never visited).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.varlen import token_seq_ids_clipped
from pallas_kernels.deberta import _common as cm
from pallas_kernels.deberta import dropout_hash
from pallas_kernels.deberta.config import (DebertaBlocks, KernelConfig,
                                           head_dim_pad)
from pallas_kernels.flash.tiles import LOG2E, mask_and
from pallas_kernels.flash.forward import dot_precision

_HIGHEST = lax.Precision.HIGHEST


def band_dtype(dtype):
  """Storage dtype of the band scratch (dC and dP per band column)."""
  return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32


def _unpack(cfg, refs, has_lens):
  refs = list(refs)
  r = {}
  r["mask"] = refs.pop(0) if cfg.has_mask else None
  r["lens"] = refs.pop(0) if has_lens else None
  r["seed"] = refs.pop(0) if cfg.has_dropout else None
  r["q"], r["k"], r["v"] = refs.pop(0), refs.pop(0), refs.pop(0)
  r["c"] = refs.pop(0) if cfg.c2p else None
  r["p"] = refs.pop(0) if cfg.p2c else None
  # "last": `out` for the dQ kernel, D = rowsum(dO * O) for the dK/dV one.
  r["do"], r["lse"], r["last"] = refs.pop(0), refs.pop(0), refs.pop(0)
  return r, refs


def _used_tokens(r, seq, n_slot):
  """(tokens the kernel works on, whether the sequence reads the token
  mask): with seq_lens (see `pallas_kernels.deberta.forward`) a sequence
  whose valid tokens are a prefix works on that prefix and never reads the
  mask; None for the second when there are no seq_lens."""
  if r["lens"] is None:
    return n_slot, None
  used = r["lens"][seq]
  row_masked = used < 0  # MASKED_ROW
  return jnp.where(row_masked, n_slot, jnp.minimum(n_slot, used)), row_masked


def _loop_with_mask(cfg, row_masked, loop):
  """loop(read_mask): two copies where seq_lens say which sequences read
  the token mask (the prefix ones skip its loads), else one."""
  if cfg.has_mask and row_masked is not None:
    return lax.cond(row_masked, lambda: loop(True), lambda: loop(False))
  return loop(cfg.has_mask)


def _dq_kernel(cu_ref, slot_ref, *refs, cfg: KernelConfig, block_q: int,
               block_k: int, has_lens: bool):
  """dq (float32, without the c2p band part) and the c2p band rows."""
  r, rest = _unpack(cfg, refs, has_lens)
  if cfg.c2p:
    _, dq_ref, delta_ref, band_ref = rest  # rest[0]: the band's alias
  else:
    dq_ref, delta_ref = rest
  q_ref, k_ref, v_ref = r["q"], r["k"], r["v"]
  q_blk, seq, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  off = cu_ref[seq]
  n_slot = cu_ref[seq + 1] - off
  n, row_masked = _used_tokens(r, seq, n_slot)
  q0 = q_blk * block_q
  total, d_pad = q_ref.shape
  dtype = q_ref.dtype
  precision = dot_precision(dtype)
  scale_log2 = cfg.scale * LOG2E
  g = cfg.geometry
  head_mask = cm.head_dim_mask(cfg.head_dim, d_pad)
  q_pos = q0 + jnp.arange(block_q, dtype=jnp.int32)
  rows = pl.ds(off + q0, block_q)
  # Rows written: the slot's (a padding row's dq and D are 0; its band rows
  # keep their zero initialisation).
  q_store = mask_and((q_pos < n_slot)[:, None], head_mask)

  if has_lens:
    @pl.when((q0 >= n) & (q0 < n_slot))
    def _():
      plgpu.store(dq_ref.at[rows, :], jnp.zeros((block_q, d_pad), jnp.float32),
                  mask=q_store)
      plgpu.store(delta_ref.at[rows], jnp.zeros((block_q,), jnp.float32),
                  mask=q_pos < n_slot)

  @pl.when(q0 < n)
  def _():
    q_valid = q_pos < n
    q_rows = jnp.minimum(off + q_pos, total - 1)
    row_mask = mask_and(q_valid[:, None], head_mask)
    q = cm.load(q_ref.at[rows, :], mask=row_mask, other=0.0)
    do = cm.load(r["do"].at[rows, :], mask=row_mask, other=0.0)
    lse2 = cm.load(r["lse"].at[rows], mask=q_valid, other=jnp.inf)
    # D_i = dO_i . O_i, computed here per tile (not by an XLA reduction,
    # whose order may depend on the array's shape) and handed to the dK/dV
    # kernel.
    o = cm.load(r["last"].at[rows, :], mask=row_mask, other=0.0)
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1)
    plgpu.store(delta_ref.at[rows], delta, mask=q_pos < n_slot)
    c_vec = {}
    if cfg.c2p:
      for kind in ("hi", "lo"):
        c_vec[kind] = cm.table_column_vec(cfg, kind, r["c"], off + q0,
                                          block_q, q_valid)
    row_h = None
    if cfg.has_dropout:
      row_h = dropout_hash.row_hash(
          dropout_hash.program_key(r["seed"][0], seq, head), q_pos)
    n_kt = cm.cdiv(n, block_k)
    n_full = lax.div(n, block_k)

    def step(k_blk, carry, kind, masked, mq):
      dq, sat_lo, sat_hi = carry
      k0 = k_blk * block_k
      k_pos = k0 + jnp.arange(block_k, dtype=jnp.int32)
      k_valid = k_pos < n
      kv_mask = mask_and(k_valid[:, None] if masked else None, head_mask)
      k = cm.load(k_ref.at[pl.ds(off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      v = cm.load(v_ref.at[pl.ds(off + k0, block_k), :], mask=kv_mask,
                     other=0.0)
      s = plgpu.dot(q, k, trans_b=True, precision=precision)
      bias, w = cm.position_bias(
          cfg, kind, slot_ref=slot_ref, c_ref=r["c"], p_ref=r["p"],
          q_pos=q_pos, k_pos=k_pos, q_rows=q_rows,
          k_rows=jnp.minimum(off + k_pos, total - 1), c_sat=c_vec.get(kind),
          p_sat=cm.table_column_vec(cfg, kind, r["p"], off + k0, block_k,
                                    k_valid if masked else None),
          k_major=False)
      if bias is not None:
        s = s + bias
      p = jnp.exp2(s * scale_log2 - lse2[:, None])
      # The select runs on every tile (`masked` only adds load masks): the
      # same float operations everywhere, so padded and packed batches give
      # the same bits.
      vis = k_valid[None, :]
      if mq is not None:
        mk = cm.load(r["mask"].at[pl.ds(off + k0, block_k)],
                     mask=k_valid, other=0) != 0
        vis = vis & mk[None, :] & mq[:, None]
      p = jnp.where(vis, p, 0.0)
      dp = plgpu.dot(do, v, trans_b=True, precision=precision)
      if cfg.has_dropout:
        keep = dropout_hash.keep(row_h[:, None], k_pos[None, :],
                             dropout_hash.threshold(cfg.dropout_rate))
        dp = jnp.where(keep, dp * cfg.keep_scale, 0.0)
      ds = p * (dp - delta[:, None]) * cfg.scale
      dq = dq + plgpu.dot(ds.astype(dtype), k, precision=precision)
      if cfg.c2p:
        if kind == "hi":
          sat_hi = sat_hi + jnp.sum(ds, axis=1)
        elif kind == "lo":
          sat_lo = sat_lo + jnp.sum(ds, axis=1)
        else:
          at_lo = w == 0
          at_hi = w == g.width - 1
          sat_lo = sat_lo + jnp.sum(jnp.where(at_lo, ds, 0.0), axis=1)
          sat_hi = sat_hi + jnp.sum(jnp.where(at_hi, ds, 0.0), axis=1)
          # Unclamped rows: a masked-out lane never aliases a stored one
          # (interpret mode writes masked lanes back with their old value).
          st_rows = jnp.broadcast_to((off + q_pos)[:, None], w.shape)
          plgpu.store(band_ref.at[st_rows, w], ds.astype(band_ref.dtype),
                      mask=~(at_lo | at_hi) & q_valid[:, None])
      return dq, sat_lo, sat_hi

    zeros = jnp.zeros((block_q,), jnp.float32)
    carry = (jnp.zeros((block_q, d_pad), jnp.float32), zeros, zeros)
    ranges = cm.q_major_ranges(cfg, q0, block_q, block_k, n_kt)

    def key_loop(read_mask: bool):
      mq = None
      if read_mask:
        mq = cm.load(r["mask"].at[rows], mask=q_valid, other=0) != 0
      return cm.run_ranges(
          cfg, ranges, n_full,
          lambda t, c, kind, masked: step(t, c, kind, masked, mq), carry)

    dq, sat_lo, sat_hi = _loop_with_mask(cfg, row_masked, key_loop)
    plgpu.store(dq_ref.at[rows, :], dq, mask=q_store)
    if cfg.c2p:
      plgpu.store(band_ref.at[rows, jnp.int32(0)],
                  sat_lo.astype(band_ref.dtype), mask=q_valid)
      plgpu.store(band_ref.at[rows, jnp.int32(g.width - 1)],
                  sat_hi.astype(band_ref.dtype), mask=q_valid)


def _dkdv_kernel(cu_ref, slot_ref, *refs, cfg: KernelConfig, block_q: int,
                 block_k: int, has_lens: bool):
  """dk (float32, without the p2c band part), dv and the p2c band rows."""
  r, rest = _unpack(cfg, refs, has_lens)
  if cfg.p2c:
    _, dk_ref, dv_ref, band_ref = rest
  else:
    dk_ref, dv_ref = rest
  q_ref, k_ref, v_ref = r["q"], r["k"], r["v"]
  k_blk, seq, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  off = cu_ref[seq]
  n_slot = cu_ref[seq + 1] - off
  n, row_masked = _used_tokens(r, seq, n_slot)
  k0 = k_blk * block_k
  total, d_pad = q_ref.shape
  dtype = q_ref.dtype
  precision = dot_precision(dtype)
  scale_log2 = cfg.scale * LOG2E
  g = cfg.geometry
  head_mask = cm.head_dim_mask(cfg.head_dim, d_pad)
  k_pos = k0 + jnp.arange(block_k, dtype=jnp.int32)
  krows = pl.ds(off + k0, block_k)
  # Keys written: the slot's (a padding key's dk and dv are 0).
  k_store = mask_and((k_pos < n_slot)[:, None], head_mask)

  if has_lens:
    @pl.when((k0 >= n) & (k0 < n_slot))
    def _():
      plgpu.store(dk_ref.at[krows, :], jnp.zeros((block_k, d_pad), jnp.float32),
                  mask=k_store)
      plgpu.store(dv_ref.at[krows, :],
                  jnp.zeros((block_k, d_pad), dv_ref.dtype), mask=k_store)

  @pl.when(k0 < n)
  def _():
    k_valid = k_pos < n
    k_rows = jnp.minimum(off + k_pos, total - 1)
    kv_mask = mask_and(k_valid[:, None], head_mask)
    k = cm.load(k_ref.at[krows, :], mask=kv_mask, other=0.0)
    v = cm.load(v_ref.at[krows, :], mask=kv_mask, other=0.0)
    p_vec = {}
    if cfg.p2c:
      for kind in ("hi", "lo"):
        p_vec[kind] = cm.table_column_vec(cfg, kind, r["p"], off + k0,
                                          block_k, k_valid)
    key = None
    if cfg.has_dropout:
      key = dropout_hash.program_key(r["seed"][0], seq, head)
    n_qt = cm.cdiv(n, block_q)
    n_full = lax.div(n, block_q)

    def step(q_blk, carry, kind, masked, mk):
      dk, dv, sat_lo, sat_hi = carry
      q0 = q_blk * block_q
      q_pos = q0 + jnp.arange(block_q, dtype=jnp.int32)
      q_valid = q_pos < n
      rows = pl.ds(off + q0, block_q)
      row_valid = q_valid if masked else None
      row_mask = mask_and(None if row_valid is None else row_valid[:, None],
                          head_mask)
      q = cm.load(q_ref.at[rows, :], mask=row_mask, other=0.0)
      do = cm.load(r["do"].at[rows, :], mask=row_mask, other=0.0)
      lse2 = cm.load(r["lse"].at[rows], mask=row_valid, other=jnp.inf)
      delta = cm.load(r["last"].at[rows], mask=row_valid, other=0.0)
      s_t = plgpu.dot(k, q, trans_b=True, precision=precision)
      bias, w = cm.position_bias(
          cfg, kind, slot_ref=slot_ref, c_ref=r["c"], p_ref=r["p"],
          q_pos=q_pos, k_pos=k_pos,
          q_rows=jnp.minimum(off + q_pos, total - 1), k_rows=k_rows,
          c_sat=cm.table_column_vec(cfg, kind, r["c"], off + q0, block_q,
                                    row_valid),
          p_sat=p_vec.get(kind), k_major=True)
      if bias is not None:
        s_t = s_t + bias
      p_t = jnp.exp2(s_t * scale_log2 - lse2[None, :])
      vis = q_valid[None, :] & k_valid[:, None]
      if mk is not None:
        mq = cm.load(r["mask"].at[rows], mask=q_valid, other=0) != 0
        vis = vis & mq[None, :] & mk[:, None]
      p_t = jnp.where(vis, p_t, 0.0)
      dp_t = plgpu.dot(v, do, trans_b=True, precision=precision)
      pv_t = p_t
      if cfg.has_dropout:
        keep_t = dropout_hash.keep(dropout_hash.row_hash(key, q_pos)[None, :],
                               k_pos[:, None],
                               dropout_hash.threshold(cfg.dropout_rate))
        pv_t = jnp.where(keep_t, p_t * cfg.keep_scale, 0.0)
        dp_t = jnp.where(keep_t, dp_t * cfg.keep_scale, 0.0)
      dv = dv + plgpu.dot(pv_t.astype(dtype), do, precision=precision)
      ds_t = p_t * (dp_t - delta[None, :]) * cfg.scale
      dk = dk + plgpu.dot(ds_t.astype(dtype), q, precision=precision)
      if cfg.p2c:
        if kind == "hi":
          sat_hi = sat_hi + jnp.sum(ds_t, axis=1)
        elif kind == "lo":
          sat_lo = sat_lo + jnp.sum(ds_t, axis=1)
        else:
          at_lo = w == 0
          at_hi = w == g.width - 1
          sat_lo = sat_lo + jnp.sum(jnp.where(at_lo, ds_t, 0.0), axis=1)
          sat_hi = sat_hi + jnp.sum(jnp.where(at_hi, ds_t, 0.0), axis=1)
          st_rows = jnp.broadcast_to((off + k_pos)[:, None], w.shape)
          plgpu.store(band_ref.at[st_rows, w], ds_t.astype(band_ref.dtype),
                      mask=~(at_lo | at_hi) & k_valid[:, None])
      return dk, dv, sat_lo, sat_hi

    zeros = jnp.zeros((block_k,), jnp.float32)
    zd = jnp.zeros((block_k, d_pad), jnp.float32)
    ranges = cm.k_major_ranges(cfg, k0, block_q, block_k, n_qt)

    def query_loop(read_mask: bool):
      mk = None
      if read_mask:
        mk = cm.load(r["mask"].at[krows], mask=k_valid, other=0) != 0
      return cm.run_ranges(
          cfg, ranges, n_full,
          lambda t, c, kind, masked: step(t, c, kind, masked, mk),
          (zd, zd, zeros, zeros))

    dk, dv, sat_lo, sat_hi = _loop_with_mask(cfg, row_masked, query_loop)
    plgpu.store(dk_ref.at[krows, :], dk, mask=k_store)
    plgpu.store(dv_ref.at[krows, :], dv.astype(dv_ref.dtype), mask=k_store)
    if cfg.p2c:
      plgpu.store(band_ref.at[krows, jnp.int32(0)],
                  sat_lo.astype(band_ref.dtype), mask=k_valid)
      plgpu.store(band_ref.at[krows, jnp.int32(g.width - 1)],
                  sat_hi.astype(band_ref.dtype), mask=k_valid)


def _band_kernel(band_ref, tab_ref, pos_ref, len_ref, out_ref, *, geo,
                 key_rows: bool, block_rows: int, block_cols: int,
                 head_dim: int, precision):
  """out[t] = sum_w band[t, w] * tab[w]: the two saturated columns first
  (rank-1 updates), then the non-saturated columns in fixed chunks, only
  over the chunks where some row of the block can be nonzero (row t's band
  is zero outside the offsets of its own sequence; skipped chunks would add
  exact zeros, so the bits do not depend on the other rows of the block)."""
  blk = pl.program_id(0)
  total, width = band_ref.shape
  d_pad = tab_ref.shape[-1]
  head_mask = cm.head_dim_mask(head_dim, d_pad)
  r0 = blk * block_rows
  rows = pl.ds(r0, block_rows)
  r_valid = (r0 + jnp.arange(block_rows)) < total
  pos = cm.load(pos_ref.at[rows], mask=r_valid, other=0)
  n = cm.load(len_ref.at[rows], mask=r_valid, other=0)
  live = n > 0
  col = lambda delta: jnp.clip(delta, -geo.r_neg, geo.r_pos) + geo.r_neg
  # Row t holds pairs with the other tokens u of its sequence, at offsets
  # i - j = t - u (query rows, c2p) or u - t (key rows, p2c).
  if key_rows:
    d_lo, d_hi = -pos, n - 1 - pos
  else:
    d_lo, d_hi = pos - n + 1, pos
  lo = jnp.min(jnp.where(live, col(d_lo), width))
  hi = jnp.max(jnp.where(live, col(d_hi), -1))
  lo = jnp.maximum(lo, 1)  # saturated columns are handled first
  hi = jnp.minimum(hi, width - 2)

  acc = jnp.zeros((block_rows, d_pad), jnp.float32)
  for c in (0, width - 1):
    x = cm.load(band_ref.at[rows, jnp.int32(c)], mask=r_valid,
                other=0.0).astype(jnp.float32)
    t = cm.load(tab_ref.at[jnp.int32(c), :],
                mask=None if head_mask is None else head_mask[0],
                other=0.0).astype(jnp.float32)
    acc = acc + x[:, None] * t[None, :]

  def step(c, acc):
    c0 = c * block_cols
    cols = c0 + jnp.arange(block_cols)
    c_valid = (cols > 0) & (cols < width - 1)
    x = cm.load(band_ref.at[rows, pl.ds(c0, block_cols)],
                mask=r_valid[:, None] & c_valid[None, :], other=0.0)
    t = cm.load(tab_ref.at[pl.ds(c0, block_cols), :],
                mask=mask_and(c_valid[:, None], head_mask), other=0.0)
    return acc + plgpu.dot(x, t, precision=precision)

  first = lax.div(jnp.maximum(lo, 0), block_cols)
  last = jnp.where(hi >= lo, lax.div(jnp.maximum(hi, 0), block_cols) + 1,
                   first)
  acc = lax.fori_loop(0, last - first, lambda i, a: step(first + i, a), acc)
  plgpu.store(out_ref.at[rows, :], acc,
              mask=mask_and(r_valid[:, None], head_mask))


def band_product(band, table, tok_pos, tok_len, *, geo, key_rows: bool,
                 blocks, head_dim: int, precision, interpret: bool):
  """float32 [total, heads, d]: band [total, heads, width] x table
  [width, heads, d] per head. tok_pos, tok_len: int32 [total], each token's
  position in its sequence and the sequence's length (0 outside); key_rows:
  the band rows are keys (p2c) rather than queries (c2p)."""
  total, heads, width = band.shape
  d_pad = head_dim_pad(head_dim)
  b = blocks.band
  vec = pl.BlockSpec((total,), lambda i, h: (0,))
  return pl.pallas_call(
      functools.partial(_band_kernel, geo=geo, key_rows=key_rows,
                        block_rows=b.block_q,
                        block_cols=b.block_k, head_dim=head_dim,
                        precision=precision),
      grid=(pl.cdiv(total, b.block_q), heads),
      in_specs=[pl.BlockSpec((total, None, width), lambda i, h: (0, h, 0)),
                pl.BlockSpec((width, None, d_pad), lambda i, h: (0, h, 0)),
                vec, vec],
      out_specs=pl.BlockSpec((total, None, d_pad), lambda i, h: (0, h, 0)),
      out_shape=jax.ShapeDtypeStruct((total, heads, head_dim), jnp.float32),
      compiler_params=plgpu.CompilerParams(num_warps=b.num_warps,
                                           num_stages=b.num_stages),
      interpret=interpret,
      name="fold_deberta_band_product",
  )(band, table, tok_pos, tok_len)


@functools.partial(jax.jit, static_argnames=("cfg", "blocks", "max_seqlen",
                                             "interpret"))
def disentangled_backward(q, k, v, pos_key, pos_query, c2p_table, p2c_table,
                          out, lse2, do, cu_seqlens, token_mask=None,
                          seed=None, seq_lens=None, *, cfg: KernelConfig,
                          blocks: DebertaBlocks, max_seqlen: int,
                          interpret: bool = False):
  """Gradients of `disentangled_forward`.

  Args:
    q, k, v, out, do: [total, heads, head_dim]; pos_key, pos_query:
      [2*span, heads, head_dim] (or None when unused); c2p_table, p2c_table:
      the forward's tables; lse2: float32 [heads, total] from the forward.
    seq_lens: optional int32 [num_seqs], as for `disentangled_forward`: a
      sequence's padding tiles are skipped and, where its valid tokens are
      a prefix, the token mask is not read; the same bits as without.
  Returns:
    dq, dk, dv (inputs' dtype; zero on tokens outside every sequence),
    dpos_key, dpos_query (float32 [2*span, heads, head_dim], or None).
  """
  total, heads, head_dim = q.shape
  num_seqs = cu_seqlens.shape[0] - 1
  d_pad = head_dim_pad(head_dim)
  g = cfg.geometry
  slot = jnp.asarray(g.slot_table())
  in_seq = jnp.arange(total) < cu_seqlens[-1]
  lse2 = jnp.where(in_seq[None, :], lse2, jnp.inf)
  f32 = jnp.float32

  full = cm.full_spec
  tok = pl.BlockSpec((total, None, d_pad), lambda i, s, h: (0, h, 0))
  row = pl.BlockSpec((None, total), lambda i, s, h: (h, 0))
  tab = pl.BlockSpec((total, None, g.slots), lambda i, s, h: (0, h, 0))
  bnd = pl.BlockSpec((total, None, g.width), lambda i, s, h: (0, h, 0))
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
  in_specs += [tok, row]
  args += [do, lse2]
  bdt = band_dtype(q.dtype)

  def call(kernel, blk, tile, last_in, outs, band_needed, name):
    """outs: [(spec, shape, dtype)]; the band (if any) comes last."""
    specs, a = in_specs + [last_in[0]], args + [last_in[1]]
    out_specs = [o[0] for o in outs]
    out_shape = [jax.ShapeDtypeStruct(o[1], o[2]) for o in outs]
    aliases = {}
    if band_needed:
      specs.append(bnd)
      # Zeros made after dO exists: a broadcast with no operands may be
      # scheduled at the start of the whole training step (one such buffer
      # per layer, all alive at once).
      zero = jax.lax.optimization_barrier((jnp.zeros((), bdt), do))[0]
      a.append(jnp.broadcast_to(zero, (total, heads, g.width)))
      aliases = {len(a) - 1: len(outs)}
      out_specs.append(bnd)
      out_shape.append(jax.ShapeDtypeStruct((total, heads, g.width), bdt))
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg, block_q=blk.block_q,
                          block_k=blk.block_k,
                          has_lens=seq_lens is not None),
        grid=(pl.cdiv(max_seqlen, tile), num_seqs, heads),
        in_specs=specs, out_specs=out_specs, out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=blk.num_warps,
                                             num_stages=blk.num_stages),
        interpret=interpret, name=name)(*a)

  # dQ first: it also computes D = rowsum(dO * O), which the dK/dV kernel
  # reads.
  outs = call(_dq_kernel, blocks.bwd_q, blocks.bwd_q.block_q, (tok, out),
              [(tok, q.shape, f32), (row, (heads, total), f32)], cfg.c2p,
              "fold_deberta_backward_dq")
  dq, delta = outs[0], outs[1]
  band_c = outs[2] if cfg.c2p else None
  delta = jnp.where(in_seq[None, :], delta, 0.0)  # unwritten rows
  outs = call(_dkdv_kernel, blocks.bwd_kv, blocks.bwd_kv.block_k,
              (row, delta), [(tok, k.shape, f32), (tok, v.shape, v.dtype)],
              cfg.p2c, "fold_deberta_backward_dkdv")
  dk, dv = outs[0], outs[1]
  band_p = outs[2] if cfg.p2c else None

  t_idx = jnp.arange(total, dtype=jnp.int32)
  sid = token_seq_ids_clipped(cu_seqlens, total)
  tok_pos = t_idx - cu_seqlens[sid]
  tok_len = jnp.where(in_seq, cu_seqlens[sid + 1] - cu_seqlens[sid], 0)
  precise = jnp.dtype(q.dtype) == jnp.float32
  band_precision = _HIGHEST if precise else None
  onehot = (slot[:, None] == jnp.arange(g.slots, dtype=jnp.int32)[None, :]
            ).astype(f32)  # [width, 2*span]
  dpos_key = dpos_query = None
  if cfg.c2p:
    kband = pos_key[slot].astype(bdt)  # [width, heads, d]
    dq = dq + band_product(band_c, kband, tok_pos, tok_len, geo=g,
                           key_rows=False, blocks=blocks, head_dim=head_dim,
                           precision=band_precision, interpret=interpret)
    x = jnp.einsum("thw,thd->whd", band_c, q.astype(bdt),
                   preferred_element_type=f32, precision=_HIGHEST)
    dpos_key = jnp.einsum("wr,whd->rhd", onehot, x, precision=_HIGHEST)
  if cfg.p2c:
    qband = pos_query[slot].astype(bdt)
    dk = dk + band_product(band_p, qband, tok_pos, tok_len, geo=g,
                           key_rows=True, blocks=blocks, head_dim=head_dim,
                           precision=band_precision, interpret=interpret)
    x = jnp.einsum("thw,thd->whd", band_p, k.astype(bdt),
                   preferred_element_type=f32, precision=_HIGHEST)
    dpos_query = jnp.einsum("wr,whd->rhd", onehot, x, precision=_HIGHEST)
  keep = in_seq[:, None, None]
  dq = jnp.where(keep, dq, 0.0).astype(q.dtype)
  dk = jnp.where(keep, dk, 0.0).astype(k.dtype)
  dv = jnp.where(keep, dv, 0).astype(v.dtype)
  return dq, dk, dv, dpos_key, dpos_query
