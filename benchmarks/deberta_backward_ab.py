"""The DeBERTa backward kernels with and without `seq_lens`, A/B in one
process: what skipping right-padded rows' padding tiles and token-mask
reads saves in training (one layer of DeBERTa-v3-base: 12 heads of 64, 256
position buckets, c2p and p2c), and whether the bits agree.

    python -m benchmarks.deberta_backward_ab --out ab.json \
        [--points b8-l512,b8-l512-ragged,b2-l2048] [--dtype bf16]

Times `pallas_kernels.deberta.backward.disentangled_backward` (the dQ,
dK/dV and band kernels and XLA's position-gradient GEMMs; the position
tables are inputs), jitted, with `benchmarks._timing.time_jax`. "all ones":
a dense batch with HF's all-ones mask (every row a prefix); "ragged": rows
of lengths L, 3L/4, L/2 and L/4, repeated (right padding).
"""

from __future__ import annotations

import argparse
import functools
import json
import time


def _point(spec: str):
  ragged = spec.endswith("-ragged")
  b, l = spec.removesuffix("-ragged").split("-")
  return int(b[1:]), int(l[1:]), ragged


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--points", default="b8-l512,b8-l512-ragged,b2-l2048")
  p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
  p.add_argument("--target-s", type=float, default=0.5)
  p.add_argument("--interpret", action="store_true",
                 help="CPU smoke test (tiny points; the times mean nothing)")
  a = p.parse_args(argv)

  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks import _timing as T
  from jax_api.deberta.attention import _used_lengths
  from pallas_kernels.deberta.layout import geometry
  from pallas_kernels.deberta.backward import disentangled_backward
  from pallas_kernels.deberta.config import KernelConfig, blocks_for
  from pallas_kernels.deberta.forward import disentangled_forward

  dt = jnp.bfloat16 if a.dtype == "bf16" else jnp.float16
  heads, d, buckets, max_rel = 12, 64, 256, 512
  g = geometry(buckets, max_rel)
  blocks = blocks_for(head_dim=d, dtype=dt, interpret=a.interpret)
  recs = [dict(kind="meta", device=str(jax.devices()[0]),
               jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
               dtype=a.dtype)]
  for spec in a.points.split(","):
    b, l, ragged = _point(spec)
    lengths = ([l, 3 * l // 4, l // 2, l // 4] * b)[:b] if ragged else [l] * b
    mask = (np.arange(l)[None, :] < np.asarray(lengths)[:, None])
    tm = jnp.asarray(mask.reshape(-1).astype(np.int32))
    cu = jnp.arange(b + 1, dtype=jnp.int32) * l
    ks = jax.random.split(jax.random.key(0), 6)
    q, k, v, do = (jax.random.normal(x, (b * l, heads, d), dt)
                   for x in ks[:4])
    pk, pq = (jax.random.normal(x, (2 * g.span, heads, d), dt) * 0.5
              for x in ks[4:])
    c = jnp.einsum("thd,phd->thp", q, pk).astype(dt)
    pt = jnp.einsum("thd,phd->thp", k, pq).astype(dt)
    cfg = KernelConfig(g, True, True, True, 0.0, d, True)
    lens = _used_lengths(tm, cu, l)
    out, lse2 = jax.jit(functools.partial(
        disentangled_forward, cfg=cfg, blocks=blocks.fwd, max_seqlen=l,
        interpret=a.interpret))(
            q, k, v, c, pt, cu, tm, None, lens)
    bwd = jax.jit(functools.partial(disentangled_backward, cfg=cfg,
                                    blocks=blocks, max_seqlen=l,
                                    interpret=a.interpret))
    args = (q, k, v, pk, pq, c, pt, out, lse2, do, cu, tm, None)
    rec = dict(kind="deberta_backward", point=spec, B=b, L=l,
               lengths=sorted(set(lengths), reverse=True))
    g_mask = bwd(*args, None)
    g_lens = bwd(*args, lens)
    rec["same_bits"] = all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(g_mask, g_lens))
    for name, extra in (("token_mask_only", None), ("with_seq_lens", lens)):
      t = T.time_jax(lambda *xs, e=extra: bwd(*xs, e), [args],
                     target_s=a.target_s)
      rec[name + "_ms"] = t["ms"]
    rec["speedup"] = rec["token_mask_only_ms"] / rec["with_seq_lens_ms"]
    recs.append(rec)
    print(json.dumps(rec), flush=True)
    with open(a.out, "w") as f:
      json.dump(recs, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
