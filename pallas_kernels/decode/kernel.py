"""Split-KV paged decode whose partials combine by addition.

Layouts (those of `pallas_kernels.reference.decode`):
  q:           [batch, heads_kv, rows_pad, d_pad]: the queries of one GQA group
               stacked as rows, row r = t * group + g for draft token t and
               query head h * group + g (zero rows pad to a power of two >= 16).
  k_pages:     [num_pages, page_size, heads_kv, d_pad], a page pool.
  v_pages:     the same.
  block_table: int32 [batch, max_pages]; lengths: int32 [batch].
  k_scales, v_scales: float32 [num_pages, heads_kv] (fp8 only): k_pages and
               v_pages hold FP8 entries that decode as entry * scale of their
               (page, head) (`pallas_kernels.decode.fp8`); anchors stay in the
               query dtype, already dequantised.

The softmax reference is declared before any reduction
------------------------------------------------------
Every (sequence, KV head) program first computes, for each query row, a
reference R (base-2 log domain) from a fixed sample of that row's visible keys:
the first key of every page in the window (kept contiguous per sequence in
an anchor array) and the newest SAMPLE_TILE keys (so each draft row sees its
own token). R = max(sampled scores, sink). R is
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
M - R > ~100. The combine kernel checks M - R <= 64 per row (M from the chunk
maxima, exact). When a row fails, that (sequence, KV head) program recomputes
its chunks in place with R := M for the failing rows (same code, same order;
rare, and no host round trip); rows that passed keep their R and therefore
their bits. The check depends only on the row's own data, so the invariances
hold through the fallback.

fp8: keys and values are dequantised in registers right after their load,
(entry * scale).astype(q.dtype); the scales are powers of two, so this is
exact and the program then runs on the same values as over a cache holding
the dequantised pages (same bits, half the bytes read).

Every one of these decisions is a function of the row's own data, so the
invariances above hold for fp8 too.
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
from pallas_kernels.flash.tiles import LOG2E

# A row is recomputed against its exact maximum when M - R exceeds this.
OVERFLOW_MARGIN = 64.0
# Anchors (first keys of pages) per step of the declared-reference loop, and
# chunk partials per step of the combine loop (issued together, added in
# order).
ANCHOR_TILE = 32
COMBINE_UNROLL = 8


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
  has_sinks: bool
  interpret: bool
  fp8: bool = False     # FP8 pages + per-(page, head) float32 scales

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


def _dequant(x, scale, dtype):
  """FP8 entries times a power-of-two float32 scale: exact in dtype."""
  return (x.astype(jnp.float32) * scale).astype(dtype)


def _gather_keys(k_ref, bt_ref, b, h, kpos, ok, spec: DecodeSpec,
                 ks_ref=None, dtype=None):
  """[len(kpos), d_pad] keys at logical positions kpos (rows with ok False
  read as 0) through the block table (fp8: dequantised to dtype)."""
  s = spec.page_size
  kp = jnp.where(ok, kpos, 0)
  pages = plgpu.load(bt_ref.at[b, kp // s], mask=ok, other=0)
  d = jnp.arange(spec.d_pad, dtype=jnp.int32)[None, :]
  k = plgpu.load(k_ref.at[pages[:, None], (kp % s)[:, None], h, d],
                 mask=ok[:, None], other=0.0)
  if spec.fp8:
    ks = plgpu.load(ks_ref.at[pages, h], mask=ok, other=0.0)
    k = _dequant(k, ks[:, None], dtype)
  return k


def _declared_reference(spec: DecodeSpec, q, k_ref, bt_ref, anchors_ref, b, h,
                        hi, lo, rows: _Rows, ks_ref=None):
  """max over a fixed sample of visible keys of the row's score (base 2):
  the first key of every page in [lo, hi) (from the per-sequence anchor
  array, contiguous: no block-table chain) and the newest SAMPLE_TILE keys."""
  s = spec.page_size
  precision = _dot_precision(q.dtype)

  def sample_max(kk, kpos, ok, acc):
    sc = _scores(spec, plgpu.dot(q, kk.astype(q.dtype), trans_b=True,
                                 precision=precision))
    vis = rows.visible(kpos, hi) & ok[None, :]
    return jnp.maximum(acc, jnp.max(jnp.where(vis, sc, -jnp.inf), axis=1))

  ref = jnp.full((spec.rows_pad,), -jnp.inf, jnp.float32)
  a = ANCHOR_TILE
  p_lo = lax.div(lo + s - 1, s)
  p_hi = lax.div(hi + s - 1, s)
  n_tiles = jnp.maximum(lax.div(p_hi - p_lo + a - 1, a), 0)

  def anchor_step(i, acc):
    pv = p_lo + i * a + jnp.arange(a, dtype=jnp.int32)
    ok = pv < p_hi
    kk = plgpu.load(anchors_ref.at[b, pl.ds(p_lo + i * a, a), h, :],
                    mask=ok[:, None], other=0.0)
    return sample_max(kk, pv * s, ok, acc)

  ref = lax.fori_loop(0, n_tiles, anchor_step, ref)
  # The newest keys (each draft row's own token among them).
  kpos = hi - SAMPLE_TILE + jnp.arange(SAMPLE_TILE, dtype=jnp.int32)
  ok = (kpos >= lo) & (kpos >= 0)
  kk = _gather_keys(k_ref, bt_ref, b, h, kpos, ok, spec, ks_ref, q.dtype)
  return sample_max(kk, kpos, ok, ref)


# ----------------------------------------------------------------------------
# One chunk's partials, shared by both kernels
# ----------------------------------------------------------------------------
class _Program:
  """The refs and per-program values of one (sequence, KV head) program."""

  def __init__(self, spec: DecodeSpec, refs: list, b, h):
    self.spec = spec
    (self.len_ref, self.bt_ref, self.q_ref, self.k_ref, self.v_ref,
     self.anchors_ref) = refs[:6]
    refs = list(refs[6:])
    self.ks_ref, self.vs_ref = ((refs.pop(0), refs.pop(0)) if spec.fp8
                                else (None, None))
    self.sinks_ref = refs.pop(0) if spec.has_sinks else None
    self.b, self.h = b, h
    self.hi = self.len_ref[b]
    self.lo = _window(spec, self.hi)
    self.rows = _Rows(spec, self.hi)
    self.q = plgpu.load(self.q_ref.at[b, h])
    self.row_ids = jnp.arange(spec.rows_pad, dtype=jnp.int32)
    cs = spec.chunk_tokens
    self.c_lo = self.lo // cs
    self.c_hi = lax.div(self.hi + cs - 1, cs)

  def sink2(self):
    g = self.spec.group
    return plgpu.load(self.sinks_ref.at[self.h * g + self.row_ids % g]) * LOG2E

  def declared_reference(self):
    spec = self.spec
    ref = _declared_reference(spec, self.q, self.k_ref, self.bt_ref,
                              self.anchors_ref, self.b, self.h, self.hi,
                              self.lo, self.rows, self.ks_ref)
    if spec.has_sinks:
      ref = jnp.maximum(ref, self.sink2())
    return jnp.where(ref == -jnp.inf, 0.0, ref)

  def zeros(self):
    spec = self.spec
    return (jnp.zeros((spec.rows_pad, spec.d_pad), jnp.float32),
            jnp.zeros((spec.rows_pad,), jnp.float32),
            jnp.full((spec.rows_pad,), -jnp.inf, jnp.float32))

  def chunk_partial(self, c, ref):
    """(acc, l, m) of chunk c against the reference `ref` (base 2)."""
    spec, rows, b, h, hi = self.spec, self.rows, self.b, self.h, self.hi
    s, bk, cs = spec.page_size, spec.block_k, spec.chunk_tokens
    q = self.q
    precision = _dot_precision(q.dtype)
    kiota = jnp.arange(bk, dtype=jnp.int32)

    def tile(t, carry):
      acc, l, m = carry
      k0 = t * bk
      page = self.bt_ref[b, k0 // s]
      off = k0 % s
      kpos = k0 + kiota
      kin = kpos < hi
      vis = rows.visible(kpos, hi)
      kmask = kin[:, None]
      k = plgpu.load(self.k_ref.at[page, pl.ds(off, bk), h, :], mask=kmask,
                     other=0.0)
      if spec.fp8:
        k = _dequant(k, self.ks_ref[page, h], q.dtype)
      sc = _scores(spec, plgpu.dot(q, k, trans_b=True, precision=precision))
      m = jnp.maximum(m, jnp.max(jnp.where(vis, sc, -jnp.inf), axis=1))
      p = jnp.where(vis, jnp.exp2(sc - ref[:, None]), 0.0)
      l = l + jnp.sum(p, axis=1)
      v = plgpu.load(self.v_ref.at[page, pl.ds(off, bk), h, :], mask=kmask,
                     other=0.0)
      if spec.fp8:
        v = _dequant(v, self.vs_ref[page, h], q.dtype)
      cdt = q.dtype
      acc = acc + plgpu.dot(p.astype(cdt), v.astype(cdt),
                            precision=precision)
      return acc, l, m

    t_lo = jnp.maximum(c * cs, self.lo) // bk
    t_hi = lax.div(jnp.minimum((c + 1) * cs, hi) + bk - 1, bk)
    return lax.fori_loop(t_lo, t_hi, tile, self.zeros())


# ----------------------------------------------------------------------------
# Kernel 1: one program per (sequence, KV head, split)
# ----------------------------------------------------------------------------
def _split_kernel(*refs, spec: DecodeSpec, n_in: int):
  b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  prog = _Program(spec, list(refs[:n_in]), b, h)
  acc_ref, l_ref, m_ref, r_ref = refs[n_in:]
  ref = prog.declared_reference()

  @pl.when(split == 0)
  def _():
    plgpu.store(r_ref.at[b, h], ref)

  per = lax.div(jnp.maximum(prog.c_hi - prog.c_lo, 0) + spec.n_splits - 1,
                spec.n_splits)
  c0 = prog.c_lo + split * per
  c1 = jnp.minimum(c0 + per, prog.c_hi)
  rmask = prog.row_ids < spec.rows_store
  rows = pl.ds(0, spec.rows_pad)

  def chunk(c, carry):
    acc, l, m = prog.chunk_partial(c, ref)
    plgpu.store(acc_ref.at[b, h, c, rows, :], acc, mask=rmask[:, None])
    plgpu.store(l_ref.at[b, h, c, rows], l, mask=rmask)
    plgpu.store(m_ref.at[b, h, c, rows], m, mask=rmask)
    return carry

  lax.fori_loop(c0, jnp.maximum(c1, c0), chunk, jnp.int32(0))


# ----------------------------------------------------------------------------
# Kernel 2: one program per (sequence, KV head): the fixed-order sum
# ----------------------------------------------------------------------------
def _combine_kernel(*refs, spec: DecodeSpec, n_in: int, n_chunks: int,
                    fallback: bool):
  b, h = pl.program_id(0), pl.program_id(1)
  prog = _Program(spec, list(refs[:n_in]), b, h)
  acc_ref, l_ref, m_ref, r_ref, out_ref, used_ref = refs[n_in:]
  rmask = prog.row_ids < spec.rows_store
  rows = pl.ds(0, spec.rows_pad)

  def add(i, carry):
    # COMBINE_UNROLL chunks per step: their loads are issued together, the
    # additions happen in chunk order (the same bits as one at a time).
    acc, l, m = carry
    c0 = prog.c_lo + i * COMBINE_UNROLL
    parts = []
    for j in range(COMBINE_UNROLL):
      c = c0 + j
      live = c < c_end
      cc = jnp.minimum(c, n_chunks - 1)
      parts.append((
          plgpu.load(acc_ref.at[b, h, cc, rows, :],
                     mask=rmask[:, None] & live, other=0.0),
          plgpu.load(l_ref.at[b, h, cc, rows], mask=rmask & live, other=0.0),
          plgpu.load(m_ref.at[b, h, cc, rows], mask=rmask & live,
                     other=-jnp.inf)))
    for a, ll, mm in parts:
      acc, l, m = acc + a, l + ll, jnp.maximum(m, mm)
    return acc, l, m

  c_end = jnp.maximum(prog.c_hi, prog.c_lo)
  n_steps = lax.div(c_end - prog.c_lo + COMBINE_UNROLL - 1, COMBINE_UNROLL)
  acc, l, m = lax.fori_loop(0, n_steps, add, prog.zeros())
  ref = plgpu.load(r_ref.at[b, h])
  if fallback:
    # Rows whose maximum passed the declared reference by more than the
    # margin are recomputed here against R := M, chunk by chunk with the
    # same code and summed in the same order (rare; no host round trip).
    flag = (m - ref > OVERFLOW_MARGIN) & prog.rows.ok

    def recompute(_):
      ref2 = jnp.where(flag, m, ref)

      def again(c, carry):
        acc, l = carry
        a, ll, _ = prog.chunk_partial(c, ref2)
        return acc + a, l + ll

      acc2, l2, _ = prog.zeros()
      acc2, l2 = lax.fori_loop(prog.c_lo, c_end, again, (acc2, l2))
      # Rows that passed keep the split kernel's sums (their exact bits).
      return (jnp.where(flag[:, None], acc2, acc), jnp.where(flag, l2, l),
              ref2)

    acc, l, ref = lax.cond(_any(flag), recompute, lambda _: (acc, l, ref),
                           None)
  if spec.has_sinks:
    l = l + jnp.exp2(prog.sink2() - ref)
  ok = l > 0.0
  out = acc / jnp.where(ok, l, 1.0)[:, None]
  out = jnp.where(ok[:, None], out, 0.0)
  plgpu.store(out_ref.at[b, h, rows, :], out.astype(out_ref.dtype),
              mask=rmask[:, None])
  plgpu.store(used_ref.at[b, h], ref)


def _full(shape):
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


@functools.partial(jax.jit, static_argnames=("spec", "fallback"))
def fold_decode(q, k_pages, v_pages, block_table, lengths, anchors, *,
                spec: DecodeSpec, sinks=None, k_scales=None, v_scales=None,
                fallback: bool = True):
  """Decode attention over a paged cache (see the module docstring).

  Args:
    q: [batch, heads_kv, rows_pad, d_pad] (rows r = t * group + g).
    k_pages, v_pages: [num_pages, page_size, heads_kv, d_pad].
    block_table: int32 [batch, max_pages]; lengths: int32 [batch].
    anchors: [batch, max_pages, heads_kv, d_pad], the first key of each
      logical page (`page_anchors`; FoldKVCache keeps it up to date).
    k_scales, v_scales: float32 [num_pages, heads_kv] (spec.fp8: the pools
      hold FP8 entries).
    sinks: float32 [heads_q] or None.
    fallback: recompute rows whose maximum exceeds the declared reference by
      more than OVERFLOW_MARGIN (leave True; False is for tests).

  Returns:
    out [batch, heads_kv, rows_store, d_pad] in q's dtype, and the float32
    declared references [batch, heads_kv, rows_pad] actually used.
  """
  batch, heads_kv = q.shape[:2]
  ins = [lengths, block_table, q, k_pages, v_pages, anchors]
  if spec.fp8:
    ins.extend([k_scales.astype(jnp.float32), v_scales.astype(jnp.float32)])
  if spec.has_sinks:
    ins.append(sinks.astype(jnp.float32))
  n_in = len(ins)
  n_chunks = -(-block_table.shape[1] * spec.page_size // spec.chunk_tokens)
  rs, rp, f32 = spec.rows_store, spec.rows_pad, jnp.float32
  sds = jax.ShapeDtypeStruct
  partial_shapes = [sds((batch, heads_kv, n_chunks, rs, spec.d_pad), f32),
                    sds((batch, heads_kv, n_chunks, rs), f32),
                    sds((batch, heads_kv, n_chunks, rs), f32),
                    sds((batch, heads_kv, rp), f32)]
  params = plgpu.CompilerParams(num_warps=spec.num_warps,
                                num_stages=spec.num_stages)
  partials = pl.pallas_call(
      functools.partial(_split_kernel, spec=spec, n_in=n_in),
      grid=(batch, heads_kv, spec.n_splits),
      in_specs=[_full(a.shape) for a in ins],
      out_specs=[_full(o.shape) for o in partial_shapes],
      out_shape=partial_shapes, compiler_params=params,
      interpret=spec.interpret, name="fold_decode_split")(*ins)
  args = ins + list(partials)
  out_shapes = [sds((batch, heads_kv, rs, spec.d_pad), q.dtype),
                sds((batch, heads_kv, rp), f32)]
  out, used = pl.pallas_call(
      functools.partial(_combine_kernel, spec=spec, n_in=n_in,
                        n_chunks=n_chunks, fallback=fallback),
      grid=(batch, heads_kv),
      in_specs=[_full(a.shape) for a in args],
      out_specs=[_full(o.shape) for o in out_shapes],
      out_shape=out_shapes, compiler_params=params,
      interpret=spec.interpret, name="fold_decode_combine")(*args)
  return out, used
