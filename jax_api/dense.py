"""Dense and packed-varlen attention: `fold_attn_func`, `fold_attn_varlen_func`.

Both are differentiable in q, k, v and sinks (and through the returned LSE)
with a bitwise-deterministic backward (`pallas_kernels.flash.backward`).
Conventions (masks, sinks, soft-cap, fully masked rows) are those of
`pallas_kernels.reference.dense`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_api import _validation as val
from jax_api._backend import _gpu_capability, resolve_backend
from jax_api._xla_attention import xla_attention
from pallas_kernels import settings
from pallas_kernels.flash import core
from pallas_kernels.flash.backward import token_sequence_ids
from pallas_kernels.flash.tiles import MaskConfig
from pallas_kernels.reference.dense import dense_mask_spec, varlen_mask_spec


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _flash(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, mask: core.MaskConfig,
           plan: core.KernelPlan, max_seqlen_q: int, max_seqlen_k: int,
           interpret: bool, padded_batch: bool):
  """padded_batch: every token belongs to a sequence (cu_seqlens[-1] is the
  token count), so the backward need not zero tokens outside them."""
  out, lse, _ = core.forward(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg,
                             mask=mask, plan=plan, max_seqlen_q=max_seqlen_q,
                             interpret=interpret)
  return out, lse


def _flash_fwd(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, mask, plan,
               max_seqlen_q, max_seqlen_k, interpret, padded_batch):
  out, lse, lse2 = core.forward(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg,
                                mask=mask, plan=plan,
                                max_seqlen_q=max_seqlen_q, interpret=interpret)
  return (out, lse), (q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, out, lse2)


def _flash_bwd(mask, plan, max_seqlen_q, max_seqlen_k, interpret,
               padded_batch, res, cotangents):
  q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, out, lse2 = res
  do, dlse = cotangents
  grads = core.backward(q, k, v, sinks, cu_q, cu_k, q_seg, k_seg, out, lse2,
                        do, dlse, mask=mask, plan=plan,
                        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                        interpret=interpret,
                        all_tokens_in_sequences=padded_batch)
  return (*grads, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _kernel_plan(head_dim: int, dtype, interpret: bool) -> core.KernelPlan:
  return core.kernel_plan(head_dim, dtype, interpret=interpret,
                          compute_capability=None if interpret else
                          _gpu_capability())


def _sharded(q):
  """(mesh, spec) when q's sharding is known while tracing (then the call
  runs per shard, or round the ring: `jax_api.sharding.route`), else None.
  Imported lazily: jax_api.sharding builds on this module's package."""
  from jax_api.sharding.route import mesh_spec
  return mesh_spec(q)


def _check_common(q, k, v, sinks, window_size, softcap, softmax_scale,
                  packed: bool):
  val.check_qkv(q, k, v, packed=packed)
  window = val.check_window(window_size)
  softcap = val.check_softcap(softcap)
  scale = val.check_softmax_scale(softmax_scale, q.shape[-1])
  val.check_sinks(sinks, q.shape[-2])
  return window, softcap, scale


@settings.accepts_config
def fold_attn_func(q: jax.Array, k: jax.Array, v: jax.Array, *,
                   causal: bool = False, softmax_scale: float | None = None,
                   window_size: tuple[int, int] = (-1, -1),
                   sinks: jax.Array | None = None, softcap: float = 0.0,
                   segment_ids=None, return_lse: bool = False,
                   backend: str = "auto"):
  """Exact attention with a bitwise-deterministic backward.

  Args:
    q: [batch, seq_q, heads_q, head_dim] (bf16, fp16 or fp32).
    k, v: [batch, seq_k, heads_kv, head_dim]; heads_q % heads_kv == 0.
    causal: bottom-right aligned causal mask (query i sees keys
      j <= i + seq_k - seq_q).
    softmax_scale: defaults to 1/sqrt(head_dim).
    window_size: (left, right) sliding window; -1 leaves a side unbounded.
    sinks: float [heads_q] logits joining each row's softmax denominator.
    softcap: if > 0, scores become softcap * tanh(scores / softcap).
    segment_ids: int [batch, seq] (seq_q == seq_k) or a pair
      (q_segment_ids [batch, seq_q], kv_segment_ids [batch, seq_k]); tokens
      attend only within equal ids.
    return_lse: also return the log-sum-exp [batch, heads_q, seq_q] (float32,
      natural log, -inf for rows that see no key); differentiable.
    backend: "auto", "pallas", "interpret" or "xla" (see jax_api._backend).
    config: a `jax_api.KernelSettings` (compiler, dQ mode, tile table);
      None: the documented defaults (`pallas_kernels.settings`). Part of
      the kernels' static arguments.

  Returns:
    out [batch, seq_q, heads_q, head_dim] in q's dtype (and lse).
  """
  window, softcap, scale = _check_common(q, k, v, sinks, window_size, softcap,
                                         softmax_scale, packed=False)
  b, sq, hq, d = q.shape
  sk = k.shape[1]
  segs = val.check_segment_ids(segment_ids, b, sq, sk)
  if (sharded := _sharded(q)) is not None:
    from jax_api.sharding import route
    return route.dense(q, k, v, mesh_and_spec=sharded, causal=causal,
                       softmax_scale=softmax_scale, window_size=window_size,
                       sinks=sinks, softcap=softcap, segment_ids=segment_ids,
                       return_lse=return_lse, backend=backend,
                       single=fold_attn_func)
  be = resolve_backend(backend, kernel="fold_attn_func")
  if be == "xla":
    qs = dense_mask_spec(b, sq, None if segs is None else segs[0])
    ks = dense_mask_spec(b, sk, None if segs is None else segs[1])
    out, lse = xla_attention(q, k, v, qs, ks, sinks, causal=bool(causal),
                             window_size=window, softcap=softcap,
                             softmax_scale=scale)
    return (out, lse) if return_lse else out
  interpret = be == "interpret"
  cfg = MaskConfig.make(causal=bool(causal), window_size=window,
                        has_segments=segs is not None, softcap=softcap,
                        scale=scale)
  plan = _kernel_plan(d, q.dtype, interpret)
  # A padded batch is a packed batch of equal lengths: a free reshape.
  cu_q = jnp.arange(b + 1, dtype=jnp.int32) * sq
  cu_k = jnp.arange(b + 1, dtype=jnp.int32) * sk
  q_seg = k_seg = None
  if segs is not None:
    q_seg, k_seg = segs[0].reshape(-1), segs[1].reshape(-1)
  out, lse = _flash(q.reshape(b * sq, hq, d), k.reshape(b * sk, *k.shape[2:]),
                    v.reshape(b * sk, *v.shape[2:]), sinks, cu_q, cu_k, q_seg,
                    k_seg, cfg, plan, sq, sk, interpret, True)
  out = out.reshape(b, sq, hq, d)
  if not return_lse:
    return out
  return out, lse.reshape(hq, b, sq).transpose(1, 0, 2)


@settings.accepts_config
def fold_attn_varlen_func(q: jax.Array, k: jax.Array, v: jax.Array,
                          cu_seqlens_q: jax.Array,
                          cu_seqlens_k: jax.Array | None = None,
                          max_seqlen_q: int | None = None,
                          max_seqlen_k: int | None = None, *,
                          causal: bool = False,
                          softmax_scale: float | None = None,
                          window_size: tuple[int, int] = (-1, -1),
                          sinks: jax.Array | None = None, softcap: float = 0.0,
                          return_lse: bool = False, backend: str = "auto"):
  """Packed variable-length attention (FlashAttention's varlen layout).

  Args:
    q: [total_q, heads_q, head_dim]; k, v: [total_k, heads_kv, head_dim].
    cu_seqlens_q, cu_seqlens_k: int32 [num_seqs + 1] cumulative lengths
      (cu_seqlens_k defaults to cu_seqlens_q). Tokens past cu_seqlens[-1]
      belong to no sequence: their output is 0.
    max_seqlen_q, max_seqlen_k: longest sequence (static Python ints). Taken
      from concrete cu_seqlens when omitted; under `jax.jit` pass them, or the
      kernel grid falls back to the packed length (correct, slower).
    Other options as `fold_attn_func`; causal and windows align bottom-right
    within each sequence. Tiles start at each sequence's start, so a
    sequence's bits do not depend on what else is packed.

  Returns:
    out [total_q, heads_q, head_dim] (and lse [heads_q, total_q]).
  """
  window, softcap, scale = _check_common(q, k, v, sinks, window_size, softcap,
                                         softmax_scale, packed=True)
  if cu_seqlens_k is None:
    cu_seqlens_k = cu_seqlens_q
    if max_seqlen_k is None:
      max_seqlen_k = max_seqlen_q
  val.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0])
  val.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0])
  if cu_seqlens_q.shape != cu_seqlens_k.shape:
    raise ValueError("cu_seqlens_q and cu_seqlens_k must describe the same "
                     f"number of sequences; got shapes {cu_seqlens_q.shape} "
                     f"and {cu_seqlens_k.shape}.")
  # Checked on every backend (the XLA path does not need them, but a wrong
  # one is the caller's error all the same).
  mq = val.concrete_max_seqlen("max_seqlen_q", cu_seqlens_q, max_seqlen_q)
  mk = val.concrete_max_seqlen("max_seqlen_k", cu_seqlens_k, max_seqlen_k)
  if (sharded := _sharded(q)) is not None:
    from jax_api.sharding import route
    return route.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                        max_seqlen_k, mesh_and_spec=sharded, causal=causal,
                        softmax_scale=softmax_scale, window_size=window_size,
                        sinks=sinks, softcap=softcap, return_lse=return_lse,
                        backend=backend, single=fold_attn_varlen_func)
  cu_q = jnp.asarray(cu_seqlens_q, jnp.int32)
  cu_k = jnp.asarray(cu_seqlens_k, jnp.int32)
  be = resolve_backend(backend, kernel="fold_attn_varlen_func")
  if be == "xla":
    out, lse = xla_attention(
        q[None], k[None], v[None], varlen_mask_spec(cu_q, q.shape[0]),
        varlen_mask_spec(cu_k, k.shape[0]), sinks, causal=bool(causal),
        window_size=window, softcap=softcap, softmax_scale=scale)
    out, lse = out[0], lse[0]
  else:
    interpret = be == "interpret"
    cfg = MaskConfig.make(causal=bool(causal), window_size=window,
                          has_segments=False, softcap=softcap, scale=scale)
    plan = _kernel_plan(q.shape[-1], q.dtype, interpret)
    out, lse = _flash(q, k, v, sinks, cu_q, cu_k, None, None, cfg, plan,
                      mq or q.shape[0], mk or k.shape[0], interpret, False)
    # Rows outside every sequence are never written by the kernel.
    in_seq = token_sequence_ids(cu_q, q.shape[0]) < cu_q.shape[0] - 1
    out = jnp.where(in_seq[:, None, None], out, 0).astype(q.dtype)
    # Such rows see no key: lse is log(0) = -inf, or the sink's logit.
    empty_lse = (-jnp.inf if sinks is None else
                 sinks.astype(jnp.float32)[:, None])
    lse = jnp.where(in_seq[None, :], lse, empty_lse)
  return (out, lse) if return_lse else out
