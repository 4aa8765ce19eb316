"""Launching pip Triton's compiled kernels with the least host work: straight
into the kernel's C launcher (Triton 3.6), for pip Triton's own compile or
XLA's compile of the same IR (`torch_bridge._xla_cubin`)."""

from __future__ import annotations

import functools

import torch


def _lean_launcher(kernel, grid):
  """launch(stream, *args) straight into the compiled kernel's C launcher,
  or None. Triton's `kernel[grid](*args)` looks up the current device and
  stream and builds launch metadata on every call (about 30 us of host time
  per launch besides the C launch, under cProfile on the H200's host:
  benchmarks/results/h200/bridge-host-2026-12-03/prof-deberta-b1.json); the
  plans know the stream. Only for pip Triton 3.6, whose launcher's
  argument order this follows, and kernels without scratch buffers;
  launch hooks (profilers) take the full path at call time."""
  import triton
  if not triton.__version__.startswith("3.6."):
    return None
  try:
    kernel._init_handles()
    run = kernel.run
    if run.global_scratch_size or run.profile_scratch_size:
      return None
    c_launch, function = run.launch, kernel.function
    fixed = (function, run.launch_cooperative_grid, run.launch_pdl, None,
             None, kernel.packed_metadata, None, None, None)
  except AttributeError:
    return None
  gx, gy, gz = (tuple(grid) + (1, 1))[:3]

  def launch(stream, *args):
    c_launch(gx, gy, gz, stream, *fixed, *args)

  return launch


def _xla_launcher(kernel, xk):
  """launch(stream, *args) of XLA's compile `xk` (an `_xla_cubin.XlaKernel`)
  through the C launcher of pip Triton's compile `kernel` of the same IR
  (the caller checked that their parameters agree), with XLA's grid,
  threads and shared memory."""
  import triton
  from triton.runtime import driver
  if not triton.__version__.startswith("3.6."):
    return None
  kernel._init_handles()
  run = kernel.run
  if run.global_scratch_size or run.profile_scratch_size:
    return None
  device = torch.cuda.current_device()
  module, function, _, _, _ = driver.active.utils.load_binary(
      xk.name, xk.cubin, xk.shared, device)
  fixed = (function, run.launch_cooperative_grid, run.launch_pdl, None, None,
           (xk.threads // 32, 1, xk.shared), None, None, None)
  c_launch = run.launch
  gx, gy, gz = xk.grid

  def launch(stream, *args):
    c_launch(gx, gy, gz, stream, *fixed, *args)

  launch.module = module  # loaded for as long as the launcher lives
  return launch


def _hooks_set() -> bool:
  """Launch hooks installed (a profiler such as proton): launches then take
  Triton's full path, which builds the metadata the hooks read. Triton 3.6
  always holds hook chains, empty unless a hook was added (a chain's
  `calls`); earlier versions hold None or the hook."""
  runtime = _triton_runtime_knobs()
  enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
  return ((enter is not None and bool(getattr(enter, "calls", True))) or
          (exit_ is not None and bool(getattr(exit_, "calls", True))))


@functools.cache
def _triton_runtime_knobs():
  from triton import knobs
  return knobs.runtime
