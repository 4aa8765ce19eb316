"""Context parallelism for `fold_attn_func` / `fold_attn_varlen_func` on
sharded inputs, without rewriting the call.

`mesh_spec(q)` reads the sharding of q where it is known while tracing: a
concrete `jax.Array` with a `NamedSharding` (eager calls), or, under
`jax.jit`, an array on a mesh with `AxisType.Explicit` axes (`make_mesh(...,
explicit=True)`; the sharding is then part of the traced type). Under jit
with Auto axes the sharding is decided after tracing, so nothing is routed
and XLA partitions the single-device program as it would any other.

The routed call is one `jax.shard_map` over q's mesh:
  * batch and heads axes: each device runs the single-device op on its
    shard, with no communication (heads must split whole GQA groups);
  * a sharded sequence axis (axis 1 dense, axis 0 packed): `ring_attention`
    with the contiguous layout (inputs stay in natural order; causal work is
    then unbalanced across devices: use `sharded_attention` on zig-zag
    ordered inputs for balance). Its bits are the ring's, the same on every
    device count, and differ from the unsharded call's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_api.sharding.ring import ring_attention, ring_backend
from pallas_kernels.reference.dense import varlen_mask_spec

__all__ = ["mesh_spec", "dense", "varlen"]


def mesh_spec(x):
  """(mesh, spec padded to x.ndim) if x is known to be sharded over some
  mesh axis while tracing, else None."""
  if isinstance(x, jax.Array) and not _is_tracer(x):
    sh = x.sharding
    if not isinstance(sh, NamedSharding):
      return None
    mesh, spec = sh.mesh, sh.spec
  else:
    sh = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sh, NamedSharding) or sh.mesh.empty:
      return None
    # Only Explicit axes are sharding facts at trace time (Auto: unknown,
    # Manual: already inside a shard_map).
    explicit = {a for a, t in zip(sh.mesh.axis_names, sh.mesh.axis_types)
                if t == jax.sharding.AxisType.Explicit}
    mesh, spec = sh.mesh, sh.spec
    if not any(_names(e) & explicit for e in spec):
      return None
  spec = tuple(spec) + (None,) * (x.ndim - len(tuple(spec)))
  if all(e is None for e in spec):
    return None
  return mesh, spec


def _is_tracer(x):
  return isinstance(x, jax.core.Tracer)


def _placed(mesh, specs, args):
  """Explicit axes: shard_map takes arguments only as they are sharded, so
  the auxiliary inputs (segments, sinks, k/v placed otherwise) are resharded
  to the specs first. Auto axes: shard_map reshards by itself."""
  explicit = jax.sharding.AxisType.Explicit in tuple(mesh.axis_types)
  if not explicit:
    return args
  return tuple(
      a if a is None or s is None else jax.tree.map(
          lambda x, s=s: jax.reshard(x, NamedSharding(mesh, s)), a)
      for a, s in zip(args, specs))


def _names(entry):
  if entry is None:
    return set()
  return set(entry) if isinstance(entry, tuple) else {entry}


def _axis_size(mesh, entry):
  n = 1
  for a in _names(entry):
    n *= mesh.shape[a]
  return n


def _check(mesh, spec, q, k, seq_dim, head_dim):
  if spec[-1] is not None:
    raise ValueError(f"q: head_dim (last axis) cannot be sharded; got "
                     f"PartitionSpec {spec}.")
  hs = _axis_size(mesh, spec[head_dim])
  if q.shape[head_dim] % hs or k.shape[head_dim] % hs:
    raise ValueError(f"q, k: sharding heads over {hs} devices breaks GQA "
                     f"groups: heads_q {q.shape[head_dim]} and heads_kv "
                     f"{k.shape[head_dim]} must both be divisible by {hs}.")
  seq = spec[seq_dim]
  if len(_names(seq)) > 1:
    raise ValueError(f"q: the sequence axis may be sharded over one mesh "
                     f"axis (the ring's axis_name); got {seq!r}.")
  return None if seq is None else next(iter(_names(seq)))


def dense(q, k, v, *, mesh_and_spec, causal, softmax_scale, window_size,
          sinks, softcap, segment_ids, return_lse, backend, single):
  """`fold_attn_func` on sharded q [batch, seq, heads, head_dim]; `single`
  is the single-device op for the shards (called with the same options)."""
  mesh, spec = mesh_and_spec
  ring_axis = _check(mesh, spec, q, k, 1, 2)
  bs, ss, hs = spec[0], spec[1], spec[2]
  seg = segment_ids
  if isinstance(seg, (tuple, list)):
    if ring_axis is not None and seg[0] is not seg[1]:
      raise ValueError("segment_ids: a sequence-sharded call (ring) takes "
                       "one array shared by q and k/v; got a pair.")
    seg = seg[0] if ring_axis is not None else tuple(seg)
  if ring_axis is not None and q.shape[1] != k.shape[1]:
    raise ValueError(f"q, k: a sequence-sharded call (ring) needs seq_q == "
                     f"seq_k; got {q.shape[1]} and {k.shape[1]}.")
  seg_spec = P(bs, ss)
  opts = dict(causal=causal, softmax_scale=softmax_scale,
              window_size=window_size, softcap=softcap, backend=backend)

  def body(q, k, v, seg, sinks):
    if ring_axis is None:
      return single(q, k, v, sinks=sinks, segment_ids=seg,
                    return_lse=True, **opts)
    return ring_attention(q, k, v, axis_name=ring_axis, sinks=sinks,
                          segment_ids=seg, layout="contiguous",
                          return_lse=True,
                          **dict(opts, backend=_ring_backend(backend)))
  one = P(bs, ss, hs, None)
  specs = (one, one, one, seg_spec, P(hs))
  seg_specs = (None if seg is None else
               (seg_spec, seg_spec) if isinstance(seg, tuple) else seg_spec)
  out, lse = jax.shard_map(
      body, mesh=mesh,
      in_specs=(one, one, one, seg_specs, None if sinks is None else P(hs)),
      out_specs=(one, P(bs, hs, ss)),
      check_vma=False)(*_placed(mesh, specs, (q, k, v, seg, sinks)))
  return (out, lse) if return_lse else out


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
           *, mesh_and_spec, causal, softmax_scale, window_size, sinks,
           softcap, return_lse, backend, single):
  """`fold_attn_varlen_func` on sharded packed q [total, heads, head_dim]:
  heads split with no communication; a sharded token axis goes round the
  ring with each token's sequence id (from cu_seqlens) as its segment."""
  mesh, spec = mesh_and_spec
  ring_axis = _check(mesh, spec, q, k, 0, 1)
  ts, hs = spec[0], spec[1]
  opts = dict(causal=causal, softmax_scale=softmax_scale,
              window_size=window_size, softcap=softcap)
  if ring_axis is None:
    def body(q, k, v, sinks):
      return single(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, sinks=sinks, return_lse=True,
                    backend=backend, **opts)
    one = P(None, hs, None)
    out, lse = jax.shard_map(
        body, mesh=mesh, in_specs=(one,) * 3 +
        (None if sinks is None else P(hs),),
        out_specs=(one, P(hs, None)),
        check_vma=False)(*_placed(mesh, (one,) * 3 + (P(hs),),
                                  (q, k, v, sinks)))
    return (out, lse) if return_lse else out
  if cu_seqlens_k is not cu_seqlens_q and not (
      isinstance(cu_seqlens_k, jax.Array) and
      not _is_tracer(cu_seqlens_k) and
      bool(jnp.array_equal(cu_seqlens_q, cu_seqlens_k))):
    raise ValueError("cu_seqlens_k: a token-sharded call (ring) needs "
                     "cu_seqlens_k equal to cu_seqlens_q (self-attention).")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"q, k: a token-sharded call (ring) needs total_q == "
                     f"total_k; got {q.shape[0]} and {k.shape[0]}.")
  # Tokens past cu_seqlens[-1] get id -1, which matches nothing: out 0.
  seg = varlen_mask_spec(cu_seqlens_q, q.shape[0]).seq_id

  def ring_body(q, k, v, seg, sinks):
    out, lse = ring_attention(q[None], k[None], v[None], axis_name=ring_axis,
                              sinks=sinks, segment_ids=seg,
                              layout="contiguous", return_lse=True,
                              backend=_ring_backend(backend), **opts)
    return out[0], lse[0]
  one = P(ts, hs, None)
  out, lse = jax.shard_map(
      ring_body, mesh=mesh,
      in_specs=(one,) * 3 + (P(None, ts), None if sinks is None else P(hs)),
      out_specs=(one, P(hs, ts)),
      check_vma=False)(*_placed(mesh, (one,) * 3 + (P(None, ts), P(hs)),
                                (q, k, v, seg, sinks)))
  return (out, lse) if return_lse else out


def _ring_backend(backend):
  """Validated here (before any shard_map), resolved by the ring itself."""
  if backend != "auto":
    ring_backend(backend)
  return backend
