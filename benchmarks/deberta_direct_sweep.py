"""Block-size sweep of the DeBERTa forward as the torch bridge launches it.

`torch_bridge._direct.DebertaPlan` compiles the Pallas kernels' Triton IR
with pip Triton and launches it on torch's stream; the same IR gets other
code from XLA's built-in Triton (what `benchmarks.deberta_sweep` measures,
through the jitted JAX encoder). This tool times the plan's forward (both
position tables and the attention kernel, one layer of DeBERTa-v3-base:
12 heads of 64, 256 position buckets, c2p and p2c, fp16) per candidate
forward tile, with CUDA events, and optionally the XLA-compiled JAX path on
the same inputs, so the two compilers are compared tile by tile.

  python -m benchmarks.deberta_direct_sweep --out /tmp/dsweep.json \
      [--points b16-l512,b16-l512-ragged,b4-l2048] \
      [--fwd "64,128,4,2;64,64,8,2"] [--table "128,128,8,1"] [--xla]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

_FWD = ("64,128,4,2;64,64,4,2;64,64,8,2;128,64,8,2;128,64,4,2;64,128,8,2;"
        "32,128,4,2;32,64,4,2;128,32,4,2;64,128,4,3;64,64,4,3;128,128,8,2;"
        "64,32,4,2;32,128,8,2")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--points", default="b16-l512,b16-l512-ragged,b4-l2048")
  p.add_argument("--fwd", default=_FWD)
  p.add_argument("--table", default="",
                 help="position-table GEMM tiles to time (with the shipped "
                      "forward tiles) after the forward candidates")
  p.add_argument("--xla", action="store_true",
                 help="also time the XLA-compiled JAX path per candidate")
  p.add_argument("--target-s", type=float, default=0.4)
  p.add_argument("--without-mask", action="store_true",
                 help="also time each point with no token mask (what the "
                      "mask costs; only meaningful where it is all ones)")
  a = p.parse_args(argv)

  import jax
  import numpy as np
  import torch

  from benchmarks import _timing as T
  from benchmarks.deberta import point_inputs
  from benchmarks.kernel_probe import _parse_blocks
  from torch_bridge import _direct
  from torch_bridge import deberta as tdb

  if not torch.cuda.is_available():
    raise SystemExit("benchmarks.deberta_direct_sweep times the torch "
                     "bridge's launch on CUDA: it needs an NVIDIA GPU (the "
                     "JAX path's own sweep: benchmarks.deberta_sweep).")
  heads, d, rows = 12, 64, 512
  cfg = tdb._static("pallas", 256, 512, True, True, 0.0, 0)
  cc = torch.cuda.get_device_capability()
  records = [{"kind": "meta", "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": torch.cuda.get_device_name(), "jax": jax.__version__,
              "torch": torch.__version__, "argv": argv,
              "git_commit": os.environ.get("FOLDAX_GIT_COMMIT")}]
  tmp = tempfile.mkdtemp(prefix="ddsweep_")

  def dump():
    with open(a.out, "w") as f:
      json.dump(records, f, indent=1)

  inputs = {}
  rng = np.random.default_rng(0)
  for name in a.points.split(","):
    b, l = (int(x[1:]) for x in name.split("-")[:2])
    _, mask, _ = point_inputs(b, l, name.endswith("ragged"), 1000)
    qkv = [rng.standard_normal((b, l, heads, d), np.float32)
           for _ in range(3)]
    pos = [rng.standard_normal((rows, heads, d), np.float32)
           for _ in range(2)]
    t = [torch.from_numpy(x).to("cuda", torch.float16) for x in qkv + pos]
    m = mask.to("cuda", torch.int32)
    inputs[name] = (t, m, b, l)
  base = {}
  jobs = [("fwd", bs) for bs in _parse_blocks(a.fwd)]
  jobs += [("table", bs) for bs in _parse_blocks(a.table)]
  for kern, bs in jobs:
    path = os.path.join(tmp, f"o{len(records)}.json")
    with open(path, "w") as f:
      json.dump({f"{kern}/{d}/2": bs.to_dict()}, f)
    os.environ["FOLDAX_DEBERTA_BLOCKS"] = path
    tag = (f"{'table ' if kern == 'table' else ''}{bs.block_q}x{bs.block_k}"
           f"/w{bs.num_warps}s{bs.num_stages}")
    runs = [(name, True) for name in inputs]
    if a.without_mask:
      runs += [(name, False) for name in inputs]
    for name, with_mask in runs:
      t, m, b, l = inputs[name]
      r = dict(blocks=tag, point=name if with_mask else name + "/no-mask")
      try:
        shape = _direct._DebertaShape(b, l, heads, d, torch.float16,
                                      with_mask, rows)
        t0 = time.perf_counter()
        plan = _direct.DebertaPlan(cfg, shape, cc)
        q, k, v, pk, pq = t
        if not with_mask:
          m = None
        out = plan.forward(q, k, v, pk, pq, m)
        torch.cuda.synchronize()
        r["build_s"] = round(time.perf_counter() - t0, 2)
        valid = inputs[name][1].bool()
        o = out.float()[valid]
        r["finite"] = bool(torch.isfinite(o).all())
        if r["point"] not in base:
          base[r["point"]] = o
        r["max_abs_diff_vs_first"] = float((o - base[r["point"]]).abs().max())
        r["direct"] = T.time_torch(lambda: plan.forward(q, k, v, pk, pq, m),
                                   [()], target_s=a.target_s, n_batches=9)
        if a.xla and with_mask:
          import jax.dlpack  # noqa: F401
          import jax.numpy as jnp
          js = [jnp.asarray(x.cpu().numpy()) for x in t]
          jm = jnp.asarray(m.cpu().numpy())
          fn = jax.jit(lambda q, k, v, pk, pq, m: tdb._jax_attention(
              cfg, q, k, v, pk, pq, m, None, None))
          jo = np.asarray(jax.block_until_ready(fn(*js, jm)),
                          np.float32)[m.cpu().numpy().astype(bool)]
          r["xla_max_abs_diff_vs_direct"] = float(
              np.max(np.abs(jo - o.cpu().numpy())))
          r["xla"] = T.time_jax(fn, [(*js, jm)], target_s=a.target_s,
                                n_batches=9)
        del plan, out
      except Exception as e:  # noqa: BLE001
        r["error"] = repr(e)[:400]
      records.append(r)
      short = {k: (v["ms"] if isinstance(v, dict) and "ms" in v else v)
               for k, v in r.items()}
      print(json.dumps(short), flush=True)
      dump()
  os.environ.pop("FOLDAX_DEBERTA_BLOCKS", None)
  ok = [r for r in records[1:] if "direct" in r]
  for name in dict.fromkeys(r["point"] for r in ok):
    print(f"-- {name}")
    for r in sorted((r for r in ok if r["point"] == name),
                    key=lambda r: r["direct"]["ms"]):
      x = f"  xla {r['xla']['ms']:.3f}" if "xla" in r else ""
      print(f"  {r['blocks']:>22}  direct {r['direct']['ms']:.3f} ms{x}",
            flush=True)
  dump()


if __name__ == "__main__":
  main()
