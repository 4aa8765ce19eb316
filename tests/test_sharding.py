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
import numpy as np, jax, jax.numpy as jnp
from jax_api.sharding import make_mesh, sharded_attention, zigzag, unzigzag
from pallas_kernels.reference.dense import attention_reference
r = np.random.default_rng(0)
b, S, hq, hkv, d = 2, 64, 8, 2, 16
q = jnp.asarray(r.standard_normal((b, S, hq, d)), jnp.float32)
k = jnp.asarray(r.standard_normal((b, S, hkv, d)), jnp.float32)
v = jnp.asarray(r.standard_normal((b, S, hkv, d)), jnp.float32)
seg = jnp.asarray(np.repeat(np.array([[0]*20 + [1]*30 + [2]*14]), b, 0))
cases = {
  "causal": dict(causal=True),
  "noncausal": dict(causal=False),
  "window": dict(causal=True, window_size=(7, 0)),
  "varlen": dict(causal=True, segment_ids=seg),
  "sinks_softcap": dict(causal=False, sinks=jnp.linspace(-1, 1, hq),
                        softcap=5.0),
}
for name, kw in cases.items():
  ref, _ = attention_reference(q, k, v, **kw)
  zz = kw.get("causal", False)
  outs = []
  for n in (1, 2, 4, 8):
    m = make_mesh(context=n)
    f = (lambda x: zigzag(x, n)) if zz else (lambda x: x)
    g = (lambda x: unzigzag(x, n)) if zz else (lambda x: x)
    kk = dict(kw)
    if "segment_ids" in kk:
      kk["segment_ids"] = f(kk["segment_ids"])
    fn = jax.jit(lambda q, k, v: sharded_attention(q, k, v, mesh=m,
                                                   block_size=4, **kk))
    outs.append(np.asarray(g(fn(f(q), f(k), f(v)))))
    if n == 8 and name == "causal":
      hlo = fn.lower(f(q), f(k), f(v)).compile().as_text()
      assert "collective-permute" in hlo, "no collective-permute"
      assert "all-gather" not in hlo, "all-gather in HLO"
  err = float(np.abs(outs[0] - ref).max())
  assert err < 1e-5, (name, err)
  assert all(np.array_equal(outs[0], o) for o in outs), name
  print("ok", name, err)
m = make_mesh(context=8)
for call, msg in [
    (lambda: sharded_attention(q[:, :40], k[:, :40], v[:, :40], mesh=m,
                               causal=True), "divisible by 2 x devices"),
    (lambda: sharded_attention(q, k, v, mesh=m, seq_axis="seq"),
     "not in the mesh"),
    (lambda: sharded_attention(q, k[:, :, :1].repeat(3, 2)[:, :, :3],
                               v[:, :, :1].repeat(3, 2)[:, :, :3],
                               mesh=make_mesh(context=1, heads=2)),
     "breaks GQA groups")]:
  try:
    call()
  except ValueError as e:
    assert msg in str(e), (msg, str(e))
    print("ok error", msg)
  else:
    raise AssertionError("no error: " + msg)
print("ALL OK")
'''


def test_ring_attention_8_virtual_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert "ALL OK" in res.stdout
