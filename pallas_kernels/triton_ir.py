"""The Triton IR Pallas lowers its kernels to, captured without a GPU.

Used by the torch bridge's direct launch (`torch_bridge._direct`, which
compiles the IR with pip Triton) and by the benchmarks that compare
compilers or count instructions (`benchmarks.triton_compare`,
the tile probe, since removed: see git history).
"""

from __future__ import annotations

import re
import threading

_lock = threading.Lock()
_capturing = threading.local()


def capturing() -> bool:
  """True while this thread lowers a function only to capture its IR (the
  pip-Triton lowering rule then leaves compiling to Pallas' own rule)."""
  return getattr(_capturing, "on", False)


def capture_triton_ir(fn, args) -> list:
  """[(kernel name, Triton IR text, grid)] of the pallas_calls in fn(*args),
  in call order, lowered for CUDA.

  fn: a fresh jitted JAX function (one lowered before may come from JAX's
  cache without running Pallas' lowering, and identical pallas_calls in one
  function may be lowered once); args: ShapeDtypeStructs, arrays or None.
  Lowering for CUDA asks Pallas for the GPU's description: on a machine
  without one, stub `pallas_call_registration.gpu_info_lib.get_gpu_info`.
  """
  from pallas_kernels import compat
  lowering = compat.triton_lowering
  normalize_grid = compat.triton_pallas_call.normalize_grid
  got = []
  orig = lowering.lower_jaxpr_to_triton_module

  def capture(*a, **kw):
    r = orig(*a, **kw)
    text = r.module.operation.get_asm(enable_debug_info=False)
    m = re.search(r"tt\.func public @([\w$.]+)\(", text)
    got.append((m.group(1) if m else f"kernel{len(got)}", text,
                normalize_grid(r.grid)))
    return r

  with _lock:
    lowering.lower_jaxpr_to_triton_module = capture
    _capturing.on = True
    try:
      fn.trace(*args).lower(lowering_platforms=("cuda",))
    finally:
      _capturing.on = False
      lowering.lower_jaxpr_to_triton_module = orig
  return got


def pointer_count(ttir: str) -> int:
  """Pointer parameters of the kernel's signature (-1: no kernel found)."""
  m = re.search(r"tt\.func public @[\w$.]+\((.*?)\)\s*(attributes|\{)",
                ttir, re.S)
  return len(re.findall(r"!tt\.ptr<", m.group(1))) if m else -1


def signed_i1_minmax(ttir: str) -> list:
  """Lines of `ttir` with a signed min/max on i1. On i1 true is -1, so
  maxsi(true, false) is false: MLIR folds maxsi(extui a, extui b) of 0/1
  flags (`jnp.maximum` of booleans cast to int32) into exactly this, which
  interpret mode never shows. Kernels combine such flags with `|`."""
  return re.findall(r"[^\n]*arith\.(?:max|min)si[^\n]*: i1\b[^\n]*", ttir)
