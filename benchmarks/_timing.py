"""Timing, memory and determinism helpers shared by the benchmarks.

Nothing here imports jax or torch at module import time: each helper imports
the framework it needs, so the CPU smoke path never pays for torch.

How time is measured
--------------------
Both frameworks dispatch device work asynchronously, so a single call timed
with a host clock measures host dispatch + launch latency + the kernel. For the
millisecond-scale kernels benchmarked here we want device time, so:

* JAX (`time_jax`): the function is compiled ahead of time (the compiled
  executable is called directly, which skips jit's cache lookup), warmed up,
  and then timed as *batches of N back-to-back calls*: one host clock read
  before the batch, N asynchronous dispatches, `block_until_ready` on the last
  output (all calls run in order on one stream), a second clock read; the batch
  time divided by N is one sample. Host dispatch of call i+1 overlaps device
  execution of call i, so as long as a call's device time exceeds its dispatch
  cost (~10-30 us for a jitted call) the per-call figure is device time, and
  the fixed cost of one sync is amortised over N. The reported figure is the
  median over the batches. N is picked adaptively from a first estimate so
  that the whole measurement takes about `target_s` seconds.
* torch (`time_torch`): the same batches, timed with CUDA events recorded on
  the current stream around the N calls (event time excludes the host wait).

Inputs smaller than about twice the L2 (60 MB on the H200) would be served
from cache when one buffer is reused, so callers pass several input sets
(`n_input_sets`) and the timed loop rotates among them.

FLOPs
-----
`attention_flops`: 4*B*Hq*Sq*Sk*D for the forward (two matrix products), halved
when causal, times 3.5 for forward+backward (backward = 2.5x forward), the
convention of shared/anchors/README.md.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable, Sequence

L2_BYTES = 60 * 1024 * 1024  # H200 L2 (torch reports 60 MB)


# ----------------------------------------------------------------------------
# FLOPs and sizes
# ----------------------------------------------------------------------------
def attention_flops(B: int, Hq: int, Sq: int, Sk: int, D: int, causal: bool,
                    mode: str = "fwd") -> float:
  """FLOPs of dense attention: 4*B*Hq*Sq*Sk*D (/2 if causal), x3.5 fwd+bwd."""
  f = 4.0 * B * Hq * Sq * Sk * D
  if causal:
    f /= 2.0
  if mode in ("fwd+bwd", "fwdbwd", "bwd+fwd"):
    f *= 3.5
  elif mode != "fwd":
    raise ValueError(f"unknown mode {mode!r}")
  return f


def n_input_sets(bytes_per_set: int, l2_bytes: int = L2_BYTES,
                 max_sets: int = 8) -> int:
  """How many distinct input sets to rotate so that they exceed 2x L2."""
  if bytes_per_set <= 0:
    return 1
  return int(max(1, min(max_sets, math.ceil(2 * l2_bytes / bytes_per_set))))


# ----------------------------------------------------------------------------
# Adaptive batching
# ----------------------------------------------------------------------------
def _plan(t_est: float, target_s: float, n_batches: int, max_calls: int):
  """Split about target_s of work into n_batches batches of n calls."""
  t_est = max(t_est, 1e-6)
  total = max(n_batches, int(target_s / t_est))
  total = min(total, max_calls)
  if total < n_batches:  # very slow calls: fewer batches, one call each
    return max(1, total), 1
  return n_batches, max(1, total // n_batches)


def _summary(samples: Sequence[float], n_per_batch: int, extra: dict) -> dict:
  s = sorted(samples)
  out = dict(
      ms=statistics.median(s) * 1e3,
      ms_min=s[0] * 1e3,
      ms_max=s[-1] * 1e3,
      n_batches=len(s),
      calls_per_batch=n_per_batch,
  )
  out.update(extra)
  return out


# ----------------------------------------------------------------------------
# JAX
# ----------------------------------------------------------------------------
def jax_block(x: Any) -> Any:
  import jax
  return jax.block_until_ready(x)


def jax_compile(fn: Callable, args: Sequence[Any]):
  """jit + lower + compile ahead of time. Returns (compiled, lowered, secs)."""
  import jax
  t0 = time.perf_counter()
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  lowered = jitted.lower(*args)
  compiled = lowered.compile()
  return compiled, lowered, time.perf_counter() - t0


def time_jax(fn: Callable, arg_sets: Sequence[Sequence[Any]], *,
             target_s: float = 0.3, n_batches: int = 7, warmup: int = 2,
             max_calls: int = 20000) -> dict:
  """Median per-call time of `fn` (already compiled or jitted) in ms.

  `arg_sets` is a list of argument tuples, rotated call after call.
  Returns dict(ms, ms_min, ms_max, n_batches, calls_per_batch).
  """
  import jax
  n_sets = len(arg_sets)
  for i in range(max(1, warmup)):
    jax.block_until_ready(fn(*arg_sets[i % n_sets]))
  # First estimate: a few back-to-back calls.
  k = 3
  t0 = time.perf_counter()
  out = None
  for i in range(k):
    out = fn(*arg_sets[i % n_sets])
  jax.block_until_ready(out)
  t_est = (time.perf_counter() - t0) / k
  nb, n = _plan(t_est, target_s, n_batches, max_calls)
  samples = []
  j = 0
  for _ in range(nb):
    t0 = time.perf_counter()
    for _ in range(n):
      out = fn(*arg_sets[j % n_sets])
      j += 1
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / n)
  del out
  return _summary(samples, n, dict(timer="host, back-to-back batches",
                                   input_sets=n_sets))


def jax_memory_analysis(compiled) -> dict:
  """Device bytes XLA's buffer assignment reserves for one call.

  peak_mem_bytes = temporaries + outputs (the working memory a call adds on
  top of its inputs; cuDNN workspaces and Pallas scratch are temporaries).
  """
  try:
    m = compiled.memory_analysis()
  except Exception:  # pragma: no cover - backend without analysis
    return {}
  if m is None:
    return {}
  temp = int(getattr(m, "temp_size_in_bytes", 0) or 0)
  outb = int(getattr(m, "output_size_in_bytes", 0) or 0)
  alias = int(getattr(m, "alias_size_in_bytes", 0) or 0)
  return dict(peak_mem_bytes=temp + outb - alias, mem_temp_bytes=temp,
              mem_output_bytes=outb,
              mem_argument_bytes=int(getattr(m, "argument_size_in_bytes", 0) or 0),
              mem_source="xla buffer assignment (temp+output, excludes inputs)")


def jax_device_memory_stats() -> dict | None:
  import jax
  try:
    return jax.devices()[0].memory_stats()
  except Exception:
    return None


def jax_peak_delta(fn: Callable, args: Sequence[Any]) -> int | None:
  """Runtime peak that one call of `fn` adds over the memory in use before it.

  JAX cannot reset `peak_bytes_in_use`, so this is only exact when the call
  pushes the process-wide peak higher than it ever was; otherwise it returns
  None (the call fitted under an older peak). For an exact figure run the
  call in a fresh process (see `jax_peak_subprocess`).
  """
  import jax
  s0 = jax_device_memory_stats()
  if not s0 or "peak_bytes_in_use" not in s0:
    return None
  jax.block_until_ready(fn(*args))
  s1 = jax_device_memory_stats()
  if s1["peak_bytes_in_use"] > s0["peak_bytes_in_use"]:
    return int(s1["peak_bytes_in_use"] - s0["bytes_in_use"])
  return None


def jax_peak_subprocess(code: str, timeout: float = 300) -> int | None:
  """Run `code` (which must build inputs and call the function once) in a
  fresh python process and return that process's peak_bytes_in_use."""
  import subprocess, sys, os
  prog = (
      "import os\nos.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE','false')\n"
      + code +
      "\nimport jax\nprint('PEAK', jax.devices()[0].memory_stats()['peak_bytes_in_use'])\n")
  r = subprocess.run([sys.executable, "-c", prog], capture_output=True,
                     text=True, timeout=timeout, env=dict(os.environ))
  for line in r.stdout.splitlines():
    if line.startswith("PEAK "):
      return int(line.split()[1])
  return None


# ----------------------------------------------------------------------------
# torch
# ----------------------------------------------------------------------------
def time_torch(fn: Callable, arg_sets: Sequence[Sequence[Any]], *,
               target_s: float = 0.3, n_batches: int = 7, warmup: int = 3,
               max_calls: int = 20000) -> dict:
  """Median per-call time of a torch callable in ms, CUDA events per batch."""
  import torch
  n_sets = len(arg_sets)
  for i in range(max(1, warmup)):
    fn(*arg_sets[i % n_sets])
  torch.cuda.synchronize()
  start = torch.cuda.Event(enable_timing=True)
  end = torch.cuda.Event(enable_timing=True)
  k = 3
  start.record()
  for i in range(k):
    fn(*arg_sets[i % n_sets])
  end.record()
  end.synchronize()
  t_est = start.elapsed_time(end) / 1e3 / k
  nb, n = _plan(t_est, target_s, n_batches, max_calls)
  samples = []
  j = 0
  for _ in range(nb):
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
      fn(*arg_sets[j % n_sets])
      j += 1
    end.record()
    end.synchronize()
    samples.append(start.elapsed_time(end) / 1e3 / n)
  return _summary(samples, n, dict(timer="cuda events, back-to-back batches",
                                   input_sets=n_sets))


def torch_peak_memory(fn: Callable, args: Sequence[Any]) -> dict:
  """Peak bytes one call adds over what is allocated before it (torch)."""
  import torch
  torch.cuda.synchronize()
  torch.cuda.reset_peak_memory_stats()
  base = torch.cuda.memory_allocated()
  out = fn(*args)
  torch.cuda.synchronize()
  peak = torch.cuda.max_memory_allocated() - base
  del out
  return dict(peak_mem_bytes=int(peak),
              mem_source="torch.cuda.max_memory_allocated after reset, minus "
                         "memory allocated before the call (excludes inputs)")


# ----------------------------------------------------------------------------
# Determinism
# ----------------------------------------------------------------------------
def _leaves(x: Any) -> list:
  if isinstance(x, (list, tuple)):
    out = []
    for y in x:
      out.extend(_leaves(y))
    return out
  if isinstance(x, dict):
    out = []
    for kk in sorted(x):
      out.extend(_leaves(x[kk]))
    return out
  return [x]


def _same_bits(a: Any, b: Any) -> bool:
  """Bitwise equality, computed on the device where the arrays live."""
  mod = type(a).__module__
  if mod.startswith("torch"):
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
      return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    it = ints[a.element_size()]
    return bool(torch.equal(a.detach().contiguous().view(it),
                            b.detach().contiguous().view(it)))
  import numpy as np
  try:
    import jax
    import jax.numpy as jnp
    if isinstance(a, jax.Array):
      if a.shape != b.shape or a.dtype != b.dtype:
        return False
      ints = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
      it = ints[a.dtype.itemsize]
      return bool(jnp.all(jax.lax.bitcast_convert_type(a, it)
                          == jax.lax.bitcast_convert_type(b, it)))
  except ImportError:  # pragma: no cover
    pass
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def bitwise_repeatable(fn: Callable, args: Sequence[Any], n: int = 5) -> bool:
  """Runs fn(*args) n times (e.g. a backward) and compares the outputs' bits.

  Works for JAX arrays, torch tensors and (nested) tuples of them; the
  comparison runs on the device (bit patterns as integers, so NaNs compare
  by payload too).
  """
  ref = _leaves(fn(*args))
  same = True
  for _ in range(n - 1):
    out = _leaves(fn(*args))
    if len(out) != len(ref):
      return False
    for a, b in zip(ref, out):
      if not _same_bits(a, b):
        same = False
  return same
