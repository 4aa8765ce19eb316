"""Our forward kernel under two Triton compilers, next to fastflash-attention.

Separates what the kernel source costs from what the compiler pipeline costs:
the Triton IR that Pallas lowers our forward to is compiled twice, once by
XLA (the normal `jax.jit` path) and once by the pip `triton` package (the
compiler fastflash-attention uses), and both are timed on the same inputs,
with fastflash's own kernel at each of its autotune configurations.

  python -m benchmarks.triton_compare --out /tmp/tc.json \
      [--blocks "128,64,4,2;128,64,8,3"] [--ff-configs "128,64,8,3;..."]

Needs a GPU, torch and triton; fastflash-attention is optional. Times are
CUDA-event medians (torch) and batched host-clock medians (JAX), as in
benchmarks/_timing.py; the IR compiled by pip Triton is checked against the
JAX output before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from benchmarks import _timing
from benchmarks.kernel_probe import _parse_blocks
from pallas_kernels.triton_ir import capture_triton_ir
from pallas_kernels.flash.tiles import MaskConfig
from pallas_kernels.flash.config import BlockSizes
from pallas_kernels.flash.forward import flash_forward


def _capture_ttir(fn, *args):
  """The Triton IR of each kernel of jax.jit(fn)(*args), lowered for CUDA."""
  return [ir for _, ir, _ in capture_triton_ir(jax.jit(fn), args)]


def _pip_compile(ttir: str, name: str, bs: BlockSizes, target=None):
  """Compiles Triton IR text with the pip `triton` package, Triton's TTIR
  stage included (`pallas_kernels.pip_triton.compile_ttir`; the runs of
  2026-12-03 predate that and skipped the stage)."""
  from pallas_kernels.pip_triton import compile_ttir
  if target is not None:
    cc = divmod(int(target.arch), 10)
  else:
    import torch
    cc = torch.cuda.get_device_capability()
  return compile_ttir(name, ttir, bs.num_warps, bs.num_stages, tuple(cc))


def _cuda_median(fn, iters=20, batches=15):
  import torch
  fn()
  torch.cuda.synchronize()
  samples = []
  for _ in range(batches):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
      fn()
    b.record()
    b.synchronize()
    samples.append(a.elapsed_time(b) / iters)
  return statistics.median(samples)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--b", type=int, default=2)
  p.add_argument("--s", type=int, default=8192)
  p.add_argument("--h", type=int, default=16)
  p.add_argument("--d", type=int, default=128)
  p.add_argument("--blocks", default="128,64,4,2;128,64,8,3;128,128,8,2;"
                 "128,128,8,3;64,64,4,3")
  p.add_argument("--ff-configs", default="128,64,4,3;128,64,8,3;128,64,8,4;"
                 "128,128,8,3;128,128,8,2;64,64,4,3")
  p.add_argument("--launch", action="store_true",
                 help="instead: per-call latency at B1 H16 S128 D128 of the "
                 "JAX call, the same kernel launched directly on torch "
                 "tensors, and torch_bridge.fold_attn_func")
  p.add_argument("--iters", type=int, default=300)
  a = p.parse_args(argv)
  if a.launch:
    return launch_latency(a)
  import torch
  b, s, h, d = a.b, a.s, a.h, a.d
  flops = _timing.attention_flops(b, h, s, s, d, True)
  records = [{"kind": "meta", "date": time.strftime("%Y-%m-%d %H:%M"),
              "gpu": torch.cuda.get_device_name(), "jax": jax.__version__,
              "torch": torch.__version__,
              "triton": __import__("triton").__version__,
              "shape": dict(b=b, s=s, h=h, d=d, causal=True,
                            dtype="bfloat16")}]

  def dump():
    with open(a.out, "w") as f:
      json.dump(records, f, indent=1)

  def rec(**r):
    if "ms" in r and r["ms"]:
      r["tflops"] = flops / (r["ms"] * 1e-3) / 1e12
    records.append(r)
    print(json.dumps(r), flush=True)
    dump()

  cfg = MaskConfig.make(causal=True, window_size=(-1, -1), has_segments=False,
                        softcap=0.0, scale=d ** -0.5)
  dev = torch.device("cuda")
  gen = torch.Generator(device=dev).manual_seed(0)
  qt, kt, vt = (torch.randn(b * s, h, d, device=dev, dtype=torch.bfloat16,
                            generator=gen) for _ in range(3))
  cu_t = (torch.arange(b + 1, device=dev, dtype=torch.int32) * s)
  qj, kj, vj, cuj = (jnp.from_dlpack(x) for x in (qt, kt, vt, cu_t))

  for bs in _parse_blocks(a.blocks):
    tag = f"{bs.block_q}x{bs.block_k}/w{bs.num_warps}s{bs.num_stages}"
    fwd = jax.jit(lambda q, k, v, cu, bs=bs: flash_forward(
        q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s))
    try:
      ref_o, ref_lse = jax.block_until_ready(fwd(qj, kj, vj, cuj))
      t = _timing.time_jax(fwd, [(qj, kj, vj, cuj)], target_s=1.0)
      rec(kind="ours_xla", blocks=tag, ms=t["ms"])
    except Exception as e:  # noqa: BLE001
      rec(kind="ours_xla", blocks=tag, error=repr(e)[:300])
      continue
    try:
      ttir = [m for m in _capture_ttir(
          lambda q, k, v, cu, bs=bs: flash_forward(
              q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s),
          qj, kj, vj, cuj) if "fold_flash_forward" in m][0]
      kern = _pip_compile(ttir, f"ours_{bs.block_q}_{bs.block_k}_"
                          f"{bs.num_warps}_{bs.num_stages}", bs)
      o = torch.empty_like(qt)
      lse = torch.empty(h, b * s, device=dev, dtype=torch.float32)
      grid = (-(-s // bs.block_q), b, h)
      run = lambda: kern[grid](cu_t, cu_t, qt, kt, vt, o, lse)
      run()
      torch.cuda.synchronize()
      err = (o.float() - torch.from_dlpack(ref_o).float()).abs().max().item()
      ms = _cuda_median(run)
      rec(kind="ours_pip_triton", blocks=tag, ms=ms, max_abs_diff_vs_xla=err,
          regs=kern.n_regs, spills=kern.n_spills, shared=kern.metadata.shared)
    except Exception as e:  # noqa: BLE001
      rec(kind="ours_pip_triton", blocks=tag, error=repr(e)[:300])

  try:
    import fastflash_attention as ffa
    from fastflash_attention import _kernel as ffk
  except ImportError as e:
    rec(kind="fastflash", error=repr(e))
    return
  qh, kh, vh = (x.view(b, s, h, d).transpose(1, 2).contiguous()
                for x in (qt, kt, vt))
  auto = lambda: ffa.fast_attention(qh, kh, vh, is_causal=True)
  ms = _cuda_median(auto)
  best = getattr(ffk._fastflash_fwd, "best_config", None)
  rec(kind="fastflash_autotuned", ms=ms, best_config=str(best))
  jit_fn = ffk._fastflash_fwd.fn
  qf, kf, vf = (x.reshape(b * h, s, d) for x in (qh, kh, vh))
  of = torch.empty_like(qf)
  lf = torch.empty(b * h, s, device=dev, dtype=torch.float32)
  for bs in _parse_blocks(a.ff_configs):
    tag = f"{bs.block_q}x{bs.block_k}/w{bs.num_warps}s{bs.num_stages}"
    run = lambda bs=bs: jit_fn[(-(-s // bs.block_q), b * h)](
        qf, kf, vf, of, lf, d ** -0.5 * 1.4426950408889634,
        qf.stride(0), qf.stride(1), qf.stride(2), s, HEAD_DIM=d,
        IS_CAUSAL=True, RETURN_LSE=True, BLOCK_M=bs.block_q,
        BLOCK_N=bs.block_k, num_warps=bs.num_warps,
        num_stages=bs.num_stages)
    try:
      rec(kind="fastflash_config", blocks=tag, ms=_cuda_median(run))
    except Exception as e:  # noqa: BLE001
      rec(kind="fastflash_config", blocks=tag, error=repr(e)[:300])
  from pallas_kernels.pip_triton import _ir_dir
  print("IR in", _ir_dir(), "(cubins in Triton's cache)")


def _sync_median_us(fn, sync, iters, warmup=20):
  for _ in range(warmup):
    fn()
  sync()
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    sync()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e6


def launch_latency(a):
  """Synchronised per-call latency (us) at B1 H16 S128 D128 causal bf16:
  what a torch caller pays for the forward through JAX, through the bridge,
  and through a direct launch of the same Triton IR on torch's stream."""
  import torch
  import torch_bridge as tb
  b, s, h, d = 1, 128, 16, 128
  records = [{"kind": "meta", "date": time.strftime("%Y-%m-%d %H:%M"),
              "gpu": torch.cuda.get_device_name(), "jax": jax.__version__,
              "torch": torch.__version__,
              "triton": __import__("triton").__version__,
              "shape": dict(b=b, s=s, h=h, d=d, causal=True,
                            dtype="bfloat16"), "iters": a.iters}]
  try:
    from jax._src.lib import gpu_triton  # noqa: F401
    records[0]["jaxlib_gpu_triton"] = True
  except Exception as e:  # noqa: BLE001
    records[0]["jaxlib_gpu_triton"] = repr(e)[:200]
  cfg = MaskConfig.make(causal=True, window_size=(-1, -1), has_segments=False,
                        softcap=0.0, scale=d ** -0.5)
  from pallas_kernels.flash.config import block_sizes_for
  bs = block_sizes_for(compute_capability=(9, 0), head_dim=d,
                       dtype=jnp.bfloat16, mode="fwd", interpret=False)
  dev = torch.device("cuda")
  gen = torch.Generator(device=dev).manual_seed(0)
  q4, k4, v4 = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16,
                            generator=gen) for _ in range(3))
  qt, kt, vt = (x.view(b * s, h, d) for x in (q4, k4, v4))
  cu_t = torch.arange(b + 1, device=dev, dtype=torch.int32) * s
  qj, kj, vj, cuj = (jnp.from_dlpack(x) for x in (qt, kt, vt, cu_t))
  fwd = jax.jit(lambda q, k, v, cu: flash_forward(
      q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s))
  ttir = [m for m in _capture_ttir(
      lambda q, k, v, cu: flash_forward(q, k, v, cu, cu, cfg=cfg, blocks=bs,
                                        max_seqlen_q=s),
      qj, kj, vj, cuj) if "fold_flash_forward" in m][0]
  kern = _pip_compile(ttir, "launch", bs)
  grid = (-(-s // bs.block_q), b, h)

  def direct():
    o = torch.empty_like(qt)
    lse = torch.empty(h, b * s, device=dev, dtype=torch.float32)
    kern[grid](cu_t, cu_t, qt, kt, vt, o, lse)
    return o.view(b, s, h, d)

  ref = jax.block_until_ready(fwd(qj, kj, vj, cuj))[0]
  err = (direct().view(b * s, h, d).float() -
         torch.from_dlpack(ref).float()).abs().max().item()
  sync = torch.cuda.synchronize
  res = {
      "jax_call_us": _sync_median_us(
          lambda: jax.block_until_ready(fwd(qj, kj, vj, cuj)), lambda: None,
          a.iters),
      "direct_launch_us": _sync_median_us(direct, sync, a.iters),
      "bridge_us": _sync_median_us(
          lambda: tb.fold_attn_func(q4, k4, v4, causal=True), sync, a.iters),
      "torch_sdpa_us": _sync_median_us(
          lambda: torch.nn.functional.scaled_dot_product_attention(
              q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2),
              is_causal=True), sync, a.iters),
      "empty_sync_us": _sync_median_us(lambda: None, sync, a.iters),
      "direct_max_abs_diff_vs_jax": err,
  }
  records.append(dict(kind="launch_latency", **res))
  print(json.dumps(records, indent=1), flush=True)
  with open(a.out, "w") as f:
    json.dump(records, f, indent=1)


if __name__ == "__main__":
  main()
