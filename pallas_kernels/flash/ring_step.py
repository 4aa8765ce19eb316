"""Pallas kernels of one ring-attention step, summed on an exact integer grid.

Ring attention (`jax_api.sharding.ring_attention`) cuts the sequence over n
devices; K/V shards travel round the ring. For its bits to be the same for
every n, keys are cut into blocks of `block` tokens fixed in absolute
positions, and every (query row, key block) partial goes onto an integer
grid by itself before it is added to anything: integer sums do not depend
on how blocks were grouped into shards or in which order they arrived. The
flash kernels' online softmax cannot do this (its rescaling makes a row's
bits depend on how keys are grouped), so the ring declares its softmax
reference first (`query_pass(mode="max")`, an exact, order-free max) and
every step then adds `exp2(s - ref)`-weighted partials against it.

A grid value is three int32 limbs (lo, mid, hi) of 20 bits of
trunc(x / 2^e) (`jax_api.sharding._grid` holds the format and the unit
choice; the kernels take 2^-e as a scalar input). In registers a launch
keeps two 22-bit limbs per value (`_limbs`), REG_TERMS partials at most
between carries; the sum goes to the three-limb accumulator once, at the
end of the launch, where the carry is propagated.

Layouts (packed as in `pallas_kernels.flash.forward`, one sequence per
batch row of the local shard, head dim padded to `head_dim_bucket`):
  q, do, out: [batch * len_q, heads_q, d]     k, v: [batch * len_k, heads_kv, d]
  q_pos: int32 [len_q], k_pos: int32 [len_k]   absolute positions (zig-zag
    shards are two chunks; a key block never straddles them)
  q_seg: int32 [batch * len_q], k_seg: int32 [batch * len_k] (optional;
    -1 matches nothing)
  ref2, lse2, delta, max2: float32 [heads_q, batch * len_q]
  acc (numerators, dq): int32 [3, batch * len_q, heads_q, d]
  den (denominators): int32 [3, heads_q, batch * len_q]
  dk, dv accumulators: int32 [3, batch * len_k, heads_kv, d]
Scores are in the base-2 domain (s2 = scale * log2(e) * q.k, or the
soft-capped form), as in the flash kernels.

Tiles: a key step covers exactly one block (in a tile of at least 16 rows,
the extra rows masked); the dK/dV kernel's query step covers
`query_step(block)` rows, a divisor of the block (so the rows of one grid
partial never depend on the shard). Both are functions of the block alone,
never of the device count. (dQ and forward partials are per row.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import pip_triton
from pallas_kernels.flash import tiles
from pallas_kernels.flash.forward import dot_precision
from pallas_kernels.flash.tiles import LN2, MaskConfig

# In registers a sum is two int32 limbs of 22 bits, (lo, hi), of
# trunc(x * inv_unit) <= 2^44: REG_TERMS such terms stay below 2^30 per limb,
# so the canonical accumulator (20-bit limbs) can be added without overflow.
# Longer loops fold every REG_TERMS terms into three 20-bit limbs.
REG_TERMS = 256
_W = 20
_FAR = 2**30  # a position no mask reaches


def query_step(block: int) -> int:
  """Query rows whose dK/dV partial goes onto the grid as one: a divisor of
  `block`, so the rows are the same for every device count."""
  return min(block, 64)


def query_tile(block: int) -> int:
  """Query rows per tile: `query_step` rows, at least Triton's 16."""
  return max(16, query_step(block))


def key_tile(block: int) -> int:
  return max(16, block)


def key_rows(block: int) -> int:
  """Keys per dK/dV program: a divisor of `block` (a key row's partials are
  its own, so any split of the block gives the same bits); at most 64, so
  that three int32 limbs of dK and of dV fit in registers."""
  return min(block, 64)


def _limbs(x, inv_unit):
  """float32 x -> (lo, hi) int32 with trunc(|x| * inv_unit) = hi * 2^22 + lo,
  both with x's sign, |lo| < 2^22. Exact: each step takes the leading bits
  of a float or scales by a power of two."""
  y = jnp.abs(x) * inv_unit
  hi = jnp.floor(y * 2.0**-22)
  lo = jnp.floor(y - hi * 2.0**22)
  neg = x < 0
  return tuple(jnp.where(neg, -t, t).astype(jnp.int32) for t in (lo, hi))


def _add(a, b):
  return tuple(x + y for x, y in zip(a, b))


def _canonical(lo, mid, hi):
  c = lo >> _W
  lo = lo - (c << _W)
  mid = mid + c
  c = mid >> _W
  return lo, mid - (c << _W), hi + c


def _grid_limbs(pair):
  """(lo, hi) of 22 bits -> (lo, mid, hi) of 20 bits (`_grid`'s format,
  not yet canonical): hi * 2^22 = (hi mod 2^18) * 4 * 2^20 + (hi >> 18) 2^40."""
  lo, hi = pair
  h1 = hi >> 18
  return lo, (hi - (h1 << 18)) << 2, h1


def _grid_sum(n: int, step, zeros):
  """Runs fori_loop(0, n, step) over a carry of (lo, hi) pairs; returns
  each pair's sum as 20-bit limbs (lo, mid, hi)."""
  if n <= REG_TERMS:
    return tuple(_grid_limbs(p) for p in lax.fori_loop(0, n, step, zeros))

  def chunk(c, total):
    start = c * REG_TERMS
    part = lax.fori_loop(start, jnp.minimum(n, start + REG_TERMS), step,
                         zeros)
    return tuple(_canonical(*_add(t, _grid_limbs(p)))
                 for t, p in zip(total, part))
  total = tuple(tuple(jnp.zeros_like(p[0]) for _ in range(3)) for p in zeros)
  return lax.fori_loop(0, pl.cdiv(n, REG_TERMS), chunk, total)


def _visible(cfg: MaskConfig, q_pos, k_pos, k_valid, q_seg, k_seg):
  vis = k_valid[None, :]
  qi, kj = q_pos[:, None], k_pos[None, :]
  if cfg.right >= 0:
    vis &= kj <= qi + cfg.right
  if cfg.left >= 0:
    vis &= kj >= qi - cfg.left
  if cfg.has_segments:
    vis &= (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] >= 0)
  return vis


def _may_see(cfg: MaskConfig, q_lo, q_hi, k_lo, k_hi):
  """Scalar: can some query in positions [q_lo, q_hi] see some key in
  [k_lo, k_hi] (positions only; segments are masked per pair)? None when
  no position bound applies (every pair may be visible)."""
  ok = None
  if cfg.right >= 0:
    ok = k_lo <= q_hi + cfg.right
  if cfg.left >= 0:
    far = k_hi >= q_lo - cfg.left
    ok = far if ok is None else ok & far
  return ok


def _when_may_see(ok, run, carry):
  """run(carry) where `ok` (skipping pairs no query can see), else carry."""
  if ok is None:
    return run(carry)
  return lax.cond(ok, run, lambda c: c, carry)


def _pos_range(pos, valid):
  return (jnp.min(jnp.where(valid, pos, _FAR)),
          jnp.max(jnp.where(valid, pos, -_FAR)))


def _store_limbs(ref, index, parts, mask):
  """Adds parts (lo, mid, hi) to the canonical limbs at ref[i, *index] and
  stores the canonical sum (ref is aliased to the accumulator input)."""
  old = tuple(tiles.load(ref.at[(jnp.int32(i),) + index], mask=mask, other=0)
              for i in range(3))
  new = _canonical(*_add(old, parts))
  for i in range(3):
    plgpu.store(ref.at[(jnp.int32(i),) + index], new[i], mask=mask)


def _query_kernel(q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, *refs,
                  cfg: MaskConfig, mode: str, block: int, len_q: int,
                  len_k: int):
  """One body, three modes: "max" (the row max of s2 over visible keys),
  "forward" (numerator and denominator partials) and "dq"."""
  refs = list(refs)
  q_seg_ref = k_seg_ref = None
  if cfg.has_segments:
    q_seg_ref, k_seg_ref = refs.pop(0), refs.pop(0)
  if mode == "max":
    (max_ref,) = refs
  elif mode == "forward":
    ref_ref, unit_ref, _, _, acc_ref, den_ref = refs
  else:
    do_ref, lse_ref, delta_ref, unit_ref, _, acc_ref = refs
  tq, tk = query_tile(block), key_tile(block)
  q_blk, b = pl.program_id(0), pl.program_id(1)
  q0 = q_blk * tq
  q_valid = q0 + jnp.arange(tq) < len_q
  rows = pl.ds(b * len_q + q0, tq)
  precision = dot_precision(q_ref.dtype)
  q = tiles.load(q_ref.at[rows, :], mask=q_valid[:, None], other=0.0)
  q_pos = tiles.load(q_pos_ref.at[pl.ds(q0, tq)], mask=q_valid, other=0)
  q_lo, q_hi = _pos_range(q_pos, q_valid)
  q_seg = None
  if cfg.has_segments:
    q_seg = tiles.load(q_seg_ref.at[rows], mask=q_valid, other=-1)
  row_vec = lambda r: tiles.load(r.at[rows], mask=q_valid, other=0.0)
  if mode == "forward":
    ref2 = row_vec(ref_ref)
  elif mode == "dq":
    do = tiles.load(do_ref.at[rows, :], mask=q_valid[:, None], other=0.0)
    lse2, delta = row_vec(lse_ref), row_vec(delta_ref)
  k_in_block = jnp.arange(tk) < block

  def step(j, carry):
    k0 = j * block
    k_rows = pl.ds(b * len_k + k0, tk)
    k_mask = None if tk == block else k_in_block[:, None]

    def run(carry):
      k = tiles.load(k_ref.at[k_rows, :], mask=k_mask, other=0.0)
      k_pos = tiles.load(k_pos_ref.at[pl.ds(k0, tk)], mask=k_in_block,
                         other=_FAR)
      k_seg = None
      if cfg.has_segments:
        k_seg = tiles.load(k_seg_ref.at[k_rows], mask=k_in_block, other=-2)
      vis = _visible(cfg, q_pos, k_pos, k_in_block, q_seg, k_seg)
      s2 = tiles.scores_log2(
          cfg, plgpu.dot(q, k, trans_b=True, precision=precision))
      if mode == "max":
        return jnp.maximum(carry, jnp.max(jnp.where(vis, s2, -jnp.inf), 1))
      v = tiles.load(v_ref.at[k_rows, :], mask=k_mask, other=0.0)
      if mode == "forward":
        acc, den = carry
        p = jnp.where(vis, jnp.exp2(s2 - ref2[:, None]), 0.0)
        pv = plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return (_add(acc, _limbs(pv, unit_ref[0])),
                _add(den, _limbs(jnp.sum(p, axis=1), unit_ref[1])))
      p = jnp.where(vis, jnp.exp2(s2 - lse2[:, None]), 0.0)
      dp = plgpu.dot(do, v, trans_b=True, precision=precision)
      ds = p * (dp - delta[:, None])
      if cfg.softcap > 0.0:
        t = s2 * (LN2 / cfg.softcap)
        ds = ds * (1.0 - t * t)
      dq = plgpu.dot(ds.astype(k.dtype), k, precision=precision) * cfg.scale
      return (_add(carry[0], _limbs(dq, unit_ref[0])),)

    k_lo = k_pos_ref[k0]
    k_hi = k_pos_ref[k0 + block - 1]
    return _when_may_see(_may_see(cfg, q_lo, q_hi, k_lo, k_hi), run, carry)

  d = q_ref.shape[-1]
  if mode == "max":
    res = lax.fori_loop(0, len_k // block, step,
                        jnp.full((tq,), -jnp.inf, jnp.float32))
    plgpu.store(max_ref.at[rows], res, mask=q_valid)
    return
  zeros_d = tuple(jnp.zeros((tq, d), jnp.int32) for _ in range(2))
  zeros_r = tuple(jnp.zeros((tq,), jnp.int32) for _ in range(2))
  sums = _grid_sum(len_k // block, step, (zeros_d, zeros_r)
                   if mode == "forward" else (zeros_d,))
  _store_limbs(acc_ref, (rows, slice(None)), sums[0], q_valid[:, None])
  if mode == "forward":
    _store_limbs(den_ref, (rows,), sums[1], q_valid)


def _key_kernel(q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, do_ref, lse_ref,
                delta_ref, *refs, cfg: MaskConfig, block: int, len_q: int,
                len_k: int, group: int):
  """dK and dV partials of `key_rows(block)` keys (all heads of their GQA
  group), one grid value per (query step, key row)."""
  refs = list(refs)
  q_seg_ref = k_seg_ref = None
  if cfg.has_segments:
    q_seg_ref, k_seg_ref = refs.pop(0), refs.pop(0)
  unit_ref, _, _, dk_ref, dv_ref = refs
  kr = key_rows(block)
  tq, tk = query_tile(block), max(16, kr)
  k_blk, b = pl.program_id(0), pl.program_id(1)
  k0 = k_blk * kr
  k_rows = pl.ds(b * len_k + k0, tk)
  k_in_block = jnp.arange(tk) < kr
  k_mask = None if tk == kr else k_in_block[:, None]
  precision = dot_precision(q_ref.dtype)
  k = tiles.load(k_ref.at[k_rows, :], mask=k_mask, other=0.0)
  v = tiles.load(v_ref.at[k_rows, :], mask=k_mask, other=0.0)
  k_pos = tiles.load(k_pos_ref.at[pl.ds(k0, tk)], mask=k_in_block,
                     other=_FAR)
  k_lo, k_hi = k_pos_ref[k0], k_pos_ref[k0 + kr - 1]
  k_seg = None
  if cfg.has_segments:
    k_seg = tiles.load(k_seg_ref.at[k_rows], mask=k_in_block, other=-2)
  d = k_ref.shape[-1]

  qs = query_step(block)

  def q_step(i, carry):
    q0 = i * qs
    q_valid = (jnp.arange(tq) < qs) & (q0 + jnp.arange(tq) < len_q)
    rows = pl.ds(b * len_q + q0, tq)
    q_pos = tiles.load(q_pos_ref.at[pl.ds(q0, tq)], mask=q_valid, other=0)
    q_lo, q_hi = _pos_range(q_pos, q_valid)

    def run(carry):
      q_seg = None
      if cfg.has_segments:
        q_seg = tiles.load(q_seg_ref.at[rows], mask=q_valid, other=-1)
      vis = _visible(cfg, q_pos, k_pos, k_in_block, q_seg, k_seg)

      def head(g, dkv):
        dk, dv = dkv
        q = tiles.load(q_ref.at[rows, g, :], mask=q_valid[:, None], other=0.0)
        do = tiles.load(do_ref.at[rows, g, :], mask=q_valid[:, None],
                        other=0.0)
        lse2 = tiles.load(lse_ref.at[g, rows], mask=q_valid, other=0.0)
        delta = tiles.load(delta_ref.at[g, rows], mask=q_valid, other=0.0)
        s2 = tiles.scores_log2(
            cfg, plgpu.dot(q, k, trans_b=True, precision=precision))
        p = jnp.where(vis, jnp.exp2(s2 - lse2[:, None]), 0.0)  # [tq, tk]
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True,
                            precision=precision)
        dp = plgpu.dot(do, v, trans_b=True, precision=precision)
        ds = p * (dp - delta[:, None])
        if cfg.softcap > 0.0:
          t = s2 * (LN2 / cfg.softcap)
          ds = ds * (1.0 - t * t)
        dk = dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True,
                            precision=precision)
        return dk, dv

      zeros = jnp.zeros((tk, d), jnp.float32)
      dk, dv = lax.fori_loop(0, group, head, (zeros, zeros))
      dk_acc, dv_acc = carry
      return (_add(dk_acc, _limbs(dk * cfg.scale, unit_ref[0])),
              _add(dv_acc, _limbs(dv, unit_ref[1])))

    return _when_may_see(_may_see(cfg, q_lo, q_hi, k_lo, k_hi), run, carry)

  zeros = tuple(jnp.zeros((tk, d), jnp.int32) for _ in range(2))
  dk, dv = _grid_sum(pl.cdiv(len_q, qs), q_step, (zeros, zeros))
  index = (k_rows, slice(None))
  _store_limbs(dk_ref, index, dk, k_in_block[:, None])
  _store_limbs(dv_ref, index, dv, k_in_block[:, None])


def _geometry(q, k, batch: int, block: int):
  """(len_q, len_k, group) of packed q, k of `batch` rows; checks that the
  block divides the local keys."""
  len_q, len_k = q.shape[0] // batch, k.shape[0] // batch
  if len_k % block:
    raise ValueError(f"block ({block}) must divide the local key count "
                     f"({len_k}).")
  return len_q, len_k, q.shape[1] // k.shape[1]


def _segment_inputs(cfg, q_seg, k_seg):
  """(in_specs, args) of the segment ids, empty without segments."""
  if not cfg.has_segments:
    return [], []
  return ([tiles.full_spec(q_seg.shape), tiles.full_spec(k_seg.shape)],
          [q_seg, k_seg])


def _params(d: int, compiler: str):
  return pip_triton.compiler_params(compiler, 4 if d <= 64 else 8, 1)


@functools.partial(jax.jit, static_argnames=("cfg", "block", "batch", "mode",
                                              "interpret", "compiler"))
def query_pass(q, k, v, q_pos, k_pos, q_seg=None, k_seg=None, *rest,
               cfg: MaskConfig, block: int, batch: int, mode: str,
               interpret: bool = False, compiler: str = "xla"):
  """One ring step over query tiles.

  mode "max": rest = (); returns max2 [heads_q, total_q] (-inf where no key
    of this shard is visible).
  mode "forward": rest = (ref2, inv_units [2] (numerator, denominator),
    acc, den); returns (acc, den) with this shard's partials added.
  mode "dq": rest = (do, lse2, delta, inv_units [1], acc); returns acc.
  """
  total_q, heads_q, d = q.shape
  total_k, heads_kv, _ = k.shape
  len_q, len_k, group = _geometry(q, k, batch, block)
  q_spec = pl.BlockSpec((total_q, None, d), lambda i, b, h: (0, h, 0))
  kv_spec = pl.BlockSpec((total_k, None, d),
                         lambda i, b, h: (0, h // group, 0))
  seg_specs, seg_args = _segment_inputs(cfg, q_seg, k_seg)
  in_specs = [tiles.full_spec(q_pos.shape), tiles.full_spec(k_pos.shape),
              q_spec, kv_spec, kv_spec] + seg_specs
  args = [q_pos, k_pos, q, k, v] + seg_args
  row_spec = pl.BlockSpec((None, total_q), lambda i, b, h: (h, 0))
  acc_spec = pl.BlockSpec((3, total_q, None, d), lambda i, b, h: (0, 0, h, 0))
  den_spec = pl.BlockSpec((3, None, total_q), lambda i, b, h: (0, h, 0))
  if mode == "max":
    out_specs = [row_spec]
    out_shape = [jax.ShapeDtypeStruct((heads_q, total_q), jnp.float32)]
    aliases = {}
  elif mode == "forward":
    ref2, units, acc, den = rest
    in_specs += [row_spec, tiles.full_spec(units.shape), acc_spec, den_spec]
    args += [ref2, units, acc, den]
    out_specs = [acc_spec, den_spec]
    out_shape = [jax.ShapeDtypeStruct(acc.shape, jnp.int32),
                 jax.ShapeDtypeStruct(den.shape, jnp.int32)]
    aliases = {len(args) - 2: 0, len(args) - 1: 1}
  elif mode == "dq":
    do, lse2, delta, units, acc = rest
    in_specs += [q_spec, row_spec, row_spec, tiles.full_spec(units.shape),
                 acc_spec]
    args += [do, lse2, delta, units, acc]
    out_specs = [acc_spec]
    out_shape = [jax.ShapeDtypeStruct(acc.shape, jnp.int32)]
    aliases = {len(args) - 1: 0}
  else:
    raise ValueError(f"mode must be 'max', 'forward' or 'dq'; got {mode!r}.")
  res = pl.pallas_call(
      functools.partial(_query_kernel, cfg=cfg, mode=mode, block=block,
                        len_q=len_q, len_k=len_k),
      grid=(pl.cdiv(len_q, query_tile(block)), batch, heads_q),
      in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      input_output_aliases=aliases, compiler_params=_params(d, compiler),
      interpret=interpret, name=f"fold_ring_{mode}")(*args)
  return res[0] if len(res) == 1 else tuple(res)


@functools.partial(jax.jit, static_argnames=("cfg", "block", "batch",
                                              "interpret", "compiler"))
def key_pass(q, k, v, q_pos, k_pos, q_seg, k_seg, do, lse2, delta, units,
             dk, dv, *, cfg: MaskConfig, block: int, batch: int,
             interpret: bool = False, compiler: str = "xla"):
  """One backward ring step over key blocks: returns (dk, dv) grid
  accumulators [3, total_k, heads_kv, d] with this shard's partials added.
  units: float32 [2], 2^-e of dK's and dV's grids."""
  total_q, heads_q, d = q.shape
  total_k, heads_kv, _ = k.shape
  len_q, len_k, group = _geometry(q, k, batch, block)
  grp_spec = pl.BlockSpec((total_q, group, d), lambda j, b, h: (0, h, 0))
  kv_spec = pl.BlockSpec((total_k, None, d), lambda j, b, h: (0, h, 0))
  row_spec = pl.BlockSpec((group, total_q), lambda j, b, h: (h, 0))
  acc_spec = pl.BlockSpec((3, total_k, None, d), lambda j, b, h: (0, 0, h, 0))
  in_specs = [tiles.full_spec(q_pos.shape), tiles.full_spec(k_pos.shape),
              grp_spec, kv_spec, kv_spec, grp_spec, row_spec, row_spec]
  args = [q_pos, k_pos, q, k, v, do, lse2, delta]
  seg_specs, seg_args = _segment_inputs(cfg, q_seg, k_seg)
  in_specs += seg_specs + [tiles.full_spec(units.shape), acc_spec, acc_spec]
  args += seg_args + [units, dk, dv]
  n = len(args)
  return pl.pallas_call(
      functools.partial(_key_kernel, cfg=cfg, block=block, len_q=len_q,
                        len_k=len_k, group=group),
      grid=(len_k // key_rows(block), batch, heads_kv),
      in_specs=in_specs, out_specs=[acc_spec, acc_spec],
      out_shape=[jax.ShapeDtypeStruct(dk.shape, jnp.int32)] * 2,
      input_output_aliases={n - 2: 0, n - 1: 1},
      compiler_params=_params(d, compiler), interpret=interpret,
      name="fold_ring_dkdv")(*args)
