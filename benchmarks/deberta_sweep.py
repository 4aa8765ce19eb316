"""Block-size sweep of the DeBERTa kernels, timed as the whole encoder.

Times the jitted DeBERTa-v3-base forward (random weights, fp16, as the
`fwd-*` points of benchmarks/deberta.py) once per candidate block size of
the disentangled forward kernel and of the position-table GEMM, through the
FOLDAX_DEBERTA_BLOCKS override; the first candidate of each list is the
shipped table entry. Block sizes are per head dim and dtype only (never per
batch or length), so one choice must serve every point: pass several
`--points` to see each candidate at all of them.

  python -m benchmarks.deberta_sweep --out /tmp/sweep.json \
      [--points b16-l512,b16-l512-ragged,b4-l2048] \
      [--fwd "128,64,8,2;128,64,4,2"] [--table "128,128,8,1;128,128,4,2"]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import _timing as T
from benchmarks.deberta import hf_config_kwargs, point_inputs
from benchmarks.kernel_probe import _parse_blocks
from pallas_kernels.deberta.config import blocks_for

_FWD = ("128,64,8,2;128,64,4,2;64,64,4,2;128,32,4,2;64,32,4,2;128,128,8,2;"
        "64,128,4,2;128,64,8,3;256,64,8,2")
_TABLE = "128,128,8,1;128,128,4,2;64,128,4,2;128,64,4,2;256,128,8,2;128,256,8,2"


def _inputs(b: int, l: int, ragged: bool, vocab: int):
  """The benchmark's inputs of this point (`deberta.point_inputs`), as JAX
  int32 arrays."""
  ids, mask, _ = point_inputs(b, l, ragged, vocab)
  return (jnp.asarray(ids.numpy(), jnp.int32),
          jnp.asarray(mask.numpy(), jnp.int32))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--points", default="b16-l512,b16-l512-ragged")
  p.add_argument("--fwd", default=_FWD)
  p.add_argument("--table", default=_TABLE)
  p.add_argument("--target-s", type=float, default=0.6)
  p.add_argument("--smoke", action="store_true",
                 help="tiny config, interpret backend (CPU check of the tool)")
  a = p.parse_args(argv)
  from jax_api.deberta import DebertaV2Model
  from jax_api.deberta.modules import DebertaV2Config
  cfg = DebertaV2Config.from_hf(hf_config_kwargs(a.smoke))
  dtype = jnp.float32 if a.smoke else jnp.float16
  model = DebertaV2Model(config=cfg, dtype=dtype, param_dtype=dtype,
                         attention_backend="interpret" if a.smoke else "auto")
  points = []
  for name in a.points.split(","):
    b, l = name.split("-")[:2]
    points.append((name, int(b[1:]), int(l[1:]), name.endswith("ragged")))
  ids0, mask0 = _inputs(1, 64, False, cfg.vocab_size)
  params = jax.jit(model.init)(jax.random.key(0), ids0, mask0)["params"]
  shipped = blocks_for(head_dim=cfg.head_size, dtype=dtype,
                       interpret=False, compute_capability=(9, 0))
  records = [{"kind": "meta", "date": time.strftime("%Y-%m-%d %H:%M"),
              "device": str(jax.devices()[0]), "jax": jax.__version__,
              "shipped_fwd": shipped.fwd.to_dict(),
              "shipped_table": shipped.table.to_dict(), "argv": argv}]
  tmp = tempfile.mkdtemp(prefix="dsweep_")
  d, item = cfg.head_size, 2

  def dump():
    with open(a.out, "w") as f:
      json.dump(records, f, indent=1)

  baseline = {}

  def measure(kernel, bs, fixed):
    over = {f"{kernel}/{d}/{item}": bs.to_dict()}
    over.update(fixed)
    path = os.path.join(tmp, f"o{len(records)}.json")
    with open(path, "w") as f:
      json.dump(over, f)
    os.environ["FOLDAX_DEBERTA_BLOCKS"] = path
    tag = f"{bs.block_q}x{bs.block_k}/w{bs.num_warps}s{bs.num_stages}"
    for name, b, l, ragged in points:
      ids, mask = _inputs(b, l, ragged, cfg.vocab_size)
      r = dict(kind=kernel, blocks=tag, point=name, override=over)
      try:
        f = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m))
        compiled, _, csec = T.jax_compile(f, (params, ids, mask))
        out = jax.block_until_ready(compiled(params, ids, mask))
        valid = np.asarray(mask, bool)
        o = np.asarray(out.astype(jnp.float32))[valid]
        if name not in baseline:
          baseline[name] = o
        r["max_abs_diff_vs_first"] = float(np.max(np.abs(o - baseline[name])))
        r["finite"] = bool(np.all(np.isfinite(o)))
        r.update(T.time_jax(compiled, [(params, ids, mask)],
                            target_s=a.target_s, n_batches=9, warmup=2))
        r["compile_s"] = round(csec, 2)
        del compiled, out
      except Exception as e:  # noqa: BLE001
        r["error"] = repr(e)[:400]
      records.append(r)
      print(json.dumps({k: v for k, v in r.items() if k != "override"}),
            flush=True)
      dump()

  fwd_c = _parse_blocks(a.fwd)
  table_c = _parse_blocks(a.table)
  for bs in fwd_c:
    measure("fwd", bs, {})
  # The table sweep runs with the fastest forward at the first point.
  first = points[0][0]
  best = min((r for r in records[1:] if r["kind"] == "fwd" and
              r["point"] == first and "ms" in r), key=lambda r: r["ms"],
             default=None)
  fixed = {}
  if best is not None:
    fixed = {k: v for k, v in best["override"].items() if k.startswith("fwd")}
  for bs in table_c:
    measure("table", bs, fixed)
  os.environ.pop("FOLDAX_DEBERTA_BLOCKS", None)
  dump()


if __name__ == "__main__":
  main()
