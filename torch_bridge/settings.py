"""The bridge's switches, in one place (the only module of `torch_bridge`
that reads the environment). Each accessor reads its variable when called,
so a test or a benchmark may change one between calls.

  FOLDAX_TORCH_LAUNCH       "direct" (default): dense attention and the
                            DeBERTa inference forward launch their kernels
                            on torch's stream; "jax": everything through JAX
  FOLDAX_TORCH_BWD_CODE     "auto" (default), "xla" or "triton": whose
                            compile of the backward kernels the direct
                            launch runs (`torch_bridge._direct`)
  FOLDAX_TORCH_LEAN_LAUNCH  "1" (default) / "0": the bridge's own Triton
                            launcher or Triton's Python one (same bits)
  FOLDAX_TORCH_DLPACK       "fast" (default) / "protocol": DLPack hand-off
  FOLDAX_TORCH_DETACH       "1" (default) / "0": detach inputs before export
  FOLDAX_TORCH_FUSED_PROJECTIONS  "1" (default) / "0": DeBERTa's q/k/v in
                            one GEMM
  FOLDAX_HF_BUCKETS         "1" (default) / "0": bucket HF sequence lengths

JAX's GPU allocator: importing the package changes nothing in the
environment. `configure_jax_allocator()` (public as
`torch_bridge.configure_jax_allocator`), called before JAX starts its
backends, makes JAX's allocator grow on demand instead of taking 75% of the
GPU underneath torch; without it the bridge applies the same default at its
first call and says so once (`torch_bridge._runtime.check_jax_allocator`).
"""

from __future__ import annotations

import os

from pallas_kernels import device

ALLOCATOR_VARIABLES = device.ALLOCATOR_VARIABLES


def _choice(var: str, default: str, allowed: tuple[str, ...]) -> str:
  value = os.environ.get(var, default)
  if value not in allowed:
    quoted = ", ".join(repr(a) for a in allowed)
    raise ValueError(f"{var} must be one of {quoted}; got {value!r}.")
  return value


def _flag(var: str, default: bool = True) -> bool:
  return os.environ.get(var, "1" if default else "0") != "0"


def launch() -> str:
  return _choice("FOLDAX_TORCH_LAUNCH", "direct", ("direct", "jax"))


def backward_code() -> str:
  return _choice("FOLDAX_TORCH_BWD_CODE", "auto", ("auto", "xla", "triton"))


def lean_launch() -> bool:
  return _flag("FOLDAX_TORCH_LEAN_LAUNCH")


def dlpack_low_level() -> bool:
  return os.environ.get("FOLDAX_TORCH_DLPACK", "fast") != "protocol"


def detach_inputs() -> bool:
  return _flag("FOLDAX_TORCH_DETACH")


def fused_projections() -> bool:
  return _flag("FOLDAX_TORCH_FUSED_PROJECTIONS")


def hf_buckets() -> bool:
  return _flag("FOLDAX_HF_BUCKETS")


def allocator_chosen() -> bool:
  """Whether one of ALLOCATOR_VARIABLES (JAX's GPU allocator) is set."""
  return any(v in os.environ for v in ALLOCATOR_VARIABLES)


def configure_jax_allocator() -> bool:
  """Makes JAX's GPU allocator grow on demand, for sharing the GPU with torch.

  JAX preallocates 75% of every GPU when its GPU backend starts, which
  leaves torch a quarter of the card. This sets
  XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX's BFC allocator then takes what
  it uses, up to the same 75% cap, and keeps it pooled for later JAX calls)
  unless one of XLA_PYTHON_CLIENT_PREALLOCATE,
  XLA_PYTHON_CLIENT_MEM_FRACTION or XLA_PYTHON_CLIENT_ALLOCATOR is already
  set: the user's choice wins. JAX reads these once, when its backends
  start (the first `jax.devices()`, array or compilation), so call this
  before any JAX computation; calling it again is harmless.

  Returns True when it set the variable, False when an allocator setting
  was there already or JAX started without a GPU (nothing to share).
  Raises RuntimeError when JAX's GPU backend has already started with no
  allocator setting (the variable would change nothing).
  """
  if allocator_chosen():
    return False
  if device.backends_initialised():
    import jax
    if all(d.platform != "gpu" for d in jax.devices()):
      return False
    raise RuntimeError(
        "configure_jax_allocator() was called after JAX started its "
        "backends, so it can no longer change JAX's GPU allocator (JAX may "
        "hold 75% of the GPU). Call it before any JAX computation, or set "
        "XLA_PYTHON_CLIENT_PREALLOCATE=false before starting Python.")
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return True
