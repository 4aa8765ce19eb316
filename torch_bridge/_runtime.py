"""Process-level plumbing of the bridge: JAX's GPU allocator, the backend
choice per torch device, and the DLPack hand-off with stream ordering.

Imported by `torch_bridge/__init__.py` before anything imports JAX's backends.

Allocator
---------
JAX preallocates 75% of every GPU when its GPU backend starts
(`XLA_PYTHON_CLIENT_PREALLOCATE`, default true), which would leave torch a
quarter of the card. Unless the user set `XLA_PYTHON_CLIENT_PREALLOCATE`,
`XLA_PYTHON_CLIENT_MEM_FRACTION` or `XLA_PYTHON_CLIENT_ALLOCATOR` themselves,
importing the bridge sets `XLA_PYTHON_CLIENT_PREALLOCATE=false`: JAX's BFC
allocator then grows on demand (up to the default 75% cap, shared with
torch's caching allocator; memory JAX has taken stays in JAX's pool for reuse
by later JAX calls). Outputs of bridge calls live in JAX's pool and are
borrowed by torch through DLPack. If JAX's backends were already initialised
when the bridge was imported, the setting cannot take effect; the bridge
warns once (on GPU machines only) when that may have preallocated.

DLPack and streams (GPU)
------------------------
torch -> JAX: one CUDA event is recorded on torch's current stream and the
stream JAX uses for external buffers (`Device.get_stream_for_external_ready_
events()`, looked up once per device) waits on it (`cudaStreamWaitEvent`,
no host synchronisation); the
call's first tensor is then imported with that stream (PJRT records its
definition event there) and the others as ready, so every JAX computation
of the call, which starts after all of its inputs' definition events, is
ordered after the torch work that produced its inputs. One torch event and
one PJRT event per call instead of two per tensor (what
`jax.dlpack.from_dlpack` does through `torch.Tensor.__dlpack__(stream=...)`).

JAX -> torch: each output is exported with torch's current stream as the
consumer stream (`buffer_to_dlpack_managed_tensor(buf, stream=...)`), which
makes that stream wait for the output's ready event: again no host sync.

Lifetimes: an imported JAX array holds its DLPack capsule, and with it the
torch storage, until JAX's stream has finished with it (PJRT defers the
release of external buffers to the end of their usage events); torch tensors
made from JAX outputs hold the JAX buffers. A torch tensor that dies before
the JAX work is done returns its memory to torch's caching allocator, whose
reuse on torch's current stream is ordered after our wait on the outputs.
Imported buffers are never donated. Inputs are made contiguous only when
they are not, and exported as a `.detach()`ed alias (`DETACH_INPUTS`; the
alternative, handing over the caller's tensor itself, is kept switchable for
A/B timing because the alias's capsule deleter may need the GIL on a PJRT
thread; it is not yet measured on a GPU).

`FOLDAX_TORCH_DLPACK=protocol` switches to the public DLPack protocol
(`jax.dlpack.from_dlpack` / `torch.from_dlpack`, one event per tensor): the
fallback used automatically if JAX's low-level entry points are missing.

On CPU, JAX dispatches asynchronously: the bridge blocks until the outputs
are ready before handing them to torch (torch's CPU kernels run eagerly).
"""

from __future__ import annotations

import logging
import threading
import weakref

from torch_bridge import settings

log = logging.getLogger("torch_bridge")
_announced: set[str] = set()
_lock = threading.Lock()


def announce(msg: str) -> None:
  """Logs `msg` as a warning once per process."""
  with _lock:
    if msg in _announced:
      return
    _announced.add(msg)
  log.warning(msg)


def refuse_in_graph_capture(device, what: str) -> None:
  """Raises RuntimeError when torch's current stream is capturing a CUDA
  graph and this call would do `what`: work a graph of torch's stream cannot
  record (JAX's launches on its own streams, compiling, a blocking copy).
  Such work would run once, at capture, and never on replay, so replays
  would silently read stale buffers. `device`: the CUDA device, for the
  message (or None)."""
  import torch
  # No capture without an initialised CUDA context (and the query itself
  # fails on machines without a driver).
  if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
    on = "" if device is None else f" on {device}"
    raise RuntimeError(
        f"torch_bridge: {what} cannot be recorded in a CUDA graph (torch's "
        f"current stream{on} is capturing). Dense attention on the direct "
        "launch records into graphs once one eager call of the same shape "
        "has run outside the capture (a warm-up, as "
        "torch.cuda.make_graphed_callables does; it builds the kernels and "
        "constants); calls through JAX (varlen, the KV cache, DeBERTa "
        "training, FOLDAX_TORCH_LAUNCH=jax) cannot: keep them out of the "
        "graph.")


def warn_if_jax_initialised_early(set_by_us: bool) -> None:
  """Warns (once) if JAX's GPU backend started before the bridge could set
  its allocator: it may then hold 75% of the GPU."""
  import sys
  if not set_by_us or "jax" not in sys.modules:
    return
  try:
    from torch_bridge import compat
    initialised = compat.xla_bridge.backends_are_initialized()
  except Exception:  # pragma: no cover - private API moved
    return
  if not initialised:
    return
  import jax
  try:
    gpu = any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    gpu = False
  if gpu:
    announce(
        "torch_bridge: JAX's GPU backend was initialised before torch_bridge "
        "was imported, so XLA_PYTHON_CLIENT_PREALLOCATE=false came too late; "
        "JAX may have preallocated 75% of the GPU underneath torch. Import "
        "torch_bridge (or set XLA_PYTHON_CLIENT_PREALLOCATE=false) before "
        "using JAX.")


# ----------------------------------------------------------------------------
# Devices and backends
# ----------------------------------------------------------------------------

_derived: dict = {}


def derived(key: str, t, fn):
  """fn(t), recomputed only when `t` is another tensor or was modified in
  place since (one entry per key). An encoder hands every layer the same
  mask tensor: what each layer derives from it (dtype casts, lengths; a
  few small torch ops, host time on every call) is derived once. In-place
  changes through `.data` bypass the version counter: not for tensors
  written that way. Under torch.compile, fn(t) every time (traced)."""
  import torch
  if torch.compiler.is_compiling():
    return fn(t)
  hit = _derived.get(key)
  if hit is not None and hit[0]() is t and hit[1] == t._version:
    return hit[2]
  got = fn(t)
  _derived[key] = (weakref.ref(t), t._version, got)
  return got


class Target:
  """Where a call runs: the JAX device, how tensors travel, which backend."""

  __slots__ = ("torch_device", "jax_device", "backend", "host_copy",
               "cuda", "dl_type")

  def __init__(self, torch_device, jax_device, backend, host_copy):
    self.torch_device = torch_device
    self.jax_device = jax_device
    self.backend = backend
    self.host_copy = host_copy  # CUDA tensors through a CPU-only jaxlib
    self.cuda = torch_device.type == "cuda" and not host_copy
    self.dl_type = 2 if self.cuda else 1  # kDLCUDA / kDLCPU


_targets: dict = {}


def _jax_cuda_device(index: int):
  import jax
  from torch_bridge import compat
  try:
    backend = compat.xla_bridge.get_backend("cuda")
  except RuntimeError:
    return None
  try:
    return backend.device_from_local_hardware_id(index)
  except Exception:  # pragma: no cover
    devs = [d for d in jax.devices("cuda") if d.local_hardware_id == index]
    return devs[0] if devs else None


def target_for(device, dtype, backend: str = "auto") -> Target:
  """The Target of tensors on `device` with `dtype` (cached)."""
  key = (device.type, device.index, dtype, backend)
  t = _targets.get(key)
  if t is None:
    t = _make_target(device, dtype, backend)
    _targets[key] = t
  return t


def _make_target(device, dtype, backend: str) -> Target:
  import jax
  import torch
  if backend not in ("auto", "pallas", "interpret", "xla"):
    raise ValueError("backend must be one of ('auto', 'pallas', 'interpret', "
                     f"'xla'); got {backend!r}.")
  host_copy = False
  if device.type == "cuda":
    index = device.index if device.index is not None else \
        torch.cuda.current_device()
    jdev = _jax_cuda_device(index)
    if jdev is None:
      announce("torch_bridge: tensors are on CUDA but this jaxlib has no CUDA "
               "backend (pip install 'foldax[cuda]'); the bridge copies them "
               "to the host and runs the XLA path on CPU (slow).")
      jdev = jax.devices("cpu")[0]
      host_copy = True
      cc = None
    else:
      cc = torch.cuda.get_device_capability(index)
  elif device.type == "cpu":
    jdev = jax.devices("cpu")[0]
    cc = None
  else:
    raise ValueError(f"torch_bridge supports CPU and CUDA tensors; got a "
                     f"tensor on {device}.")
  if dtype == torch.float64:
    if backend in ("pallas", "interpret"):
      raise TypeError(f"backend={backend!r} supports bf16, fp16 and fp32; "
                      "float64 runs on the XLA path only (backend='xla' or "
                      "'auto').")
    return Target(device, jdev, "xla", host_copy)
  if backend == "auto":
    if cc is not None and cc >= (8, 0):
      backend = "pallas"
      announce(f"torch_bridge: attention runs the Pallas (Triton) kernel on "
               f"{device} (compute capability {cc[0]}.{cc[1]}).")
    else:
      why = ("the tensors are on the CPU" if device.type == "cpu" else
             "jaxlib has no CUDA backend" if cc is None else
             f"compute capability {cc[0]}.{cc[1]} < 8.0")
      announce(f"torch_bridge: attention runs JAX's XLA path ({why}); the "
               "Pallas kernel needs an NVIDIA GPU of compute capability 8.0+.")
      backend = "xla"
  elif backend == "pallas" and (cc is None or cc < (8, 0)):
    raise ValueError("backend='pallas' needs CUDA tensors on a GPU of compute "
                     f"capability 8.0+ and a CUDA jaxlib; got {device}.")
  return Target(device, jdev, backend, host_copy)


# ----------------------------------------------------------------------------
# DLPack hand-off
# ----------------------------------------------------------------------------

_low_level = settings.dlpack_low_level()
_cuda_sync: dict = {}  # device index -> (event, {jax stream ptr: ExternalStream})


_JAX = None


def _jax_internal():
  global _JAX
  if _JAX is None:
    from torch_bridge import compat
    _JAX = compat.jaxlib_internal
  return _JAX


_external_streams: dict = {}  # jax device -> its external-ready stream


def _order_jax_after_torch(target: Target):
  """Makes JAX's external-ready stream wait on torch's current stream;
  returns that stream (int) for the imports of this call."""
  import torch
  dev = target.torch_device
  idx = dev.index if dev.index is not None else torch.cuda.current_device()
  stream = _external_streams.get(target.jax_device)
  if stream is None:  # PJRT's dedicated stream: fixed per device
    stream = target.jax_device.get_stream_for_external_ready_events()
    _external_streams[target.jax_device] = stream
  entry = _cuda_sync.get(idx)
  if entry is None:
    entry = (torch.cuda.Event(), {})
    _cuda_sync[idx] = entry
  event, streams = entry
  ext = streams.get(stream)
  if ext is None:
    ext = torch.cuda.ExternalStream(stream, device=torch.device("cuda", idx))
    streams[stream] = ext
  event.record(torch.cuda.current_stream(idx))
  ext.wait_event(event)
  return stream


def _to_dlpack(t):
  return t.__dlpack__() if _TO_DLPACK is None else _TO_DLPACK(t)


try:  # the C entry points, without Tensor.__dlpack__'s / from_dlpack's
  # Python checks (`_to_dlpack` does not look at requires_grad; the capsule
  # holds the tensor's storage, not its graph use)
  from torch._C import _to_dlpack as _TO_DLPACK
except ImportError:  # pragma: no cover
  _TO_DLPACK = None
try:
  from torch._C import _from_dlpack as _FROM_DLPACK
except ImportError:  # pragma: no cover
  _FROM_DLPACK = None


# Whether imports wrap a `.detach()`ed alias of each tensor (the default, as
# the bridge's contract says). FOLDAX_TORCH_DETACH=0 (and `benchmarks.bridge_calls
# --phases`, which times both) hands over the caller's tensor itself, a
# candidate for lower host overhead not yet measured on a GPU: a fresh
# alias's Python object dies at once while the capsule still holds the
# alias, so torch "resurrects" it (C++ then owns the PyObject), and the
# capsule's deleter -- which PJRT runs on its own callback thread on GPU,
# after JAX's last use -- may then have to take the GIL to free it,
# contending with the caller and autograd's device thread once per tensor.
DETACH_INPUTS = settings.detach_inputs()


def _current_raw_stream(target: Target) -> int:
  """torch's current CUDA stream on the target's device, as a DLPack stream
  number (1: the legacy default stream)."""
  import torch
  dev = target.torch_device
  idx = dev.index if dev.index is not None else torch.cuda.current_device()
  try:
    raw = torch._C._cuda_getCurrentRawStream(idx)
  except AttributeError:  # pragma: no cover - older torch
    raw = torch.cuda.current_stream(dev).cuda_stream
  return raw or 1


class Importer:
  """Imports the torch tensors of one call into JAX (see module docs).

  One Importer per JAX computation, and the first tensor it imports must be
  one that computation reads (jit drops unused arguments, and with them the
  definition event that orders the call after torch's stream)."""

  __slots__ = ("target", "stream", "_dev", "_dl_type", "_fast",
               "_pending_stream")

  def __init__(self, target: Target):
    global _low_level
    self.target = target
    self.stream = None
    self._dev = target.jax_device
    self._dl_type = target.dl_type
    if target.cuda:
      refuse_in_graph_capture(target.torch_device,
                              "a call through JAX and DLPack")
    if target.cuda and _low_level:
      try:
        self.stream = _order_jax_after_torch(target)
      except Exception as e:  # pragma: no cover - GPU only
        _low_level = False
        announce(f"torch_bridge: fast CUDA stream hand-off unavailable ({e!r});"
                 " using the DLPack protocol (one event per tensor).")
    self._fast = (_low_level and _TO_DLPACK is not None and
                  not target.host_copy)
    self._pending_stream = self.stream

  def __call__(self, t):
    if t is None:
      return None
    if not t.is_contiguous():
      t = t.detach().contiguous()  # a copy (no autograd record)
    elif DETACH_INPUTS:
      t = t.detach()
    if self._fast and _low_level:
      # Only the call's first import carries the stream (PJRT records one
      # definition event for it, ~10 us on the H200); the rest import as
      # ready. XLA launches a computation after every input's definition
      # event, so that one event orders the whole call after the torch work
      # our stream hand-off waited for, which produced all of its inputs.
      stream, self._pending_stream = self._pending_stream, None
      try:
        return _jax_internal().dlpack_managed_tensor_to_buffer(
            _TO_DLPACK(t), self._dev, stream, None, self._dl_type)
      except Exception as e:
        self._pending_stream = stream
        return self._slow(t, e)
    return self._slow(t, None)

  def _slow(self, t, err):
    global _low_level
    t = t.detach()
    if self.target.host_copy:
      t = t.cpu()
    if err is None and _low_level:
      try:
        return _jax_internal().dlpack_managed_tensor_to_buffer(
            _to_dlpack(t), self.target.jax_device, self.stream, None,
            self.target.dl_type)
      except Exception as e:
        err = e
    if err is not None and self.target.cuda:  # pragma: no cover - GPU only
      _low_level = False
      announce(f"torch_bridge: low-level DLPack import failed ({err!r}); "
               "using the DLPack protocol.")
    # CPU: e.g. a misaligned buffer; the public path may copy.
    import jax
    return jax.dlpack.from_dlpack(t)


def export(arrays, target: Target):
  """JAX arrays -> torch tensors on the target device (None passes)."""
  global _low_level
  if not target.cuda:  # torch's CPU kernels run eagerly: wait for JAX
    for a in arrays:
      if a is not None:
        a.block_until_ready()
  stream = _current_raw_stream(target) if target.cuda else None
  to_dl = getattr(_jax_internal(), "buffer_to_dlpack_managed_tensor", None)
  out = []
  for a in arrays:
    if a is None:
      out.append(None)
      continue
    t = None
    if _low_level and to_dl is not None and _FROM_DLPACK is not None:
      try:
        t = _FROM_DLPACK(to_dl(a, stream=stream))
      except Exception as e:  # pragma: no cover
        _low_level = False
        announce(f"torch_bridge: low-level DLPack export failed ({e!r}); "
                 "using the DLPack protocol.")
    if t is None:
      import torch
      t = torch.from_dlpack(a)
    if target.host_copy:
      t = t.to(target.torch_device)
    out.append(t)
  return out
