"""Where GPU time goes: per-kernel CUDA times of one workload, for JAX and
torch alike (torch.profiler's CUPTI trace sees every kernel of the process,
XLA's included).

    python -m benchmarks.gpu_profile deberta --point fwd-b16-l512
    python -m benchmarks.gpu_profile deberta --point train-b2-l2048 --impls fold_jax
    python -m benchmarks.gpu_profile llama --impls fold,sdpa,sdpa_flash

Prints, per implementation: host wall time per call, the sum of kernel
times per call (the gap is host-bound time), and the kernels that take the
most time. Writes the same as JSON with --output.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time


def _profile(fn, calls: int, top: int) -> dict:
  import torch
  from torch.profiler import ProfilerActivity, profile
  fn()
  torch.cuda.synchronize()
  fn()
  torch.cuda.synchronize()
  t = time.perf_counter()
  for _ in range(calls):
    fn()
  torch.cuda.synchronize()
  wall = (time.perf_counter() - t) / calls
  # Host time: each call's return with the GPU idle at its start (the host
  # enqueues while the GPU runs behind; wall - host ~ GPU-bound time).
  host = []
  for _ in range(calls):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host.append(time.perf_counter() - t)
  torch.cuda.synchronize()
  with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(calls):
      fn()
    torch.cuda.synchronize()
  per = collections.Counter()
  count = collections.Counter()
  for ev in prof.events():
    if ev.device_type.name != "CUDA":
      continue
    name = ev.name[:90]
    per[name] += ev.device_time_total if hasattr(ev, "device_time_total") \
        else ev.cuda_time_total
    count[name] += 1
  total = sum(per.values()) / calls
  rows = [dict(kernel=n, us_per_call=round(v / calls, 1),
               launches_per_call=round(count[n] / calls, 2),
               share=round(v / calls / total, 3) if total else None)
          for n, v in per.most_common(top)]
  return dict(wall_ms=round(wall * 1e3, 3), kernel_ms=round(total / 1e3, 3),
              host_ms=round(sorted(host)[len(host) // 2] * 1e3, 3),
              launches_per_call=round(sum(count.values()) / calls, 1),
              top=rows)


def _cprofile(fn, calls: int, top: int) -> list:
  """Host time by Python function over `calls` calls (cProfile: the main
  thread only), the top by own time and the top by cumulative time."""
  import cProfile
  import pstats
  import torch
  sync = torch.cuda.synchronize if torch.cuda.is_available() else (
      lambda: None)
  fn()
  sync()
  prof = cProfile.Profile()
  prof.enable()
  for _ in range(calls):
    fn()
  prof.disable()
  sync()
  st = pstats.Stats(prof)
  rows = []
  for key, (cc, nc, tt, ct, _) in st.stats.items():
    file, line, name = key
    rows.append(dict(fn=f"{file.split('site-packages/')[-1][-60:]}:{line}"
                        f"({name})", calls_per=round(nc / calls, 1),
                     own_us=round(tt / calls * 1e6, 1),
                     cum_us=round(ct / calls * 1e6, 1)))
  own = sorted(rows, key=lambda r: -r["own_us"])[:top]
  cum = sorted(rows, key=lambda r: -r["cum_us"])[:top * 2]
  print(f"   cProfile, {calls} calls: top by own time (us per call)")
  for r in own:
    print(f"     {r['own_us']:9.1f} own {r['cum_us']:9.1f} cum "
          f"x{r['calls_per']:<6} {r['fn']}")
  print("   top by cumulative time")
  for r in cum:
    print(f"     {r['cum_us']:9.1f} cum {r['own_us']:9.1f} own "
          f"x{r['calls_per']:<6} {r['fn']}")
  return dict(own=own, cum=cum)


def _deberta(args) -> dict:
  import torch
  from benchmarks import deberta as D
  ns = D.build_parser().parse_args(["--output", "/dev/null", "--quick"])
  s = D.Suite(ns, [])
  point = {p.name: p for p in D.GPU_POINTS}[args.point]
  out = {}
  for impl in args.impls.split(","):
    try:
      with _deberta_fn(s, point, impl, args.dump_hlo) as fn, (
          torch.no_grad() if point.mode == "fwd" else
          contextlib.nullcontext()):
        out[impl] = _profile(fn, args.calls, args.top)
    except Exception as e:  # noqa: BLE001
      out[impl] = dict(error=repr(e)[:300])
      continue
    if args.cprofile:
      with _deberta_fn(s, point, impl) as fn, (
          torch.no_grad() if point.mode == "fwd" else
          contextlib.nullcontext()):
        out[impl]["cprofile"] = _cprofile(fn, args.cprofile, args.top)
    print(f"== {impl} {point.label}: wall {out[impl]['wall_ms']} ms, kernels "
          f"{out[impl]['kernel_ms']} ms, {out[impl]['launches_per_call']} "
          "launches", flush=True)
    for r in out[impl]["top"]:
      print(f"   {r['us_per_call']:9.1f} us  x{r['launches_per_call']:<6} "
            f"{r['kernel']}")
  return out


def _bridge(args) -> dict:
  """Host time of a bridge forward+backward (B1 H16 S128 D128 bf16 causal):
  wall time of each part over many calls, then a torch.profiler CPU trace
  with Python frames (the autograd engine's share shows up there)."""
  import statistics
  import torch
  from torch.profiler import ProfilerActivity, profile
  import torch_bridge as tb
  dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
  sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
  shape = (1, args.seq, 16, 128)
  q, k, v = (torch.randn(shape, device=dev, dtype=torch.bfloat16,
                         requires_grad=True) for _ in range(3))
  do = torch.randn(shape, device=dev, dtype=torch.bfloat16)
  parts = collections.defaultdict(list)

  def call():
    t0 = time.perf_counter()
    out = tb.fold_attn_func(q, k, v, causal=True)
    t1 = time.perf_counter()
    g = torch.autograd.grad(out, (q, k, v), do)
    t2 = time.perf_counter()
    sync()
    t3 = time.perf_counter()
    parts["forward_call"].append(t1 - t0)
    parts["autograd_grad_call"].append(t2 - t1)
    parts["sync"].append(t3 - t2)
    return g

  res_steps = _bridge_step_timers(q, k, v, do, call, args)
  for _ in range(20):
    call()
  parts.clear()
  for _ in range(args.calls * 40):
    call()
  res = {k: round(statistics.median(v) * 1e6, 1) for k, v in parts.items()}
  print("bridge fwd+bwd parts (median us):", res, flush=True)
  acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type ==
                                   "cuda" else [])
  with profile(activities=acts,
               with_stack=True) as prof:
    for _ in range(args.calls * 4):
      call()
  n = args.calls * 4
  rows = []
  for e in sorted(prof.key_averages(group_by_stack_n=0),
                  key=lambda e: -e.cpu_time_total)[:args.top * 2]:
    rows.append(dict(name=e.key[:100], cpu_us_per_call=round(
        e.cpu_time_total / n, 1), self_cpu_us_per_call=round(
        e.self_cpu_time_total / n, 1), count_per_call=round(e.count / n, 2)))
    print(f"   {rows[-1]['cpu_us_per_call']:9.1f} us total "
          f"{rows[-1]['self_cpu_us_per_call']:9.1f} self  "
          f"x{rows[-1]['count_per_call']:<5} {rows[-1]['name']}")
  return dict(parts_us=res, steps_us=res_steps, cpu_profile=rows)


def _bridge_step_timers(q, k, v, do, call, args) -> dict:
  """Medians (us) of the bridge's steps, per thread (main: forward; other:
  autograd's device thread, backward), plus the backward body called on the
  main thread."""
  import statistics
  import threading
  import torch
  from torch_bridge import _runtime as rt
  from torch_bridge import attention as A
  rec = collections.defaultdict(list)

  def where():
    return "main" if threading.current_thread() is threading.main_thread() \
        else "autograd"

  def timed(name, fn):
    def w(*a, **kw):
      t = time.perf_counter()
      try:
        return fn(*a, **kw)
      finally:
        rec[f"{where()}:{name}"].append(time.perf_counter() - t)
    return w

  orig = dict(imp_init=rt.Importer.__init__, imp_call=rt.Importer.__call__,
              export=rt.export, fwd_impl=A._fwd_impl, bwd_impl=A._bwd_impl)
  sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
  static = A._dense_static(q, causal=True)  # what call()'s plan uses
  call()
  plans = list(A._plans.values())
  saved = [(p_.fwd, p_.bwd) for p_ in plans]
  out = {}
  try:
    rt.Importer.__init__ = timed("importer_init", orig["imp_init"])
    rt.Importer.__call__ = timed("import_one", orig["imp_call"])
    rt.export = timed("export", orig["export"])
    A._fwd_impl = timed("fwd_impl", orig["fwd_impl"])
    A._bwd_impl = timed("bwd_impl", orig["bwd_impl"])
    for p_, (pf, pb) in zip(plans, saved):
      p_.fwd = timed("jax_fwd_dispatch", pf)
      p_.bwd = timed("jax_bwd_dispatch", pb)
    for _ in range(10):
      call()
    rec.clear()
    for _ in range(args.calls * 40):
      call()
    (o, l, a), kept = orig["fwd_impl"](q.detach(), k.detach(), v.detach(),
                                       None, None, None, None, None, static,
                                       keep=True, aux_tensor=False)
    sync()
    for _ in range(args.calls * 40):
      A._bwd_impl(do, None, q, k, v, None, None, None, None, None, o, l, a,
                  static, kept=kept, ds_tensor=False)
      sync()
    out = {n: round(statistics.median(x) * 1e6, 1)
           for n, x in sorted(rec.items())}
    print("bridge steps (median us):", out, flush=True)
  finally:
    rt.Importer.__init__ = orig["imp_init"]
    rt.Importer.__call__ = orig["imp_call"]
    rt.export = orig["export"]
    A._fwd_impl, A._bwd_impl = orig["fwd_impl"], orig["bwd_impl"]
    for p_, (pf, pb) in zip(plans, saved):
      p_.fwd, p_.bwd = pf, pb
  return out


def _llama(args) -> dict:
  """One training step (forward, backward, fused AdamW) of the Llama model of
  benchmarks/bridge.py (hidden 1024, 8 layers, 16 heads / 4 kv, B4 S2048,
  bf16) per attn_implementation."""
  import copy
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel
  from benchmarks.bridge import LLAMA_GPU as c
  from benchmarks.bridge import llama_model
  base = llama_model(c, "cuda", torch.bfloat16)
  ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device="cuda")
  out = {}
  for impl in args.impls.split(","):
    m = copy.deepcopy(base)
    # "sdpa_flash": SDPA with torch's flash backend forced, as the bridge
    # suite's Llama step runs it.
    m.set_attn_implementation("sdpa" if impl == "sdpa_flash" else impl)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5, fused=True)

    def step():
      m.zero_grad(set_to_none=True)
      with (sdpa_kernel([SDPBackend.FLASH_ATTENTION]) if impl == "sdpa_flash"
            else contextlib.nullcontext()):
        m(input_ids=ids, labels=ids).loss.backward()
      opt.step()
    try:
      out[impl] = _profile(step, args.calls, args.top)
    except Exception as e:  # noqa: BLE001
      out[impl] = dict(error=repr(e)[:300])
      continue
    finally:
      del m, opt
    print(f"== llama {impl} train step: wall {out[impl]['wall_ms']} ms, "
          f"kernels {out[impl]['kernel_ms']} ms, host {out[impl]['host_ms']} ms, "
          f"{out[impl]['launches_per_call']} launches", flush=True)
    for r in out[impl]["top"]:
      print(f"   {r['us_per_call']:9.1f} us  x{r['launches_per_call']:<6} "
            f"{r['kernel']}")
  return out


@contextlib.contextmanager
def _deberta_fn(s, point, impl, dump_hlo=None):
  """Yields one call of `impl` at `point`, with the models, inputs and
  training steps of benchmarks/deberta.py."""
  import jax
  from benchmarks import deberta as D
  if impl in ("fold_jax",) + D.TRAIN_ONLY:
    model, params = s.jax_model(
        s.jax_dtype(point), remat={"fold_jax_remat": True,
                                   "fold_jax_ffn": "ffn"}.get(impl, False))
    ids, mask = s.jax_inputs(point)
    if point.mode == "fwd":
      f = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m))
      if dump_hlo:
        with open(dump_hlo, "w") as fh:
          fh.write(f.lower(params, ids, mask).compile().as_text())
      yield lambda: jax.block_until_ready(f(params, ids, mask))
      return
    step = jax.jit(D.jax_train_step(model))  # not donated: same params
    rng = jax.random.key(0)
    yield lambda: jax.block_until_ready(step(params, ids, mask, rng))
    return
  ids, mask, _ = s.inputs(point)
  dtype = s.torch_dtype(point)
  with contextlib.ExitStack() as stack:
    if impl == "disentangled_flash":
      m = s.df(dtype, train=point.mode == "train")
      if isinstance(m, Exception):
        raise m
      if point.mode == "fwd":
        m.encoder.activate_shape(point.L)
    elif impl == "fold_torch":
      m = stack.enter_context(s.fold_torch(dtype))
    elif impl == "hf_eager":
      m = s.hf(dtype)
    else:
      raise ValueError(impl)
    if point.mode == "fwd":
      yield lambda: m(input_ids=ids, attention_mask=mask).last_hidden_state
      return
    m.train()

    def train_step():
      h = m(input_ids=ids, attention_mask=mask).last_hidden_state
      h.float().square().mean().backward()
    try:
      yield train_step
    finally:
      m.eval()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("workload", choices=["deberta", "bridge", "llama"])
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--dump-hlo", default=None,
                 help="deberta fold_jax forward: write the optimised HLO here")
  p.add_argument("--point", default="fwd-b16-l512")
  p.add_argument("--impls", default="fold_jax,disentangled_flash,fold_torch",
                 help="of fold_jax, fold_jax_ffn, fold_jax_remat, fold_torch, "
                      "disentangled_flash, hf_eager")
  p.add_argument("--calls", type=int, default=5)
  p.add_argument("--cprofile", type=int, default=0,
                 help="deberta: also this many calls under cProfile "
                      "(host time by Python function)")
  p.add_argument("--top", type=int, default=18)
  p.add_argument("--output", default=None)
  a = p.parse_args(argv)
  r = {"deberta": _deberta, "bridge": _bridge, "llama": _llama}[a.workload](a)
  if a.output:
    with open(a.output, "w") as f:
      json.dump(dict(workload=a.workload, point=a.point, results=r), f,
                indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
