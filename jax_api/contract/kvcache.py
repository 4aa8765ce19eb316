"""Contract of the paged KV cache (`FoldKVCache` create / append / prefill /
decode / free, `fold_attn_with_kvcache`), for JAX and torch.

The capacity rules (max_len, the page pool, empty slots for a prefill) need
the cache's lengths and stay with the cache (`jax_api.kvcache`); what is
checked here is what shapes, dtypes and static values decide.

  append: k, v [batch, n_kv_heads, head_dim] or [batch, n, n_kv_heads,
    head_dim] in the cache's dtype; active bool [batch].
  decode: q [batch, n_heads, head_dim] or [batch, q_len, n_heads, head_dim]
    (q_len <= max_draft) in the cache's dtype.
"""

from __future__ import annotations

from jax_api.contract.common import (Shape, check_float_dtype, check_int,
                                     check_rank, dtype_name)


def _check_cache_dtype(name: str, dtype, cache_dtype) -> None:
  check_float_dtype(name, dtype)
  if dtype_name(dtype) != dtype_name(cache_dtype):
    raise TypeError(f"{name} has dtype {dtype_name(dtype)}; the cache stores "
                    f"{dtype_name(cache_dtype)} (they must match: cast "
                    f"{name} first).")


def check_append(k_shape: Shape, v_shape: Shape, k_dtype, v_dtype, *,
                 batch: int, n_kv_heads: int, head_dim: int, cache_dtype,
                 active_shape: Shape | None = None) -> None:
  layout = "[batch, (n,) n_kv_heads, head_dim]"
  for name, shape, dt in (("k", k_shape, k_dtype), ("v", v_shape, v_dtype)):
    check_rank(name, shape, (3, 4), layout)
    check_float_dtype(name, dt)
  if tuple(k_shape) != tuple(v_shape):
    raise ValueError(f"k and v must have the same shape; got k "
                     f"{tuple(k_shape)} and v {tuple(v_shape)}.")
  got = (k_shape[0], k_shape[-2], k_shape[-1])
  if got != (batch, n_kv_heads, head_dim):
    raise ValueError(f"k must have shape {layout} = [{batch}, (n,) "
                     f"{n_kv_heads}, {head_dim}]; got {tuple(k_shape)}.")
  for name, dt in (("k", k_dtype), ("v", v_dtype)):
    _check_cache_dtype(name, dt, cache_dtype)
  if len(k_shape) == 4 and k_shape[1] < 1:
    raise ValueError(f"k must hold at least one token per slot (k.shape[1]);"
                     f" got {tuple(k_shape)}.")
  if active_shape is not None:
    check_rank("active", active_shape, 1, "[batch]")
    if active_shape[0] != batch:
      raise ValueError(f"active must have shape [batch] = [{batch}]; got "
                       f"{tuple(active_shape)}.")


def check_decode_q(q_shape: Shape, q_dtype, *, batch: int, n_heads: int,
                   head_dim: int, cache_dtype, max_draft: int) -> None:
  check_rank("q", q_shape, (3, 4), "[batch, (q_len,) n_heads, head_dim]")
  _check_cache_dtype("q", q_dtype, cache_dtype)
  got = (q_shape[0], q_shape[-2], q_shape[-1])
  if got != (batch, n_heads, head_dim):
    raise ValueError(f"q must have shape [batch, (q_len,) n_heads, head_dim] "
                     f"= [{batch}, (q_len,) {n_heads}, {head_dim}]; got "
                     f"{tuple(q_shape)}.")
  if len(q_shape) == 4 and not 1 <= q_shape[1] <= max_draft:
    raise ValueError(f"a draft has 1..{max_draft} tokens (q.shape[1]); got "
                     f"{q_shape[1]}.")


def check_num_splits(num_splits) -> int | None:
  """None (the kernel chooses) or a Python int >= 1."""
  if num_splits is None:
    return None
  return check_int("num_splits", num_splits)


def check_prefill_heads(q_shape: Shape, k_shape: Shape, *, n_heads: int,
                        n_kv_heads: int, head_dim: int) -> None:
  if (q_shape[1], q_shape[2]) != (n_heads, head_dim) or \
      k_shape[1] != n_kv_heads:
    raise ValueError(
        f"prefill expects q [total, {n_heads}, {head_dim}] and k, v "
        f"[total, {n_kv_heads}, {head_dim}]; got q {tuple(q_shape)}, k "
        f"{tuple(k_shape)}.")


def check_seq_ids(name: str, shape: Shape, dtype, n: int | None) -> None:
  """seq_ids: int [n] (n: the number of prompts, or None for free())."""
  check_rank(name, shape, 1, "[num_seqs]")
  if not dtype_name(dtype).startswith(("int", "uint")):
    raise TypeError(f"{name} must be an int array [n]; got dtype "
                    f"{dtype_name(dtype)}.")
  if n is not None and shape[0] != n:
    raise ValueError(f"{name} must have shape [num_seqs] = [{n}]; got "
                     f"{tuple(shape)}.")


def check_slots(name: str, ids, batch: int) -> None:
  """Host slot ids: distinct, in [0, batch)."""
  import numpy as np
  ids = np.asarray(ids).reshape(-1)
  if np.any(ids < 0) or np.any(ids >= batch) or \
      len(np.unique(ids)) != len(ids):
    raise ValueError(f"{name} must be distinct slots in [0, {batch}); got "
                     f"{ids.tolist()}.")
