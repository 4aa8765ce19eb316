"""Runs every kernel family once on small ragged shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --kernel-name kns=fold \
        python3 tests/gpu_logs/sanitize_kernels.py [family ...]

Families: dense (forward, recompute and atomic backward), decode, deberta
(forward, backward), bridge (the torch direct launch). Shapes: sequence
lengths that are not multiples of the tiles, head dims 96 and 192. Prints
one line per family; the sanitizer's report is the result (logs beside this
file).
"""

import sys

import jax
import jax.numpy as jnp

import jax_api
from jax_api import KernelSettings

# On CPU the same calls run interpreted (a quick check of this script).
BACKEND = "pallas" if jax.default_backend() == "gpu" else "interpret"


def _rand(key, shape, dtype=jnp.bfloat16):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32).astype(dtype)


def dense():
  for d in (96, 192):
    for mode in ("recompute", "atomic"):
      cfg = KernelSettings(dq_mode=mode)
      q = _rand(0, (2, 77, 4, d))
      k = _rand(1, (2, 131, 2, d))
      v = _rand(2, (2, 131, 2, d))
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
  print("dense: ok")


def decode():
  for d in (96, 192):
    cache = jax_api.FoldKVCache.create(batch=3, n_heads=8, n_kv_heads=2,
                                       head_dim=d, max_len=300, page_size=64,
                                       dtype=jnp.bfloat16)
    cu = jnp.array([0, 50, 173, 300], jnp.int32)
    q = _rand(0, (300, 8, d))
    k = _rand(1, (300, 2, d))
    _, cache = cache.prefill(q, k, k, cu, backend=BACKEND)
    for step in range(3):
      out, cache = jax_api.fold_attn_with_kvcache(
          _rand(10 + step, (3, 8, d)), cache, _rand(20 + step, (3, 2, d)),
          _rand(30 + step, (3, 2, d)), backend=BACKEND)
    jax.block_until_ready(out)
  print("decode: ok")


def deberta():
  for d in (64, 96):
    q = _rand(0, (2, 77, 2, d))
    pos = _rand(1, (64, 2, d))
    mask = (jnp.arange(77)[None] < jnp.array([[77], [50]])).astype(jnp.int32)
    f = lambda q, pk: jax_api.disentangled_attention(
        q, q, q, pk, pk, attention_mask=mask, position_buckets=32,
        max_relative_positions=64, backend=BACKEND).astype(
            jnp.float32).sum()
    jax.block_until_ready(jax.jit(jax.grad(f, argnums=(0, 1)))(q, pos))
  print("deberta: ok")


def bridge():
  import torch
  import torch_bridge
  for d in (96, 128):
    q = torch.randn(2, 77, 4, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    k = torch.randn(2, 131, 2, d, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    out = torch_bridge.fold_attn_func(q, k, k, causal=True)
    out.float().sum().backward()
  torch.cuda.synchronize()
  print("bridge: ok")


if __name__ == "__main__":
  names = sys.argv[1:] or ["dense", "decode", "deberta", "bridge"]
  for n in names:
    globals()[n]()
