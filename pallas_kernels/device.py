"""What the default device is, for the kernels' tile tables, and whether JAX
has started its backends yet."""

from __future__ import annotations

import functools

import jax

# The variables JAX's GPU client reads its memory allocator from, once, when
# it is created (https://docs.jax.dev/en/latest/gpu_memory_allocation.html).
ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION",
                       "XLA_PYTHON_CLIENT_ALLOCATOR")


def backends_initialised() -> bool:
  """Whether JAX has created its backends (the first `jax.devices()`, array
  or compilation does): from then on XLA_FLAGS and ALLOCATOR_VARIABLES no
  longer change anything in this process. True where the internal this asks
  has moved (`tests/test_compat.py` fails then)."""
  from pallas_kernels import compat
  try:
    return bool(compat.xla_bridge.backends_are_initialized())
  except AttributeError:  # pragma: no cover
    return True


@functools.cache
def gpu_capability() -> tuple[int, int] | None:
  """Compute capability (major, minor) of the default device when it is an
  NVIDIA GPU, else None."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:
    return None
  if dev.platform != "gpu":
    return None
  cc = getattr(dev, "compute_capability", None)
  if cc is None:
    return None
  major, minor = (int(x) for x in str(cc).split("."))
  return major, minor
