"""Per-row statistics the backward kernels read, computed by Pallas kernels.

The backward needs, for every query row i of head h,

    D_i = dO_i . O_i - dlse_i        (0 for rows outside every sequence)

and, in dQ's atomic mode, the exponent e_i of its integer grid (see
`pallas_kernels.flash.backward`). As XLA reductions over [total, heads, d]
these would be computed with a tiling, vectorisation and fusion that XLA
picks from the array's total shape, so a row's bits could change with the
batch or the packing around its sequence. Here each is a fixed in-tile
reduction over the row's own head-dim lanes, in tiles aligned to the row's
sequence (grid: query tiles of the longest sequence, sequences, heads), with
a tile shape fixed by the head dim alone: a row's bits depend on nothing but
its own data.

Outputs start as zeros (aliased inputs), so rows outside every sequence,
never visited by a program, read D = 0 and e = 0 (also in interpret mode,
where an unaliased output would start as garbage).

Only maxima (order-free, exact in any order) and integer work are left to
XLA: the per-(sequence, KV head) maxima of |K| and of ||V_j|| (the norms
themselves come from `_key_norm_kernel`), and the powers of two built from
e_i by integer bit operations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import varlen
from pallas_kernels import pip_triton
from pallas_kernels.flash import tiles
from pallas_kernels.flash.config import head_dim_bucket

DQ_GRID_BITS = 29  # partial sums stay below 2^29: 4x headroom in int32
BOUND_WIDEN = 1.125  # rounding of P and dS before the products
# Clip of the bound's exponent: keeps 2^(29 - e) and 2^(e - 29) normal.
E_MIN, E_MAX = -90, 97


def preprocess_rows(d_pad: int, interpret: bool) -> int:
  """Rows per tile: a function of the padded head dim only (never of batch
  or sequence length). Interpret mode uses the tests' 16-row tiles."""
  if interpret:
    return 16
  return max(16, min(64, 8192 // d_pad))


def launch_params(d_pad: int, compiler: str = "xla"):
  """Compiler params of the preprocess kernels for head dim `d_pad`."""
  return pip_triton.compiler_params(compiler, 4 if d_pad <= 128 else 8, 1)


def _exponent(bound):
  """int32 e with bound <= 2^e (jnp.frexp's exponent: 0 for 0, inf, nan),
  from the float's bits, clipped to [E_MIN, E_MAX]."""
  bits = jax.lax.bitcast_convert_type(bound, jnp.int32)
  biased = jax.lax.shift_right_logical(bits, 23) & 0xFF
  e = biased - 126  # normal numbers: bound = m * 2^e, m in [1/2, 1)
  # Tested on the bits: a float compare may flush subnormals to zero (which
  # frexp does not; they clip to E_MIN like any tiny bound).
  special = ((bits & 0x7FFFFFFF) == 0) | (biased == 0xFF)
  e = jnp.where(special, 0, e)
  return jnp.minimum(jnp.maximum(e, E_MIN), E_MAX)


def _query_kernel(cu_q_ref, o_ref, do_ref, *refs, block: int, head_dim: int,
                  group: int, has_dlse: bool, with_grid: bool,
                  bound_scale: float):
  refs = list(refs)
  dlse_ref = refs.pop(0) if has_dlse else None
  kmax_ref = vmax_ref = None
  if with_grid:
    kmax_ref, vmax_ref = refs.pop(0), refs.pop(0)
  outs = refs[len(refs) // 2:]  # the first half are the aliased zeros
  delta_ref = outs[0]
  exp_ref = outs[1] if with_grid else None

  q_blk, seq, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  q_off = cu_q_ref[seq]
  len_q = cu_q_ref[seq + 1] - q_off
  q0 = q_blk * block
  d_pad = o_ref.shape[-1]

  @pl.when(q0 < len_q)
  def _():
    valid, rows, mask = tiles.row_tile(q_off, q0, len_q, block, head_dim,
                                        d_pad)
    o = tiles.load(o_ref.at[rows, :], mask=mask, other=0.0)
    do = tiles.load(do_ref.at[rows, :], mask=mask, other=0.0)
    do = do.astype(jnp.float32)
    delta = jnp.sum(do * o.astype(jnp.float32), axis=1)
    if has_dlse:
      delta = delta - tiles.load(dlse_ref.at[rows], mask=valid, other=0.0)
    plgpu.store(delta_ref.at[rows], delta, mask=valid)
    if with_grid:
      # |dQ_i[d]| <= scale * max|K_s| * (||dO_i|| max_j ||V_j|| + |D_i|).
      do_norm = jnp.sqrt(jnp.sum(do * do, axis=1))
      kv = head // group
      bound = (bound_scale * kmax_ref[seq, kv]) * (
          do_norm * vmax_ref[seq, kv] + jnp.abs(delta))
      plgpu.store(exp_ref.at[rows], _exponent(bound), mask=valid)


def _key_norm_kernel(cu_k_ref, v_ref, _, norm_ref, *, block: int,
                     head_dim: int):
  k_blk, seq = pl.program_id(0), pl.program_id(1)
  k_off = cu_k_ref[seq]
  len_k = cu_k_ref[seq + 1] - k_off
  k0 = k_blk * block
  d_pad = v_ref.shape[-1]

  @pl.when(k0 < len_k)
  def _():
    valid, rows, mask = tiles.row_tile(k_off, k0, len_k, block, head_dim,
                                        d_pad)
    v = tiles.load(v_ref.at[rows, :], mask=mask, other=0.0)
    v = v.astype(jnp.float32)
    plgpu.store(norm_ref.at[rows], jnp.sqrt(jnp.sum(v * v, axis=1)),
                mask=valid)


def token_sequence_ids(cu_seqlens, total: int):
  """int32 [total]: the sequence of each packed token; num_seqs for tokens
  past cu_seqlens[-1] (they belong to no sequence)."""
  t = jnp.arange(total, dtype=jnp.int32)
  seq = varlen.token_seq_ids(cu_seqlens, total)
  return jnp.where(t < cu_seqlens[-1], seq, cu_seqlens.shape[0] - 1)


def _segment_max(x, seq_ids, num_seqs: int):
  """[num_seqs, ...] maxima of x [tokens, ...] per sequence (0 if empty);
  tokens with seq_ids == num_seqs belong to none. Order-free: exact."""
  m = jax.ops.segment_max(x, seq_ids, num_segments=num_seqs + 1)
  return jnp.maximum(m[:num_seqs], 0.0)


def backward_rows(out, do, dlse, k, v, cu_seqlens_q, cu_seqlens_k, *,
                  softmax_scale: float, max_seqlen_q: int, max_seqlen_k: int,
                  with_grid: bool, interpret: bool, compiler: str = "xla"):
  """(delta, exponent or None), each [heads_q, total_q].

  out, do: [total_q, heads_q, head_dim]; dlse: float32 [heads_q, total_q] or
  None; k, v: [total_k, heads_kv, head_dim] (read only when with_grid).
  delta is float32 D_i; exponent (with_grid) is int32 e_i, the smallest e
  with bound_i <= 2^e (clipped to [E_MIN, E_MAX]). Both are 0 on rows
  outside every sequence. compiler: the backward's (BlockSizes.compiler).
  """
  total_q, heads_q, head_dim = out.shape
  num_seqs = cu_seqlens_q.shape[0] - 1
  d_pad = head_dim_bucket(head_dim)
  block = preprocess_rows(d_pad, interpret)
  row_spec = pl.BlockSpec((None, total_q), lambda i, s, h: (h, 0))
  tok_q = pl.BlockSpec((total_q, None, d_pad), lambda i, s, h: (0, h, 0))
  in_specs = [tiles.full_spec(cu_seqlens_q.shape), tok_q, tok_q]
  args = [cu_seqlens_q, out, do]
  if dlse is not None:
    in_specs.append(row_spec)
    args.append(dlse.astype(jnp.float32))
  group = 1
  if with_grid:
    total_k, heads_kv, _ = k.shape
    group = heads_q // heads_kv
    k_seq = token_sequence_ids(cu_seqlens_k, total_k)
    tok_k = pl.BlockSpec((total_k, None, d_pad), lambda i, s, h: (0, h, 0))
    krow_spec = pl.BlockSpec((None, total_k), lambda i, s, h: (h, 0))
    v_norm = pl.pallas_call(
        functools.partial(_key_norm_kernel, block=block, head_dim=head_dim),
        grid=(pl.cdiv(max_seqlen_k, block), num_seqs, heads_kv),
        in_specs=[tiles.full_spec(cu_seqlens_k.shape), tok_k, krow_spec],
        out_specs=krow_spec,
        out_shape=jax.ShapeDtypeStruct((heads_kv, total_k), jnp.float32),
        input_output_aliases={2: 0},
        compiler_params=launch_params(d_pad, compiler),
        interpret=interpret,
        name="fold_flash_backward_key_norms",
    )(cu_seqlens_k, v, jnp.zeros((heads_kv, total_k), jnp.float32))
    # Maxima of the finite entries only: a non-finite key must not move the
    # grid of rows that never see it (the rows that do are set to NaN by
    # `flash_backward`, since int32 sums cannot carry it).
    k_abs = jnp.abs(k.astype(jnp.float32))
    k_abs_max = jnp.max(jnp.where(jnp.isfinite(k_abs), k_abs, 0.0),
                        axis=-1)  # [tk, hkv]
    k_max = _segment_max(k_abs_max, k_seq, num_seqs)  # [num_seqs, hkv]
    v_norm = jnp.where(jnp.isfinite(v_norm), v_norm, 0.0)
    v_max = _segment_max(v_norm.T, k_seq, num_seqs)
    in_specs += [tiles.full_spec(k_max.shape), tiles.full_spec(v_max.shape)]
    args += [k_max, v_max]
  out_shape = [jax.ShapeDtypeStruct((heads_q, total_q), jnp.float32)]
  if with_grid:
    out_shape.append(jax.ShapeDtypeStruct((heads_q, total_q), jnp.int32))
  n_in = len(args)
  in_specs += [row_spec] * len(out_shape)
  args += [jnp.zeros(s.shape, s.dtype) for s in out_shape]
  res = pl.pallas_call(
      functools.partial(_query_kernel, block=block, head_dim=head_dim,
                        group=group, has_dlse=dlse is not None,
                        with_grid=with_grid,
                        bound_scale=softmax_scale * BOUND_WIDEN),
      grid=(pl.cdiv(max_seqlen_q, block), num_seqs, heads_q),
      in_specs=in_specs,
      out_specs=[row_spec] * len(out_shape),
      out_shape=out_shape,
      input_output_aliases={n_in + i: i for i in range(len(out_shape))},
      compiler_params=launch_params(d_pad, compiler),
      interpret=interpret,
      name="fold_flash_backward_preprocess",
  )(*args)
  return res[0], (res[1] if with_grid else None)


def pow2(e):
  """float32 2^e for int32 e in [-126, 127], by building the float's bits
  (exact under any XLA fusion)."""
  return jax.lax.bitcast_convert_type(
      jax.lax.shift_left(e.astype(jnp.int32) + 127, 23), jnp.float32)
