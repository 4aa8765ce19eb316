"""Split-KV paged decode whose partials combine by addition.

Layouts (those of `pallas_kernels.reference.decode`):
  q:           [batch, heads_kv, rows_pad, d_pad]: the queries of one GQA group
               stacked as rows, row r = t * group + g for draft token t and
               query head h * group + g (zero rows pad to a power of two >= 16).
  k_pages:     [num_pages, page_size, heads_kv, d_pad], a page pool.
  v_pages:     the same, or (v8) the coarse E4M3 plane, with `v_res` the
               residual E4M3 plane and `v_scale` [1] the power-of-two scale.
  block_table: int32 [batch, max_pages]; lengths: int32 [batch].
  summaries:   (kmax, kmin) [num_pages, heads_kv, d_pad] in the key dtype and
               (ksum, ksumsq) float32: per-page key statistics (depth).

The softmax reference is declared before any reduction
------------------------------------------------------
Every (sequence, KV head) program first computes, for each query row, a
reference R (base-2 log domain) from a fixed sample of that row's visible keys:
the first key of every page in the window and the newest SAMPLE_TILE keys
(so each draft row sees its own token). R = max(sampled scores, sink). R is
a lower bound of the row's true maximum M (the sample is a subset), never far
below it in practice, and it does not depend on the split count, the batch or
the page placement. Then every chunk c (a fixed run of `chunk_tokens` keys,
absolute positions [c*C, (c+1)*C)) emits

    acc_c = sum_{j in c} 2^(s_j - R) v_j,   l_c = sum_{j in c} 2^(s_j - R),
    m_c   = max_{j in c} s_j,

and the combine kernel adds chunks 0, 1, 2, ... in that order:
out = sum_c acc_c / (sum_c l_c + 2^(sink - R)). No partial is ever rescaled;
the split count only decides which program computes which chunk, so 1, 2, 7
or 64 splits give identical bits, and so do any batch and any page placement
(the same program code runs on the same values).

Safety: weights are 2^(s - R) with R <= M; they overflow float32 only if
M - R > ~100. The combine checks M - R <= 64 per row (M from the chunk maxima,
exact). A row that fails is recomputed with R := M (a second pass, under
`lax.cond`, only when some row failed); rows that passed keep their R and
therefore their bits. The flag depends only on the row's own data, so the
invariances hold through the fallback.

depth (optional), with w_j = 2^(s_j - R) a key's weight against the declared
reference:
  * key cut: keys with w_j < 2^-depth leave the numerator but keep their
    exact mass in the denominator; a tile where no (row, key) weight reaches
    2^-depth does not read its values.
  * page cut: a page whose bounding-box bound u_pr = max over the page's box
    of s is below R_r - depth (so every key of it would be cut for row r)
    is not read at all for that row (nor by the program if no row needs it);
    its mass enters the denominator as an estimate n_visible * 2^(e_pr - R_r),
    e = mean score + ln2 * var / 2 (the log-normal mean, capped at the bound),
    from the page summaries.

v8: values are decoded from a coarse E4M3 plane c and a residual plane r as
scale * (c + r / 16); the residual term of key j is used only when
w_j >= 2^-v8_depth, and a tile where no weight reaches that reads only the
coarse plane (half the value bytes).

Every one of these decisions is a function of the row's own data, so the
invariances above hold for depth and v8 too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode.config import MAX_DRAFT, SAMPLE_TILE
from pallas_kernels.flash._tiles import LN2, LOG2E

# A row is recomputed against its exact maximum when M - R exceeds this.
OVERFLOW_MARGIN = 64.0
# Residual plane factor: v = scale * (coarse + residual * 2^-V8_RES_SHIFT).
V8_RES_SHIFT = 4


def _pow2(n: int) -> int:
  p = 16
  while p < n:
    p *= 2
  return p


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
  """Static description of one decode call (hashed into the jit cache)."""

  group: int            # query heads per KV head
  q_len: int            # draft tokens per sequence (1 for plain decode)
  d_pad: int            # padded head dim (power of two >= 16)
  page_size: int
  chunk_tokens: int     # partials are cut every chunk_tokens keys
  block_k: int
  num_warps: int
  num_stages: int
  n_splits: int
  scale: float          # softmax scale (natural-log domain)
  softcap: float        # 0: off
  left: int             # window's left extent, -1 unbounded (right is 0)
  depth: int | None
  v8: bool
  v8_depth: int
  has_sinks: bool
  interpret: bool

  def __post_init__(self):
    if self.page_size % self.block_k:
      raise ValueError(f"block_k {self.block_k} must divide the page size "
                       f"{self.page_size}.")
    if self.chunk_tokens % self.page_size:
      raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a multiple "
                       f"of the page size {self.page_size}.")
    if not 1 <= self.q_len <= MAX_DRAFT:
      raise ValueError(f"q_len must be in 1..{MAX_DRAFT}; got {self.q_len}.")

  @property
  def rows(self) -> int:
    return self.group * self.q_len

  @property
  def rows_pad(self) -> int:
    return _pow2(self.rows)

  @property
  def rows_store(self) -> int:
    # Interpret mode emulates out-of-range stores by padding; on the GPU the
    # partials keep only the real rows (masked stores).
    return self.rows_pad if self.interpret else self.rows

  @property
  def summaries(self) -> bool:
    return self.depth is not None


# ----------------------------------------------------------------------------
# In-kernel helpers
# ----------------------------------------------------------------------------
def _capped(spec: DecodeSpec, x2):
  """Soft-cap in the base-2 domain (x2 = scale * log2(e) * q.k)."""
  if spec.softcap > 0.0:
    c2 = spec.softcap * LOG2E
    return c2 * jnp.tanh(x2 / c2)
  return x2


def _scores(spec: DecodeSpec, qk):
  return _capped(spec, qk * (spec.scale * LOG2E))


def _any(x):
  """Triton has no reduce_or: max over int32."""
  return jnp.max(x.astype(jnp.int32)) > 0


def _any2(x):
  return jnp.max(jnp.max(x.astype(jnp.int32), axis=1)) > 0


def _dot_precision(dtype):
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


class _Rows:
  """Per-row geometry of a program: row r is draft token r // group."""

  def __init__(self, spec: DecodeSpec, hi):
    r = jnp.arange(spec.rows_pad, dtype=jnp.int32)
    self.ok = r < spec.rows
    self.pos = hi - spec.q_len + r // spec.group  # the query's position
    self.spec = spec

  def visible(self, kpos, hi):
    """[rows_pad, len(kpos)] mask: key kpos is visible to the row."""
    kj = kpos[None, :]
    qi = self.pos[:, None]
    vis = self.ok[:, None] & (kj >= 0) & (kj < hi) & (kj <= qi)
    if self.spec.left >= 0:
      vis &= kj >= qi - self.spec.left
    return vis


def _window(spec: DecodeSpec, hi):
  """Keys [lo, hi) that some row of the program may see."""
  if spec.left >= 0:
    return jnp.maximum(hi - spec.q_len - spec.left, 0)
  return jnp.int32(0)


def _gather_keys(k_ref, bt_ref, b, h, kpos, ok, spec: DecodeSpec):
  """[len(kpos), d_pad] keys at logical positions kpos (rows with ok False
  read as 0) through the block table."""
  s = spec.page_size
  kp = jnp.where(ok, kpos, 0)
  pages = plgpu.load(bt_ref.at[b, kp // s], mask=ok, other=0)
  d = jnp.arange(spec.d_pad, dtype=jnp.int32)[None, :]
  return plgpu.load(k_ref.at[pages[:, None], (kp % s)[:, None], h, d],
                    mask=ok[:, None], other=0.0)


def _declared_reference(spec: DecodeSpec, q, k_ref, bt_ref, b, h, hi, lo,
                        rows: _Rows):
  """max over a fixed sample of visible keys of the row's score (base 2)."""
  s = spec.page_size
  a = SAMPLE_TILE
  precision = _dot_precision(q.dtype)

  def sample_max(kpos, ok, acc):
    kk = _gather_keys(k_ref, bt_ref, b, h, kpos, ok, spec).astype(q.dtype)
    sc = _scores(spec, plgpu.dot(q, kk, trans_b=True, precision=precision))
    vis = rows.visible(kpos, hi) & ok[None, :]
    return jnp.maximum(acc, jnp.max(jnp.where(vis, sc, -jnp.inf), axis=1))

  ref = jnp.full((spec.rows_pad,), -jnp.inf, jnp.float32)
  # The first key of each page in the window.
  p_lo = lax.div(lo + s - 1, s)
  p_hi = lax.div(hi + s - 1, s)
  n_tiles = jnp.maximum(lax.div(p_hi - p_lo + a - 1, a), 0)

  def anchor_step(i, acc):
    pv = p_lo + i * a + jnp.arange(a, dtype=jnp.int32)
    return sample_max(pv * s, pv < p_hi, acc)

  ref = lax.fori_loop(0, n_tiles, anchor_step, ref)
  # The newest keys (each draft row's own token among them).
  kpos = hi - a + jnp.arange(a, dtype=jnp.int32)
  ref = sample_max(kpos, (kpos >= lo) & (kpos >= 0), ref)
  return ref


def _page_stats(spec: DecodeSpec, qf, sum_refs, page, h, count):
  """Bound u (base 2, capped) and log-normal mass exponent e of one page."""
  kmax_ref, kmin_ref, ksum_ref, ksq_ref = sum_refs
  kmax = kmax_ref[page, h, :].astype(jnp.float32)[None, :]
  kmin = kmin_ref[page, h, :].astype(jnp.float32)[None, :]
  u_raw = jnp.sum(jnp.maximum(qf * kmax, qf * kmin), axis=1)
  c2 = spec.scale * LOG2E
  u = _capped(spec, u_raw * c2)
  n = jnp.maximum(count, 1).astype(jnp.float32)
  mean = ksum_ref[page, h, :][None, :] / n
  var = jnp.maximum(ksq_ref[page, h, :][None, :] / n - mean * mean, 0.0)
  mu2 = jnp.sum(qf * mean, axis=1) * c2
  var2 = jnp.sum(qf * qf * var, axis=1) * (c2 * c2)
  e = _capped(spec, jnp.minimum(mu2 + (0.5 * LN2) * var2, u_raw * c2))
  return u, e


# ----------------------------------------------------------------------------
# Kernel 1: one program per (sequence, KV head, split)
# ----------------------------------------------------------------------------
def _split_kernel(len_ref, bt_ref, q_ref, k_ref, v_ref, *refs,
                  spec: DecodeSpec):
  refs = list(refs)
  vr_ref = refs.pop(0) if spec.v8 else None
  sum_refs = tuple(refs.pop(0) for _ in range(4)) if spec.summaries else None
  sinks_ref = refs.pop(0) if spec.has_sinks else None
  ovr_ref, acc_ref, l_ref, m_ref, r_ref = refs

  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  hi = len_ref[b]
  lo = _window(spec, hi)
  rows = _Rows(spec, hi)
  q = plgpu.load(q_ref.at[b, h])
  qf = q.astype(jnp.float32)
  precision = _dot_precision(q.dtype)
  row_ids = jnp.arange(spec.rows_pad, dtype=jnp.int32)

  ref = _declared_reference(spec, q, k_ref, bt_ref, b, h, hi, lo, rows)
  if spec.has_sinks:
    sink2 = plgpu.load(sinks_ref.at[h * spec.group + row_ids % spec.group])
    ref = jnp.maximum(ref, sink2 * LOG2E)
  ref = jnp.where(ref == -jnp.inf, 0.0, ref)
  ovr = plgpu.load(ovr_ref.at[b, h])
  ref = jnp.where(jnp.isnan(ovr), ref, ovr)  # the fallback pass's R := M

  @pl.when(split == 0)
  def _():
    plgpu.store(r_ref.at[b, h], ref)

  s, bk, cs = spec.page_size, spec.block_k, spec.chunk_tokens
  c_lo = lo // cs
  c_hi = lax.div(hi + cs - 1, cs)
  per = lax.div(jnp.maximum(c_hi - c_lo, 0) + spec.n_splits - 1, spec.n_splits)
  c0 = c_lo + split * per
  c1 = jnp.minimum(c0 + per, c_hi)
  kiota = jnp.arange(bk, dtype=jnp.int32)

  def tile(t, carry):
    acc, l, m = carry
    k0 = t * bk
    page = bt_ref[b, k0 // s]
    off = k0 % s
    kpos = k0 + kiota
    kin = kpos < hi
    vis = rows.visible(kpos, hi)
    use = vis
    kmask = kin[:, None]
    if spec.depth is not None:
      # Page cut: a page whose bound is below R - depth is not read; its mass
      # enters the denominator as an estimate.
      count = jnp.minimum(hi - (k0 // s) * s, s)
      u, e = _page_stats(spec, qf, sum_refs, page, h, count)
      keep = u >= ref - spec.depth
      use = vis & keep[:, None]
      kmask = kmask & _any(keep & rows.ok)
    k = plgpu.load(k_ref.at[page, pl.ds(off, bk), h, :], mask=kmask,
                   other=0.0)
    sc = _scores(spec, plgpu.dot(q, k, trans_b=True, precision=precision))
    m = jnp.maximum(m, jnp.max(jnp.where(use, sc, -jnp.inf), axis=1))
    rel = sc - ref[:, None]
    p = jnp.where(use, jnp.exp2(rel), 0.0)
    l = l + jnp.sum(p, axis=1)
    num = p
    vmask = kin[:, None]
    if spec.depth is not None:
      n_vis = jnp.sum(vis.astype(jnp.float32), axis=1)
      l = l + jnp.where(keep, 0.0, jnp.exp2(e - ref) * n_vis)
      # Key cut: weights below 2^-depth of R leave the numerator (their mass
      # stays in l); a tile with no weight left is not read.
      num = jnp.where(rel >= -spec.depth, p, 0.0)
      vmask = vmask & _any2(num > 0.0)
    v = plgpu.load(v_ref.at[page, pl.ds(off, bk), h, :], mask=vmask,
                   other=0.0)
    cdt = q.dtype
    acc = acc + plgpu.dot(num.astype(cdt), v.astype(cdt), precision=precision)
    if spec.v8:
      # Residual plane only where the weight reaches 2^-v8_depth of R.
      fine = jnp.where(rel >= -spec.v8_depth, num, 0.0)
      rmask = kin[:, None] & _any2(fine > 0.0)
      vr = plgpu.load(vr_ref.at[page, pl.ds(off, bk), h, :], mask=rmask,
                      other=0.0)
      acc = acc + plgpu.dot(fine.astype(cdt), vr.astype(cdt),
                            precision=precision) * (2.0 ** -V8_RES_SHIFT)
    return acc, l, m

  def chunk(c, carry):
    t_lo = jnp.maximum(c * cs, lo) // bk
    t_hi = lax.div(jnp.minimum((c + 1) * cs, hi) + bk - 1, bk)
    init = (jnp.zeros((spec.rows_pad, spec.d_pad), jnp.float32),
            jnp.zeros((spec.rows_pad,), jnp.float32),
            jnp.full((spec.rows_pad,), -jnp.inf, jnp.float32))
    acc, l, m = lax.fori_loop(t_lo, t_hi, tile, init)
    rmask = row_ids < spec.rows_store
    plgpu.store(acc_ref.at[b, h, c, pl.ds(0, spec.rows_pad), :], acc,
                mask=rmask[:, None])
    plgpu.store(l_ref.at[b, h, c, pl.ds(0, spec.rows_pad)], l, mask=rmask)
    plgpu.store(m_ref.at[b, h, c, pl.ds(0, spec.rows_pad)], m, mask=rmask)
    return carry

  lax.fori_loop(c0, jnp.maximum(c1, c0), chunk, jnp.int32(0))


# ----------------------------------------------------------------------------
# Kernel 2: one program per (sequence, KV head): the fixed-order sum
# ----------------------------------------------------------------------------
def _combine_kernel(len_ref, acc_ref, l_ref, m_ref, r_ref, *refs,
                    spec: DecodeSpec):
  refs = list(refs)
  vscale_ref = refs.pop(0) if spec.v8 else None
  sinks_ref = refs.pop(0) if spec.has_sinks else None
  out_ref, flag_ref, mx_ref = refs
  b, h = pl.program_id(0), pl.program_id(1)
  hi = len_ref[b]
  lo = _window(spec, hi)
  cs = spec.chunk_tokens
  c_lo = lo // cs
  c_hi = lax.div(hi + cs - 1, cs)
  row_ids = jnp.arange(spec.rows_pad, dtype=jnp.int32)
  rmask = row_ids < spec.rows_store

  def add(c, carry):
    acc, l, m = carry
    acc = acc + plgpu.load(acc_ref.at[b, h, c, pl.ds(0, spec.rows_pad), :],
                           mask=rmask[:, None], other=0.0)
    l = l + plgpu.load(l_ref.at[b, h, c, pl.ds(0, spec.rows_pad)],
                       mask=rmask, other=0.0)
    m = jnp.maximum(m, plgpu.load(m_ref.at[b, h, c, pl.ds(0, spec.rows_pad)],
                                  mask=rmask, other=-jnp.inf))
    return acc, l, m

  init = (jnp.zeros((spec.rows_pad, spec.d_pad), jnp.float32),
          jnp.zeros((spec.rows_pad,), jnp.float32),
          jnp.full((spec.rows_pad,), -jnp.inf, jnp.float32))
  acc, l, m = lax.fori_loop(c_lo, jnp.maximum(c_hi, c_lo), add, init)
  ref = plgpu.load(r_ref.at[b, h])
  if spec.has_sinks:
    sink2 = plgpu.load(sinks_ref.at[h * spec.group + row_ids % spec.group])
    l = l + jnp.exp2(sink2 * LOG2E - ref)
  ok = l > 0.0
  out = acc / jnp.where(ok, l, 1.0)[:, None]
  if spec.v8:
    out = out * vscale_ref[0]
  out = jnp.where(ok[:, None], out, 0.0)
  flag = (m - ref > OVERFLOW_MARGIN).astype(jnp.int32)
  plgpu.store(out_ref.at[b, h, pl.ds(0, spec.rows_pad), :],
              out.astype(out_ref.dtype), mask=rmask[:, None])
  plgpu.store(flag_ref.at[b, h, pl.ds(0, spec.rows_pad)], flag, mask=rmask)
  plgpu.store(mx_ref.at[b, h, pl.ds(0, spec.rows_pad)], m, mask=rmask)


def _full(shape):
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _split_call(spec: DecodeSpec, q, k_pages, v_pages, block_table, lengths,
                v_res, summaries, sinks, ovr):
  batch, heads_kv = q.shape[:2]
  n_chunks = -(-block_table.shape[1] * spec.page_size // spec.chunk_tokens)
  args = [lengths, block_table, q, k_pages, v_pages]
  if spec.v8:
    args.append(v_res)
  if spec.summaries:
    args.extend(summaries)
  if spec.has_sinks:
    args.append(sinks)
  args.append(ovr)
  rs = spec.rows_store
  out_shape = [
      jax.ShapeDtypeStruct((batch, heads_kv, n_chunks, rs, spec.d_pad),
                           jnp.float32),
      jax.ShapeDtypeStruct((batch, heads_kv, n_chunks, rs), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads_kv, n_chunks, rs), jnp.float32),
      jax.ShapeDtypeStruct((batch, heads_kv, spec.rows_pad), jnp.float32),
  ]
  return pl.pallas_call(
      functools.partial(_split_kernel, spec=spec),
      grid=(batch, heads_kv, spec.n_splits),
      in_specs=[_full(a.shape) for a in args],
      out_specs=[_full(o.shape) for o in out_shape],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=spec.num_warps,
                                           num_stages=spec.num_stages),
      interpret=spec.interpret,
      name="fold_decode_split",
  )(*args)


def _combine_call(spec: DecodeSpec, lengths, acc, l, m, ref, v_scale, sinks,
                  out_dtype):
  batch, heads_kv = acc.shape[:2]
  args = [lengths, acc, l, m, ref]
  if spec.v8:
    args.append(v_scale)
  if spec.has_sinks:
    args.append(sinks)
  rs = spec.rows_store
  out_shape = [
      jax.ShapeDtypeStruct((batch, heads_kv, rs, spec.d_pad), out_dtype),
      jax.ShapeDtypeStruct((batch, heads_kv, rs), jnp.int32),
      jax.ShapeDtypeStruct((batch, heads_kv, rs), jnp.float32),
  ]
  return pl.pallas_call(
      functools.partial(_combine_kernel, spec=spec),
      grid=(batch, heads_kv),
      in_specs=[_full(a.shape) for a in args],
      out_specs=[_full(o.shape) for o in out_shape],
      out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=spec.interpret,
      name="fold_decode_combine",
  )(*args)


@functools.partial(jax.jit, static_argnames=("spec", "fallback"))
def fold_decode(q, k_pages, v_pages, block_table, lengths, *, spec: DecodeSpec,
                v_res=None, v_scale=None, summaries=None, sinks=None,
                fallback: bool = True):
  """Decode attention over a paged cache (see the module docstring).

  Args:
    q: [batch, heads_kv, rows_pad, d_pad] (rows r = t * group + g).
    k_pages, v_pages: [num_pages, page_size, heads_kv, d_pad].
    block_table: int32 [batch, max_pages]; lengths: int32 [batch].
    v_res, v_scale: the residual E4M3 plane and float32 [1] scale (v8).
    summaries: (kmax, kmin, ksum, ksumsq) [num_pages, heads_kv, d_pad]
      (depth only).
    sinks: float32 [heads_q] or None.
    fallback: recompute rows whose maximum exceeds the declared reference by
      more than OVERFLOW_MARGIN (leave True; False is for tests).

  Returns:
    out [batch, heads_kv, rows_store, d_pad] in q's dtype, and the float32
    declared references [batch, heads_kv, rows_pad] actually used.
  """
  if sinks is not None:
    sinks = sinks.astype(jnp.float32)
  if v_scale is not None:
    v_scale = jnp.reshape(v_scale, (1,)).astype(jnp.float32)
  batch, heads_kv = q.shape[:2]

  def run(ovr):
    acc, l, m, ref = _split_call(spec, q, k_pages, v_pages, block_table,
                                 lengths, v_res, summaries, sinks, ovr)
    out, flag, mx = _combine_call(spec, lengths, acc, l, m, ref, v_scale,
                                  sinks, q.dtype)
    return out, flag, mx, ref

  none = jnp.full((batch, heads_kv, spec.rows_pad), jnp.nan, jnp.float32)
  out, flag, mx, ref = run(none)
  if not fallback:
    return out, ref

  def redo(_):
    pad = spec.rows_pad - spec.rows_store
    f = jnp.pad(flag, ((0, 0), (0, 0), (0, pad))) > 0
    mm = jnp.pad(mx, ((0, 0), (0, 0), (0, pad)))
    o2, _, _, r2 = run(jnp.where(f, mm, jnp.nan))
    return o2, r2

  return lax.cond(jnp.any(flag > 0), redo, lambda _: (out, ref), None)
