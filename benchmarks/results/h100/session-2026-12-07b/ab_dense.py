"""A/B of the dense kernels of one tree (PYTHONPATH picks the tree): fwd and
fwd+bwd for causal dense, segment-masked dense, and ragged varlen."""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from jax_api import fold_attn_func, fold_attn_varlen_func
from benchmarks._timing import time_jax

tag = sys.argv[1]
small = len(sys.argv) > 2  # CPU smoke
kw = dict(backend="interpret") if small else {}
rows = []
key = jax.random.PRNGKey(0)
def rnd(shape, i):
  return jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)

def bench(name, f, args, flops):
  fwd = jax.jit(f)
  def loss(*a):
    return jnp.sum(f(*a).astype(jnp.float32) * a[-1].astype(jnp.float32))
  fb = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  for mode, fn, fl in (("fwd", fwd, flops), ("fwd+bwd", fb, 3.5 * flops)):
    r = time_jax(fn, [args], target_s=0.01 if small else 0.4, n_batches=3 if small else 9)
    rows.append(dict(tree=tag, case=name, mode=mode, ms=r["ms"],
                     tflops=fl / r["ms"] / 1e9))
    print(json.dumps(rows[-1]), flush=True)

B, H, S, D = (1, 2, 64, 16) if small else (2, 16, 8192, 128)
q, k, v = (rnd((B, S, H, D), i) for i in range(3))
flops = 4 * B * H * S * S * D / 2
bench("causal-b2-s8192", lambda q, k, v, do: fold_attn_func(q, k, v, causal=True, **kw),
      (q, k, v, q), flops)
seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), S // 4)[None].repeat(B, 0)
bench("segments4-causal-b2-s8192",
      lambda q, k, v, do: fold_attn_func(q, k, v, causal=True, segment_ids=seg, **kw),
      (q, k, v, q), flops / 4)
lens = np.array([3001, 517, 4096, 1999, 2560, 3300, 777, 100])
if small: lens = np.array([30, 5, 41])
cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
T = int(lens.sum())
qv, kv_, vv = (rnd((T, H, D), 10 + i) for i in range(3))
fl = float(sum(4 * H * int(l) * int(l) * D / 2 for l in lens))
bench("varlen8-causal", lambda q, k, v, do: fold_attn_varlen_func(
    q, k, v, cu, causal=True, max_seqlen_q=4096, max_seqlen_k=4096, **kw),
    (qv, kv_, vv, qv), fl)
