"""Relative-position geometry shared by the DeBERTa kernels, their backward
and the XLA path: the log buckets as a small band table.

With delta = i - j (query minus key position, both sequence-relative) the
score of pair (i, j) reads column slot(delta) = clip(bucket(delta) + span, 0,
2*span - 1) of the c2p table (Q Kpos^T, row i) and of the p2c table
(K Qpos^T, row j). (HF's p2c index clip(-bucket(j - i) + span) equals
slot(i - j) because the bucketing is odd.)

slot() is monotone in delta and saturates: slot(delta) = 2*span - 1 for
delta >= r_pos and slot(delta) = 0 for delta <= -r_neg. So every pair falls
into one *band column*

    w(delta) = clip(delta, -r_neg, r_pos) + r_neg  in [0, width),
    width = r_neg + r_pos + 1,

where column 0 and column width - 1 are the two saturated ends and every
other column holds exactly one delta. `slot_table[w]` is the slot of column
w. Both radii depend on (position_buckets, max_relative_positions) only,
never on sequence lengths, so a sequence's bits never depend on its batch.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from pallas_kernels.reference.deberta import (deberta_att_span,
                                              make_log_position_buckets)

# Band tables wider than this would make the backward's band scratch
# ([tokens, heads, width]) approach L x L memory; such configurations
# (huge max_relative_positions with few buckets) are refused by the kernels.
MAX_BAND_WIDTH = 1 << 15


@dataclasses.dataclass(frozen=True)
class Geometry:
  """Static description of the relative positions (hashable: a jit key)."""

  span: int  # att_span: the tables have 2*span columns
  r_neg: int  # delta <= -r_neg  ->  slot 0
  r_pos: int  # delta >= r_pos   ->  slot 2*span - 1
  position_buckets: int
  max_relative_positions: int

  @property
  def width(self) -> int:
    return self.r_neg + self.r_pos + 1

  @property
  def slots(self) -> int:
    return 2 * self.span

  def slot_table(self) -> np.ndarray:
    """int32 [width]: slot of each band column."""
    return _slot_table(self.position_buckets, self.max_relative_positions,
                       self.r_neg, self.width)

  def band_column(self, delta):
    """Band column of integer offsets (numpy or jnp)."""
    import jax.numpy as jnp
    xp = np if isinstance(delta, np.ndarray) else jnp
    return xp.clip(delta, -self.r_neg, self.r_pos) + self.r_neg


def _slots(delta: np.ndarray, position_buckets: int,
           max_relative_positions: int) -> np.ndarray:
  span = deberta_att_span(position_buckets, max_relative_positions)
  if position_buckets > 0 and max_relative_positions > 0:
    import jax
    with jax.ensure_compile_time_eval():  # host arrays even under jit
      b = np.asarray(make_log_position_buckets(delta, position_buckets,
                                               max_relative_positions))
  else:
    b = delta
  return np.clip(b.astype(np.int64) + span, 0, 2 * span - 1)


@functools.lru_cache(maxsize=64)
def _slot_table(position_buckets, max_relative_positions, r_neg, width):
  delta = np.arange(width, dtype=np.int64) - r_neg
  return _slots(delta, position_buckets, max_relative_positions).astype(
      np.int32)


@functools.lru_cache(maxsize=64)
def geometry(position_buckets: int, max_relative_positions: int) -> Geometry:
  """The band geometry of a DebertaV2Config's relative-position settings.

  max_relative_positions must already be resolved (HF replaces values < 1 by
  max_position_embeddings).
  """
  span = deberta_att_span(position_buckets, max_relative_positions)
  top = 2 * span - 1

  def first(pred_fn):
    lo = 0
    step = 1024
    while lo < MAX_BAND_WIDTH:
      d = np.arange(lo, lo + step, dtype=np.int64)
      hit = np.nonzero(pred_fn(d))[0]
      if hit.size:
        return int(d[hit[0]])
      lo += step
    raise ValueError(
        f"position_buckets={position_buckets}, max_relative_positions="
        f"{max_relative_positions}: relative positions do not saturate "
        f"within {MAX_BAND_WIDTH}; unsupported by the Pallas kernels (use "
        "backend='xla').")

  r_pos = first(lambda d: _slots(d, position_buckets,
                                 max_relative_positions) == top)
  r_neg = first(lambda d: _slots(-d, position_buckets,
                                 max_relative_positions) == 0)
  g = Geometry(span=span, r_neg=r_neg, r_pos=r_pos,
               position_buckets=int(position_buckets),
               max_relative_positions=int(max_relative_positions))
  if g.width > MAX_BAND_WIDTH:
    raise ValueError(f"band width {g.width} exceeds {MAX_BAND_WIDTH}")
  return g
