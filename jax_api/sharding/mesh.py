"""Mesh helper and a `shard_map` wrapper for globally sharded inputs."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from jax_api.sharding.ring import ring_attention

__all__ = ["make_mesh", "sharded_attention"]


def make_mesh(context: int = 1, data: int = 1, heads: int = 1, *,
              devices=None, explicit: bool = False) -> Mesh:
  """Mesh with axes ("data", "heads", "context") over the first
  data * heads * context devices (CPU virtual devices or GPUs alike).

  explicit: give the axes `AxisType.Explicit`, so that arrays placed on the
  mesh keep their sharding in their traced type under `jax.jit`: then
  `fold_attn_func` / `fold_attn_varlen_func` see it and shard themselves
  (`jax_api.sharding.route`). With the default Auto axes that happens only
  for eager calls on concrete sharded arrays."""
  devices = list(jax.devices() if devices is None else devices)
  need = data * heads * context
  if need > len(devices):
    raise ValueError(f"make_mesh needs {need} devices; {len(devices)} "
                     "available (on CPU set XLA_FLAGS=--xla_force_host_"
                     "platform_device_count=N before JAX starts).")
  arr = np.array(devices[:need]).reshape(data, heads, context)
  kind = (jax.sharding.AxisType.Explicit if explicit else
          jax.sharding.AxisType.Auto)
  return Mesh(arr, ("data", "heads", "context"), axis_types=(kind,) * 3)


def sharded_attention(q, k, v, *, mesh: Mesh, seq_axis="context",
                      batch_axis="data", head_axis="heads", segment_ids=None,
                      sinks=None, **kw):
  """Attention on global arrays [batch, seq, heads, head_dim] laid out (when
  causal) in zig-zag order: batch and heads split with no communication,
  the sequence through `ring_attention`."""
  if seq_axis is None:
    raise ValueError("seq_axis (the ring's axis_name) must name a mesh "
                     "axis; got None.")
  for arg, name in (("seq_axis", seq_axis), ("batch_axis", batch_axis),
                    ("head_axis", head_axis)):
    if name is not None and name not in mesh.axis_names:
      raise ValueError(f"{arg}={name!r} is not in the mesh axes "
                       f"{mesh.axis_names}.")
  hs = mesh.shape[head_axis] if head_axis else 1
  if q.shape[2] % hs or k.shape[2] % hs:
    raise ValueError(f"q, k: sharding heads over {hs} devices breaks GQA "
                     f"groups: heads_q {q.shape[2]} and heads_kv "
                     f"{k.shape[2]} must both be divisible by {hs}.")
  n = mesh.shape[seq_axis]
  zz = kw.get("layout") or ("zigzag" if kw.get("causal") else "contiguous")
  parts = 2 * n if zz == "zigzag" else n
  if q.shape[1] % parts:
    what = ("causal zig-zag needs the sequence length divisible by 2 x "
            "devices" if zz == "zigzag" else
            "the sequence length must be divisible by the devices")
    raise ValueError(f"q: {what} = {parts} (axis {seq_axis!r} has {n}); "
                     f"got seq {q.shape[1]}.")
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
