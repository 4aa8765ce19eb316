"""GPU probe and opt-in autotuner for the dense kernels: correctness,
determinism and a block-size sweep in one process.

    python -m benchmarks.kernel_probe --out probe.json \
        [--write-table blocks.json]

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
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.flash._tiles import MaskConfig
from pallas_kernels.flash.backward import flash_backward
from pallas_kernels.flash.config import BlockSizes, block_sizes_for
from pallas_kernels.flash.forward import flash_forward
from pallas_kernels.reference import attention_reference


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


def correctness(records):
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
  dtype = jnp.bfloat16
  q, k, v, do = _inputs(b, s, h, h, d, dtype)
  flops_fwd = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
  cfg = MaskConfig.make(causal=causal, window_size=(-1, -1),
                        has_segments=False, softcap=0.0, scale=d ** -0.5)
  cu = jnp.arange(b + 1, dtype=jnp.int32) * s
  pq, pk, pv, pdo = map(_pack, (q, k, v, do))
  best_fwd = None
  best_bwd = {}
  for bs in fwd_cands:
    try:
      fn = jax.jit(lambda q, k, v, bs=bs: flash_forward(
          q, k, v, cu, cu, cfg=cfg, blocks=bs, max_seqlen_q=s))
      ms = _time(fn, pq, pk, pv)
      rec = dict(kind="fwd", b=b, s=s, h=h, d=d, causal=causal,
                 blocks=bs.__dict__, ms=ms, tflops=flops_fwd / ms / 1e9)
      if best_fwd is None or ms < best_fwd[0]:
        best_fwd = (ms, bs)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="fwd", blocks=bs.__dict__, error=repr(e)[:300])
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
                 blocks=bs.__dict__, ms=ms,
                 tflops=2.5 * flops_fwd / ms / 1e9,
                 fwd_bwd_tflops=3.5 * flops_fwd / (ms + best_fwd[0]) / 1e9)
    except Exception as e:  # noqa: BLE001
      rec = dict(kind="bwd", blocks=bs.__dict__, error=repr(e)[:300])
    print(rec, flush=True)
    records.append(rec)
  major = int(jax.devices()[0].compute_capability.split(".")[0])
  table = {json.dumps([major, d, 2, "fwd"]): best_fwd[1].__dict__}
  for mode, (_, bs) in best_bwd.items():
    key = "bwd" if mode == "recompute" else "bwd_atomic"
    table[json.dumps([major, d, 2, key])] = bs.__dict__
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


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default="probe.json")
  p.add_argument("--skip-correctness", action="store_true")
  p.add_argument("--sweep", default="small")
  p.add_argument("--write-table", default=None,
                 help="write the fastest blocks as a FOLDAX_BLOCK_TABLE file")
  a = p.parse_args(argv)
  records = [dict(kind="meta", device=str(jax.devices()[0]),
                  jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                  argv=sys.argv)]
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
