"""Mesh helper and a `shard_map` wrapper for globally sharded inputs."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jax_api.sharding.ring import ring_attention

__all__ = ["make_mesh", "sharded_attention"]


def make_mesh(context: int = 1, data: int = 1, heads: int = 1, *,
              devices=None) -> Mesh:
  """Mesh with axes ("data", "heads", "context") over the first
  data * heads * context devices (CPU virtual devices or GPUs alike)."""
  devices = list(jax.devices() if devices is None else devices)
  need = data * heads * context
  if need > len(devices):
    raise ValueError(f"make_mesh needs {need} devices; {len(devices)} "
                     "available (on CPU set XLA_FLAGS=--xla_force_host_"
                     "platform_device_count=N before JAX starts).")
  arr = np.array(devices[:need]).reshape(data, heads, context)
  return Mesh(arr, ("data", "heads", "context"))


def sharded_attention(q, k, v, *, mesh: Mesh, seq_axis="context",
                      batch_axis="data", head_axis="heads", segment_ids=None,
                      sinks=None, **kw):
  """Attention on global arrays [batch, seq, heads, head_dim] laid out (when
  causal) in zig-zag order: batch and heads split with no communication,
  the sequence through `ring_attention`."""
  for name in (seq_axis, batch_axis, head_axis):
    if name is not None and name not in mesh.axis_names:
      raise ValueError(f"axis {name!r} is not in the mesh axes "
                       f"{mesh.axis_names}.")
  hs = mesh.shape[head_axis] if head_axis else 1
  if q.shape[2] % hs or k.shape[2] % hs:
    raise ValueError(f"sharding heads over {hs} devices breaks GQA groups: "
                     f"heads_q {q.shape[2]} and heads_kv {k.shape[2]} must "
                     f"both be divisible by {hs}.")
  spec = P(batch_axis, seq_axis, head_axis, None)
  seg_spec = P(batch_axis, seq_axis)
  fn = functools.partial(ring_attention, axis_name=seq_axis, **kw)

  def body(q, k, v, seg, sinks):
    return fn(q, k, v, segment_ids=seg, sinks=sinks)
  return jax.shard_map(
      body, mesh=mesh,
      in_specs=(spec, spec, spec, None if segment_ids is None else seg_spec,
                None if sinks is None else P(head_axis)),
      out_specs=((spec, P(batch_axis, head_axis, seq_axis))
                 if kw.get("return_lse") else spec),
      check_vma=False)(q, k, v, segment_ids, sinks)
