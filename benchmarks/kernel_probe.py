"""GPU probe and opt-in autotuner for the dense kernels: correctness,
determinism and a block-size sweep in one process.

    python -m benchmarks.kernel_probe --out probe.json \
        [--write-table blocks.json]
    python -m benchmarks.kernel_probe --fwd-probe --out fwd.json \
        [--fwd-blocks '128,64,4,2;128,128,8,3']
    python -m benchmarks.kernel_probe --bwd-probe --out bwd.json \
        [--bwd-configs '64,64,4,2/128,64,8,2;...']
    python -m benchmarks.kernel_probe --ir-stats [--bwd]

`--bwd-probe` times the recompute backward (dK/dV kernel blocks / dQ kernel
blocks) at the same shape and checks that its gradients repeat bitwise.

`--fwd-probe` only times the forward at B2 H16 S8192 D128 causal bf16 for a
few block configurations next to JAX's Pallas mha (tuned 128/64/4w/2s and
default 128/128/8w/2s), in about a minute.

`--write-table` writes the fastest configuration per (GPU generation, head
dim, dtype, mode) as a JSON table; point `FOLDAX_BLOCK_TABLE` at it to use it
instead of the shipped table in `pallas_kernels/flash/config.py`. Block sizes
are chosen per GPU, head dim, dtype and mode only, never per batch or length,
so tuned tables keep a sequence's bits independent of its batch.
The full comparison with every competitor is `benchmarks.dense`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash.tiles import MaskConfig
from pallas_kernels.flash.config import BlockSizes, block_sizes_for
from pallas_kernels.flash.forward import flash_forward


def _time(fn, *args, reps=20, inner=5):
  out = fn(*args)
  jax.block_until_ready(out)
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times) * 1e3


def _pack(x):
  return x.reshape(-1, *x.shape[2:])


def _inputs(b, s, hq, hkv, d, dtype, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, s, hq, d), dtype)
  k = jax.random.normal(ks[1], (b, s, hkv, d), dtype)
  v = jax.random.normal(ks[2], (b, s, hkv, d), dtype)
  do = jax.random.normal(ks[3], (b, s, hq, d), dtype)
  return q, k, v, do


def _mask_config(d, causal):
  return MaskConfig.make(causal=causal, window_size=(-1, -1),
                         has_segments=False, softcap=0.0, scale=d ** -0.5)


def _packed_problem(b, s, h, d, causal, dtype=jnp.bfloat16, hkv=None):
  """The probes' problem: forward FLOPs, mask config, cu_seqlens, q, k, v,
  dO ([b, s, h|hkv, d]) and the same packed ([b*s, h|hkv, d])."""
  qkvo = _inputs(b, s, h, hkv or h, d, dtype)
  flops_fwd = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
  cu = jnp.arange(b + 1, dtype=jnp.int32) * s
  return (flops_fwd, _mask_config(d, causal), cu, qkvo,
          tuple(map(_pack, qkvo)))


def correctness(records):
  # Imported here so that --fwd-probe / --ir-stats never depend on them.
  from pallas_kernels.flash.backward import flash_backward
  from pallas_kernels.reference import attention_reference
  cases = [
      dict(b=1, s=256, hq=2, hkv=2, d=64, causal=False, diag=True),
      dict(b=1, s=256, hq=2, hkv=2, d=64, causal=False, diag=True,
           mode="recompute"),
      dict(b=2, s=1000, hq=8, hkv=8, d=128, causal=True, mode="recompute"),
      dict(b=2, s=1000, hq=8, hkv=8, d=128, causal=True),
      dict(b=2, s=777, hq=8, hkv=2, d=64, causal=False),
      dict(b=1, s=1024, hq=4, hkv=1, d=96, causal=True, window=(200, 0)),
      dict(b=1, s=513, hq=4, hkv=4, d=256, causal=True, softcap=30.0),
      dict(b=2, s=300, hq=4, hkv=2, d=32, causal=False, sinks=True),
  ]
  for c in cases:
    for dtype in ((jnp.bfloat16,) if c.get("diag") else
                  (jnp.bfloat16, jnp.float32)):
      q, k, v, do = _inputs(c["b"], c["s"], c["hq"], c["hkv"], c["d"], dtype)
      sinks = (jax.random.normal(jax.random.PRNGKey(9), (c["hq"],))
               if c.get("sinks") else None)
      window = c.get("window", (-1, -1))
      cfg = MaskConfig.make(causal=c["causal"], window_size=window,
                            has_segments=False, softcap=c.get("softcap", 0.0),
                            scale=c["d"] ** -0.5)
      cu = jnp.arange(c["b"] + 1, dtype=jnp.int32) * c["s"]
      bf = block_sizes_for(compute_capability=(9, 0), head_dim=c["d"],
                           dtype=dtype, mode="fwd", interpret=False)
      bb = block_sizes_for(compute_capability=(9, 0), head_dim=c["d"],
                           dtype=dtype, mode="bwd", interpret=False)
      out, lse2 = flash_forward(_pack(q), _pack(k), _pack(v), cu, cu,
                                sinks=sinks, cfg=cfg, blocks=bf,
                                max_seqlen_q=c["s"])
      mode = c.get("mode", "atomic")
      grads = [flash_backward(_pack(q), _pack(k), _pack(v), out, lse2,
                              _pack(do), cu, cu, sinks=sinks, cfg=cfg,
                              blocks=bb, max_seqlen_q=c["s"],
                              max_seqlen_k=c["s"], dq_mode=mode)
               for _ in range(3)]
      if c.get("diag"):
        interp = flash_backward(_pack(q), _pack(k), _pack(v), out, lse2,
                                _pack(do), cu, cu, sinks=sinks, cfg=cfg,
                                blocks=bb, max_seqlen_q=c["s"],
                                max_seqlen_k=c["s"], dq_mode=mode,
                                interpret=True)
        a = np.asarray(grads[0][0], np.float32).ravel()
        b_ = np.asarray(interp[0], np.float32).ravel()
        nz = np.abs(b_) > 1e-3
        ratio = a[nz] / b_[nz]
        print("DIAG", mode, "triton vs interpret dq ratio: median",
              np.median(ratio), "p5", np.percentile(ratio, 5), "p95",
              np.percentile(ratio, 95), "first", a[:6], b_[:6],
              "dk equal", bool(np.array_equal(np.asarray(grads[0][1]),
                                               np.asarray(interp[1]))),
              flush=True)
      repeat = all(
          all(bool(jnp.all(a == b)) for a, b in zip(g[:3], grads[0][:3]))
          for g in grads[1:])
      f = lambda q, k, v: attention_reference(
          q, k, v, causal=c["causal"], window_size=window, sinks=sinks,
          softcap=c.get("softcap", 0.0))[0]
      ro, vjp = jax.vjp(f, q.astype(jnp.float32), k.astype(jnp.float32),
                        v.astype(jnp.float32))
      rq, rk, rv = vjp(do.astype(jnp.float32))

      def rel(a, b):
        a = a.reshape(b.shape).astype(jnp.float32)
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

      dq, dk, dv, _ = grads[0]
      rec = dict(kind="correctness", dtype=jnp.dtype(dtype).name, **c,
                 out=rel(out, ro), dq=rel(dq, rq), dk=rel(dk, rk),
                 dv=rel(dv, rv), bitwise_repeatable=repeat,
                 nan=bool(jnp.any(jnp.isnan(out)) or jnp.any(jnp.isnan(dq))))
      print(rec, flush=True)
      records.append(rec)


def sweep(records, b, s, h, d, causal, fwd_cands, bwd_cands,
          modes=("atomic", "recompute")):
  from pallas_kernels.flash.backward import flash_backward
  dtype = jnp.bfloat16
  flops_fwd, cfg, cu, (q, k, v, do), (pq, pk, pv, pdo) = _packed_problem(
      b, s, h, d, causal, dtype)
  best_fwd = None
  best_bwd = {}
  for bs in fwd_cands:
    try:
      fn = jax.jit(lambda q, k, v, bs=bs: flash_forward(
          q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s))
      ms = _time(fn, pq, pk, pv)
      rec = dict(kind="fwd", b=b, s=s, h=h, d=d, causal=causal,
                 blocks=bs.to_dict(), ms=ms, tflops=flops_fwd / ms / 1e9)
      if best_fwd is None or ms < best_fwd[0]:
        best_fwd = (ms, bs)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="fwd", blocks=bs.to_dict(), error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
  out, lse2 = flash_forward(pq, pk, pv, cu, cu, cfg=cfg, blocks=best_fwd[1],
                            max_seqlen_q=s)
  for bs, mode in itertools.product(bwd_cands, modes):
    try:
      fn = jax.jit(lambda q, k, v, o, l, do, bs=bs, mode=mode: flash_backward(
          q, k, v, o, l, do, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s,
          max_seqlen_k=s, dq_mode=mode)[:3])
      ms = _time(fn, pq, pk, pv, out, lse2, pdo)
      if mode not in best_bwd or ms < best_bwd[mode][0]:
        best_bwd[mode] = (ms, bs)
      rec = dict(kind="bwd", mode=mode, b=b, s=s, h=h, d=d, causal=causal,
                 blocks=bs.to_dict(), ms=ms,
                 tflops=2.5 * flops_fwd / ms / 1e9,
                 fwd_bwd_tflops=3.5 * flops_fwd / (ms + best_fwd[0]) / 1e9)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="bwd", blocks=bs.to_dict(), error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
  major = int(jax.devices()[0].compute_capability.split(".")[0])
  table = {json.dumps([major, d, 2, "fwd"]): best_fwd[1].to_dict()}
  for mode, (_, bs) in best_bwd.items():
    key = "bwd" if mode == "recompute" else "bwd_atomic"
    table[json.dumps([major, d, 2, key])] = bs.to_dict()
  records.append(dict(kind="table", entries=table))
  # cuDNN reference point in the same process.
  try:
    f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    ms = _time(f, q, k, v)
    g = jax.jit(jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn").astype(
            jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
    ms2 = _time(g, q, k, v)
    rec = dict(kind="cudnn", b=b, s=s, h=h, d=d, causal=causal, fwd_ms=ms,
               fwd_tflops=flops_fwd / ms / 1e9, fwdbwd_ms=ms2,
               fwdbwd_tflops=3.5 * flops_fwd / ms2 / 1e9)
  except Exception as e:  # noqa: BLE001
    rec = dict(kind="cudnn", error=repr(e)[:300])
  print(rec, flush=True)
  records.append(rec)


# Forward candidates timed by --fwd-probe (B2 H16 S8192 D128 causal bf16).
# 4-warp 128x64 (2 stages) and 64x64 fit two programs per SM (<= 255
# registers at 128 threads, <= 113 KB shared memory each); the 8-warp ones
# run one program per SM.
FWD_PROBE_CONFIGS = ((128, 64, 4, 2), (128, 128, 8, 3), (128, 128, 8, 2),
                     (128, 64, 8, 3), (64, 64, 4, 3), (256, 64, 8, 2))


# (dK/dV blocks, dQ blocks) timed by --bwd-probe, from `--ir-stats --bwd`
# (pip triton 3.6, sm_90): dK/dV 64x64/4w/2s 255 regs, no stack; dK/dV
# 64x128/8w 254 regs, no stack; dQ 128x64/8w 191 regs and 128x128/8w/2s
# 255 regs, no stack; dQ 128x64/4w/2s spills (352 B stack, 77 LDL/STL in the
# hot loop) and is kept only as the forward-like reference point; dQ
# 128x128/8w/3s needs 256 KB of shared memory (too much).
BWD_PROBE_CONFIGS = (
    ((64, 64, 4, 2), (64, 64, 4, 2)),
    ((64, 64, 4, 2), (128, 64, 8, 2)),
    ((64, 64, 4, 2), (128, 128, 8, 2)),
    ((64, 128, 8, 2), (128, 64, 8, 2)),
    ((64, 128, 8, 3), (128, 128, 8, 2)),
    ((64, 64, 4, 2), (128, 64, 4, 2)),
)


def _blocks(item):
  """'bq,bk,warps,stages[,heads_per_wave]' -> BlockSizes."""
  bq, bk, w, st, *wave = (int(x) for x in item.split(","))
  return BlockSizes(bq, bk, w, st, heads_per_wave=wave[0] if wave else 0)


def _parse_bwd_configs(spec):
  """'64,64,4,2/128,64,4,2;...' -> [(BlockSizes, BlockSizes), ...]; a fifth
  number per kernel sets its heads_per_wave."""
  out = []
  for item in spec.replace(" ", "").split(";"):
    if item:
      kv, dq = item.split("/")
      out.append((_blocks(kv), _blocks(dq)))
  return out


def _probe_compiler(bs: BlockSizes) -> BlockSizes:
  """A probed configuration is compiled by pip Triton under
  FOLDAX_KERNEL_COMPILER=triton, by XLA otherwise."""
  from pallas_kernels.flash.config import compiler_setting, with_compiler
  return with_compiler(bs, "triton" if compiler_setting() == "triton"
                       else "xla")


def _parse_blocks(spec):
  """'128,64,4,2;128,128,8,3,4' -> [BlockSizes, ...] (a fifth number sets
  heads_per_wave)."""
  return [_blocks(item) for item in spec.replace(" ", "").split(";") if item]


def fwd_probe(records, configs, b=2, s=8192, h=16, d=128, causal=True,
              reps=30, inner=5, out_path=None, interpret=False):
  """Times our forward for each of `configs` next to JAX's Pallas mha.

  One process, one input set; every record also carries the relative error
  against mha's output, so a fast but wrong configuration shows. Records are
  appended (and the JSON rewritten) as they finish.
  """
  import warnings
  dtype = jnp.bfloat16
  flops, cfg, cu, (q, k, v, _), (pq, pk, pv, _) = _packed_problem(
      b, s, h, d, causal, dtype)
  shape = dict(b=b, s=s, h=h, d=d, causal=causal, dtype="bfloat16")

  def dump():
    if out_path:
      with open(out_path, "w") as f:
        json.dump(records, f, indent=1)

  ref = None
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as pattn
  for name, bq, bk, w, st in (("jax_mha_tuned", 128, 64, 4, 2),
                              ("jax_mha_default", 128, 128, 8, 2)):
    try:
      fn = jax.jit(lambda q, k, v, bq=bq, bk=bk, w=w, st=st: pattn.mha(
          q, k, v, None, sm_scale=d ** -0.5, causal=causal,
          block_sizes=pattn.BlockSizes(block_q=bq, block_k=bk),
          num_warps=w, num_stages=st, interpret=interpret))
      t0 = time.perf_counter()
      o = jax.block_until_ready(fn(q, k, v))
      compile_s = time.perf_counter() - t0
      if ref is None:
        ref = o.astype(jnp.float32)
      ms = _time(fn, q, k, v, reps=reps, inner=inner)
      rec = dict(kind="fwd_probe", impl=name, **shape,
                 blocks=dict(block_q=bq, block_k=bk, num_warps=w,
                             num_stages=st),
                 ms=ms, tflops=flops / ms / 1e9, compile_s=compile_s)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="fwd_probe", impl=name, error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
    dump()
  for bs in configs:
    try:
      fn = jax.jit(lambda q, k, v, bs=bs: flash_forward(
          q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s,
          interpret=interpret))
      t0 = time.perf_counter()
      o, _ = jax.block_until_ready(fn(pq, pk, pv))
      compile_s = time.perf_counter() - t0
      err = None
      if ref is not None:
        o = o.reshape(ref.shape).astype(jnp.float32)
        err = float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
      ms = _time(fn, pq, pk, pv, reps=reps, inner=inner)
      rec = dict(kind="fwd_probe", impl="ours", **shape, blocks=bs.to_dict(),
                 ms=ms, tflops=flops / ms / 1e9, compile_s=compile_s,
                 rel_err_vs_mha=err)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="fwd_probe", impl="ours", blocks=bs.to_dict(),
                 error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
    dump()
  ok = [r for r in records if r.get("kind") == "fwd_probe" and "ms" in r]
  for r in sorted(ok, key=lambda r: r["ms"]):
    bl = r["blocks"]
    print(f"{r['impl']:16s} {bl['block_q']:4d} {bl['block_k']:4d} "
          f"w{bl['num_warps']} s{bl['num_stages']} "
          f"hw{bl.get('heads_per_wave', 0)}  {r['ms']:.3f} ms  "
          f"{r['tflops']:6.1f} TFLOP/s", flush=True)


def bwd_probe(records, configs, b=2, s=8192, h=16, d=128, causal=True,
              reps=10, inner=5, out_path=None, interpret=False,
              budget_s=60.0, hkv=None):
  """Times the recompute backward for each (dK/dV blocks, dQ blocks) pair.

  The forward runs once (shipped blocks) and is timed once; each candidate
  then times `flash_backward` alone on those residuals (what jax.vjp's
  backward runs), checks that two runs give bitwise equal dq, dk, dv, and
  compares with the first candidate (dK/dV bitwise when its blocks match;
  dQ relative error). Records are appended and the JSON rewritten as they
  finish; candidates are skipped once `budget_s` has passed.
  """
  from pallas_kernels.flash.backward import flash_backward
  t_start = time.perf_counter()
  dtype = jnp.bfloat16
  flops_fwd, cfg, cu, (q, k, v, do), (pq, pk, pv, pdo) = _packed_problem(
      b, s, h, d, causal, dtype, hkv)
  shape = dict(b=b, s=s, h=h, hkv=hkv or h, d=d, causal=causal,
               dtype="bfloat16")

  def dump():
    if out_path:
      with open(out_path, "w") as f:
        json.dump(records, f, indent=1)

  fb = (block_sizes_for(compute_capability=(9, 0), head_dim=d, dtype=dtype,
                        mode="fwd", interpret=False)
        if not interpret else BlockSizes(16, 16, 4, 1))
  fwd = jax.jit(lambda q, k, v: flash_forward(
      q, k, v, cu, cu, cfg=cfg, blocks=fb, max_seqlen_q=s,
      interpret=interpret))
  out, lse2 = jax.block_until_ready(fwd(pq, pk, pv))
  fwd_ms = _time(fwd, pq, pk, pv, reps=reps, inner=inner)
  rec = dict(kind="bwd_probe_fwd", **shape, blocks=fb.to_dict(), ms=fwd_ms,
             tflops=flops_fwd / fwd_ms / 1e9)
  print(rec, flush=True)
  records.append(rec)
  dump()
  base = None
  for kv_bs, dq_bs in configs:
    if time.perf_counter() - t_start > budget_s:
      rec = dict(kind="bwd_probe", dkdv=kv_bs.to_dict(), dq=dq_bs.to_dict(),
                 skipped="time budget")
      print(rec, flush=True)
      records.append(rec)
      dump()
      continue
    try:
      fn = jax.jit(lambda q, k, v, o, l, do, kv_bs=kv_bs, dq_bs=dq_bs:
                   flash_backward(q, k, v, o, l, do, cu, cu, cfg=cfg,
                                  blocks=kv_bs, dq_blocks=dq_bs,
                                  max_seqlen_q=s, max_seqlen_k=s,
                                  interpret=interpret,
                                  dq_mode="recompute",
                                  all_tokens_in_sequences=True)[:3])
      t0 = time.perf_counter()
      g1 = jax.block_until_ready(fn(pq, pk, pv, out, lse2, pdo))
      compile_s = time.perf_counter() - t0
      g2 = jax.block_until_ready(fn(pq, pk, pv, out, lse2, pdo))
      repeat = all(bool(jnp.array_equal(x, y)) for x, y in zip(g1, g2))
      ms = _time(fn, pq, pk, pv, out, lse2, pdo, reps=reps, inner=inner)
      rec = dict(kind="bwd_probe", **shape, dkdv=kv_bs.to_dict(),
                 dq=dq_bs.to_dict(), bwd_ms=ms,
                 bwd_tflops=2.5 * flops_fwd / ms / 1e9,
                 fwd_bwd_ms=ms + fwd_ms,
                 fwd_bwd_tflops=3.5 * flops_fwd / (ms + fwd_ms) / 1e9,
                 compile_s=compile_s, bitwise_repeatable=repeat)
      if base is None:
        base = (kv_bs, g1)
      else:
        ref = base[1][0].astype(jnp.float32)
        rec["dq_rel_err_vs_first"] = float(
            jnp.linalg.norm(g1[0].astype(jnp.float32) - ref) /
            jnp.linalg.norm(ref))
        if kv_bs == base[0]:
          rec["dkdv_bitwise_eq_first"] = all(
              bool(jnp.array_equal(x, y)) for x, y in zip(g1[1:], base[1][1:]))
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="bwd_probe", dkdv=kv_bs.to_dict(), dq=dq_bs.to_dict(),
                 error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
    dump()
  print(f"forward {fwd_ms:.3f} ms (blocks {fb.block_q}x{fb.block_k} "
        f"w{fb.num_warps} s{fb.num_stages})", flush=True)
  ok = [r for r in records if r.get("kind") == "bwd_probe" and "bwd_ms" in r]
  for r in sorted(ok, key=lambda r: r["bwd_ms"]):
    a, c = r["dkdv"], r["dq"]
    print(f"dkdv {a['block_q']:3d}x{a['block_k']:<3d} w{a['num_warps']} "
          f"s{a['num_stages']} hw{a.get('heads_per_wave', 0)} | dq "
          f"{c['block_q']:3d}x{c['block_k']:<3d} w{c['num_warps']} "
          f"s{c['num_stages']} hw{c.get('heads_per_wave', 0)}  bwd "
          f"{r['bwd_ms']:.3f} ms "
          f"{r['bwd_tflops']:6.1f} TFLOP/s  fwd+bwd {r['fwd_bwd_ms']:.3f} ms "
          f"{r['fwd_bwd_tflops']:6.1f}  repeatable "
          f"{r['bitwise_repeatable']}", flush=True)
  print(f"total {time.perf_counter() - t_start:.1f} s", flush=True)


def ir_stats(configs, b=2, s=8192, h=16, d=128, causal=True,
             bwd_configs=None):
  """CPU-only: what the GPU would run, without a GPU.

  Lowers our forward (and JAX's mha at its two settings) for sm_90 with the
  GPU query stubbed (as tests/test_dense.py does), compiles the Triton IR
  with the pip `triton` package's CUDA pipeline (the passes XLA runs for
  Hopper) and its bundled ptxas, and prints registers, stack (spills) and,
  for every SASS loop holding an HGMMA, its instruction count and histogram.
  With `bwd_configs` ((dK/dV blocks, dQ blocks) pairs) it does the same for
  the two recompute-mode backward kernels instead of the forward.
  XLA's own Triton and ptxas may differ in details; use it to compare
  variants, not to predict times.
  """
  import collections
  import re
  import subprocess
  import tempfile
  import warnings
  from jax._src.pallas.triton import gpu_info
  from jax._src.pallas.triton import pallas_call_registration as reg
  from pallas_kernels.triton_ir import capture_triton_ir
  import triton
  from triton._C.libtriton import ir
  from triton.backends.compiler import GPUTarget
  from triton.backends.nvidia.compiler import CUDABackend
  from triton.compiler.compiler import IRSource
  reg.gpu_info_lib.get_gpu_info = lambda *a, **k: gpu_info.GpuInfo(
      gpu_version=gpu_info.GpuVersion.H200, arch_name="9.0",
      compute_capability=90)
  bindir = os.path.join(os.path.dirname(triton.__file__), "backends",
                        "nvidia", "bin")
  target = GPUTarget("cuda", 90, 32)
  backend = CUDABackend(target)
  sds = jax.ShapeDtypeStruct
  cfg = _mask_config(d, causal)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from jax.experimental.pallas.ops.gpu import attention as pattn
  jobs = []
  if bwd_configs is None:
    jobs = [("jax_mha", BlockSizes(128, 64, 4, 2)),
            ("jax_mha", BlockSizes(128, 128, 8, 2))]
    jobs += [("ours", bs) for bs in configs]
  else:
    jobs = [("bwd", pair) for pair in bwd_configs]
  tmp = tempfile.mkdtemp(prefix="fold_ir_")

  def compile_stats(name, ttir, bs):
    path = os.path.join(tmp, name + ".ttir")
    with open(path, "w") as f:
      f.write(ttir)
    ctx = ir.context()
    src = IRSource(path, ctx, backend)
    mod = src.module
    mod.context = ctx
    opts = backend.parse_options(dict(num_warps=bs.num_warps,
                                      num_stages=bs.num_stages))
    stages = {}
    backend.add_stages(stages, opts, src.language)
    md = {"hash": name, "target": target, **opts.__dict__}
    for ext, fn in stages.items():
      mod = fn(mod, md)
      if ext in ("ttgir", "ptx"):
        with open(os.path.join(tmp, f"{name}.{ext}"), "w") as f:
          f.write(str(mod))
    cubin = os.path.join(tmp, name + ".cubin")
    with open(cubin, "wb") as f:
      f.write(mod)
    usage = subprocess.run([os.path.join(bindir, "cuobjdump"),
                            "--dump-resource-usage", cubin],
                           capture_output=True, text=True).stdout
    res = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    sass = subprocess.run([os.path.join(bindir, "cuobjdump"), "-sass", cubin],
                          capture_output=True, text=True).stdout
    with open(os.path.join(tmp, name + ".sass"), "w") as f:
      f.write(sass)
    ins = [(int(m.group(1), 16), m.group(2).strip())
           for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+([^;]*);", sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, t) in enumerate(ins):
      m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", t)
      if m and m.group(1) and int(m.group(1), 16) < a:
        body = [x for _, x in ins[at[int(m.group(1), 16)]:i + 1]]
        if any("HGMMA" in x for x in body):
          ops = collections.Counter(
              re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
              for x in body)
          loops.append((len(body), ops))
    total_spill = sum(1 for _, x in ins if re.search(r"\b(LDL|STL)\b", x))
    print(f"{name}: regs {res.group(1)} stack {res.group(2)} bytes, "
          f"shared {md.get('shared')} B, {total_spill} LDL/STL in all",
          flush=True)
    for n, ops in loops:
      top = ", ".join(f"{k} {v}" for k, v in ops.most_common(14))
      spill = ops.get("LDL", 0) + ops.get("STL", 0)
      print(f"   loop: {n} instructions, {spill} spill ld/st; {top}",
            flush=True)

  def capture(fn, *args):
    return [ir for _, ir, _ in capture_triton_ir(jax.jit(fn), args)]

  for impl, bs in jobs:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      if impl == "bwd":
        from pallas_kernels.flash.backward import flash_backward
        kv_bs, dq_bs = bs
        q = sds((b * s, h, d), jnp.bfloat16)
        cu = sds((b + 1,), jnp.int32)
        rows = sds((h, b * s), jnp.float32)
        captured = capture(
            lambda q, k, v, o, l, do, cu, kv_bs=kv_bs, dq_bs=dq_bs:
            flash_backward(q, k, v, o, l, do, cu, cu, cfg=cfg, blocks=kv_bs,
                           dq_blocks=dq_bs, max_seqlen_q=s, max_seqlen_k=s,
                           dq_mode="recompute"),
            q, q, q, q, rows, q, cu)
        kernels = [("dkdv", kv_bs, "fold_flash_backward_dkdv"),
                   ("dq", dq_bs, "fold_flash_backward_dq")]
        for kname, kbs, tag in kernels:
          mods = [m for m in captured if tag in m]
          tiles = (f"{kbs.block_q}_{kbs.block_k}_w{kbs.num_warps}"
                   f"s{kbs.num_stages}")
          compile_stats(f"bwd_{kname}_{tiles}", mods[0], kbs)
        continue
      if impl == "ours":
        q = sds((b * s, h, d), jnp.bfloat16)
        cu = sds((b + 1,), jnp.int32)
        captured = capture(lambda q, k, v, cu, bs=bs: flash_forward(
            q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s), q, q, q, cu)
      else:
        q = sds((b, s, h, d), jnp.bfloat16)
        captured = capture(lambda q, k, v, bs=bs: pattn.mha(
            q, k, v, None, sm_scale=d ** -0.5, causal=causal,
            block_sizes=pattn.BlockSizes(bs.block_q, bs.block_k),
            num_warps=bs.num_warps, num_stages=bs.num_stages), q, q, q)
    name = (f"{impl}_{bs.block_q}_{bs.block_k}_w{bs.num_warps}"
            f"s{bs.num_stages}")
    compile_stats(name, captured[0], bs)
  print("IR, PTX and cubins in", tmp)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe.json")
  p.add_argument("--skip-correctness", action="store_true")
  p.add_argument("--sweep", default="small")
  p.add_argument("--write-table", default=None,
                 help="write the fastest blocks as a FOLDAX_BLOCK_TABLE file")
  p.add_argument("--fwd-probe", action="store_true",
                 help="only time the forward (B2 H16 S8192 D128 causal bf16) "
                      "for --fwd-blocks next to JAX's Pallas mha; ~1 min")
  p.add_argument("--fwd-shape", default="2,8192,16,128",
                 help="b,s,h,d for --fwd-probe (causal, bf16); --bwd-probe "
                      "also takes b,s,h,d,h_kv (GQA)")
  p.add_argument("--interpret", action="store_true",
                 help="--fwd-probe in interpret mode (CPU smoke test only)")
  p.add_argument("--fwd-reps", type=int, default=30)
  p.add_argument("--fwd-blocks", default=None,
                 help="'bq,bk,warps,stages;...' for --fwd-probe (default: "
                      "FWD_PROBE_CONFIGS)")
  p.add_argument("--ir-stats", action="store_true",
                 help="CPU only: compile the forward for sm_90 with the pip "
                      "triton package and print registers, spills and the "
                      "SASS of its loops (needs `triton`; no GPU)")
  p.add_argument("--bwd", action="store_true",
                 help="with --ir-stats: the recompute backward's dK/dV and "
                      "dQ kernels for --bwd-configs instead of the forward")
  p.add_argument("--bwd-probe", action="store_true",
                 help="only time the recompute backward (B2 H16 S8192 D128 "
                      "causal bf16) for --bwd-configs; ~1 min")
  p.add_argument("--bwd-configs", default=None,
                 help="'kvq,kvk,w,s/dqq,dqk,w,s;...' (dK/dV blocks / dQ "
                      "blocks) for --bwd-probe and --ir-stats --bwd "
                      "(default: BWD_PROBE_CONFIGS)")
  p.add_argument("--bwd-reps", type=int, default=10)
  p.add_argument("--bwd-budget", type=float, default=60.0,
                 help="seconds after which --bwd-probe skips candidates")
  a = p.parse_args(argv)
  bwd_configs = (_parse_bwd_configs(a.bwd_configs) if a.bwd_configs else
                 [(BlockSizes(*kv), BlockSizes(*dq))
                  for kv, dq in BWD_PROBE_CONFIGS])
  if a.ir_stats:
    ir_stats(_parse_blocks(a.fwd_blocks) if a.fwd_blocks else
             [BlockSizes(*c) for c in FWD_PROBE_CONFIGS],
             bwd_configs=bwd_configs if a.bwd else None)
    return
  records = [dict(kind="meta", device=str(jax.devices()[0]),
                  jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                  argv=sys.argv)]
  if os.environ.get("FOLDAX_GIT_COMMIT"):
    records[0]["git_commit"] = os.environ["FOLDAX_GIT_COMMIT"]
  bwd_configs = [(_probe_compiler(kv), _probe_compiler(dq))
                 for kv, dq in bwd_configs]
  if a.bwd_probe:
    b, s_, h, d, *hkv = (int(x) for x in a.fwd_shape.split(","))
    bwd_probe(records, bwd_configs, b=b, s=s_, h=h, d=d, reps=a.bwd_reps,
              inner=1 if a.interpret else 5, out_path=a.out,
              interpret=a.interpret, hkv=hkv[0] if hkv else None,
              budget_s=a.bwd_budget)
    return
  if a.fwd_probe:
    configs = [_probe_compiler(c) for c in (
        _parse_blocks(a.fwd_blocks) if a.fwd_blocks else
        [BlockSizes(*c) for c in FWD_PROBE_CONFIGS])]
    b, s_, h, d = (int(x) for x in a.fwd_shape.split(","))
    fwd_probe(records, configs, b=b, s=s_, h=h, d=d, reps=a.fwd_reps,
              inner=1 if a.interpret else 5, out_path=a.out,
              interpret=a.interpret)
    return
  if not a.skip_correctness:
    correctness(records)
  B = BlockSizes
  if a.sweep == "small":
    fwd = [B(128, 64, 8, 3), B(128, 64, 4, 2), B(128, 128, 8, 3),
           B(128, 64, 8, 4), B(64, 128, 4, 3), B(128, 128, 8, 2)]
    bwd = [B(64, 128, 8, 2), B(128, 128, 8, 2), B(64, 64, 4, 2),
           B(128, 64, 8, 2)]
  else:
    fwd = [B(bq, bk, w, st) for bq, bk, w, st in itertools.product(
        (64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    bwd = [B(bq, bk, w, st) for bq, bk, w, st in itertools.product(
        (32, 64, 128), (64, 128), (4, 8), (1, 2))]
  sweep(records, 2, 8192, 16, 128, True, fwd, bwd)
  sweep(records, 4, 4096, 16, 64, False, fwd[:3], bwd[:3])
  with open(a.out, "w") as f:
    json.dump(records, f, indent=1)
  if a.write_table:
    table = {}
    for r in records:
      if r.get("kind") == "table":
        table.update(r["entries"])
    with open(a.write_table, "w") as f:
      json.dump(table, f, indent=1)


if __name__ == "__main__":
  main()
