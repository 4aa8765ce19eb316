"""Checks shared by every op: array rank, dtypes, softmax scale, soft-cap,
sliding window, sinks, backend names (see `jax_api.contract`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

SUPPORTED_DTYPE_NAMES = ("bfloat16", "float16", "float32")
SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 192, 256)  # tuned; others are padded
MAX_HEAD_DIM = 256
BACKENDS = ("auto", "pallas", "interpret", "xla")

Shape = Sequence[int]


def dtype_name(dtype) -> str:
  """Canonical name of a dtype given as a name, a numpy/JAX dtype or scalar
  type ("bfloat16", np.float32, jnp.bfloat16 ...). Unknown objects are
  returned as their `str` (so the message still says what was given)."""
  if isinstance(dtype, str):
    try:
      return _np_dtype(dtype).name
    except TypeError:
      return dtype
  try:
    return _np_dtype(dtype).name
  except TypeError:
    return str(dtype)


def _np_dtype(dtype):
  try:
    return np.dtype(dtype)
  except TypeError:
    pass
  # bfloat16 and the float8 types live in ml_dtypes (installed with JAX).
  import ml_dtypes
  if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):
    return np.dtype(getattr(ml_dtypes, dtype))
  raise TypeError(f"not a dtype: {dtype!r}")


def is_float_name(name: str) -> bool:
  return name in ("bfloat16", "float16", "float32", "float64") or \
      name.startswith("float8")


def is_int_name(name: str) -> bool:
  return name.startswith(("int", "uint"))


def check_rank(name: str, shape: Shape, ndim: int | tuple[int, ...],
               layout: str) -> None:
  """`shape` has rank `ndim` (one int or a tuple of accepted ranks)."""
  ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
  if len(shape) not in ndims:
    raise ValueError(f"{name} must have rank {' or '.join(map(str, ndims))} "
                     f"(layout {layout}); got shape {tuple(shape)}.")


def check_float_dtype(name: str, dtype,
                      allowed: Sequence[str] = SUPPORTED_DTYPE_NAMES) -> str:
  """Returns the dtype's name; TypeError unless it is one of `allowed`."""
  n = dtype_name(dtype)
  if n not in allowed:
    raise TypeError(f"{name} has dtype {n}; supported dtypes are "
                    f"{', '.join(allowed)}.")
  return n


def check_same_dtype(names: Sequence[str], dtypes: Sequence) -> None:
  got = [dtype_name(d) for d in dtypes]
  if len(set(got)) > 1:
    listed = ", ".join(f"{n} {d}" for n, d in zip(names, got))
    raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must share one "
                    f"dtype; got {listed}.")


def check_int_dtype(name: str, dtype, what: str = "an integer (int32)") -> None:
  n = dtype_name(dtype)
  if not is_int_name(n):
    raise TypeError(f"{name} must be {what} array; got {n}.")


def check_head_dim(d: int, name: str = "head_dim (last axis of q)") -> None:
  if d > MAX_HEAD_DIM or d < 1:
    raise ValueError(f"{name} is {d}; supported head dims are "
                     f"1..{MAX_HEAD_DIM} (kernels are tuned for "
                     f"{SUPPORTED_HEAD_DIMS}).")


def _is_number(x) -> bool:
  return (isinstance(x, (int, float, np.floating, np.integer)) and
          not isinstance(x, (bool, np.bool_)))


def check_window(window_size) -> tuple[int, int]:
  """(left, right) Python ints >= -1 (-1: unbounded)."""
  if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or
      not all(isinstance(w, (int, np.integer)) and
              not isinstance(w, (bool, np.bool_)) for w in window_size)):
    raise TypeError("window_size must be a pair of Python ints (left, right) "
                    f"with -1 meaning unbounded; got {window_size!r}.")
  left, right = int(window_size[0]), int(window_size[1])
  if left < -1 or right < -1:
    raise ValueError(f"window_size entries must be >= -1 (-1: unbounded); got "
                     f"{window_size!r}.")
  return left, right


def check_softcap(softcap) -> float:
  """A finite float >= 0 (0 disables the soft-cap)."""
  if not _is_number(softcap):
    raise TypeError(f"softcap must be a Python float; got {softcap!r}.")
  if not (softcap >= 0 and math.isfinite(softcap)):  # rejects NaN and inf
    raise ValueError(f"softcap must be a finite float >= 0 (0 disables it); "
                     f"got {softcap}.")
  return float(softcap)


def check_softmax_scale(softmax_scale, head_dim: int) -> float:
  """A finite float > 0; None gives 1/sqrt(head_dim)."""
  if softmax_scale is None:
    return 1.0 / float(head_dim) ** 0.5
  if not _is_number(softmax_scale):
    raise TypeError("softmax_scale must be a Python float or None; got "
                    f"{softmax_scale!r}.")
  if not (softmax_scale > 0 and math.isfinite(softmax_scale)):
    raise ValueError(f"softmax_scale must be a finite float > 0 (or None for "
                     f"1/sqrt(head_dim)); got {softmax_scale}.")
  return float(softmax_scale)


def check_sinks(shape: Shape | None, dtype, heads_q: int,
                allowed: Sequence[str] = SUPPORTED_DTYPE_NAMES) -> None:
  """sinks: None or float [heads_q]."""
  if shape is None:
    return
  check_rank("sinks", shape, 1, "[heads_q]")
  if shape[0] != heads_q:
    raise ValueError(f"sinks must have shape [heads_q] = [{heads_q}]; got "
                     f"{tuple(shape)}.")
  check_float_dtype("sinks", dtype, allowed)


def check_backend(backend) -> str:
  if not isinstance(backend, str) or backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}.")
  return backend


def check_int(name: str, x, lo: int = 1) -> int:
  """A Python int (not a bool) >= lo."""
  if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int; got {x!r}.")
  if x < lo:
    raise ValueError(f"{name} must be >= {lo}; got {x}.")
  return int(x)
