"""Contract of DeBERTa-v2/v3 disentangled attention
(`jax_api.deberta.disentangled_attention` and the torch bridge's).

q, k, v: [batch, seq, heads, head_dim] (or packed [total, heads, head_dim]);
pos_key / pos_query: [>= 2*att_span, heads, head_dim], att_span =
position_buckets if > 0 else max_relative_positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_api.contract.common import (SUPPORTED_DTYPE_NAMES, Shape,
                                     check_float_dtype, check_rank)


def check_self_attention(q_shape: Shape, k_shape: Shape) -> None:
  if tuple(q_shape) != tuple(k_shape):
    raise ValueError(f"disentangled attention is self-attention: q and k "
                     f"must have one shape; got {tuple(q_shape)} and "
                     f"{tuple(k_shape)}.")


def att_span(position_buckets: int, max_relative_positions: int) -> int:
  return position_buckets if position_buckets > 0 else max_relative_positions


def check_options(position_buckets, max_relative_positions, pos_att_type,
                  dropout_rate, has_rng: bool) -> tuple[bool, bool, float]:
  """Returns (c2p, p2c, dropout_rate). has_rng: a dropout key/seed exists."""
  for name, x in (("position_buckets", position_buckets),
                  ("max_relative_positions", max_relative_positions)):
    if not isinstance(x, (int, np.integer)) or isinstance(x, (bool, np.bool_)):
      raise TypeError(f"{name} must be a Python int; got {x!r}.")
  if max_relative_positions < 1:
    raise ValueError(
        "max_relative_positions must be >= 1 (HF replaces values < 1 by "
        f"max_position_embeddings; do that first); got "
        f"{max_relative_positions}.")
  if position_buckets > max_relative_positions:
    # Log buckets need max_relative_positions > position_buckets / 2 to be
    # monotone; HF never builds such a model, and the bucket formula would
    # give out-of-range slots.
    raise ValueError(f"position_buckets ({position_buckets}) must be <= "
                     f"max_relative_positions ({max_relative_positions}) "
                     "(or <= 0 for no bucketing).")
  if isinstance(pos_att_type, str):
    pos_att_type = tuple(t.strip() for t in pos_att_type.split("|") if t)
  types = tuple(pos_att_type or ())
  bad = [t for t in types if t not in ("c2p", "p2c")]
  if bad:
    raise ValueError(f"pos_att_type entries must be 'c2p' or 'p2c'; got "
                     f"{bad}.")
  if isinstance(dropout_rate, (bool, np.bool_)) or \
      not isinstance(dropout_rate, (int, float, np.floating)):
    raise TypeError(f"dropout_rate must be a Python float; got "
                    f"{dropout_rate!r}.")
  if not 0.0 <= float(dropout_rate) < 1.0:
    raise ValueError(f"dropout_rate must be in [0, 1); got {dropout_rate}.")
  if dropout_rate > 0 and not has_rng:
    raise ValueError("dropout_rate > 0 needs dropout_rng (a jax.random key; "
                     "torch: seed).")
  return "c2p" in types, "p2c" in types, float(dropout_rate)


def check_position_table(name: str, shape: Shape | None, dtype, span: int,
                         heads: int, head_dim: int,
                         allowed: Sequence[str] = SUPPORTED_DTYPE_NAMES
                         ) -> None:
  """pos_key / pos_query: [>= 2*span, heads, head_dim], a float dtype."""
  if shape is None:
    raise TypeError(f"{name} is None but the pos_att_type it serves is "
                     f"requested; pass {name} [2*att_span, heads, head_dim] "
                     f"= [{2 * span}, {heads}, {head_dim}] or drop it from "
                     "pos_att_type.")
  check_rank(name, shape, 3, "[2*att_span, heads, head_dim]")
  check_float_dtype(name, dtype, allowed)
  if tuple(shape[1:]) != (heads, head_dim):
    raise ValueError(f"{name} must have shape [>= 2*att_span, {heads}, "
                     f"{head_dim}]; got {tuple(shape)}.")
  if shape[0] < 2 * span:
    raise ValueError(f"{name} has {shape[0]} rows; needs at least "
                     f"2*att_span = {2 * span} (att_span = position_buckets "
                     "if > 0 else max_relative_positions).")


def check_attention_mask(shape: Shape, lead: Shape) -> None:
  check_rank("attention_mask", shape, 2, "[batch, seq]")
  if tuple(shape) != tuple(lead):
    raise ValueError(f"attention_mask must have shape [batch, seq] = "
                     f"{list(lead)}; got {tuple(shape)}.")


def check_packed_mask_exclusive(has_mask: bool) -> None:
  if has_mask:
    raise ValueError("attention_mask and cu_seqlens are exclusive (packed "
                     "sequences need no padding mask).")
