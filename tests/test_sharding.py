"""jax_api.sharding: ring attention on 8 virtual CPU devices (run in a
subprocess: the device count is fixed when JAX initialises)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import re, sys
BACKEND = sys.argv[1]  # "xla" (the pair blocks) or "interpret" (ring_step)
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax_api.sharding import (make_mesh, ring_attention, sharded_attention,
                              zigzag, unzigzag)
from pallas_kernels.reference.dense import attention_reference
r = np.random.default_rng(0)
b, S, hq, hkv, d = 1, 32, 8, 2, 8   # GQA group 4 in every case
q, k, v, w = (jnp.asarray(r.standard_normal((b, S, h, d)), jnp.float32)
              for h in (hq, hkv, hkv, hq))
wl = jnp.asarray(r.standard_normal((b, hq, S)), jnp.float32)
# segment -1 matches nothing: those rows are fully masked (zero gradients).
seg = jnp.asarray(np.array([[0] * 10 + [1] * 15 + [-1] * 7]))
cases = {
  "causal": dict(causal=True),
  "noncausal": dict(causal=False),
  "window": dict(causal=True, window_size=(5, 0)),
  "varlen": dict(causal=True, segment_ids=seg),
  "sinks_softcap_lse": dict(causal=False, sinks=jnp.linspace(-1, 1, hq),
                            softcap=3.0),
}

def loss_of(attn, kw):
  # out and (with sinks) the lse both carry a cotangent.
  def loss(q, k, v, sinks):
    kk = dict(kw, sinks=sinks) if "sinks" in kw else kw
    out, lse = attn(q, k, v, kk)
    l = jnp.sum(out * w)
    if "sinks" in kw:
      l = l + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * wl)
    return l, out
  return jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)

def sharded_attn(n, zz):
  """attn(q, k, v, kk) for loss_of on a context mesh of n devices; zz: the
  causal zig-zag layout (inputs zig-zagged in, outputs back)."""
  m = make_mesh(context=n)
  f = (lambda x: zigzag(x, n)) if zz else (lambda x: x)
  g = (lambda x: unzigzag(x, n)) if zz else (lambda x: x)
  def attn(q, k, v, kk):
    kk = dict(kk)
    if "segment_ids" in kk:
      kk["segment_ids"] = f(kk["segment_ids"])
    out, lse = sharded_attention(f(q), f(k), f(v), mesh=m, block_size=2,
                                 return_lse=True, backend=BACKEND, **kk)
    return g(out), jnp.swapaxes(g(jnp.swapaxes(lse, 1, 2)), 1, 2)
  return attn

if BACKEND == "interpret":  # the kernels interpreted: fewer cases
  cases = {n: cases[n] for n in ("causal", "varlen", "sinks_softcap_lse")}
for name, kw in cases.items():
  sinks = kw.get("sinks", jnp.zeros(hq))
  (_, ref), gref = loss_of(lambda q, k, v, kk: attention_reference(
      q, k, v, **kk), kw)(q, k, v, sinks)
  zz = kw.get("causal", False)
  res = []
  for n in (1, 2, 4, 8):
    fn = jax.jit(loss_of(sharded_attn(n, zz), kw))
    (_, out), grads = fn(q, k, v, sinks)
    res.append([np.asarray(x) for x in (out,) + tuple(grads)])
    if n == 8 and name == "causal":
      hlo = fn.lower(q, k, v, sinks).compile().as_text()
      assert "collective-permute" in hlo, "no collective-permute"
      # K/V move only by permutes: no all-gather of any kind in the ring.
      assert "all-gather" not in hlo, "all-gather in HLO"
      print("ok hlo")
  errs = [float(np.abs(res[0][i] - x).max() / (1 + np.abs(x).max()))
          for i, x in enumerate((ref,) + tuple(gref))]
  n_checked = 5 if "sinks" in kw else 4
  assert max(errs[:n_checked]) < 2e-5, (name, errs)
  for o in res[1:]:
    for i in range(n_checked):
      assert np.array_equal(res[0][i], o[i]), (name, "not bitwise", i)
  if name == "varlen":
    assert not np.any(res[0][1][:, 25:]), "masked rows: dq not 0"
    assert not np.any(res[0][2][:, 25:]) and not np.any(res[0][3][:, 25:])
  print("ok", name, errs)
if BACKEND == "interpret":
  print("ALL OK")
  raise SystemExit(0)
# bf16 inputs: K/V travel round the ring in bf16 and are upcast per block.
qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
kw, sinks = dict(causal=True), jnp.zeros(hq)
bf16_fn = {n: jax.jit(loss_of(sharded_attn(n, True), kw)) for n in (1, 8)}
hlo = bf16_fn[8].lower(qb, kb, vb, sinks).as_text()
assert re.search(r"collective_permute[^\n]*: \(tensor<1x4x2x8xbf16>\)", hlo), \
    "bf16 K/V do not travel as bf16"
got = [jax.tree.map(lambda x: np.asarray(x, np.float32),
                    bf16_fn[n](qb, kb, vb, sinks)) for n in (1, 8)]
assert all(np.array_equal(a, c) for a, c in
           zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1]))), \
    "bf16: not bitwise across device counts"
_, gref = loss_of(lambda q, k, v, kk: attention_reference(q, k, v, **kk),
                  kw)(*(x.astype(jnp.float32) for x in (qb, kb, vb)), sinks)
for a, c in zip(got[0][1][:3], gref[:3]):
  assert np.abs(a - c).max() / (1 + np.abs(c).max()) < 2e-2, "bf16 grads"
print("ok bf16")
m = make_mesh(context=8)
for call, msg in [
    (lambda: sharded_attention(q[:, :24], k[:, :24], v[:, :24], mesh=m,
                               causal=True), "divisible by 2 x devices"),
    (lambda: sharded_attention(q, k, v, mesh=m, seq_axis="seq"),
     "not in the mesh"),
    (lambda: sharded_attention(q, k[:, :, :1].repeat(3, 2)[:, :, :3],
                               v[:, :, :1].repeat(3, 2)[:, :, :3],
                               mesh=make_mesh(context=1, heads=2)),
     "breaks GQA groups"),
    (lambda: jax.shard_map(
        lambda q, k, v: ring_attention(q, k, v, axis_name="seq"), mesh=m,
        in_specs=P(None, "context"), out_specs=P(None, "context"),
        check_vma=False)(q, k, v), "axis_name 'seq' is not a mesh axis"),
    (lambda: sharded_attention(q, k, v, mesh=m, causal=True, block_size=3),
     "block_size must divide")]:
  try:
    call()
  except ValueError as e:
    assert msg in str(e), (msg, str(e))
    print("ok error", msg)
  else:
    raise AssertionError("no error: " + msg)
print("ALL OK")
'''


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_ring_attention_8_virtual_devices(backend):
  """backend "xla": the ring's pair blocks (also bf16 and the errors);
  "interpret": the Pallas ring step (`pallas_kernels.flash.ring_step`)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _SCRIPT, backend], env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert "ALL OK" in res.stdout
