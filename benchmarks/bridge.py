"""The torch-bridge suite: the acceptance benchmarks of `torch_bridge`.

    python -m benchmarks.run --suite bridge --output r.json      (the usual way)
    python -m benchmarks.bridge --output r.json [--smoke]        (standalone)

In order of importance, so that a run cut short keeps what matters (the
JSON is rewritten after every measurement):

1. Per-call overhead at B1 H16 S128 D128 bf16 causal, forward and
   forward+backward: `torch_bridge.fold_attn_func` on torch tensors
   ("bridge") against the very jitted JAX functions the bridge calls, on
   JAX-owned arrays ("jax_direct": what a JAX user pays, no torch).
   Target: bridge - JAX <= 25 us (a naive DLPack round trip: 213 us).
2. The same at S4096. Target: bridge / JAX <= 1.03.
3. A Llama-style model (transformers `LlamaConfig` built here, no
   downloads) trained with `attn_implementation="fold"`
   (`torch_bridge.hf.register()`) and with `"sdpa"` (torch's flash backend
   forced on CUDA): the time of one training step (forward + backward +
   fused AdamW, CUDA events, median over interleaved rounds after warm-up),
   and whether every parameter gradient is bitwise identical across three
   forward+backward runs from the same state (recorded for sdpa too).
   Targets: fold step time <= sdpa's; fold gradients bitwise repeatable.
4. Extras when the budget allows: torch SDPA (flash) on the attention
   shapes, the bridge's components (DLPack import, export), and
   `jax.jit(jax.vjp(jax_api.fold_attn_func))` at S4096 as a second "JAX
   directly" reference.

How the attention calls are timed (1, 2): in the same process, after
warm-up, with the garbage collector off, the bridge and JAX alternate in
rounds; every call is timed on the host (perf_counter) from before the call
until its results are complete: `torch.cuda.synchronize()` (the whole device,
so JAX's streams too) after a bridge call, `jax.block_until_ready` on the
outputs after a JAX call. The figure is the median over all calls; the
overhead is the difference of the medians (per-round differences are kept
to show the spread). A second, pipelined figure (`ms_pipelined`: batches of
back-to-back calls, one synchronisation per batch, median over rounds) shows
the cost in a loop that does not wait for each call: there host overhead
hides behind GPU time once the kernel is long enough. Targets' `met` uses
the per-call (synchronised) figures, `met_pipelined` the pipelined ones.
Read the two together: each side waits with its own framework's
synchronisation, and JAX's `block_until_ready` (a host callback) can be
slower than `torch.cuda.synchronize()` (a spin wait), which flatters the
bridge in the per-call figure; the pipelined figure has no per-call wait
(when the GPU idles between calls it is the extra host time per call). The
floors of both waits are recorded (components record: trivial JAX call,
trivial torch op).

On a machine without a CUDA GPU (or with --smoke) everything runs in a
small CPU configuration (tiny shapes, fp32, JAX's XLA path, a 2-layer
Llama), in seconds: the harness is tested, the numbers mean nothing.

Output (`benchmarks.run` keeps `metadata` and `records`):
  records: attention records (impl, B, Hq, Hkv, S, D, causal, dtype, mode
    "fwd" | "fwd+bwd", ms, ...; the bridge's carry overhead_us and ratio)
    and Llama records (model "llama", mode "train_step", impl "fold" |
    "sdpa", ms, tokens_per_s, grads_bitwise_repeatable, ...).
  metadata.targets: {name: {value, limit, met, ...}}, also printed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import sys
import time

from benchmarks import dense as D

OVERHEAD_LIMIT_US = 25.0  # per call at B1 H16 S128 D128 (the issue)
NAIVE_DLPACK_US = 213.0  # a naive DLPack round trip, as measured in the issue
RATIO_LIMIT = 1.03  # bridge / JAX at S4096
LLAMA_GPU = dict(vocab=32000, hidden=1024, intermediate=2816, layers=8,
                 heads=16, kv_heads=4, seq=2048, batch=4)
LLAMA_CPU = dict(vocab=128, hidden=64, intermediate=128, layers=2, heads=4,
                 kv_heads=2, seq=64, batch=2)


class Suite:
  """Settings, the records so far, and the incremental JSON."""

  def __init__(self, args, argv, gpu: bool, md: dict, budget_s: float):
    self.args = args
    self.gpu = gpu
    self.md = md
    self.records: list[dict] = []
    self.t0 = time.time()
    self.budget_s = budget_s
    self.targets: dict = {}
    md["targets"] = self.targets

  def left(self) -> float:
    return self.budget_s - (time.time() - self.t0)

  def doc(self) -> dict:
    self.md["elapsed_s"] = round(time.time() - self.t0, 1)
    return dict(status="ok", metadata=self.md, records=self.records)

  def flush(self):
    D.write_json(getattr(self.args, "output", None), self.doc())


# ----------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------
def metadata(argv: list[str], gpu: bool, command_prefix: str) -> dict:
  import jax
  import torch
  md = D.metadata(argv, None)
  md["command"] = " ".join([command_prefix] + argv)
  md["suite"] = "bridge"
  md["versions"]["transformers"] = D._pkg_version("transformers")
  dev = jax.devices()[0]
  md.update(jax_backend=dev.platform, device_kind=dev.device_kind,
            jax_compute_capability=getattr(dev, "compute_capability", None),
            torch_cuda=torch.version.cuda,
            torch_cudnn=(torch.backends.cudnn.version()
                         if torch.cuda.is_available() else None))
  if torch.cuda.is_available():
    cc = torch.cuda.get_device_capability()
    md["torch_compute_capability"] = f"{cc[0]}.{cc[1]}"
    md["torch_device_name"] = torch.cuda.get_device_name()
  md["smoke"] = not gpu
  md["conventions"] = dict(
      flops="4*B*Hq*S*S*D forward, /2 causal, x3.5 forward+backward",
      overhead_us=("bridge per-call time minus JAX per-call time (medians), "
                   "the same jitted functions on both sides"),
      timing_attention=(
          "host perf_counter per call, each call followed by "
          "torch.cuda.synchronize() (bridge) or jax.block_until_ready "
          "(JAX); bridge and JAX interleaved in rounds after warm-up, gc "
          "off; ms = median over all calls. ms_pipelined: batches of "
          "back-to-back calls with one synchronisation, median over rounds"),
      fwd_bwd=("forward + gradients wrt q, k, v for a random cotangent: "
               "bridge torch.autograd.grad; JAX the bridge's jitted forward "
               "then its jitted backward"),
      train_step=("Llama: model(input_ids, labels).loss.backward() + fused "
                  "AdamW step, CUDA events on torch's stream per step, "
                  "median over interleaved rounds after warm-up"),
      grads_bitwise=("three forward+backward runs from the same state and "
                     "batch; every parameter gradient compared bit for bit"),
      ratio="bridge / JAX time (<= 1.03 at S4096); Llama fold / sdpa step time")
  return md


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------
def _measure(cands, *, target_s: float, rounds: int, max_calls: int,
             pipelined_share: float = 0.3) -> dict:
  """cands: [(name, fn, sync)] where sync(fn()) completes a call. Returns
  {name: timing dict}; rounds alternate the order of the candidates."""
  for _, fn, sync in cands:
    for _ in range(3):
      sync(fn())
  est = {}
  for name, fn, sync in cands:
    t0 = time.perf_counter()
    for _ in range(3):
      sync(fn())
    est[name] = max((time.perf_counter() - t0) / 3, 1e-6)
  share = target_s / len(cands)
  per_round = {n: max(3, min(max_calls, int(share * (1 - pipelined_share)
                                             / est[n])) // rounds)
               for n, _, _ in cands}
  pipe_n = {n: max(2, min(200, int(share * pipelined_share / est[n]
                                  / rounds)))
            for n, _, _ in cands}
  samples = {n: [] for n, _, _ in cands}
  round_med = {n: [] for n, _, _ in cands}
  pipe = {n: [] for n, _, _ in cands}
  gc.collect()
  gc.disable()
  try:
    for r in range(rounds):
      for name, fn, sync in (cands if r % 2 == 0 else cands[::-1]):
        ts = []
        for _ in range(per_round[name]):
          t0 = time.perf_counter()
          sync(fn())
          ts.append(time.perf_counter() - t0)
        samples[name].extend(ts)
        round_med[name].append(statistics.median(ts))
        m = pipe_n[name]
        t0 = time.perf_counter()
        out = None
        for _ in range(m):
          out = fn()
        sync(out)
        pipe[name].append((time.perf_counter() - t0) / m)
        del out
  finally:
    gc.enable()
  res = {}
  for name, _, _ in cands:
    s = sorted(samples[name])
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]
    res[name] = dict(
        ms=statistics.median(s) * 1e3, ms_min=s[0] * 1e3, ms_p10=q(0.1) * 1e3,
        ms_p90=q(0.9) * 1e3, n_calls=len(s), rounds=rounds,
        ms_rounds=[round(x * 1e3, 5) for x in round_med[name]],
        ms_pipelined=statistics.median(pipe[name]) * 1e3,
        pipelined_calls_per_batch=pipe_n[name],
        timer="host per call, synchronised (see conventions)")
  return res


# ----------------------------------------------------------------------------
# 1-2. Attention: bridge vs JAX
# ----------------------------------------------------------------------------
class AttnCase:
  """Inputs, the bridge's plan and the callables of one attention shape."""

  def __init__(self, B, H, S, Dh, dev, tdt):
    import jax
    import torch
    import torch_bridge as tb
    from torch_bridge import _runtime as rt
    from torch_bridge import attention as A
    self.shape = (B, H, S, Dh)
    self.dev = dev
    g = torch.Generator(device=dev).manual_seed(0)
    shp = (B, S, H, Dh)
    self.q, self.k, self.v, self.do = (
        torch.randn(shp, device=dev, dtype=tdt, generator=g) for _ in range(4))
    self.qg, self.kg, self.vg = (x.clone().requires_grad_()
                                 for x in (self.q, self.k, self.v))
    # the static key fold_attn_func(q, k, v, causal=True) builds
    static = A._dense_static(self.q, causal=True)
    self.backend = static[0]
    self.plan = A._plan(static, self.q.device, self.q.dtype)
    self.target = self.plan.target
    imp = rt.Importer(self.target)
    js = [imp(x) for x in (self.q, self.k, self.v, self.do)]
    # JAX-owned copies: the JAX side never touches torch memory
    self.jq, self.jk, self.jv, self.jdo = (
        jax.device_put(x, self.target.jax_device) + 0 for x in js)
    jax.block_until_ready((self.jq, self.jk, self.jv, self.jdo))
    if dev == "cuda":
      torch.cuda.synchronize()
    self.tb, self.rt, self.torch, self.jax = tb, rt, torch, jax

  # -- callables (each returns what its sync waits on) --
  def jax_fwd(self):
    return self.plan.fwd(self.jq, self.jk, self.jv, None, None, None, None,
                         None)

  def jax_fwd_bwd(self):
    o, l, a = self.plan.fwd(self.jq, self.jk, self.jv, None, None, None, None,
                            None)
    return self.plan.bwd(self.jq, self.jk, self.jv, None, None, None, None,
                         None, o, l, a, self.jdo, None)

  def bridge_fwd(self):
    return self.tb.fold_attn_func(self.q, self.k, self.v, causal=True)

  def bridge_fwd_bwd(self):
    out = self.tb.fold_attn_func(self.qg, self.kg, self.vg, causal=True)
    return self.torch.autograd.grad(out, (self.qg, self.kg, self.vg),
                                    self.do)

  def jax_sync(self, out):
    return self.jax.block_until_ready(out)

  def torch_sync(self, out=None):
    if self.dev == "cuda":
      self.torch.cuda.synchronize()
    return out


def _attn_rec(impl, case: AttnCase, dtname: str, mode: str, **kw) -> dict:
  B, H, S, Dh = case.shape
  r = dict(impl=impl, B=B, Hq=H, Hkv=H, S=S, D=Dh, causal=True, dtype=dtname,
           mode=mode, ms=None, tflops=None, error=None,
           backend=case.backend)
  r.update(kw)
  return r


def _tflops(rec):
  from benchmarks._timing import attention_flops
  if rec.get("ms"):
    rec["tflops"] = attention_flops(rec["B"], rec["Hq"], rec["S"], rec["S"],
                                    rec["D"], True, rec["mode"]) / (
                                        rec["ms"] * 1e-3) / 1e12


def _print_attn(rec):
  head = (f"  {rec['impl']:11s} {rec['mode']:8s} B{rec['B']} H{rec['Hq']} "
          f"S{rec['S']} D{rec['D']}: ")
  if rec.get("ms") is None:
    print(head + str(rec.get("error")), flush=True)
    return
  extra = ""
  if rec.get("overhead_us") is not None:
    extra = (f"  overhead {rec['overhead_us']:+.1f} us, ratio "
             f"{rec['ratio']:.3f} (pipelined {rec['overhead_pipelined_us']:+.1f}"
             f" us, {rec['ratio_pipelined']:.3f})")
  print(head + f"{rec['ms'] * 1e3:9.1f} us/call (p10 {rec['ms_p10'] * 1e3:.1f},"
        f" p90 {rec['ms_p90'] * 1e3:.1f}, n={rec['n_calls']}), pipelined "
        f"{rec['ms_pipelined'] * 1e3:.1f} us" + extra, flush=True)


def bridge_vs_jax(suite: Suite, case: AttnCase, dtname: str, mode: str,
                  target_s: float) -> dict:
  """Times bridge and JAX for one mode; appends both records; returns the
  bridge record."""
  fwd = mode == "fwd"
  jr = _attn_rec("jax_direct", case, dtname, mode,
                 notes=["the bridge's jitted forward" +
                        ("" if fwd else " + backward") + " on JAX arrays"])
  br = _attn_rec("bridge", case, dtname, mode,
                 notes=["torch_bridge.fold_attn_func" +
                        ("" if fwd else " + torch.autograd.grad")])
  suite.records += [jr, br]
  t0 = time.time()
  try:
    cands = [("jax_direct", case.jax_fwd if fwd else case.jax_fwd_bwd,
              case.jax_sync),
             ("bridge", case.bridge_fwd if fwd else case.bridge_fwd_bwd,
              case.torch_sync)]
    res = _measure(cands, target_s=target_s, rounds=5, max_calls=3000)
    jr.update(res["jax_direct"])
    br.update(res["bridge"])
    for r in (jr, br):
      _tflops(r)
    br["overhead_us"] = (br["ms"] - jr["ms"]) * 1e3
    br["ratio"] = br["ms"] / jr["ms"]
    br["overhead_pipelined_us"] = (br["ms_pipelined"] - jr["ms_pipelined"]) \
        * 1e3
    br["ratio_pipelined"] = br["ms_pipelined"] / jr["ms_pipelined"]
    br["overhead_rounds_us"] = [round((b - j) * 1e3, 2) for b, j in
                                zip(br["ms_rounds"], jr["ms_rounds"])]
  except Exception as e:  # noqa: BLE001
    br["error"] = jr["error"] = D._err(e)
  br["wall_s"] = jr["wall_s"] = round(time.time() - t0, 2)
  _print_attn(jr)
  _print_attn(br)
  suite.flush()
  return br


def _target_overhead(suite, name, br):
  ok = br.get("overhead_us") is not None
  suite.targets[name] = dict(
      value_us=round(br["overhead_us"], 2) if ok else None,
      limit_us=OVERHEAD_LIMIT_US, met=(br["overhead_us"] <= OVERHEAD_LIMIT_US
                                        if ok else None),
      naive_dlpack_us=NAIVE_DLPACK_US,
      pipelined_us=(round(br["overhead_pipelined_us"], 2) if ok else None),
      met_pipelined=(br["overhead_pipelined_us"] <= OVERHEAD_LIMIT_US
                     if ok else None),
      bridge_us=round(br["ms"] * 1e3, 2) if ok else None,
      jax_us=(round(br["ms"] / br["ratio"] * 1e3, 2) if ok else None),
      shape=f"B{br['B']} H{br['Hq']} S{br['S']} D{br['D']} {br['dtype']} "
            f"causal", mode=br["mode"], error=br.get("error"))


def _target_ratio(suite, name, br):
  ok = br.get("ratio") is not None
  suite.targets[name] = dict(
      value=round(br["ratio"], 4) if ok else None, limit=RATIO_LIMIT,
      met=(br["ratio"] <= RATIO_LIMIT if ok else None),
      pipelined=round(br["ratio_pipelined"], 4) if ok else None,
      met_pipelined=(br["ratio_pipelined"] <= RATIO_LIMIT if ok else None),
      overhead_us=round(br["overhead_us"], 2) if ok else None,
      bridge_ms=round(br["ms"], 4) if ok else None,
      jax_ms=round(br["ms"] / br["ratio"], 4) if ok else None,
      shape=f"B{br['B']} H{br['Hq']} S{br['S']} D{br['D']} {br['dtype']} "
            f"causal", mode=br["mode"], error=br.get("error"))


# ----------------------------------------------------------------------------
# 3. Llama training step: fold vs sdpa
# ----------------------------------------------------------------------------
def _same_bits(a, b) -> bool:
  import torch
  if a.shape != b.shape or a.dtype != b.dtype:
    return False
  ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
  it = ints[a.element_size()]
  return bool(torch.equal(a.contiguous().view(it), b.contiguous().view(it)))


def llama_model(c: dict, dev: str, dtype):
  """The benchmark's Llama (config dict `c`, LLAMA_GPU or LLAMA_CPU): random
  weights from seed 0, in training mode, with "fold" registered."""
  import torch
  import torch_bridge.hf
  from transformers import LlamaConfig, LlamaForCausalLM
  torch_bridge.hf.register()
  cfg = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"],
                    intermediate_size=c["intermediate"],
                    num_hidden_layers=c["layers"],
                    num_attention_heads=c["heads"],
                    num_key_value_heads=c["kv_heads"],
                    max_position_embeddings=c["seq"], attention_dropout=0.0,
                    tie_word_embeddings=False, use_cache=False)
  torch.manual_seed(0)
  with torch.device(dev):
    base = LlamaForCausalLM(cfg)
  return base.to(dtype).train()


def llama(suite: Suite, dev: str, smoke: bool, target_s: float) -> list[dict]:
  import torch
  c = LLAMA_CPU if smoke else LLAMA_GPU
  dt = torch.float32 if smoke else torch.bfloat16
  dtname = "fp32" if smoke else "bf16"
  base = llama_model(c, dev, dt)
  n_params = sum(p.numel() for p in base.parameters())
  g = torch.Generator(device=dev).manual_seed(1)
  ids = torch.randint(0, c["vocab"], (c["batch"], c["seq"]), device=dev,
                      generator=g)
  cuda = dev == "cuda"
  impls = ("fold", "sdpa")
  models = {"fold": base, "sdpa": copy.deepcopy(base)}
  recs = {}
  for impl in impls:
    try:
      models[impl].set_attn_implementation(impl)
    except Exception as e:  # noqa: BLE001 - older transformers: set it directly
      print(f"  llama: set_attn_implementation({impl!r}) failed "
            f"({D._err(e)}); setting config._attn_implementation", flush=True)
      models[impl].config._attn_implementation = impl
    r = dict(impl=impl, model="llama", mode="train_step", B=c["batch"],
             S=c["seq"], Hq=c["heads"], Hkv=c["kv_heads"],
             D=c["hidden"] // c["heads"], causal=True, dtype=dtname,
             hidden=c["hidden"], layers=c["layers"],
             intermediate=c["intermediate"], vocab=c["vocab"],
             n_params=n_params, ms=None, error=None,
             step="forward + backward + fused AdamW" if cuda else
                  "forward + backward + AdamW",
             attn_implementation=impl)
    recs[impl] = r
    suite.records.append(r)
  sdpa_ctx = [_sdpa_flash_ctx(cuda, recs["sdpa"])]

  def fwd_bwd(impl):
    m = models[impl]
    m.zero_grad(set_to_none=True)
    with (sdpa_ctx[0]() if impl == "sdpa" else _null()):
      loss = m(input_ids=ids, labels=ids).loss
      loss.backward()
    return loss.detach()

  if cuda:  # flash refusing this call (e.g. GQA): fall back, say so
    try:
      fwd_bwd("sdpa")
    except RuntimeError as e:
      sdpa_ctx[0] = _null
      recs["sdpa"]["sdpa_backend"] = ("torch default (flash refused: "
                                      f"{D._err(e)[:200]})")
      print(f"  llama sdpa: {recs['sdpa']['sdpa_backend']}", flush=True)

  opts = {i: torch.optim.AdamW(models[i].parameters(), lr=1e-5,
                               fused=True if cuda else None) for i in impls}

  def step(impl):
    loss = fwd_bwd(impl)
    opts[impl].step()
    return loss

  def sync():
    if cuda:
      torch.cuda.synchronize()

  # Gradients: three forward+backward runs from the same (initial) state.
  first = {}
  for impl in impls:
    r = recs[impl]
    t0 = time.time()
    try:
      if cuda:
        torch.cuda.reset_peak_memory_stats()
      ref = None
      n_total = 0
      bad_names = []
      names = [n for n, _ in models[impl].named_parameters()]
      losses = []
      for run in range(3):
        loss = fwd_bwd(impl)
        losses.append(float(loss))
        grads = [p.grad for p in models[impl].parameters()]
        if ref is None:
          ref = [x.detach().clone() for x in grads]
          n_total = len(ref)
          continue
        for name, a, b in zip(names, ref, grads):
          if b is None or not _same_bits(a, b):
            if name not in bad_names:
              bad_names.append(name)
      n_bad = len(bad_names)
      first[impl] = (losses[0], ref)
      r.update(grads_bitwise_repeatable=(n_bad == 0), grad_runs=3,
               grad_tensors=n_total, grad_mismatches=n_bad,
               grad_mismatch_names=bad_names[:12],
               loss=losses[0], losses_bitwise_repeatable=len(set(losses)) == 1)
      if cuda:
        sync()
        r["torch_peak_mem_bytes"] = int(torch.cuda.max_memory_allocated())
        try:
          import jax
          st = jax.devices()[0].memory_stats() or {}
          r["jax_bytes_in_use"] = st.get("bytes_in_use")
          r["jax_peak_bytes_in_use"] = st.get("peak_bytes_in_use")
        except Exception:  # noqa: BLE001
          pass
    except Exception as e:  # noqa: BLE001
      r["error"] = D._err(e)
    r["grad_check_s"] = round(time.time() - t0, 2)
    print(f"  llama {impl}: grads bitwise repeatable over 3 runs: "
          f"{r.get('grads_bitwise_repeatable')} ({r.get('grad_mismatches')} of "
          f"{r.get('grad_tensors')} tensors differ), loss {r.get('loss')}"
          + (f"  ERROR {r['error']}" if r.get("error") else ""), flush=True)
  if "fold" in first and "sdpa" in first:
    (lf, gf), (ls, gs) = first["fold"], first["sdpa"]
    num = sum(float((a.float() - b.float()).pow(2).sum()) for a, b in
              zip(gf, gs))
    den = sum(float(b.float().pow(2).sum()) for b in gs)
    recs["fold"]["grad_rel_l2_vs_sdpa"] = math.sqrt(num / max(den, 1e-30))
    recs["fold"]["loss_minus_sdpa"] = lf - ls
    print(f"  llama fold vs sdpa: loss diff {lf - ls:+.3e}, grad rel L2 "
          f"{recs['fold']['grad_rel_l2_vs_sdpa']:.2e}", flush=True)
  first.clear()
  suite.flush()

  # Step time: warm-up, then interleaved rounds of steps.
  live = [i for i in impls if not recs[i].get("error")]
  try:
    est = {}
    for impl in live:
      step(impl)
      sync()
      t0 = time.perf_counter()
      step(impl)
      sync()
      est[impl] = max(time.perf_counter() - t0, 1e-4)
    # FOLDAX_LLAMA_ROUNDS / FOLDAX_LLAMA_TARGET_S: longer runs for a machine
    # whose step time drifts by more than the difference measured.
    rounds = int(os.environ.get("FOLDAX_LLAMA_ROUNDS", 4 if cuda else 2))
    target_s = float(os.environ.get("FOLDAX_LLAMA_TARGET_S", target_s))
    per_round = {i: max(2 if cuda else 1, min(12, int(
        target_s / len(live) / est[i] / rounds))) for i in live}
    times = {i: [] for i in live}
    host = {i: [] for i in live}
    for rnd in range(rounds):
      for impl in (live if rnd % 2 == 0 else live[::-1]):
        n = per_round[impl]
        sync()
        h0 = time.perf_counter()
        if cuda:
          ev = [(torch.cuda.Event(enable_timing=True),
                 torch.cuda.Event(enable_timing=True)) for _ in range(n)]
          for a, b in ev:
            a.record()
            step(impl)
            b.record()
          sync()
          times[impl] += [a.elapsed_time(b) for a, b in ev]
        else:
          for _ in range(n):
            t0 = time.perf_counter()
            step(impl)
            times[impl].append((time.perf_counter() - t0) * 1e3)
        host[impl].append((time.perf_counter() - h0) * 1e3 / n)
    for impl in live:
      r = recs[impl]
      s = sorted(times[impl])
      r.update(ms=statistics.median(s), ms_min=s[0], ms_max=s[-1],
               n_steps=len(s), rounds=rounds, warmup_steps=2,
               ms_host_rounds=[round(x, 3) for x in host[impl]],
               tokens_per_s=c["batch"] * c["seq"] / (statistics.median(s)
                                                     * 1e-3),
               timer=("cuda events around each step on torch's stream"
                      if cuda else "host perf_counter per step (CPU)"))
      print(f"  llama {impl:4s} train step: {r['ms']:.2f} ms median "
            f"(min {r['ms_min']:.2f}, max {r['ms_max']:.2f}, n={len(s)}), "
            f"{r['tokens_per_s']:,.0f} tokens/s", flush=True)
  except Exception as e:  # noqa: BLE001
    for impl in live:
      if recs[impl].get("ms") is None:
        recs[impl]["error"] = D._err(e)
    print(f"  llama timing failed: {D._err(e)}", flush=True)
  f, s = recs["fold"], recs["sdpa"]
  if f.get("ms") and s.get("ms"):
    f["ratio_vs_sdpa"] = f["ms"] / s["ms"]
  suite.targets["llama_train_step"] = dict(
      value=round(f["ratio_vs_sdpa"], 4) if f.get("ratio_vs_sdpa") else None,
      limit=1.0, met=(f["ratio_vs_sdpa"] <= 1.0 if f.get("ratio_vs_sdpa")
                      else None),
      fold_ms=f.get("ms"), sdpa_ms=s.get("ms"),
      sdpa_backend=s.get("sdpa_backend"), step=f["step"],
      model=(f"Llama hidden {c['hidden']}, {c['layers']} layers, "
             f"{c['heads']} heads / {c['kv_heads']} kv, seq {c['seq']}, "
             f"batch {c['batch']}, {dtname}"),
      error=f.get("error") or s.get("error"))
  suite.targets["llama_fold_grads_bitwise"] = dict(
      met=f.get("grads_bitwise_repeatable"), runs=3,
      mismatches=f.get("grad_mismatches"), tensors=f.get("grad_tensors"),
      sdpa_grads_bitwise=s.get("grads_bitwise_repeatable"),
      sdpa_mismatches=s.get("grad_mismatches"))
  suite.flush()
  del models, opts
  gc.collect()
  if cuda:
    torch.cuda.empty_cache()
  return [f, s]


class _null:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False


def _sdpa_flash_ctx(cuda: bool, rec: dict):
  """A context factory forcing torch's flash SDPA backend on CUDA; records
  the choice."""
  if not cuda:
    rec["sdpa_backend"] = "torch default (CPU)"
    return _null
  from torch.nn.attention import SDPBackend, sdpa_kernel
  rec["sdpa_backend"] = "flash (forced: sdpa_kernel(FLASH_ATTENTION))"
  return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


# ----------------------------------------------------------------------------
# 4. Extras
# ----------------------------------------------------------------------------
def sdpa_attention(suite: Suite, case: AttnCase, dtname: str,
                   target_s: float):
  import torch
  import torch.nn.functional as F
  from torch.nn.attention import SDPBackend, sdpa_kernel
  qt, kt, vt = (x.transpose(1, 2) for x in (case.q, case.k, case.v))
  qg, kg, vg = (x.clone().requires_grad_() for x in (qt, kt, vt))
  dot = case.do.transpose(1, 2)

  def fwd():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
      return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

  def fwd_bwd():
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
      o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    return torch.autograd.grad(o, (qg, kg, vg), dot)

  for mode, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
    r = _attn_rec("torch_sdpa", case, dtname, mode, backend="torch flash",
                  notes=["F.scaled_dot_product_attention, flash backend, "
                         "[B, H, S, D] views of the same tensors"])
    suite.records.append(r)
    try:
      r.update(_measure([("x", fn, case.torch_sync)], target_s=target_s,
                        rounds=3, max_calls=1000)["x"])
      _tflops(r)
    except Exception as e:  # noqa: BLE001
      r["error"] = D._err(e)
    _print_attn(r)
  suite.flush()


def components(suite: Suite, case: AttnCase, dtname: str):
  """The bridge's parts alone: DLPack import of q, k, v (with the one stream
  hand-off) and export of out, lse; and the floors of each framework (a
  trivial jitted JAX call + block_until_ready, a trivial torch op +
  torch.cuda.synchronize), which tell how much of a per-call difference is
  the synchronisation itself."""
  import jax
  import torch
  rt, target = case.rt, case.target
  out_j, lse_j, _ = case.jax_sync(case.jax_fwd())

  def import3():
    i = rt.Importer(target)
    return i(case.q), i(case.k), i(case.v)

  def export2():
    return rt.export((out_j, lse_j), target)

  tiny_j = jax.device_put(jax.numpy.zeros((8,), jax.numpy.float32),
                          target.jax_device)
  inc = jax.jit(lambda x: x + 1)
  tiny_t = torch.zeros(8, device=case.dev)
  r = _attn_rec("bridge_parts", case, dtname, "components",
                notes=["not an attention time: the DLPack hand-off alone "
                       "(*_us: back-to-back, host cost; *_synced_us: each "
                       "call followed by a device sync) and sync floors"])
  suite.records.append(r)
  try:
    res = _measure([("import", import3, case.torch_sync),
                    ("export", export2, case.torch_sync),
                    ("jax_floor", lambda: inc(tiny_j), case.jax_sync),
                    ("torch_floor", lambda: tiny_t + 1, case.torch_sync)],
                   target_s=0.4, rounds=3, max_calls=2000)
    r["import3_us"] = res["import"]["ms_pipelined"] * 1e3
    r["export2_us"] = res["export"]["ms_pipelined"] * 1e3
    r["import3_synced_us"] = res["import"]["ms"] * 1e3
    r["export2_synced_us"] = res["export"]["ms"] * 1e3
    r["jax_trivial_call_us"] = res["jax_floor"]["ms"] * 1e3
    r["torch_trivial_op_us"] = res["torch_floor"]["ms"] * 1e3
    print(f"  components B{case.shape[0]} S{case.shape[2]}: import q,k,v "
          f"{r['import3_us']:.1f} us, export out,lse {r['export2_us']:.1f} us"
          f" (back-to-back; synced {r['import3_synced_us']:.1f} / "
          f"{r['export2_synced_us']:.1f}); floors: trivial JAX call + "
          f"block_until_ready {r['jax_trivial_call_us']:.1f} us, trivial "
          f"torch op + synchronize {r['torch_trivial_op_us']:.1f} us",
          flush=True)
  except Exception as e:  # noqa: BLE001
    r["error"] = D._err(e)
  suite.flush()


def jax_api_direct(suite: Suite, case: AttnCase, dtname: str,
                   target_s: float, bridge_recs: dict):
  """jax.jit(jax_api.fold_attn_func) and jax.jit of its VJP: a JAX user's
  own call, as a second reference for the ratio."""
  import jax
  from jax_api import fold_attn_func
  f = jax.jit(lambda q, k, v: fold_attn_func(q, k, v, causal=True))
  fb = jax.jit(lambda q, k, v, do: jax.vjp(
      lambda q, k, v: fold_attn_func(q, k, v, causal=True), q, k, v)[1](do))
  for mode, fn in (("fwd", lambda: f(case.jq, case.jk, case.jv)),
                   ("fwd+bwd", lambda: fb(case.jq, case.jk, case.jv,
                                          case.jdo))):
    r = _attn_rec("jax_api", case, dtname, mode,
                  notes=["jax.jit(jax_api.fold_attn_func)" +
                         ("" if mode == "fwd" else " VJP, one program")])
    suite.records.append(r)
    try:
      r.update(_measure([("x", fn, case.jax_sync)], target_s=target_s,
                        rounds=3, max_calls=1000)["x"])
      _tflops(r)
      br = bridge_recs.get(mode)
      if br and br.get("ms"):
        br["ratio_vs_jax_api"] = br["ms"] / r["ms"]
    except Exception as e:  # noqa: BLE001
      r["error"] = D._err(e)
    _print_attn(r)
  suite.flush()


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------
def run(args, argv, command_prefix: str = "python -m benchmarks.run") -> dict:
  """The suite (`benchmarks.run --child bridge` calls this)."""
  try:
    import torch_bridge
    import torch_bridge.hf  # noqa: F401
  except Exception as e:  # noqa: BLE001
    return dict(status="not available", records=[],
                note=f"torch_bridge: {D._err(e)}")
  try:
    torch_bridge.configure_jax_allocator()
  except RuntimeError as e:  # JAX started first: its allocator stays
    print(f"bridge: {e}", file=sys.stderr)
  import jax
  import torch
  gpu = (torch.cuda.is_available() and jax.devices()[0].platform == "gpu"
         and not args.smoke)
  md = metadata(argv, gpu, command_prefix)
  budget = float(os.environ.get("FOLDAX_BRIDGE_BUDGET_S",
                                100 if gpu else 120))
  suite = Suite(args, argv, gpu, md, budget)
  md["budget_s"] = budget
  if gpu:
    dev, tdt, dtname = "cuda", torch.bfloat16, "bf16"
    small, large = (1, 16, 128, 128), (1, 16, 4096, 128)
    t_small, t_large = 0.8, 1.0
  else:
    dev, tdt, dtname = "cpu", torch.float32, "fp32"
    small, large = (1, 2, 64, 32), (1, 2, 256, 32)
    t_small, t_large = 0.15, 0.15
  print(f"bridge suite on {md.get('gpu_name') or 'CPU (smoke)'}; budget "
        f"{budget:.0f}s", flush=True)
  suite.flush()

  cases = {}
  brs = {}
  # FOLDAX_BRIDGE_PARTS: a subset of "overhead,llama,extras" (default all).
  parts = set(os.environ.get("FOLDAX_BRIDGE_PARTS",
                             "overhead,llama,extras").split(","))
  # 1-2. acceptance: overhead at the small shape, ratio at the large one
  for label, shp, tgt in (("s128", small, t_small), ("s4096", large,
                                                     t_large)):
    if "overhead" not in parts:
      break
    try:
      case = cases[label] = AttnCase(*shp, dev, tdt)
    except Exception as e:  # noqa: BLE001
      print(f"  {label}: setup failed: {D._err(e)}", flush=True)
      suite.records.append(dict(impl="bridge", B=shp[0], Hq=shp[1],
                                Hkv=shp[1], S=shp[2], D=shp[3], causal=True,
                                dtype=dtname, mode="fwd", ms=None,
                                error=D._err(e)))
      continue
    for mode in ("fwd", "fwd+bwd"):
      br = brs[(label, mode)] = bridge_vs_jax(suite, case, dtname, mode, tgt)
      tag = "fwd" if mode == "fwd" else "fwd_bwd"
      if label == "s128":
        _target_overhead(suite, f"overhead_{tag}", br)
      else:
        _target_ratio(suite, f"ratio_{tag}", br)
      suite.flush()

  # 3. Llama training step
  try:
    if "llama" in parts:
      llama(suite, dev, not gpu, 1.6 if gpu else 0.3)
  except Exception as e:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    suite.records.append(dict(impl="fold", model="llama", mode="train_step",
                              ms=None, error=D._err(e)))
    suite.targets.setdefault("llama_train_step",
                             dict(value=None, limit=1.0, met=None,
                                  error=D._err(e)))
  suite.flush()

  # 4. extras, while the budget lasts
  for label, case in (cases.items() if "extras" in parts else ()):
    if suite.left() < 8:
      break
    if label == "s128":
      components(suite, case, dtname)
    if gpu and suite.left() > 8:
      sdpa_attention(suite, case, dtname, 0.3)
  if "s4096" in cases and "extras" in parts and suite.left() > 15:
    jax_api_direct(suite, cases["s4096"], dtname, 0.5,
                   {m: brs.get(("s4096", m)) for m in ("fwd", "fwd+bwd")})

  print_targets(suite.targets)
  return suite.doc()


def print_targets(targets: dict):
  print("targets:", flush=True)
  for name, t in targets.items():
    met = t.get("met")
    val = t.get("value_us", t.get("value"))
    lim = t.get("limit_us", t.get("limit"))
    word = "met" if met else ("NOT MET" if met is False else "unknown")
    pipe = t.get("pipelined_us", t.get("pipelined"))
    print(f"  {name}: {word}" + (f" ({val} vs limit {lim})"
                                 if val is not None else "")
          + (f"; pipelined {pipe}: "
             f"{'met' if t.get('met_pipelined') else 'NOT MET'}"
             if pipe is not None else "")
          + (f" [{t['error']}]" if t.get("error") else ""), flush=True)


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(prog="python -m benchmarks.bridge",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--output", "-o", default="bridge.json")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--quick", action="store_true", help="(same as default)")
  args = ap.parse_args(argv)
  t0 = time.time()
  doc = run(args, argv, "python -m benchmarks.bridge")
  doc.setdefault("metadata", {})["elapsed_s"] = round(time.time() - t0, 1)
  D.write_json(args.output, doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
