"""The decode call of `FoldKVCache` (`attend`, `fold_attn_with_kvcache`):
the input checks, the backend choice, then the decode op's core
(`pallas_kernels.decode.core.decode`, which `torch_bridge.kvcache` calls
too)."""

from __future__ import annotations

from jax_api import _validation as val
from jax_api._backend import _gpu_capability, resolve_backend
from pallas_kernels.decode import core


def attend(cache, q, *, softmax_scale, sinks, window_size, softcap,
           num_splits, backend):
  """q [batch, (q_len,) n_heads, head_dim] over `cache` -> out like q, in
  q's dtype (options as `jax_api.kvcache.fold_attn_with_kvcache`)."""
  cfg = cache.config
  val.check_array("q", q, ndim=(3, 4), layout="[batch, (q_len,) n_heads, "
                  "head_dim]")
  if sinks is not None:
    val.check_array("sinks", sinks, ndim=1, layout="[heads_q]")
  be = resolve_backend(backend, kernel="fold_attn_with_kvcache")
  options = cfg.decode_options(
      q.shape, q.dtype, None if sinks is None else sinks.shape,
      None if sinks is None else sinks.dtype, backend=be,
      softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
      num_splits=num_splits)
  return core.decode(q, cache.paged_kv, sinks, options=options,
                     compute_capability=_gpu_capability()
                     if be == "pallas" else None)
