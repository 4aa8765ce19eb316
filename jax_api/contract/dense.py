"""Contract of dense and packed-varlen attention (`fold_attn_func`,
`fold_attn_varlen_func`, and the prefill of the KV cache).

Layouts: dense q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k,
heads_kv, head_dim]; packed the same without the batch axis. cu_seqlens:
int [num_seqs + 1], 0 first, non-decreasing, last <= the token count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jax_api.contract.common import (SUPPORTED_DTYPE_NAMES, Shape,
                                     check_float_dtype, check_head_dim,
                                     check_int_dtype, check_rank,
                                     check_same_dtype)


def layouts(packed: bool) -> tuple[str, str]:
  if packed:
    return "[total_q, heads_q, head_dim]", "[total_k, heads_kv, head_dim]"
  return ("[batch, seq_q, heads_q, head_dim]",
          "[batch, seq_k, heads_kv, head_dim]")


def check_qkv(q_shape: Shape, k_shape: Shape, v_shape: Shape, q_dtype,
              k_dtype, v_dtype, *, packed: bool,
              allowed: Sequence[str] = SUPPORTED_DTYPE_NAMES) -> None:
  """Ranks, dtypes, head dims and GQA divisibility of q, k, v."""
  rank = 3 if packed else 4
  lq, lk = layouts(packed)
  check_rank("q", q_shape, rank, lq)
  check_rank("k", k_shape, rank, lk)
  check_rank("v", v_shape, rank, lk)
  for name, dt in (("q", q_dtype), ("k", k_dtype), ("v", v_dtype)):
    check_float_dtype(name, dt, allowed)
  check_same_dtype(("q", "k", "v"), (q_dtype, k_dtype, v_dtype))
  q_shape, k_shape, v_shape = tuple(q_shape), tuple(k_shape), tuple(v_shape)
  if k_shape != v_shape:
    raise ValueError(f"k and v must have the same shape; got k {k_shape} and "
                     f"v {v_shape}.")
  if not packed and q_shape[0] != k_shape[0]:
    raise ValueError(f"q and k must have the same batch size; got q batch "
                     f"{q_shape[0]} and k batch {k_shape[0]}.")
  d = q_shape[-1]
  if k_shape[-1] != d:
    raise ValueError(f"k head_dim {k_shape[-1]} must equal q head_dim {d}.")
  check_head_dim(d)
  hq, hkv = q_shape[-2], k_shape[-2]
  if hkv < 1 or hq % hkv != 0:
    raise ValueError(f"heads_q ({hq}, q.shape[-2]) must be a multiple of "
                     f"heads_kv ({hkv}, k.shape[-2]) for GQA/MQA.")
  if q_shape[-3] < 1 or k_shape[-3] < 1:
    raise ValueError(f"sequence lengths must be >= 1; got q {q_shape} and "
                     f"k {k_shape}.")


def check_segment_ids(name: str, shape: Shape, dtype, batch: int,
                      seq: int) -> None:
  check_rank(name, shape, 2, "[batch, seq]")
  if tuple(shape) != (batch, seq):
    raise ValueError(f"{name} must have shape [batch, seq] = [{batch}, {seq}];"
                     f" got {tuple(shape)}.")
  check_int_dtype(name, dtype, "an integer")


def check_cu_seqlens(name: str, shape: Shape, dtype, total: int,
                     values=None) -> None:
  """int [num_seqs + 1]; with `values` (host integers, when the caller has
  them: not under a trace) also 0 first, non-decreasing, last <= total."""
  check_rank(name, shape, 1, "[num_seqs + 1]")
  check_int_dtype(name, dtype)
  if shape[0] < 2:
    raise ValueError(f"{name} must have at least 2 entries (num_seqs + 1); "
                     f"got shape {tuple(shape)}.")
  if values is None:
    return
  c = np.asarray(values)
  if c[0] != 0:
    raise ValueError(f"{name}[0] must be 0; got {int(c[0])}.")
  if np.any(np.diff(c) < 0):
    raise ValueError(f"{name} must be non-decreasing; got {c.tolist()}.")
  if c[-1] > total:
    raise ValueError(f"{name}[-1] = {int(c[-1])} exceeds the number of packed "
                     f"tokens ({total}).")


def check_same_num_seqs(shape_q: Shape, shape_k: Shape) -> None:
  if tuple(shape_q) != tuple(shape_k):
    raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same "
                     f"number of sequences; got shapes {tuple(shape_q)} and "
                     f"{tuple(shape_k)}.")


def longest(values) -> int:
  """The longest sequence of host cu_seqlens values (>= 1)."""
  return max(1, int(np.max(np.diff(np.asarray(values)))))


def check_max_seqlen(name: str, given, values=None) -> int | None:
  """`given` (a Python int >= 1, or None) checked against the longest
  sequence of host `values` when given; returns the max_seqlen to use (None
  when neither is known)."""
  if given is not None:
    if isinstance(given, (bool, np.bool_)) or \
        not isinstance(given, (int, np.integer)):
      raise TypeError(f"{name} must be a positive Python int; got {given!r}.")
    if given < 1:
      raise ValueError(f"{name} must be >= 1; got {given!r}.")
    if values is not None:
      actual = longest(values)
      if actual > given:
        raise ValueError(f"{name} = {given} is smaller than the longest "
                         f"sequence ({actual}); pass the true maximum or "
                         "None.")
    return int(given)
  return None if values is None else longest(values)
