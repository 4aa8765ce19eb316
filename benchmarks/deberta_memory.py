"""Where the memory of the JAX DeBERTa training step goes: XLA's buffer
assignment of the compiled step, without running it.

    python -m benchmarks.deberta_memory          # B8 L512; remat off, ffn, layer
    python -m benchmarks.deberta_memory --batch 2 --seq 2048 --remat layer
    python -m benchmarks.deberta_memory --attention standin  # no kernel
    python -m benchmarks.deberta_memory --dump-dir /tmp/d    # XLA's reports

The step is `benchmarks.deberta.jax_train_step` on the DeBERTa-v3-base
configuration (bf16 parameters, dropout on), compiled from shapes alone
(`jax.eval_shape`: no weights, no HF model). Printed per variant: the
compiled step's argument, temporary, output and aliased bytes (the figure
`benchmarks.deberta` reports as `peak_mem_bytes` is arguments + temporaries
+ outputs - aliases) and, with --dump-dir, the largest slots of XLA's
memory-usage report (`*memory-usage-report.txt`: which shapes share each
offset of the temporary allocation).

--attention standin replaces `disentangled_attention` by a custom-VJP
stand-in that keeps q, k, v, the position projections and the output (what
the kernel path keeps) but allocates nothing else: the difference to
--attention kernel is what the attention kernels' own buffers add. On a
machine without a GPU, `kernel` compiles the interpret-mode kernels, whose
loop state copies every input: use `standin` there.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def _standin():
  import jax
  import jax.numpy as jnp

  @jax.custom_vjp
  def attn(q, k, v, pk, pq):
    return v * jnp.asarray(1.0001, v.dtype)

  def fwd(q, k, v, pk, pq):
    out = attn(q, k, v, pk, pq)
    return out, (q, k, v, pk, pq, out)

  def bwd(res, do):
    q, k, v, pk, pq, out = res
    s = jnp.sum(do[..., :1, :1, :1])  # something of dO, cheaply
    return (do * 2, do * 3, do * out, pk * s, pq * s)

  attn.defvjp(fwd, bwd)

  def disentangled_attention(q, k, v, pos_key, pos_query, **_):
    return attn(q, k, v, pos_key, pos_query)
  return disentangled_attention


def analyse(batch: int, seq: int, remat, attention: str,
            dump_dir: str | None = None, smoke: bool = False) -> dict:
  """One variant's buffer assignment (smoke: benchmarks.deberta's tiny
  configuration, for tests)."""
  import jax
  import jax.numpy as jnp
  from benchmarks.deberta import hf_config_kwargs, jax_train_step
  from jax_api.deberta import DebertaV2Model
  from jax_api.deberta import modules as M
  from jax_api.deberta.modules import DebertaV2Config

  cfg = DebertaV2Config.from_hf(hf_config_kwargs(smoke=smoke))
  saved = M.disentangled_attention
  if attention == "standin":
    M.disentangled_attention = _standin()
  try:
    model = DebertaV2Model(config=cfg, dtype=jnp.bfloat16,
                           param_dtype=jnp.bfloat16,
                           attention_backend="auto", remat=remat)
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    params = jax.eval_shape(lambda: model.init(
        jax.random.key(0), jnp.zeros((batch, seq), jnp.int32),
        jnp.ones((batch, seq), jnp.int32))["params"])
    step = jax.jit(jax_train_step(model), donate_argnums=0)
    compiled = step.lower(params, ids, ids, jax.random.key(0)).compile()
  finally:
    M.disentangled_attention = saved
  m = compiled.memory_analysis()
  r = dict(batch=batch, seq=seq, remat=remat, attention=attention,
           smoke=smoke,
           platform=jax.devices()[0].platform,
           argument_bytes=int(m.argument_size_in_bytes),
           temp_bytes=int(m.temp_size_in_bytes),
           output_bytes=int(m.output_size_in_bytes),
           alias_bytes=int(m.alias_size_in_bytes))
  r["peak_mem_bytes"] = (r["argument_bytes"] + r["temp_bytes"] +
                         r["output_bytes"] - r["alias_bytes"])
  if dump_dir:
    reports = sorted(glob.glob(os.path.join(
        dump_dir, "*jit_step*memory-usage-report.txt")), key=os.path.getmtime)
    if reports:  # the newest: this variant's
      with open(reports[-1]) as f:
        r["memory_usage_report_head"] = f.read().splitlines()[:60]
  return r


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--seq", type=int, default=512)
  ap.add_argument("--remat", nargs="+", choices=("off", "ffn", "layer"),
                  default=["off", "ffn", "layer"],
                  help="DebertaV2Model(remat=...) variants: False, 'ffn', True")
  ap.add_argument("--attention", choices=("kernel", "standin"),
                  default="kernel")
  ap.add_argument("--dump-dir", default=None,
                  help="dump XLA's reports here (set before JAX starts)")
  ap.add_argument("--output", default=None, help="write the JSON here")
  ap.add_argument("--smoke", action="store_true",
                  help="the tiny configuration of benchmarks.deberta --smoke")
  a = ap.parse_args(argv)
  if a.dump_dir:  # read when JAX's backend starts: set before any import
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") +
        f" --xla_dump_to={a.dump_dir} --xla_dump_hlo_module_re=.*jit_step.*")
  results = []
  for remat in ({"off": False, "layer": True, "ffn": "ffn"}[m]
                for m in a.remat):
    r = analyse(a.batch, a.seq, remat, a.attention, a.dump_dir, a.smoke)
    results.append(r)
    print(json.dumps({k: v for k, v in r.items()
                      if k != "memory_usage_report_head"}), flush=True)
    for line in r.get("memory_usage_report_head", [])[:30]:
      print("   ", line[:160])
  if a.output:
    with open(a.output, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
