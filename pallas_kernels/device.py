"""What the default device is, for the kernels' tile tables."""

from __future__ import annotations

import functools

import jax


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
