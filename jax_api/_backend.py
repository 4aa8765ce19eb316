"""Backend choice, in one place.

  "pallas"    the Pallas kernel lowered through Triton; strict: raises when the
              platform or input is outside the kernel's contract.
  "interpret" the same Pallas kernel through `interpret=True` (CPU; tests).
  "xla"       the memory-efficient pure-JAX path (chunked over keys).
  "auto"      "pallas" on an NVIDIA GPU of compute capability 8.0+, else
              "xla"; the choice is logged once per process and reason.
"""

from __future__ import annotations

import functools
import logging

import jax

from pallas_kernels import device

BACKENDS = ("auto", "pallas", "interpret", "xla")
_log = logging.getLogger("jax_api")
_announced: set[str] = set()


# Tests replace this module attribute to pretend a GPU.
_gpu_capability = device.gpu_capability


def _announce(msg: str) -> None:
  if msg not in _announced:
    _announced.add(msg)
    _log.warning(msg)


def resolve_backend(backend: str, *, kernel: str = "attention") -> str:
  """Returns one of "pallas", "interpret", "xla" for the given request."""
  if not isinstance(backend, str) or backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}.")
  cc = _gpu_capability()
  if backend == "pallas":
    if cc is None:
      raise ValueError(
          "backend='pallas' needs an NVIDIA GPU (compute capability 8.0+); the "
          f"default device is {jax.devices()[0].platform!r}. Use "
          "backend='interpret' (Pallas on CPU), 'xla' or 'auto'.")
    if cc < (8, 0):
      raise ValueError(
          f"backend='pallas' needs compute capability 8.0+; this GPU has "
          f"{cc[0]}.{cc[1]}. Use backend='xla' or 'auto'.")
    return "pallas"
  if backend == "auto":
    if cc is not None and cc >= (8, 0):
      _announce(f"jax_api: {kernel} runs the Pallas (Triton) kernel on this "
                f"GPU (compute capability {cc[0]}.{cc[1]}).")
      return "pallas"
    where = ("no NVIDIA GPU" if cc is None else
             f"compute capability {cc[0]}.{cc[1]} < 8.0")
    _announce(f"jax_api: {kernel} runs the XLA path ({where}); pass "
              "backend='interpret' to run the Pallas kernel on CPU.")
    return "xla"
  return backend
