"""Per-call overhead of the bridge: bridge time minus the JAX call alone.

    python -m benchmarks.bridge_calls                # B1 H16 S128 D128 and S4096
    python -m benchmarks.bridge_calls --seq 128 --iters 500 --dtype bfloat16
    python -m benchmarks.bridge_calls --seq 128 --phases   # + fwd+bwd breakdown
    python -m benchmarks.bridge_calls --seq 4096 --pipeline  # which step blocks
    python -m benchmarks.bridge_calls --seq 128 --direct-phases  # direct launch
    python -m benchmarks.bridge_calls --seq 128 4096 --graphs  # in CUDA graphs

"JAX alone" calls the very jitted function the bridge calls, on JAX arrays
that already live on the device (what a JAX user pays); "bridge" calls
`torch_bridge.fold_attn_func` on torch tensors (validation, backend choice,
DLPack import with the stream hand-off, the same JAX call, DLPack export).
Forward only, and forward+backward (autograd), causal. On the GPU both are
timed as the median of `iters` wall-clock calls each followed by a device
synchronisation, so that the numbers include launch and hand-off latency;
the overhead is the difference of the medians. Components (import, export,
stream hand-off) are timed alone as well.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import torch

import torch_bridge as tb
from torch_bridge import _runtime as rt
from torch_bridge import attention as A


def _sync(device):
  if device.type == "cuda":
    torch.cuda.synchronize(device)


def _median_us(fn, iters, device, warmup=10):
  for _ in range(warmup):
    fn()
  _sync(device)
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    _sync(device)
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e6


def overhead(batch=1, heads=16, seq=128, head_dim=128, dtype=None,
             device=None, iters=200, causal=True, phases=False,
             pipeline=False, direct_phases=False, profile=0,
             graphs=False) -> dict:
  import jax
  if device is None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  device = torch.device(device)
  if dtype is None:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
  g = torch.Generator(device=device).manual_seed(0)
  shape = (batch, seq, heads, head_dim)
  q, k, v = (torch.randn(shape, device=device, dtype=dtype, generator=g)
             for _ in range(3))
  do = torch.randn(shape, device=device, dtype=dtype, generator=g)
  static = A._dense_static(q, causal)
  be = static[0]
  plan = A._plan(static, q.device, q.dtype)
  target = plan.target
  imp = rt.Importer(target)
  qj, kj, vj, doj = (imp(x) for x in (q, k, v, do))
  qj, kj, vj, doj = (jax.device_put(x, target.jax_device) + 0
                     for x in (qj, kj, vj, doj))  # JAX-owned copies
  _sync(device)

  def jax_fwd():
    return jax.block_until_ready(plan.fwd(qj, kj, vj, None, None, None, None,
                                          None))

  out_j, lse_j, aux_j = jax_fwd()

  def jax_fwd_bwd():
    o, l, a = plan.fwd(qj, kj, vj, None, None, None, None, None)
    return jax.block_until_ready(plan.bwd(qj, kj, vj, None, None, None, None,
                                          None, o, l, a, doj, None))

  def bridge_fwd():
    return tb.fold_attn_func(q, k, v, causal=causal)

  qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

  def bridge_fwd_bwd():
    out = tb.fold_attn_func(qg, kg, vg, causal=causal)
    return torch.autograd.grad(out, (qg, kg, vg), do)

  def import_only():
    i = rt.Importer(target)
    return i(q), i(k), i(v)

  def export_only():
    return rt.export((out_j, lse_j), target)

  r = {"device": str(device), "backend": be, "dtype": str(dtype),
       "shape": list(shape), "iters": iters}
  r["jax_fwd_us"] = _median_us(jax_fwd, iters, device)
  r["bridge_fwd_us"] = _median_us(bridge_fwd, iters, device)
  r["jax_fwd_bwd_us"] = _median_us(jax_fwd_bwd, iters, device)
  r["bridge_fwd_bwd_us"] = _median_us(bridge_fwd_bwd, iters, device)
  r["import3_us"] = _median_us(import_only, iters, device)
  r["export2_us"] = _median_us(export_only, iters, device)
  if direct_phases:
    r.update(_direct_phases(q, k, v, do, qg, kg, vg, static, iters, device,
                            bridge_fwd_bwd))
    r.update(_timeline(qg, kg, vg, do, static, iters, device))
  if graphs:
    if device.type != "cuda":
      raise ValueError(f"--graphs needs a CUDA device; got {device}.")
    r.update(_graphs(q, k, v, do, causal, iters, device))
  if profile:
    _profile(bridge_fwd_bwd, profile, device)
  if phases:
    # The JAX path's steps: the direct launch (dense on CUDA) is off here.
    with _launch_mode("jax"):
      r.update(_host_steps(plan, target, q, out_j, static, iters, device))
      r.update(_phases(plan, target, q, k, v, do, qg, kg, vg, doj, static,
                       causal, iters, device, bridge_fwd_bwd))
  if pipeline:
    r.update(_pipeline(plan, target, q, k, v, qg, kg, vg, do, static, causal,
                       iters, device))
  r["overhead_us"] = r["bridge_fwd_us"] - r["jax_fwd_us"]
  r["overhead_fwd_bwd_us"] = r["bridge_fwd_bwd_us"] - r["jax_fwd_bwd_us"]
  r["ratio_fwd"] = r["bridge_fwd_us"] / r["jax_fwd_us"]
  r["ratio_fwd_bwd"] = r["bridge_fwd_bwd_us"] / r["jax_fwd_bwd_us"]
  return r


@contextlib.contextmanager
def _launch_mode(mode: str):
  old = os.environ.get("FOLDAX_TORCH_LAUNCH")
  os.environ["FOLDAX_TORCH_LAUNCH"] = mode
  try:
    yield
  finally:
    if old is None:
      del os.environ["FOLDAX_TORCH_LAUNCH"]
    else:
      os.environ["FOLDAX_TORCH_LAUNCH"] = old


def _profile(fn, iters: int, device) -> None:
  """Prints where the host time of `iters` calls of fn goes (cProfile, the
  30 costliest functions by own time and by cumulative time)."""
  import cProfile
  import pstats
  for _ in range(10):
    fn()
  _sync(device)
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(iters):
    fn()
  _sync(device)
  prof.disable()
  st = pstats.Stats(prof, stream=sys.stdout)
  print(f"--- profile of {iters} bridge forward+backward calls", flush=True)
  st.sort_stats("tottime").print_stats(30)
  st.sort_stats("cumulative").print_stats(30)


class _Identity(torch.autograd.Function):
  """A custom Function that does nothing: what autograd alone costs."""

  @staticmethod
  def forward(ctx, x):
    return x.view_as(x)

  @staticmethod
  def backward(ctx, g):
    return g


def _direct_phases(q, k, v, do, qg, kg, vg, static, iters, device,
                   bridge_fwd_bwd) -> dict:
  """Where a direct-launch forward+backward's time goes (--direct-phases):
  the forward and the backward body called alone (no autograd), and
  `torch.autograd.grad` through a custom Function that does nothing, on
  tensors of the same shape."""
  from torch_bridge import _direct
  r = {}
  if not _direct.eligible(static, q, k, None, None, None):
    r["direct"] = "not eligible (CPU tensors, varlen, or switched off)"
    return r
  plan = _direct.plan(static, q, k, None)
  out, _, aux = plan.forward(q, k, v, None, need_lse=False)
  r["direct_fwd_us"] = _median_us(
      lambda: plan.forward(q, k, v, None, need_lse=False), iters, device)
  r["direct_fwd_lse_us"] = _median_us(
      lambda: plan.forward(q, k, v, None, need_lse=True), iters, device)
  r["direct_bwd_body_us"] = _median_us(
      lambda: plan.backward(q, k, v, None, out, aux, do, None), iters,
      device)
  r["autograd_noop_us"] = _median_us(
      lambda: torch.autograd.grad(_Identity.apply(qg), (qg,), do), iters,
      device)
  r["autograd_noop3_us"] = _median_us(
      lambda: torch.autograd.grad(
          _Identity.apply(qg) + _Identity.apply(kg) + _Identity.apply(vg),
          (qg, kg, vg), do), iters, device)
  r["bridge_fwd_bwd_again_us"] = _median_us(bridge_fwd_bwd, iters, device)
  return r


def _host_steps(plan, target, q, out_j, static, iters, device) -> dict:
  """Host cost of each step of a bridge call (--phases), back to back
  without device synchronisation (mean per call, µs): what to trim."""
  jax_mod = rt._jax_internal()
  dev, dl_type = target.jax_device, target.dl_type
  stream = rt.Importer(target).stream

  def mean_us(fn, n=iters):
    for _ in range(5):
      fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
      fn()
    dt = time.perf_counter() - t0
    _sync(device)
    return round(dt / n * 1e6, 2)

  r = {}
  steps = {
      "importer_init": lambda: rt.Importer(target),
      "get_external_stream": (
          (lambda: dev.get_stream_for_external_ready_events())
          if target.cuda else None),
      "detach": lambda: q.detach(),
      "to_dlpack": lambda: rt._TO_DLPACK(q),
      "import_one_stream": lambda: jax_mod.dlpack_managed_tensor_to_buffer(
          rt._TO_DLPACK(q), dev, stream, None, dl_type),
      "import_one_no_stream": lambda: jax_mod.dlpack_managed_tensor_to_buffer(
          rt._TO_DLPACK(q), dev, None, None, dl_type),
      "export_one": lambda: rt.export([out_j], target),
      "plan_lookup": lambda: A._plan(static, q.device, q.dtype),
      "current_raw_stream": ((lambda: rt._current_raw_stream(target))
                             if target.cuda else None),
  }
  for name, fn in steps.items():
    if fn is None:
      continue
    try:
      r[f"step_{name}_us"] = mean_us(fn)
    except Exception as e:  # noqa: BLE001
      r[f"step_{name}_us"] = repr(e)[:120]
  return r


def _phases(plan, target, q, k, v, do, qg, kg, vg, doj, static, causal, iters,
            device, bridge_fwd_bwd) -> dict:
  """Where a forward+backward's extra time goes (--phases): the forward with
  grad alone, the backward body without autograd on this thread and on a
  helper thread (autograd runs CUDA backwards on its device thread), the JAX
  backward alone, the gradients' export, and the whole call with the old
  `.detach()`ed imports and with a short GIL switch interval (both probe GIL
  hand-offs to PJRT's callback threads)."""
  import queue
  import sys
  import threading

  import jax
  r = {}
  r["bridge_fwd_grad_us"] = _median_us(
      lambda: tb.fold_attn_func(qg, kg, vg, causal=causal), iters, device)
  (o, l, a), kept = A._fwd_impl(q, k, v, None, None, None, None, None, static,
                                keep=True, aux_tensor=False)

  def bwd_body():
    return A._bwd_impl(do, None, q, k, v, None, None, None, None, None, o, l,
                       a, static, kept=kept, ds_tensor=False)

  r["bwd_body_us"] = _median_us(bwd_body, iters, device)
  ins, res = kept
  jdo = rt.Importer(target)(do)

  def jax_bwd():
    g = plan.bwd(*ins, *res, jdo, None)
    if device.type != "cuda":
      jax.block_until_ready(g)
    return g

  r["jax_bwd_on_bridge_arrays_us"] = _median_us(jax_bwd, iters, device)
  grads = jax.block_until_ready(plan.bwd(*ins, *res, jdo, None))
  r["export3_us"] = _median_us(lambda: rt.export(grads, target), iters,
                               device)
  jobs, done = queue.Queue(), queue.Queue()
  cuda_idx = torch.cuda.current_device() if device.type == "cuda" else None

  def worker():
    if cuda_idx is not None:
      torch.cuda.set_device(cuda_idx)
    while True:
      fn = jobs.get()
      if fn is None:
        return
      done.put(fn())

  th = threading.Thread(target=worker, daemon=True)
  th.start()
  try:
    def on_thread():
      jobs.put(bwd_body)
      return done.get()
    r["bwd_body_on_thread_us"] = _median_us(on_thread, iters, device)
    r["thread_roundtrip_us"] = _median_us(
        lambda: (jobs.put(lambda: None), done.get()), iters, device)
  finally:
    jobs.put(None)
    th.join()
  old = rt.DETACH_INPUTS
  rt.DETACH_INPUTS = not old
  try:
    key = ("bridge_fwd_bwd_undetached_imports_us" if old else
           "bridge_fwd_bwd_detached_imports_us")
    r[key] = _median_us(bridge_fwd_bwd, iters, device)
  finally:
    rt.DETACH_INPUTS = old
  sw = sys.getswitchinterval()
  sys.setswitchinterval(2e-5)
  try:
    r["bridge_fwd_bwd_switch20us_us"] = _median_us(bridge_fwd_bwd, iters,
                                                   device)
  finally:
    sys.setswitchinterval(sw)
  r["bridge_fwd_bwd_again_us"] = _median_us(bridge_fwd_bwd, iters, device)
  return r


def _timeline(qg, kg, vg, do, static, iters, device) -> dict:
  """Medians (µs) of the stages of one eager forward+backward through the
  bridge's autograd.Function, each call synchronised first: the forward
  call, autograd's hand-off to the backward (autograd.grad's entry to
  backward()'s), the backward body, and the hand-back to the caller."""
  marks = {}
  orig = A._EagerAttn.backward

  def backward(ctx, *grads):
    marks["bwd_in"] = time.perf_counter()
    res = orig(ctx, *grads)
    marks["bwd_out"] = time.perf_counter()
    return res

  stages = {"t_forward": [], "t_handoff": [], "t_backward": [],
            "t_handback": []}
  A._EagerAttn.backward = staticmethod(backward)
  try:
    for i in range(iters + 10):
      _sync(device)
      t0 = time.perf_counter()
      out = A._call(qg, kg, vg, None, None, None, None, None, static, False)[0]
      t1 = time.perf_counter()
      torch.autograd.grad(out, (qg, kg, vg), do)
      t2 = time.perf_counter()
      if i >= 10:
        for k, v in (("t_forward", t1 - t0),
                     ("t_handoff", marks["bwd_in"] - t1),
                     ("t_backward", marks["bwd_out"] - marks["bwd_in"]),
                     ("t_handback", t2 - marks["bwd_out"])):
          stages[k].append(v)
  finally:
    A._EagerAttn.backward = orig
  return {f"{k}_us": statistics.median(v) * 1e6 for k, v in stages.items()}


def _pipeline(plan, target, q, k, v, qg, kg, vg, do, static, causal, n,
              device) -> dict:
  """Back-to-back calls without synchronisation (--pipeline): for each
  prefix of a bridge call, the host time per call of a loop of `n` calls
  (`host_us`) and the time until the device finished them (`total_us`). A
  step that waits for the GPU shows as host_us ~ total_us (the host never
  runs ahead); one that does not, as host_us << total_us once the kernels
  are long enough."""
  def imports():
    imp = rt.Importer(target)
    return (imp(q), imp(k), imp(v), None, None, None, None, None)

  def call():
    return plan.fwd(*imports())

  graveyard = []

  def call_keep_inputs():  # imported arrays outlive the loop (no deletion)
    ins = imports()
    graveyard.append(ins)
    return plan.fwd(*ins)

  variants = {
      "jax_only": None,  # filled below: JAX arrays, no torch
      "import3": imports,
      "import3_call": call,
      "import3_call_keep_inputs": call_keep_inputs,
      "import3_call_export_out": lambda: rt.export(call()[:1], target),
      "import3_call_export_all": lambda: rt.export(call(), target),
      "bridge_fwd": lambda: tb.fold_attn_func(q, k, v, causal=causal),
      "bridge_fwd_bwd": lambda: torch.autograd.grad(
          tb.fold_attn_func(qg, kg, vg, causal=causal), (qg, kg, vg), do),
  }
  import jax
  ja = [jax.device_put(x, target.jax_device) + 0 for x in imports()[:3]]
  variants["jax_only"] = lambda: plan.fwd(*ja, None, None, None, None, None)
  r = {}
  for name, fn in variants.items():
    for _ in range(3):
      fn()
    _sync(device)
    jax.effects_barrier()
    t0 = time.perf_counter()
    for _ in range(n):
      res = fn()
    t1 = time.perf_counter()
    _sync(device)
    if name.startswith(("jax", "import3_call")) and \
        not name.endswith(("out", "all")):
      jax.block_until_ready(res)
    t2 = time.perf_counter()
    graveyard.clear()
    r[f"pipe_{name}_host_us"] = round((t1 - t0) / n * 1e6, 1)
    r[f"pipe_{name}_total_us"] = round((t2 - t0) / n * 1e6, 1)
  return r


def _graphs(q, k, v, do, causal, iters, device) -> dict:
  """The bridge inside CUDA graphs (the direct launch records on torch's
  stream): the forward alone and a whole forward+backward step captured
  with torch.cuda.graph, replayed; each replay timed with a synchronisation
  like the other figures. Also whether a replay gives the eager call's
  bits."""
  qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

  def fwd():
    with torch.no_grad():
      return tb.fold_attn_func(qg, kg, vg, causal=causal)

  def step():
    out = tb.fold_attn_func(qg, kg, vg, causal=causal)
    out.backward(do)
    return out

  side = torch.cuda.Stream(device)
  side.wait_stream(torch.cuda.current_stream(device))
  with torch.cuda.stream(side):  # warm-up off the capture's stream
    for _ in range(3):
      fwd()
      step()
  torch.cuda.current_stream(device).wait_stream(side)
  for x in (qg, kg, vg):
    x.grad = None
  fwd_graph, step_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
  with torch.cuda.graph(fwd_graph):
    fwd()
  with torch.cuda.graph(step_graph):
    out = step()
  r = {"graph_fwd_us": _median_us(fwd_graph.replay, iters, device),
       "graph_fwd_bwd_us": _median_us(step_graph.replay, iters, device)}
  step_graph.replay()
  qe, ke, ve = (x.detach().clone().requires_grad_() for x in (q, k, v))
  oe = tb.fold_attn_func(qe, ke, ve, causal=causal)
  ge = torch.autograd.grad(oe, (qe, ke, ve), do)
  r["graph_bits_equal_eager"] = bool(
      torch.equal(out, oe) and all(torch.equal(a.grad, b)
                                   for a, b in zip((qg, kg, vg), ge)))
  return r


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seq", type=int, nargs="*", default=[128, 4096])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default=None)
  p.add_argument("--iters", type=int, default=200)
  p.add_argument("--device", default=None)
  p.add_argument("--phases", action="store_true",
                 help="also time the parts of a forward+backward")
  p.add_argument("--pipeline", action="store_true",
                 help="also find which step of a call waits for the GPU")
  p.add_argument("--profile", type=int, default=0, metavar="N",
                 help="cProfile N bridge forward+backward calls and print "
                      "the costliest functions")
  p.add_argument("--direct-phases", action="store_true",
                 help="also time the parts of a direct-launch call")
  p.add_argument("--graphs", action="store_true",
                 help="also time the forward and a forward+backward step "
                      "captured in CUDA graphs (GPU)")
  a = p.parse_args(argv)
  dtype = getattr(torch, a.dtype) if a.dtype else None
  for s in a.seq:
    r = overhead(a.batch, a.heads, s, a.head_dim, dtype, a.device, a.iters,
                 phases=a.phases, pipeline=a.pipeline,
                 direct_phases=a.direct_phases, profile=a.profile,
                 graphs=a.graphs)
    print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v)
                      for k, v in r.items()}))


if __name__ == "__main__":
  main()
