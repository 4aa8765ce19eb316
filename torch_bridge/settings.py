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

JAX's GPU allocator: `configure_jax_allocator` (called when the package is
imported, before JAX starts) sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless
the user chose an allocator setting, so that JAX does not take 75% of the
GPU underneath torch.
"""

from __future__ import annotations

import os

ALLOCATOR_VARIABLES = ("XLA_PYTHON_CLIENT_PREALLOCATE",
                       "XLA_PYTHON_CLIENT_MEM_FRACTION",
                       "XLA_PYTHON_CLIENT_ALLOCATOR")


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


def configure_jax_allocator() -> bool:
  """Sets XLA_PYTHON_CLIENT_PREALLOCATE=false unless the user chose an
  allocator setting. Returns True when it set the variable."""
  if any(v in os.environ for v in ALLOCATOR_VARIABLES):
    return False
  os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return True
