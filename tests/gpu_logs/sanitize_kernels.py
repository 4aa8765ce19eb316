"""Runs every kernel family once on small ragged shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-name kns=fold \
        python3 tests/gpu_logs/sanitize_kernels.py [family ...]

Families: dense (forward, recompute and atomic backward; also one mode
alone: dense_recompute, dense_atomic), decode, deberta (forward,
backward), ring (the ring-attention step kernels, forward and backward),
bridge (the torch direct launch, forward and backward). Shapes:
sequence lengths that are not multiples of the tiles (ragged tails, packed
varlen sequences, partial pages), head dims 96 and 192. Prints one line per
family; the sanitizer's report is the result (`run_sanitizer.sh` runs one
family per tool and writes the logs).

On CPU the same calls run interpreted on smaller (still ragged) shapes, a
check of this script: `PYTHONPATH=$PWD python tests/gpu_logs/
sanitize_kernels.py dense_recompute` (bridge needs CUDA and says so).
"""

import sys

import jax
import jax.numpy as jnp

import jax_api
from jax_api import KernelSettings

# On CPU the same calls run interpreted (a quick check of this script).
ON_GPU = jax.default_backend() == "gpu"
BACKEND = "pallas" if ON_GPU else "interpret"
# (seq_q, seq_k): not multiples of any tile (16 .. 128 rows).
SEQ = (77, 131) if ON_GPU else (21, 37)


def _rand(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def dense(modes=("recompute", "atomic")):
  for d in (96, 192):
    for mode in modes:
      cfg = KernelSettings(dq_mode=mode)
      q = _rand(0, (2, SEQ[0], 4, d))
      k = _rand(1, (2, SEQ[1], 2, d))
      v = _rand(2, (2, SEQ[1], 2, d))
      f = lambda q, k, v: jax_api.fold_attn_func(
          q, k, v, causal=True, backend=BACKEND, config=cfg).astype(
              jnp.float32).sum()
      g = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)
      jax.block_until_ready(g)
      cu = jnp.array([0, 37, 100, 154], jnp.int32)
      qv = _rand(3, (154, 4, d))
      kv = _rand(4, (154, 2, d))
      fv = lambda q, k: jax_api.fold_attn_varlen_func(
          q, k, k, cu, max_seqlen_q=63, max_seqlen_k=63, causal=True,
          backend=BACKEND, config=cfg).astype(jnp.float32).sum()
      jax.block_until_ready(jax.jit(jax.grad(fv, argnums=(0, 1)))(qv, kv))
  print(f"dense {'+'.join(modes)}: ok")


def dense_recompute():
  dense(("recompute",))


def dense_atomic():
  dense(("atomic",))


def decode():
  for d in (96, 192):
    n = 300 if ON_GPU else 90
    cache = jax_api.FoldKVCache.create(batch=3, n_heads=8, n_kv_heads=2,
                                       head_dim=d, max_len=n, page_size=64 if
                                       ON_GPU else 16, dtype=jnp.bfloat16)
    cu = jnp.array([0, 50, 173, 300] if ON_GPU else [0, 17, 45, 90],
                   jnp.int32)
    q = _rand(0, (n, 8, d))
    k = _rand(1, (n, 2, d))
    _, cache = cache.prefill(q, k, k, cu, backend=BACKEND)
    cache = cache.free(jnp.array([0]))  # refilled by the appends: reuse
    for step in range(3):
      out, cache = jax_api.fold_attn_with_kvcache(
          _rand(10 + step, (3, 8, d)), cache, _rand(20 + step, (3, 2, d)),
          _rand(30 + step, (3, 2, d)), backend=BACKEND)
    jax.block_until_ready(out)
  print("decode: ok")


def deberta():
  s = SEQ[0]
  for d in (64, 96):
    q = _rand(0, (2, s, 2, d))
    pos = _rand(1, (64, 2, d))
    mask = (jnp.arange(s)[None] < jnp.array([[s], [s - 27 if ON_GPU else
                                                 s - 6]])).astype(jnp.int32)
    f = lambda q, pk: jax_api.disentangled_attention(
        q, q, q, pk, pk, attention_mask=mask, position_buckets=32,
        max_relative_positions=64, backend=BACKEND).astype(
            jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1)))(q, pos))
  print("deberta: ok")


def ring():
  """The ring with the Pallas step (`pallas_kernels.flash.ring_step`) on a
  one-device mesh: causal with segments (two of them, the second cut
  short by a masked tail) and non-causal with a window, head dim 96."""
  from jax_api.sharding import make_mesh, sharded_attention
  mesh = make_mesh(context=1)
  s = 320 if ON_GPU else 48  # 5 (GPU) / 3 (CPU) key blocks
  q = _rand(0, (2, s, 4, 96))
  k = _rand(1, (2, s, 2, 96))
  seg = (jnp.arange(s)[None] >= s // 3).astype(jnp.int32).repeat(2, 0)
  seg = jnp.where(jnp.arange(s)[None] < s - 11, seg, -1)
  block = 64 if ON_GPU else 16
  for kw in (dict(causal=True, segment_ids=seg),
             dict(causal=False, window_size=(40, 17))):
    f = lambda q, k: sharded_attention(
        q, k, k, mesh=mesh, layout="contiguous", backend=BACKEND,
        block_size=block, **kw).astype(jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1)))(q, k))
  print("ring: ok")


def bridge():
  import torch
  import torch_bridge
  if not torch.cuda.is_available():
    print("bridge: skipped (the direct launch needs CUDA)")
    return
  for d in (96, 192):
    q = torch.randn(2, 77, 4, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k = torch.randn(2, 131, 2, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    out = torch_bridge.fold_attn_func(q, k, k, causal=True)
    out.float().sum().backward()
  torch.cuda.synchronize()
  print("bridge: ok")


if __name__ == "__main__":
  names = sys.argv[1:] or ["dense", "decode", "deberta", "ring", "bridge"]
  for n in names:
    globals()[n]()
