"""fold_attn_func / fold_attn_varlen_func on NamedSharding-sharded inputs
(jax_api.sharding.route): batch/heads split with no communication, the
sequence round the ring; 8 virtual CPU devices in a subprocess."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]

_SCRIPT = r'''
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax_api import fold_attn_func, fold_attn_varlen_func
from jax_api.sharding import make_mesh
from pallas_kernels.reference.dense import attention_reference
r = np.random.default_rng(1)
b, S, hq, hkv, d = 2, 32, 4, 2, 8
q, k, v, w = (jnp.asarray(r.standard_normal((b, S, h, d)), jnp.float32)
              for h in (hq, hkv, hkv, hq))
sinks = jnp.linspace(-1, 1, hq)
kw = dict(causal=True, sinks=sinks, window_size=(9, 0), backend="xla")
def loss(q, k, v):
  return jnp.sum(fold_attn_func(q, k, v, **kw) * w)
vg = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))
fwd = jax.jit(lambda q, k, v: fold_attn_func(q, k, v, **kw))
ref = attention_reference(q, k, v, **{a: kw[a] for a in kw if a != "backend"})[0]
rv, rg = jax.value_and_grad(lambda q, k, v: jnp.sum(attention_reference(
    q, k, v, **{a: kw[a] for a in kw if a != "backend"})[0] * w), (0, 1, 2))(q, k, v)
base = None
COLL = ("collective-permute", "all-gather", "all-reduce", "all-to-all")
for spec, mesh in [
    (P("data", None, "heads"), make_mesh(data=2, heads=2, explicit=True)),
    (P(None, "context"), make_mesh(context=2, explicit=True)),
    (P(None, "context"), make_mesh(context=8, explicit=True)),
    (P("data", "context", "heads"), make_mesh(2, 2, 2, explicit=True))]:
  put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))
  args = [put(x) for x in (q, k, v)]
  val, g = vg(*args)
  out = fwd(*args)
  assert out.sharding.spec[:3] == tuple(spec) + (None,) * (3 - len(spec)), out.sharding
  hlo = fwd.lower(*args).compile().as_text()
  errs = [float(jnp.abs(out - ref).max())] + [
      float(jnp.abs(a - b_).max()) for a, b_ in zip(g, rg)]
  assert max(errs) < 2e-5, (spec, errs)
  if spec[1] is None:  # batch/heads only: no communication at all
    assert not any(c in hlo for c in COLL), [c for c in COLL if c in hlo]
  else:
    assert "collective-permute" in hlo and "all-gather" not in hlo
  if spec == P(None, "context"):
    gg = [np.asarray(x) for x in (out,) + tuple(g)]
    if base is None:
      base = gg
    else:
      assert all(np.array_equal(a, b_) for a, b_ in zip(base, gg)), "bits"
  print("ok", spec, dict(mesh.shape), errs)
# Eager call on concrete arrays over an Auto mesh routes the same way.
m = make_mesh(context=4)
put = lambda x: jax.device_put(x, NamedSharding(m, P(None, "context")))
out = fold_attn_func(put(q), put(k), put(v), **kw)
assert np.array_equal(np.asarray(out), base[0]), "eager bits"
# Packed varlen: tokens sharded round the ring; the tail past cu[-1] is 0.
cu = jnp.asarray([0, 10, 25, 29], jnp.int32)
qp, kp, vp = (x.reshape(-1, x.shape[2], d)[:32] for x in (q, k, v))
vkw = dict(causal=True, backend="xla")
ref = fold_attn_varlen_func(qp, kp, vp, cu, **vkw)
m = make_mesh(context=4, heads=2, explicit=True)
put = lambda x: jax.device_put(x, NamedSharding(m, P("context", "heads")))
fv = jax.jit(lambda q, k, v: fold_attn_varlen_func(q, k, v, cu, **vkw))
out = fv(put(qp), put(kp), put(vp))
hlo = fv.lower(put(qp), put(kp), put(vp)).compile().as_text()
assert "collective-permute" in hlo and "all-gather" not in hlo
err = float(jnp.abs(out - ref).max())
assert err < 2e-5 and not np.any(np.asarray(out)[29:]), err
print("ok varlen", err)
try:  # q's 4 heads split over 4 devices; k/v's 2 heads cannot follow
  fold_attn_func(jax.device_put(q, NamedSharding(make_mesh(heads=4),
                 P(None, None, "heads"))), k, v, backend="xla")
except ValueError as e:
  assert "breaks GQA groups" in str(e), e
  print("ok error GQA")
else:
  raise AssertionError("no GQA error")
print("ALL OK")
'''


def test_sharded_inputs_route_8_virtual_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", _SCRIPT], env=env,
                       capture_output=True, text=True, timeout=300)
  assert res.returncode == 0, res.stdout + res.stderr
  assert "ALL OK" in res.stdout
