"""Tile ranges, position-term gathers and masks shared by the DeBERTa
forward and backward kernels."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.deberta.config import KernelConfig
# The flash kernels' helpers, shared (re-exported for the DeBERTa kernels).
from pallas_kernels.flash.tiles import (  # noqa: F401
    cdiv, full_spec, head_dim_mask)


def load(ref, mask=None, other=None):
  """plgpu.load that drops `other` when there is no mask (Triton's lowering
  rejects `other` without a mask)."""
  if mask is None:
    return plgpu.load(ref)
  return plgpu.load(ref, mask=mask, other=other)


def _floor_pos(num, b: int):
  """floor(num / b) for num > 0, else 0."""
  return jnp.where(num > 0, lax.div(jnp.maximum(num, 0), b), 0)


def q_major_ranges(cfg: KernelConfig, q0, block_q: int, block_k: int, n_kt):
  """Key-tile ranges of a query tile, in increasing order:
  ("hi", all pairs i - j >= r_pos), ("band", ...), ("lo", i - j <= -r_neg).
  """
  if not cfg.has_pos:
    return (("none", jnp.int32(0), n_kt),)
  g = cfg.geometry
  # hi: k0 + block_k - 1 <= q0 - r_pos.
  a = jnp.minimum(_floor_pos(q0 - g.r_pos + 1, block_k), n_kt)
  # lo: k0 >= q0 + block_q - 1 + r_neg.
  b = jnp.clip(cdiv(q0 + block_q - 1 + g.r_neg, block_k), a, n_kt)
  return (("hi", jnp.int32(0), a), ("band", a, b), ("lo", b, n_kt))


def k_major_ranges(cfg: KernelConfig, k0, block_q: int, block_k: int, n_qt):
  """Query-tile ranges of a key tile, in increasing order: ("lo", ...),
  ("band", ...), ("hi", ...)."""
  if not cfg.has_pos:
    return (("none", jnp.int32(0), n_qt),)
  g = cfg.geometry
  # lo: q0 + block_q - 1 - k0 <= -r_neg.
  a = jnp.minimum(_floor_pos(k0 - g.r_neg + 1, block_q), n_qt)
  # hi: q0 - (k0 + block_k - 1) >= r_pos.
  b = jnp.clip(cdiv(k0 + block_k - 1 + g.r_pos, block_q), a, n_qt)
  return (("lo", jnp.int32(0), a), ("band", a, b), ("hi", b, n_qt))


def run_ranges(cfg: KernelConfig, ranges, n_full, step, carry):
  """Runs step(tile, carry, kind, masked) over each range in order; tiles
  >= n_full (the partial last tile) take the load-masked variant."""
  for kind, lo, hi in ranges:
    if not cfg.split_full_tiles:
      carry = lax.fori_loop(
          0, hi - lo,
          lambda t, c, kind=kind, lo=lo: step(lo + t, c, kind, True), carry)
      continue
    mid = jnp.clip(n_full, lo, hi)
    carry = lax.fori_loop(
        0, mid - lo,
        lambda t, c, kind=kind, lo=lo: step(lo + t, c, kind, False), carry)
    carry = lax.fori_loop(
        0, hi - mid,
        lambda t, c, kind=kind, mid=mid: step(mid + t, c, kind, True), carry)
  return carry


def sat_column(cfg: KernelConfig, kind: str) -> int:
  return cfg.geometry.slots - 1 if kind == "hi" else 0


def table_column_vec(cfg: KernelConfig, kind: str, ref, start, size: int,
                     mask):
  """float32 [size]: rows start.. of a table's saturated column (hi/lo)."""
  if ref is None or kind not in ("hi", "lo"):
    return None
  return load(ref.at[pl.ds(start, size), jnp.int32(sat_column(cfg, kind))],
              mask=mask, other=0.0).astype(jnp.float32)


def band_columns(cfg: KernelConfig, q_pos, k_pos, k_major: bool):
  """int32 band columns w(i - j): [bq, bk] (or [bk, bq] when k_major)."""
  g = cfg.geometry
  if k_major:
    delta = q_pos[None, :] - k_pos[:, None]
  else:
    delta = q_pos[:, None] - k_pos[None, :]
  return jnp.clip(delta, -g.r_neg, g.r_pos) + g.r_neg


def position_bias(cfg: KernelConfig, kind: str, *, slot_ref, c_ref, p_ref,
                  q_pos, k_pos, q_rows, k_rows, c_sat=None, p_sat=None,
                  k_major: bool):
  """c2p + p2c terms of a tile (float32) and its band columns (band only).

  q_rows, k_rows: absolute (clamped) table rows of the tile's tokens;
  c_sat [bq], p_sat [bk]: the saturated columns for hi/lo tiles.
  Returns (bias or None, w or None); shapes [bq, bk], or [bk, bq] if
  k_major.
  """
  if kind == "none":
    return None, None
  qa = (lambda x: x[None, :]) if k_major else (lambda x: x[:, None])
  ka = (lambda x: x[:, None]) if k_major else (lambda x: x[None, :])
  if kind in ("hi", "lo"):
    bias = None
    if cfg.c2p:
      bias = qa(c_sat)
    if cfg.p2c:
      bias = ka(p_sat) if bias is None else bias + ka(p_sat)
    return bias, None
  w = band_columns(cfg, q_pos, k_pos, k_major)
  slot = load(slot_ref.at[w])
  # The table whose rows run along the tile's *second* axis is gathered in
  # the transposed orientation (rows along the first axis, so neighbouring
  # lanes read neighbouring columns of one row: coalesced) and transposed
  # back, or with cfg.gather == "direct" in the tile's own orientation (one
  # slot gather serves both tables, no transpose through shared memory:
  # faster as pip Triton compiles it, see KernelConfig.gather).
  direct = cfg.gather == "direct"
  if ((cfg.c2p and k_major) or (cfg.p2c and not k_major)) and not direct:
    slot_t = load(slot_ref.at[band_columns(cfg, q_pos, k_pos, not k_major)])
  bias = None
  if cfg.c2p:
    if k_major and direct:
      rows = jnp.broadcast_to(q_rows[None, :], w.shape)
      t = load(c_ref.at[rows, slot]).astype(jnp.float32)
    elif k_major:  # query rows run along axis 1
      rows = jnp.broadcast_to(q_rows[:, None], slot_t.shape)
      t = load(c_ref.at[rows, slot_t]).astype(jnp.float32).T
    else:
      rows = jnp.broadcast_to(q_rows[:, None], w.shape)
      t = load(c_ref.at[rows, slot]).astype(jnp.float32)
    bias = t
  if cfg.p2c:
    if k_major:
      rows = jnp.broadcast_to(k_rows[:, None], w.shape)
      t = load(p_ref.at[rows, slot]).astype(jnp.float32)
    elif direct:
      rows = jnp.broadcast_to(k_rows[None, :], w.shape)
      t = load(p_ref.at[rows, slot]).astype(jnp.float32)
    else:  # key rows run along axis 1
      rows = jnp.broadcast_to(k_rows[:, None], slot_t.shape)
      t = load(p_ref.at[rows, slot_t]).astype(jnp.float32).T
    bias = t if bias is None else bias + t
  return bias, w
