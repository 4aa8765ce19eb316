"""Attention on CUDA tensors without PJRT: the same Pallas kernels,
launched by Triton on torch's current stream (dense attention forward and
backward; DeBERTa's disentangled attention forward, for inference).

The bridge's general path hands tensors to jit-compiled JAX functions
through DLPack; each call then pays for the import, the stream hand-off, the
XLA dispatch and the export (292 us per forward at B1 H16 S128 D128 on the
H200, against 104 us for the JAX call alone and 30 us for the kernel
launched directly: benchmarks/results/h200/triton-compare-2026-12-03). For
dense attention (not varlen; segment ids allowed) this module launches the very
kernels the JAX path runs, directly:

1. Once per configuration and shape, the JAX function the general path
   would call (`_jax_side._pallas_fwd` / `_pallas_bwd`) is traced and lowered
   for CUDA, and the Triton IR that Pallas produces for each of its
   `pallas_call`s is captured (forward: the flash kernel; backward: the
   D_i preprocess, the dK/dV kernel and the dQ kernel).
2. Each IR is compiled by the pip `triton` package (the compiler torch's
   own Triton kernels use) with the kernel's warps and stages from the
   shipped block table; both steps run inside
   `pallas_kernels.flash.config.compiled_by("triton")`, whose entries
   replace XLA's where the two compilers favour different tiles.
   Without GQA the backward's kernels then run XLA's compile of the same
   IR instead (the cubins `jax.jit` runs, 9% faster there: see
   `torch_bridge._xla_cubin` and `_xla_code_wanted`), through pip
   Triton's launcher.
3. Calls launch the compiled kernels on torch tensors, on torch's current
   stream; what XLA did between the kernels (reshapes, the natural-log LSE,
   zero-initialised accumulators, the sinks' gradient) is done in torch.

The DeBERTa inference forward (no dropout, not packed) captures the position-table GEMM and the disentangled forward
kernel of `jax_api.deberta`'s Pallas path the same way (`DebertaPlan`); its
backward still goes through JAX (the VJP recomputes the forward it
differentiates).

So the kernel source, masking and fixed-order reductions are those of the
JAX path (the tiles too, except where the Triton table differs): outputs
agree with it to rounding (a different compiler may contract
floating-point operations differently) and every call gives the same bits.
`FOLDAX_TORCH_LAUNCH=jax` turns this path off (everything through JAX and
DLPack); without pip Triton, or for any other case, the general path runs.

Kernel arguments are the `pallas_call`'s operands then its results, in
order (an output aliased to an input is passed the same tensor); the
number of pointers in each captured signature is checked against the
arguments this module passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading

import torch

from pallas_kernels.pip_triton import compile_ttir
from pallas_kernels.triton_ir import capture_triton_ir, pointer_count
from torch_bridge import _runtime as rt
from torch_bridge._launchers import (_hooks_set, _lean_launcher,  # noqa: F401
                                    _xla_launcher)
from torch_bridge import settings

LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634

_lock = threading.Lock()
_plans: dict = {}
# Each fast kernel flags the tiles whose result holds a non-finite value; its
# `_contain` twin redoes only those (see `pallas_kernels.flash.forward`).
_KERNELS = ("fold_flash_forward", "fold_flash_forward_contain",
            "fold_flash_backward_preprocess", "fold_flash_backward_dkdv",
            "fold_flash_backward_dkdv_contain", "fold_flash_backward_dq",
            "fold_flash_backward_dq_contain")


def enabled() -> bool:
  """False when FOLDAX_TORCH_LAUNCH=jax or pip Triton is missing."""
  if settings.launch() == "jax":
    return False
  return _triton_available()


@functools.cache
def _triton_available() -> bool:
  import importlib
  try:
    importlib.import_module("triton.backends.compiler")
  except Exception:  # noqa: BLE001
    return False
  return True


@dataclasses.dataclass(frozen=True)
class _Shape:
  b: int
  sq: int
  sk: int
  hq: int
  hkv: int
  d: int
  dtype: torch.dtype
  has_sinks: bool
  has_segments: bool = False


def eligible(static, q, k, q_seg, k_seg, cu_q) -> bool:
  """Whether a call can take the direct path (see the module docstring)."""
  from pallas_kernels.flash.config import dq_mode, head_dim_bucket
  backend, varlen = static[0], static[8]
  return (backend == "pallas" and not varlen and cu_q is None and
          (q_seg is None) == (k_seg is None) and q.is_cuda and
          q.dtype in (torch.bfloat16, torch.float16, torch.float32) and
          q.dim() == 4 and head_dim_bucket(q.shape[-1]) == q.shape[-1] and
          dq_mode() == "recompute" and enabled())


_FAILED = object()  # a plan that could not be built: the general path runs


def _cached_plan(key, build, what: str):
  """_plans[key], built once; None when building failed (said once, with
  the error: those calls then go through JAX and DLPack, the same kernels
  compiled by XLA)."""
  p = _plans.get(key)
  if p is None:
    rt.refuse_in_graph_capture(f"cuda:{key[-1]}",
                               f"building the kernels of {what}")
    with _lock:
      p = _plans.get(key)
      if p is None:
        try:
          p = build()
        except Exception as e:  # noqa: BLE001
          rt.announce(f"torch_bridge: the direct launch of {what} failed "
                      f"({type(e).__name__}: {str(e)[:300]}); these calls "
                      "go through JAX and DLPack instead.")
          p = _FAILED
        _plans[key] = p
  return None if p is _FAILED else p


_MISS = object()
_call_plans: dict = {}  # a call's key -> its DensePlan, or None


def plan_for_call(static, q, k, sinks, q_seg, k_seg,
                  cu_q) -> "DensePlan | None":
  """`plan(...)` if `eligible(...)`, else None, by one dictionary lookup
  per call once a call of that key was seen (both depend only on the key
  and on the environment switches, which are read on every call)."""
  if cu_q is not None or not enabled() or _dq_mode() != "recompute":
    return None
  key = (static, q.shape, k.shape, q.dtype, q.device, sinks is None,
         q_seg is None, k_seg is None)
  p = _call_plans.get(key, _MISS)
  if p is _MISS:
    p = (plan(static, q, k, sinks, q_seg)
         if eligible(static, q, k, q_seg, k_seg, cu_q) else None)
    with _lock:
      if len(_call_plans) >= 4096:
        _call_plans.clear()
      _call_plans[key] = p
  return p


def _dq_mode() -> str:
  from pallas_kernels.flash.config import dq_mode
  return dq_mode()


def plan(static, q, k, sinks, q_seg=None) -> "DensePlan | None":
  """The compiled kernels for this configuration and shape (cached), or
  None if they could not be built (see `_cached_plan`)."""
  shape = _Shape(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2],
                 q.shape[3], q.dtype, sinks is not None, q_seg is not None)

  def build():
    p = DensePlan(static, shape, torch.cuda.get_device_capability(q.device))
    rt.announce("torch_bridge: dense attention on CUDA launches the Pallas "
                "kernels' Triton IR directly on torch's stream "
                "(FOLDAX_TORCH_LAUNCH=jax: through JAX and DLPack).")
    return p

  return _cached_plan((static, shape, q.device.index), build,
                      f"dense attention {shape}")


# ----------------------------------------------------------------------------
# Capturing and compiling
# ----------------------------------------------------------------------------

def _sds(shape, dtype):
  import jax
  return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _jax_dtype(dtype: torch.dtype):
  import jax.numpy as jnp
  return {torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
          torch.float32: jnp.float32}[dtype]


_SAME_DEVICE = contextlib.nullcontext()


def _on_device(device: torch.device):
  """`torch.cuda.device(device)`, or nothing when it is already current
  (the common case; the context manager costs host time on every call)."""
  if device.index == torch._C._cuda_getDevice():
    return _SAME_DEVICE
  return torch.cuda.device(device)


class _Kernels:
  """Compiled kernels by name, their grids and IR; checked and launched."""

  def __init__(self, compile_kernels: bool):
    self.compile_kernels = compile_kernels
    self.grids, self.kernels, self.ir, self.lean = {}, {}, {}, {}
    self.xla = {}  # name -> _xla_cubin.XlaKernel launched instead of pip's
    self._fast = {}  # name -> (lean launch, runs with hooks set too)

  def _add(self, name, ttir, grid, n_ptrs, num_warps, num_stages, cc):
    got = pointer_count(ttir)
    if got != n_ptrs:
      raise RuntimeError(f"torch_bridge: {name} takes {got} pointers; the "
                         f"direct launch passes {n_ptrs}")
    if self.compile_kernels:
      self.kernels[name] = compile_ttir(name, ttir, num_warps, num_stages, cc)
    self.grids[name] = grid
    self.ir[name] = ttir  # last: marks the kernel ready

  @staticmethod
  def _new_device_constant(cache: dict, device, what: str, make):
    """cache[device] = make() placed on `device`: `make` returns host tensors
    (one or a tuple), copied once per device, blocking, so complete before
    any stream reads them. A CUDA graph capture cannot record that copy, so
    it is refused there. The device copy is allocated by JAX, not by torch:
    a constant made during a warm-up of inductor's CUDA graph trees would
    otherwise sit in the graph's memory pool, where it is an allocation the
    graph does not track (and the tree refuses to record)."""
    rt.refuse_in_graph_capture(device, f"a first call's {what}")
    host = make()
    if isinstance(host, tuple):
      c = tuple(rt.device_constant(t, device) for t in host)
    else:
      c = rt.device_constant(host, device)
    cache[device] = c
    return c

  def _launch(self, name, *args, stream=None):
    """On `stream` (a raw CUDA stream handle: torch's current stream of the
    tensors' device, which the caller made current)."""
    fast = self._fast.get(name)
    if fast is not None and stream is not None and (
        fast[1] or not _hooks_set()):
      fast[0](stream, *args)
      return
    self._launch_resolving(name, args, stream)

  def _launch_resolving(self, name, args, stream):
    """`_launch` on the first call of a kernel, or with launch hooks set:
    resolves (once) which launcher runs it and keeps the lean one in
    `_fast` as (launch, whether it runs even with hooks set)."""
    xk = self.xla.get(name)
    if xk is not None and stream is not None:
      # XLA's code always takes the lean launcher: which code runs (and so
      # the bits) must not depend on launch hooks.
      if name not in self.lean:
        self.lean[name] = _xla_launcher(self.kernels[name], xk)
        if self.lean[name] is None:
          del self.xla[name], self.lean[name]
          rt.announce(f"torch_bridge: XLA's compile of {name} cannot be "
                      "launched with this pip Triton; pip Triton's runs.")
          return self._launch_resolving(name, args, stream)
        self._fast[name] = (self.lean[name], True)
      self.lean[name](stream, *args)
      return
    if name not in self.lean:
      # At the first launch, on the tensors' device: loading the module
      # binds it to the current device, as Triton's own first launch does.
      self.lean[name] = (_lean_launcher(self.kernels[name], self.grids[name])
                         if _lean_enabled() else None)
      if self.lean[name] is not None:
        self._fast[name] = (self.lean[name], False)
    lean = self.lean[name]
    if lean is not None and stream is not None and not _hooks_set():
      lean(stream, *args)
    else:
      self.kernels[name][self.grids[name]](*args)


def _xla_code_wanted(gqa: bool) -> bool:
  """FOLDAX_TORCH_BWD_CODE: which compile of the backward's kernels the
  direct launch runs. "xla": XLA's (the code `jax.jit` runs); "triton": pip
  Triton's; "auto" (the default): XLA's without GQA, pip Triton's with it.
  On the H200 XLA's compile is the faster one at B1 H16 S4096 D128 causal
  (0.560 against 0.611 ms, benchmarks/results/h200/xla-cubin-2026-12-04)
  and B4 H16 S2048 D64 (0.481 against 0.547 ms, pip-triton-2026-12-03),
  pip Triton's at B4 S2048 H16/4 D64 (0.526 against 0.555 ms,
  xla-cubin-2026-12-04/gqa-d64; 0.544 against 0.624 ms in
  bridge-host-2026-12-03)."""
  mode = settings.backward_code()
  return mode == "xla" or (mode == "auto" and not gqa)


def _lean_enabled() -> bool:
  return settings.lean_launch()


def _raw_stream(device) -> int:
  """torch's current CUDA stream on `device`, as the raw handle."""
  return torch._C._cuda_getCurrentRawStream(device.index)


class DensePlan(_Kernels):
  """The kernels of one dense configuration and shape, compiled, and the
  torch glue around them. Tensors: q [b, sq, hq, d], k, v [b, sk, hkv, d]
  (contiguous), sinks [hq] or None; aux: the kernel's base-2 LSE float32
  [hq, b * sq] (+inf on rows that saw nothing). The forward's kernels (the
  fast one and its `_contain` twin) are captured and compiled when the plan
  is made, the backward's five on the first backward (inference never pays
  for them)."""

  _FWD = _KERNELS[:2]
  _BWD = _KERNELS[2:]

  def __init__(self, static, shape: _Shape, cc, *, compile_kernels=True):
    from torch_bridge._jax_side import attn_config
    super().__init__(compile_kernels)
    self.shape, self.cc, self.cfg = shape, cc, attn_config(*static)
    self._cu_cache = {}
    self._zero_cache = {}
    self._bwd_lock = threading.Lock()
    self._bwd_failed = False
    self._build(self._FWD)

  def ensure_backward(self):
    if self._BWD[0] not in self.ir:
      rt.refuse_in_graph_capture(None, "building the backward's kernels")
      with self._bwd_lock:
        if self._BWD[0] not in self.ir:
          self._build(self._BWD)

  def backward_ready(self) -> bool:
    """Builds the backward's kernels once; False (said once, with the
    error) if that failed: the backward then goes through JAX."""
    if self._bwd_failed:
      return False
    try:
      self.ensure_backward()
    except Exception as e:  # noqa: BLE001
      self._bwd_failed = True
      rt.announce(f"torch_bridge: the direct launch of the backward of "
                  f"{self.shape} failed ({type(e).__name__}: "
                  f"{str(e)[:300]}); it goes through JAX and DLPack "
                  "instead.")
      return False
    return True

  def _build(self, names):
    import jax
    import jax.numpy as jnp
    from pallas_kernels import device
    from pallas_kernels.flash import core, preprocess
    from pallas_kernels.settings import compiled_by
    from torch_bridge import _jax_side
    s, cfg = self.shape, self.cfg
    dt = _jax_dtype(s.dtype)
    f32 = jnp.float32
    q = _sds((s.b, s.sq, s.hq, s.d), dt)
    kv = _sds((s.b, s.sk, s.hkv, s.d), dt)
    sinks = _sds((s.hq,), f32) if s.has_sinks else None
    qs = ks = None
    if s.has_segments:
      qs, ks = _sds((s.b, s.sq), jnp.int32), _sds((s.b, s.sk), jnp.int32)
    lse = _sds((s.b, s.hq, s.sq), f32)
    aux = _sds((s.hq, s.b * s.sq), f32)
    with compiled_by("triton"):  # pip Triton's block table (see config)
      # Fresh jit wrappers: a function lowered before (by the general path)
      # would come from JAX's lowering cache without running Pallas'
      # lowering.
      if names == self._FWD:
        fn = jax.jit(functools.partial(_jax_side._pallas_fwd, cfg))
        args = (q, kv, kv, sinks, qs, ks, None, None)
      else:
        fn = jax.jit(functools.partial(_jax_side._pallas_bwd, cfg))
        args = (q, kv, kv, sinks, qs, ks, None, None, q, lse, aux, q, lse)
      irs = {n: (ir, grid) for n, ir, grid in capture_triton_ir(fn, args)}
      plan = core.kernel_plan(s.d, dt, interpret=False,
                              compute_capability=device.gpu_capability())
      fwd_b, bwd_b = plan.fwd, plan.bwd
    missing = [n for n in names if n not in irs]
    if missing:
      raise RuntimeError(f"torch_bridge: no Triton IR captured for {missing}")
    dqb = bwd_b.dq_blocks
    pre = preprocess.launch_params(s.d)
    launch = {
        "fold_flash_forward": (fwd_b.num_warps, fwd_b.num_stages),
        "fold_flash_backward_preprocess": (pre.num_warps, pre.num_stages),
        "fold_flash_backward_dkdv": (bwd_b.num_warps, bwd_b.num_stages),
        "fold_flash_backward_dq": (dqb.num_warps, dqb.num_stages),
    }
    seg = 2 * int(s.has_segments)
    # Fast kernels: inputs, outputs, flags. Their _contain twins: inputs,
    # flags, the fast outputs (aliased: passed twice, in and out).
    n_ptrs = {"fold_flash_forward": 8 + int(s.has_sinks) + seg,
              "fold_flash_forward_contain": 10 + int(s.has_sinks) + seg,
              "fold_flash_backward_preprocess": 6,
              "fold_flash_backward_dkdv": 11 + seg,
              "fold_flash_backward_dkdv_contain": 13 + seg,
              "fold_flash_backward_dq": 10 + seg,
              "fold_flash_backward_dq_contain": 11 + seg}
    for name in list(launch):
      launch[name + "_contain"] = launch[name]
    for name in names:
      self._add(name, *irs[name], n_ptrs[name], *launch[name], self.cc)
    if (names == self._BWD and self.compile_kernels and
        _xla_code_wanted(s.hq != s.hkv)):
      self._take_xla_code(cfg, args, self._BWD)

  def _take_xla_code(self, cfg, args, names):
    """Launch XLA's compile of `names` (the one `jax.jit` runs: JAX's speed
    and bits) instead of pip Triton's, where it can be found and its
    parameters match pip's (`torch_bridge._xla_cubin`); said once."""
    import jax
    from pallas_kernels.settings import compiled_by
    from torch_bridge import _jax_side
    from torch_bridge import _xla_cubin
    if jax.default_backend() != "gpu":  # e.g. the CPU tests' stubbed sm_90
      return
    try:
      with compiled_by("xla"):
        fn = jax.jit(functools.partial(_jax_side._pallas_bwd, cfg))
        found = _xla_cubin.xla_kernels(fn, args, names)
      took = []
      for name in names:
        xk = found.get(name)
        if xk is None:
          continue
        pip_params = _xla_cubin.param_layout(self.kernels[name].kernel, name)
        xla_params = _xla_cubin.param_layout(xk.cubin, name)
        # XLA's compile declares no scratch pointers; the launcher's two
        # trailing (null) ones are then beyond its parameters, unread.
        if (xla_params and pip_params[:len(xla_params)] == xla_params and
            len(pip_params) - len(xla_params) in (0, 2)):
          self.xla[name] = xk
          took.append(name)
      missing = [n for n in names if n not in took]
    except Exception as e:  # noqa: BLE001
      took = []
      missing = [f"{names} ({type(e).__name__}: {str(e)[:200]})"]
    if took:
      rt.announce("torch_bridge: the direct backward launches XLA's compile "
                  f"of {', '.join(took)} (the code jax.jit runs; "
                  "FOLDAX_TORCH_BWD_CODE=triton: pip Triton's).")
    if missing:
      rt.announce("torch_bridge: XLA's compile of "
                  f"{', '.join(map(str, missing))} was not usable; the "
                  "direct backward launches pip Triton's compile there.")

  def _cu(self, device):
    """cu_seqlens of the dense batch (made once per device, read only, by
    a blocking host-to-device copy: complete before any stream reads it)."""
    cu = self._cu_cache.get(device)
    if cu is not None:
      return cu
    return self._new_device_constant(
        self._cu_cache, device, "cu_seqlens",
        lambda: tuple(torch.arange(self.shape.b + 1, dtype=torch.int32) * n
                      for n in (self.shape.sq, self.shape.sk)))

  def _zero_rows(self, device):
    """float32 zeros [hq, total_q], the dLSE of a call whose LSE got no
    gradient (made once per device, like `_cu`, by a blocking
    host-to-device copy; kernels only read it)."""
    z = self._zero_cache.get(device)
    if z is not None:
      return z
    return self._new_device_constant(
        self._zero_cache, device, "zero dLSE",
        lambda: torch.zeros((self.shape.hq, self.shape.b * self.shape.sq),
                            dtype=torch.float32))

  @staticmethod
  def _segs(q_seg, k_seg):
    """Segment ids flattened to the packed token order (int32 [b * s])."""
    if q_seg is None:
      return []
    return [x.to(torch.int32).reshape(-1).contiguous() for x in (q_seg, k_seg)]

  def forward(self, q, k, v, sinks, q_seg=None, k_seg=None,
              need_lse: bool = True):
    """(out [b, sq, hq, d], lse float32 [b, hq, sq] or None, aux);
    q_seg / k_seg: int [b, sq] / [b, sk] or None."""
    s = self.shape
    dev = q.device
    with _on_device(dev):
      cu_q, cu_k = self._cu(dev)
      q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
      out = torch.empty_like(q)
      aux = q.new_empty((s.hq, s.b * s.sq), dtype=torch.float32)
      args = [cu_q, cu_k, q, k, v]
      if q_seg is not None:
        args += self._segs(q_seg, k_seg)
      if sinks is not None:
        args.append(sinks.detach().float().contiguous())
      flags = q.new_empty((s.hq, s.b * s.sq), dtype=torch.int32)
      stream = _raw_stream(dev)
      self._launch("fold_flash_forward", *args, out, aux, flags,
                   stream=stream)
      self._launch("fold_flash_forward_contain", *args, flags, out, aux,
                   out, aux, stream=stream)
    lse = None
    if need_lse:
      lse = torch.where(aux == float("inf"), float("-inf"), aux * LN2)
      lse = lse.view(s.hq, s.b, s.sq).transpose(0, 1).contiguous()
    return out, lse, aux

  def backward(self, q, k, v, sinks, out, aux, dout, dlse, q_seg=None,
               k_seg=None):
    """(dq, dk, dv, dsinks float32 [hq] or None)."""
    if self._BWD[0] not in self.ir:
      self.ensure_backward()
    s = self.shape
    total_q = s.b * s.sq
    dev = q.device
    with _on_device(dev):
      cu_q, cu_k = self._cu(dev)
      q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
      out, aux = out.contiguous(), aux.contiguous()
      if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
      dout = dout.contiguous()
      if dlse is None:
        dlse_rows = self._zero_rows(dev)
      else:
        dlse_rows = dlse.float().transpose(0, 1).reshape(s.hq, total_q)
        dlse_rows = torch.where(torch.isfinite(dlse_rows), dlse_rows, 0.0)
        dlse_rows = dlse_rows.contiguous()
      # Every row of a dense batch lies in a sequence: the preprocess
      # kernel writes all of delta (no zero fill needed).
      delta = torch.empty_like(aux)  # [hq, total_q] float32
      stream = _raw_stream(dev)
      self._launch("fold_flash_backward_preprocess", cu_q, out, dout,
                   dlse_rows, delta, delta, stream=stream)
      dq = torch.empty_like(q)
      dk = torch.empty_like(k)
      dv = torch.empty_like(v)
      # grouped views: [total, hkv, group, d] and [hkv, group, total] are
      # the same memory as [total, hq, d] and [hq, total].
      segs = self._segs(q_seg, k_seg) if q_seg is not None else ()
      kflags = k.new_empty((s.hkv, s.b * s.sk), dtype=torch.int32)
      qflags = aux.new_empty(aux.shape, dtype=torch.int32)
      rows = (cu_q, cu_k, q, k, v, dout, aux, delta, *segs)
      self._launch("fold_flash_backward_dkdv", *rows, dk, dv, kflags,
                   stream=stream)
      self._launch("fold_flash_backward_dkdv_contain", *rows, kflags, dk, dv,
                   dk, dv, stream=stream)
      self._launch("fold_flash_backward_dq", *rows, dq, qflags,
                   stream=stream)
      self._launch("fold_flash_backward_dq_contain", *rows, qflags, dq, dq,
                   stream=stream)
      dsinks = None
      if sinks is not None:
        # A row that saw no key with a -inf sink has a non-finite LSE:
        # P_sink = 0 there, not exp2(-inf - -inf) = NaN.
        p_sink = torch.exp2(sinks.detach().float()[:, None] * LOG2E - aux)
        p_sink = torch.where(torch.isfinite(aux), p_sink, 0.0)
        dsinks = -(p_sink * delta).sum(dim=1)
    return dq, dk, dv, dsinks


# ----------------------------------------------------------------------------
# DeBERTa disentangled attention, inference forward
# ----------------------------------------------------------------------------
