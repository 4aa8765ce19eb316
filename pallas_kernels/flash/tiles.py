"""Tile ranges and in-tile masks shared by the forward and backward kernels.

All positions are sequence-relative (tiles are aligned to each sequence's
start), which is what makes a sequence's bits independent of its batch or
packing. `off = len_k - len_q` aligns causal masks and windows bottom-right.
A query at position i sees key j iff
    i + off - left <= j <= i + off + right      (unbounded sides skipped)
where `causal` means right = 0.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclasses.dataclass(frozen=True)
class MaskConfig:
  """Static masking and score options, hashed into the kernel's cache key."""

  left: int  # -1: unbounded
  right: int  # -1: unbounded; 0 for causal
  has_segments: bool
  softcap: float  # 0.0: off
  scale: float  # softmax scale (natural-log domain)

  @staticmethod
  def make(*, causal: bool, window_size: tuple[int, int], has_segments: bool,
           softcap: float, scale: float) -> "MaskConfig":
    left, right = window_size
    if causal:
      right = 0 if right < 0 else min(right, 0)
    return MaskConfig(int(left), int(right), bool(has_segments),
                      float(softcap), float(scale))


def cdiv(a, b):
  return lax.div(a + b - 1, b)


def full_spec(shape):
  """BlockSpec handing every program the whole array."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _nonempty_or_zero(lo, hi):
  # An empty range becomes [0, 0) so that no tile past the sequence is read.
  empty = hi <= lo
  return jnp.where(empty, 0, lo), jnp.where(empty, 0, hi)


def key_range(cfg: MaskConfig, q0, block_q: int, len_q, len_k):
  """Keys [lo, hi) that some query of the tile [q0, q0 + block_q) may see."""
  off = len_k - len_q
  q_last = jnp.minimum(q0 + block_q, len_q) - 1
  lo = jnp.int32(0)
  hi = len_k
  if cfg.left >= 0:
    lo = jnp.maximum(lo, q0 + off - cfg.left)
  if cfg.right >= 0:
    hi = jnp.minimum(hi, q_last + off + cfg.right + 1)
  return _nonempty_or_zero(lo, hi)


def unmasked_key_range(cfg: MaskConfig, q0, block_q: int, len_q, len_k,
                       *, keys_in_bounds: bool):
  """Keys [lo, hi) that every query row of the tile sees (band interior).

  keys_in_bounds: also require keys < len_k (the forward must never read a
  key past the sequence unmasked; the backward tolerates it since such keys
  load as zeros and their gradients are not stored).
  """
  off = len_k - len_q
  q_last = q0 + block_q - 1
  lo = jnp.int32(0)
  hi = len_k if keys_in_bounds else jnp.int32(2**30)
  if cfg.left >= 0:
    lo = jnp.maximum(lo, q_last + off - cfg.left)
  if cfg.right >= 0:
    hi = jnp.minimum(hi, q0 + off + cfg.right + 1)
  return lo, jnp.maximum(hi, lo)


def query_range(cfg: MaskConfig, k0, block_k: int, len_q, len_k):
  """Queries [lo, hi) that may see some key of the tile [k0, k0 + block_k)."""
  off = len_k - len_q
  k_last = k0 + block_k - 1
  lo = jnp.int32(0)
  hi = len_q
  if cfg.right >= 0:
    lo = jnp.maximum(lo, k0 - off - cfg.right)
  if cfg.left >= 0:
    hi = jnp.minimum(hi, k_last - off + cfg.left + 1)
  return _nonempty_or_zero(lo, hi)


def unmasked_query_range(cfg: MaskConfig, k0, block_k: int, len_q, len_k):
  """Queries [lo, hi) that see every key of the tile (band interior), all
  inside the sequence (so their tiles load without masks)."""
  off = len_k - len_q
  k_last = k0 + block_k - 1
  lo = jnp.int32(0)
  hi = len_q
  if cfg.right >= 0:
    lo = jnp.maximum(lo, k_last - off - cfg.right)
  if cfg.left >= 0:
    hi = jnp.minimum(hi, k0 - off + cfg.left + 1)
  return lo, jnp.maximum(hi, lo)


def block_split(lo, hi, ulo, uhi, block: int):
  """Splits blocks covering [lo, hi) into masked and unmasked blocks.

  Returns (first, n_pre, full_first, n_full, post_first, n_post): blocks
  first .. first+n_pre-1 and post_first .. post_first+n_post-1 need masks,
  full_first .. full_first+n_full-1 do not.
  """
  first = lo // block
  last = cdiv(hi, block)  # exclusive
  full_first = jnp.maximum(cdiv(ulo, block), first)
  full_last = jnp.minimum(uhi // block, last)
  full_last = jnp.maximum(full_last, full_first)
  # Degenerate: no unmasked blocks -> everything is "pre".
  no_full = full_last <= full_first
  full_first = jnp.where(no_full, last, full_first)
  full_last = jnp.where(no_full, last, full_last)
  n_pre = full_first - first
  n_full = full_last - full_first
  n_post = last - full_last
  return first, n_pre, full_first, n_full, full_last, n_post


def mask_and(*masks):
  """Conjunction of the masks that are not None (None: nothing masked)."""
  out = None
  for m in masks:
    if m is not None:
      out = m if out is None else out & m
  return out


def load(ref, mask=None, other=0.0):
  """`plgpu.load` that reads unmasked (and drops `other`) when mask is None."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=other)


def head_dim_mask(head_dim: int, d_pad: int):
  """[1, d_pad] mask of real head-dim columns; None when nothing is padded,
  so loads stay unmasked (vectorised, pipelined)."""
  if head_dim == d_pad:
    return None
  return (jnp.arange(d_pad) < head_dim)[None, :]


def row_tile(start, t0, length, block: int, head_dim: int, d_pad: int):
  """Rows start + t0 .. start + t0 + block of a packed sequence of `length`
  tokens: (valid [block] bool, the row slice, the [block, d_pad] load mask
  of valid rows and real head-dim columns)."""
  valid = (t0 + jnp.arange(block)) < length
  rows = pl.ds(start + t0, block)
  return valid, rows, mask_and(valid[:, None], head_dim_mask(head_dim, d_pad))


def finite_part(x):
  """(x with its non-finite entries set to 0, float32 [rows] 1.0 on rows of x
  that hold one).

  For masked tiles: a hidden pair still meets in a product with weight 0,
  and 0 * NaN = NaN would reach rows that never see the bad entry.
  `abs(x) < inf` is false for NaN and +-inf alike (one compare, no isnan).
  """
  ok = jnp.abs(x) < jnp.inf
  return (jnp.where(ok, x, jnp.zeros_like(x)),
          jnp.max(jnp.where(ok, 0.0, 1.0), axis=1))


def has_non_finite(x):
  """int32 scalar: 1 if the 2-D tile x holds a NaN or an infinity, else 0.

  The tile's sum is non-finite then (NaN and Inf propagate through sums):
  one add per element. A sum that overflows float32 says 1 for a finite
  tile; callers use the flag only to redo the tile with code that gives
  the same finite values, so that costs time, never bits.

  Combine flags with `|`, never `jnp.maximum`: MLIR folds
  maxsi(extui a, extui b) of these 0/1 values into maxsi on i1, where
  true is -1, so max(1, 0) lowers to 0 on the GPU (interpret mode is
  right; seen on an H100, 2026-12-08)."""
  total = jnp.sum(jnp.sum(x.astype(jnp.float32), axis=1), axis=0)
  return jnp.where(jnp.abs(total) < jnp.inf, 0, 1).astype(jnp.int32)


def when_flagged(valid, flag_ref, row, contain: bool):
  """Decorator: runs a program's body where `valid` and, in a `_contain`
  launch, only where the fast launch flagged the tile (flag_ref[row] != 0;
  read only by valid programs, whose rows the fast launch wrote)."""
  def wrap(body):
    if not contain:
      return pl.when(valid)(body)

    @pl.when(valid)
    def _():
      pl.when(flag_ref[row] != 0)(body)
  return wrap


def rows_that_see(vis, bad_col):
  """float32 [rows of vis]: 1.0 where a visible pair's column is bad."""
  return jnp.max(jnp.where(vis, bad_col[None, :], 0.0), axis=1)


def visible(cfg: MaskConfig, q_pos, k_pos, len_q, len_k, q_seg=None,
            k_seg=None):
  """Boolean [len(q_pos), len(k_pos)] tile mask (keys past len_k hidden)."""
  off = len_k - len_q
  qi = q_pos[:, None]
  kj = k_pos[None, :]
  vis = kj < len_k
  if cfg.right >= 0:
    vis &= kj <= qi + off + cfg.right
  if cfg.left >= 0:
    vis &= kj >= qi + off - cfg.left
  if cfg.has_segments:
    vis &= q_seg[:, None] == k_seg[None, :]
  return vis


def scores_log2(cfg: MaskConfig, qk: jax.Array) -> jax.Array:
  """Raw q.k products -> scores in the base-2 domain (scale, soft-cap)."""
  if cfg.softcap > 0.0:
    return (cfg.softcap * LOG2E) * jnp.tanh(qk * (cfg.scale / cfg.softcap))
  return qk * (cfg.scale * LOG2E)


# L2 bytes one wave of heads may stream (K and V for the forward and dQ
# kernels, Q and dO for dK/dV): Hopper's L2 is 50 MB; the rest holds the
# tiles streamed once (Q, O, dQ) and the other wave still finishing.
WAVE_L2_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class LaunchOrder:
  """Which (tile, sequence, head) each program of a 3-D launch grid runs.

  Under a causal mask a tile's cost grows along the sequence (the forward's
  and dQ's last query tile sees every key; dK/dV's first key tile is seen
  by every query). The GPU starts programs in launch order, x fastest. With
  the tile index fastest (one head after another), the last heads' longest
  tiles start last and the grid ends in a tail of a few long programs.
  Longest-first across every head would stream all heads' K/V (or Q/dO) at
  once, more than L2 holds. So heads go in waves of `heads_per_wave`: within
  a wave, the costliest tile of every head starts first; a wave's working
  set fits L2; consecutive heads share a KV head under GQA.

  Launch grid (heads_per_wave, n_tiles, num_seqs * heads / heads_per_wave):
  program (a, b, c) runs tile b (or n_tiles - 1 - b when `reverse`) of head
  (c mod waves) * heads_per_wave + a of sequence c // waves. heads_per_wave
  = 1 is the plain (tile, sequence, head) order. Only the order changes,
  never what a program computes: the bits are the same for any wave size.
  """

  n_tiles: int
  num_seqs: int
  heads: int
  heads_per_wave: int
  reverse: bool  # tile n_tiles - 1 is the costliest (forward, dQ)

  @property
  def grid(self) -> tuple[int, int, int]:
    return (self.heads_per_wave, self.n_tiles,
            self.num_seqs * (self.heads // self.heads_per_wave))

  def tile_seq_head(self, a, b, c):
    """(tile, sequence, head) of program (a, b, c); also in index maps."""
    waves = self.heads // self.heads_per_wave
    tile = self.n_tiles - 1 - b if self.reverse else b
    if waves == 1:
      return tile, c, a
    return tile, c // waves, (c % waves) * self.heads_per_wave + a

  def head(self, a, b, c):
    """Head of program (a, b, c), for BlockSpec index maps."""
    return self.tile_seq_head(a, b, c)[2]

  def program(self):
    """(tile, sequence, head) of the running program (inside a kernel)."""
    return self.tile_seq_head(pl.program_id(0), pl.program_id(1),
                              pl.program_id(2))


def launch_order(*, n_tiles: int, num_seqs: int, heads: int,
                 heads_per_wave: int, bytes_per_head: int, reverse: bool,
                 heads_sharing: int = 1) -> LaunchOrder:
  """The launch order of a kernel over `heads` heads.

  heads_per_wave: from BlockSizes. A positive value caps the wave: it takes
    the largest divisor of `heads` up to that value. 0 takes the largest
    divisor whose wave streams at most WAVE_L2_BYTES, with `bytes_per_head`
    the bytes one head streams and `heads_sharing` consecutive heads
    streaming the same bytes (a GQA group over K/V).
  """
  check_heads_per_wave(heads_per_wave)
  wave = 1
  for g in range(2, heads + 1):
    if heads % g:
      continue
    if heads_per_wave:
      fits = g <= heads_per_wave
    else:
      fits = -(-g // heads_sharing) * bytes_per_head <= WAVE_L2_BYTES
    if fits:
      wave = g
  return LaunchOrder(n_tiles, num_seqs, heads, wave, reverse)


def check_heads_per_wave(heads_per_wave: int) -> None:
  if heads_per_wave < 0:
    raise ValueError("heads_per_wave must be >= 0 (0: sized to L2); got "
                     f"{heads_per_wave}.")


def query_tile_order(k, d_pad: int, *, n_tiles: int, num_seqs: int,
                     heads_q: int, heads_per_wave: int) -> LaunchOrder:
  """Launch order of a kernel owning query tiles (the forward, dQ): K and V
  ([total_k, heads_kv, d]) of a KV head stream through each of its query
  tiles, the costliest (last) tile first; the wave is sized by K/V at the
  mean sequence length."""
  total_k, heads_kv = k.shape[:2]
  return launch_order(
      n_tiles=n_tiles, num_seqs=num_seqs, heads=heads_q,
      heads_per_wave=heads_per_wave,
      bytes_per_head=2 * pl.cdiv(total_k, num_seqs) * d_pad
      * k.dtype.itemsize,
      heads_sharing=heads_q // heads_kv, reverse=True)

