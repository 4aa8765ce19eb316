"""Input validation shared by every public function of `jax_api`.

Every error names the argument, what was given and what is supported, and is a
`TypeError` (wrong kind of thing) or `ValueError` (right kind, wrong value).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
                    jnp.dtype(jnp.float32))
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)
MAX_HEAD_DIM = 256


def _dtype_names(dtypes) -> str:
  return ", ".join(str(d) for d in dtypes)


def check_array(name: str, x: Any, *, ndim: int | tuple[int, ...],
                layout: str) -> None:
  """`x` is a JAX/NumPy array of rank `ndim` (layout named for the message)."""
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array with layout {layout}; got "
                    f"{type(x).__name__}.")
  ndims = (ndim,) if isinstance(ndim, int) else ndim
  if x.ndim not in ndims:
    raise ValueError(f"{name} must have rank {' or '.join(map(str, ndims))} "
                     f"(layout {layout}); got shape {tuple(x.shape)}.")


def check_float_dtype(name: str, x) -> None:
  if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
    raise TypeError(f"{name} has dtype {x.dtype}; supported dtypes are "
                    f"{_dtype_names(SUPPORTED_DTYPES)}.")


def check_qkv(q, k, v, *, packed: bool) -> None:
  """Shapes, dtypes, head dims and GQA divisibility of q, k, v.

  packed=False: q [batch, seq_q, heads_q, head_dim], k/v [batch, seq_k,
  heads_kv, head_dim]. packed=True: the same without the batch axis.
  """
  rank = 3 if packed else 4
  layout_q = ("[total_q, heads_q, head_dim]" if packed else
              "[batch, seq_q, heads_q, head_dim]")
  layout_kv = ("[total_k, heads_kv, head_dim]" if packed else
               "[batch, seq_k, heads_kv, head_dim]")
  check_array("q", q, ndim=rank, layout=layout_q)
  check_array("k", k, ndim=rank, layout=layout_kv)
  check_array("v", v, ndim=rank, layout=layout_kv)
  for name, x in (("q", q), ("k", k), ("v", v)):
    check_float_dtype(name, x)
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share one dtype; got q {q.dtype}, "
                    f"k {k.dtype}, v {v.dtype}.")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got k "
                     f"{tuple(k.shape)} and v {tuple(v.shape)}.")
  if not packed and q.shape[0] != k.shape[0]:
    raise ValueError(f"q and k must have the same batch size; got q batch "
                     f"{q.shape[0]} and k batch {k.shape[0]}.")
  d = q.shape[-1]
  if k.shape[-1] != d:
    raise ValueError(f"k head_dim {k.shape[-1]} must equal q head_dim {d}.")
  if d > MAX_HEAD_DIM or d < 1:
    raise ValueError(f"head_dim (last axis of q) is {d}; supported head dims "
                     f"are 1..{MAX_HEAD_DIM} (kernels are tuned for "
                     f"{SUPPORTED_HEAD_DIMS}).")
  hq, hkv = q.shape[-2], k.shape[-2]
  if hkv < 1 or hq % hkv != 0:
    raise ValueError(f"heads_q ({hq}, q.shape[-2]) must be a multiple of "
                     f"heads_kv ({hkv}, k.shape[-2]) for GQA/MQA.")
  if q.shape[-3] < 1 or k.shape[-3] < 1:
    raise ValueError(f"sequence lengths must be >= 1; got q "
                     f"{tuple(q.shape)} and k {tuple(k.shape)}.")


def check_window(window_size) -> tuple[int, int]:
  if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or
      not all(isinstance(w, (int, np.integer)) for w in window_size)):
    raise TypeError("window_size must be a pair of Python ints (left, right) "
                    f"with -1 meaning unbounded; got {window_size!r}.")
  left, right = int(window_size[0]), int(window_size[1])
  if left < -1 or right < -1:
    raise ValueError(f"window_size entries must be >= -1; got {window_size!r}.")
  return left, right


def check_softcap(softcap) -> float:
  if not isinstance(softcap, (int, float, np.floating, np.integer)):
    raise TypeError(f"softcap must be a Python float; got {softcap!r}.")
  if not softcap >= 0:  # also rejects NaN
    raise ValueError(f"softcap must be >= 0 (0 disables it); got {softcap}.")
  return float(softcap)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
  if softmax_scale is None:
    return 1.0 / float(head_dim) ** 0.5
  if not isinstance(softmax_scale, (int, float, np.floating, np.integer)):
    raise TypeError("softmax_scale must be a Python float or None; got "
                    f"{softmax_scale!r}.")
  if not softmax_scale > 0:
    raise ValueError(f"softmax_scale must be > 0; got {softmax_scale}.")
  return float(softmax_scale)


def check_sinks(sinks, heads_q: int) -> None:
  if sinks is None:
    return
  check_array("sinks", sinks, ndim=1, layout="[heads_q]")
  if sinks.shape[0] != heads_q:
    raise ValueError(f"sinks must have shape [heads_q] = [{heads_q}]; got "
                     f"{tuple(sinks.shape)}.")
  check_float_dtype("sinks", sinks)


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
    if tuple(s.shape) != (batch, n):
      raise ValueError(f"{name} must have shape [batch, seq] = [{batch}, {n}];"
                       f" got {tuple(s.shape)}.")
    if not jnp.issubdtype(s.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array; got {s.dtype}.")
  return jnp.asarray(qs, jnp.int32), jnp.asarray(ks, jnp.int32)


def check_cu_seqlens(name: str, cu, total: int) -> None:
  """int32 [num_seqs + 1], starting at 0, non-decreasing, last <= total.

  The value checks run only when `cu` is concrete (outside `jax.jit`).
  """
  check_array(name, cu, ndim=1, layout="[num_seqs + 1]")
  if not jnp.issubdtype(cu.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer (int32) array; got {cu.dtype}.")
  if cu.shape[0] < 2:
    raise ValueError(f"{name} must have at least 2 entries (num_seqs + 1); "
                     f"got shape {tuple(cu.shape)}.")
  if isinstance(cu, jax.core.Tracer):
    return
  c = np.asarray(cu)
  if c[0] != 0:
    raise ValueError(f"{name}[0] must be 0; got {int(c[0])}.")
  if np.any(np.diff(c) < 0):
    raise ValueError(f"{name} must be non-decreasing; got {c.tolist()}.")
  if c[-1] > total:
    raise ValueError(f"{name}[-1] = {int(c[-1])} exceeds the number of packed "
                     f"tokens ({total}).")


def concrete_max_seqlen(name: str, cu, given: int | None) -> int | None:
  """max_seqlen from the caller, else from a concrete `cu`, else None."""
  if given is not None:
    if not isinstance(given, (int, np.integer)):
      raise TypeError(f"{name} must be a positive Python int; got {given!r}.")
    if given < 1:
      raise ValueError(f"{name} must be >= 1; got {given!r}.")
    if not isinstance(cu, jax.core.Tracer):
      actual = int(np.max(np.diff(np.asarray(cu))))
      if actual > given:
        raise ValueError(f"{name} = {given} is smaller than the longest "
                         f"sequence ({actual}).")
    return int(given)
  if isinstance(cu, jax.core.Tracer):
    return None
  return max(1, int(np.max(np.diff(np.asarray(cu)))))


def check_device(name: str, x, platform: str | None = None) -> None:
  """Arrays must live on one device of the expected platform (if given)."""
  if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
    return
  devs = x.devices()
  if platform is not None and any(d.platform != platform for d in devs):
    raise ValueError(f"{name} lives on {sorted(d.platform for d in devs)}; the "
                     f"'{platform}' backend needs it on a {platform} device "
                     "(move it with jax.device_put).")
