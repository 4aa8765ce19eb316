"""Per-block timings behind the README's context-parallel PROJECTION.

    python -m benchmarks.ring_block                       (one GPU, ~2 min)
    python -m benchmarks.ring_block --output ring_block.json
    python -m benchmarks.ring_block --smoke               (CPU, seconds)

What a device of the causal zig-zag ring computes, for a global length S on
n devices (chunks of C = S / 2n tokens, local shards of L = 2C):
  * ring step 0 (its own K/V): its two chunks against themselves, i.e. the
    work of one causal L x L block ("diag");
  * each of the other n - 1 steps: two fully visible C x C blocks, one
    non-causal call of 2C queries x C keys or C queries x 2C keys ("off";
    both shapes are timed, they alternate with the step).
Each is timed forward and forward+backward (loss sum(out * w), gradients in
q, k, v) at B1 H16 D128 bf16 by default, for S in {32768, 131072}, n = 8.

Three implementations per block:
  pallas   `fold_attn_func(..., backend="pallas")`: the dense Triton kernel
           at the step's shape (bf16): the flash kernel's cost, a floor.
  ring_step the kernels one step of `ring_attention(..., backend="pallas")`
           launches (`pallas_kernels.flash.ring_step`, bf16): forward = the
           row-max pass and the grid-accumulating pass; forward+backward
           adds the dQ pass and the dK/dV pass (the once-per-ring D and
           unit computations are left out).
  xla_f32  the dense XLA path (`pallas_kernels.flash.xla`) in float32 with
           blocks of `jax_api.sharding.default_block_size(S)` tokens: the
           per-pair computation the ring runs today. The ring's forward
           adds a row-max pass (the scores again, no P.V) on top.

Prints one JSON document (and writes it with --output): for every
(S, block, impl, mode) the median ms and the names the README's projection
uses (T_DIAG_FWD, T_OFF_FWD, T_DIAG_FWDBWD, T_OFF_FWDBWD).
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks import _timing


def _inputs(B, Sq, Sk, H, D, dtype, seed):
  import jax
  import jax.numpy as jnp
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, Sq, H, D), dtype)
  k = jax.random.normal(ks[1], (B, Sk, H, D), dtype)
  v = jax.random.normal(ks[2], (B, Sk, H, D), dtype)
  w = jax.random.normal(ks[3], (B, Sq, H, D), dtype)
  return q, k, v, w


def _fns(impl, causal, block, interpret):
  """(forward, forward+backward) of one block for `impl`."""
  import jax
  import jax.numpy as jnp
  if impl == "ring_step":
    return _ring_step_fns(causal, block, interpret)
  if impl == "pallas":
    from jax_api import fold_attn_func
    be = "interpret" if interpret else "pallas"

    def fwd(q, k, v, w):
      return fold_attn_func(q, k, v, causal=causal, backend=be)
  else:
    from pallas_kernels.flash import xla
    from pallas_kernels.reference.dense import dense_mask_spec

    def fwd(q, k, v, w):
      q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
      cfg = xla.make_config(q, k, v, None, causal=causal,
                            window_size=(-1, -1), softcap=0.0,
                            softmax_scale=None, chunk_size=block)
      b = q.shape[0]
      return xla.forward(cfg, q, k, v, dense_mask_spec(b, q.shape[1]),
                         dense_mask_spec(b, k.shape[1]), None)[0]

    def fwdbwd_xla(q, k, v, w):
      q, k, v, w = (x.astype(jnp.float32) for x in (q, k, v, w))
      cfg = xla.make_config(q, k, v, None, causal=causal,
                            window_size=(-1, -1), softcap=0.0,
                            softmax_scale=None, chunk_size=block)
      b = q.shape[0]
      qs, kss = dense_mask_spec(b, q.shape[1]), dense_mask_spec(b, k.shape[1])
      out, lse = xla.forward(cfg, q, k, v, qs, kss, None)
      return xla.backward(cfg, q, k, v, qs, kss, None, out, lse, w,
                          jnp.zeros_like(lse))[:3]
    return jax.jit(fwd), jax.jit(fwdbwd_xla)

  def loss(q, k, v, w):
    return jnp.sum(fwd(q, k, v, w).astype(jnp.float32) * w)
  return jax.jit(fwd), jax.jit(jax.grad(loss, (0, 1, 2)))


def _ring_step_fns(causal, block, interpret):
  import jax
  import jax.numpy as jnp
  from pallas_kernels.flash import ring_step
  from pallas_kernels.flash.tiles import MaskConfig

  def setup(q, k):
    b, sq, h, d = q.shape
    cfg = MaskConfig.make(causal=causal, window_size=(-1, -1),
                          has_segments=False, softcap=0.0, scale=d**-0.5)
    kw = dict(cfg=cfg, block=block, batch=b, interpret=interpret)
    pos = (jnp.arange(sq, dtype=jnp.int32), jnp.arange(k.shape[1],
                                                       dtype=jnp.int32))
    return kw, pos

  def packed(x):
    return x.reshape((-1,) + x.shape[2:])

  def fwd(q, k, v, w):
    kw, (qp, kp) = setup(q, k)
    q, k, v = packed(q), packed(k), packed(v)
    m = ring_step.query_pass(q, k, v, qp, kp, mode="max", **kw)
    ref2 = jnp.where(jnp.isfinite(m), m, 0.0)
    units = jnp.array([2.0**30, 2.0**40], jnp.float32)
    acc = jnp.zeros((3,) + q.shape, jnp.int32)
    den = jnp.zeros((3, q.shape[1], q.shape[0]), jnp.int32)
    return ring_step.query_pass(q, k, v, qp, kp, None, None, ref2, units,
                                acc, den, mode="forward", **kw), ref2

  def fwdbwd(q, k, v, w):
    kw, (qp, kp) = setup(q, k)
    (acc, _), ref2 = fwd(q, k, v, w)
    q, k, v, w = packed(q), packed(k), packed(v), packed(w)
    delta = jnp.zeros_like(ref2)
    units = jnp.array([2.0**30, 2.0**30], jnp.float32)
    dq = ring_step.query_pass(q, k, v, qp, kp, None, None, w, ref2, delta,
                              units[:1], jnp.zeros_like(acc), mode="dq",
                              **kw)
    zkv = jnp.zeros((3,) + k.shape, jnp.int32)
    return acc, dq, ring_step.key_pass(q, k, v, qp, kp, None, None, w, ref2,
                                       delta, units, zkv, zkv, **kw)
  return jax.jit(lambda *a: fwd(*a)[0]), jax.jit(fwdbwd)


def run(seqs, devices, heads, head_dim, dtype_name, impls, interpret,
        target_s):
  import jax
  import jax.numpy as jnp
  from jax_api.sharding import default_block_size
  dtype = {"bf16": jnp.bfloat16, "fp16": jnp.float16,
           "fp32": jnp.float32}[dtype_name]
  dev = jax.devices()[0]
  doc = dict(device=f"{dev.platform} ({dev.device_kind})", devices=devices,
             heads=heads, head_dim=head_dim, dtype=dtype_name, batch=1,
             rows=[], projection_inputs={})
  for S in seqs:
    if S % (2 * devices):
      raise ValueError(f"--seqs: {S} is not divisible by 2 x devices.")
    C = S // (2 * devices)
    L = 2 * C
    block = default_block_size(S)
    shapes = {"diag": (L, L, True), "off_q2c": (L, C, False),
              "off_k2c": (C, L, False)}
    for impl in impls:
      for name, (sq, sk, causal) in shapes.items():
        args = [_inputs(1, sq, sk, heads, head_dim, dtype, s)
                for s in range(2)]
        fns = _fns(impl, causal, block, interpret)
        for mode, fn in zip(("fwd", "fwd+bwd"), fns):
          row = dict(S=S, block=name, Sq=sq, Sk=sk, causal=causal, impl=impl,
                     mode=mode, pair_block=block)
          try:
            t = _timing.time_jax(fn, args, target_s=target_s)
            row.update(ms=t["ms"], ms_min=t["ms_min"], ms_max=t["ms_max"])
            flops = _timing.attention_flops(1, heads, sq, sk, head_dim,
                                            causal, mode)
            row["tflops"] = flops / (t["ms"] * 1e-3) / 1e12
          except Exception as err:  # one failure must not end the run
            row["error"] = f"{type(err).__name__}: {err}"[:400]
          doc["rows"].append(row)
          print(json.dumps(row), file=sys.stderr, flush=True)
      ms = {(r["block"], r["mode"]): r.get("ms") for r in doc["rows"]
            if r["S"] == S and r["impl"] == impl}

      def off(mode):
        a, b = ms.get(("off_q2c", mode)), ms.get(("off_k2c", mode))
        return None if a is None or b is None else (a + b) / 2
      doc["projection_inputs"][f"{impl}_S{S}"] = dict(
          T_DIAG_FWD=ms.get(("diag", "fwd")), T_OFF_FWD=off("fwd"),
          T_DIAG_FWDBWD=ms.get(("diag", "fwd+bwd")),
          T_OFF_FWDBWD=off("fwd+bwd"), unit="ms")
  return doc


def build_parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seqs", default="32768,131072",
                 help="global sequence lengths S, comma separated")
  p.add_argument("--devices", type=int, default=8)
  p.add_argument("--heads", type=int, default=16)
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
  p.add_argument("--impls", default="pallas,ring_step,xla_f32")
  p.add_argument("--target-s", type=float, default=0.3)
  p.add_argument("--smoke", action="store_true",
                 help="tiny CPU shapes (S 64, 2 heads, d 16; Pallas in "
                 "interpret mode): checks the harness, times nothing real")
  p.add_argument("--output", default=None)
  return p


def main(argv=None) -> int:
  a = build_parser().parse_args(argv)
  impls = a.impls.split(",")
  for i in impls:
    if i not in ("pallas", "ring_step", "xla_f32"):
      raise ValueError(f"--impls: unknown {i!r}; known: pallas, ring_step, "
                       "xla_f32.")
  if a.smoke:
    doc = run([64], 2, 2, 16, "fp32", impls, True, 0.01)
  else:
    doc = run([int(s) for s in a.seqs.split(",")], a.devices, a.heads,
              a.head_dim, a.dtype, impls, False, a.target_s)
  text = json.dumps(doc, indent=1, default=str)
  print(text)
  if a.output:
    with open(a.output, "w") as f:
      f.write(text)
  return 0 if all("error" not in r for r in doc["rows"]) else 1


if __name__ == "__main__":
  sys.exit(main())
