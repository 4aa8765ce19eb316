"""Input validation shared by every public function of `jax_api`.

Every error names the argument, what was given and what is supported, and is a
`TypeError` (wrong kind of thing) or `ValueError` (right kind, wrong value).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_api.contract import common as _c
from jax_api.contract import dense as _cd

SUPPORTED_DTYPES = tuple(jnp.dtype(n) for n in _c.SUPPORTED_DTYPE_NAMES)
SUPPORTED_HEAD_DIMS = _c.SUPPORTED_HEAD_DIMS
MAX_HEAD_DIM = _c.MAX_HEAD_DIM

# The rules live in `jax_api.contract` (shared with torch_bridge); these
# wrappers take JAX/NumPy arrays and hand the contract their shapes, dtypes
# and, where concrete (not under a trace), their values.


def _is_array(x) -> bool:
  return hasattr(x, "shape") and hasattr(x, "dtype")


def check_array(name: str, x: Any, *, ndim: int | tuple[int, ...],
                layout: str) -> None:
  """`x` is a JAX/NumPy array of rank `ndim` (layout named for the message)."""
  if not _is_array(x):
    raise TypeError(f"{name} must be an array with layout {layout}; got "
                    f"{type(x).__name__}.")
  _c.check_rank(name, x.shape, ndim, layout)


def check_float_dtype(name: str, x) -> None:
  _c.check_float_dtype(name, x.dtype)


def check_qkv(q, k, v, *, packed: bool) -> None:
  """Shapes, dtypes, head dims and GQA divisibility of q, k, v.

  packed=False: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k,
  heads_kv, head_dim]. packed=True: the same without the batch axis.
  """
  lq, lk = _cd.layouts(packed)
  for name, x, layout in (("q", q, lq), ("k", k, lk), ("v", v, lk)):
    if not _is_array(x):
      raise TypeError(f"{name} must be an array with layout {layout}; got "
                      f"{type(x).__name__}.")
  _cd.check_qkv(q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
                packed=packed)


check_window = _c.check_window
check_softcap = _c.check_softcap
check_softmax_scale = _c.check_softmax_scale


def check_sinks(sinks, heads_q: int) -> None:
  if sinks is None:
    return
  check_array("sinks", sinks, ndim=1, layout="[heads_q]")
  _c.check_sinks(sinks.shape, sinks.dtype, heads_q)


def check_segment_ids(segment_ids, batch: int, seq_q: int, seq_k: int):
  """Returns (q_segment_ids, kv_segment_ids) or None."""
  if segment_ids is None:
    return None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise TypeError("segment_ids must be an array [batch, seq] or a pair "
                      "(q_segment_ids, kv_segment_ids); got a "
                      f"{type(segment_ids).__name__} of length "
                      f"{len(segment_ids)}.")
    qs, ks = segment_ids
  else:
    qs = ks = segment_ids
  for name, s, n in (("segment_ids (queries)", qs, seq_q),
                     ("segment_ids (keys)", ks, seq_k)):
    check_array(name, s, ndim=2, layout="[batch, seq]")
    _cd.check_segment_ids(name, s.shape, s.dtype, batch, n)
  return jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32)


def _host_values(x):
  """x's values as a NumPy array, or None under a trace."""
  return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_cu_seqlens(name: str, cu, total: int) -> None:
  """int32 [num_seqs + 1], starting at 0, non-decreasing, last <= total.

  The value checks run only when `cu` is concrete (outside `jax.jit`).
  """
  check_array(name, cu, ndim=1, layout="[num_seqs + 1]")
  _cd.check_cu_seqlens(name, cu.shape, cu.dtype, total, _host_values(cu))


def concrete_max_seqlen(name: str, cu, given: int | None) -> int | None:
  """max_seqlen from the caller, else from a concrete `cu`, else None."""
  return _cd.check_max_seqlen(name, given, _host_values(cu))


def check_device(name: str, x, platform: str | None = None) -> None:
  """Arrays must live on one device of the expected platform (if given)."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return
  devs = x.devices()
  if platform is not None and any(d.platform != platform for d in devs):
    raise ValueError(f"{name} lives on {sorted(d.platform for d in devs)}; the "
                     f"'{platform}' backend needs it on a {platform} device "
                     "(move it with jax.device_put).")
