"""Zig-zag sequence layout for causal load balancing over n devices.

The sequence axis (axis 1, [batch, seq, ...]) is cut into 2n equal chunks;
device i holds chunks i and 2n-1-i, so every device gets the same amount of
causal work. `zigzag` reorders a global array so that contiguous sharding of
axis 1 over n devices gives that layout; `unzigzag` inverts it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["zigzag", "unzigzag", "zigzag_positions", "local_positions"]


def _check(seq: int, n: int):
  if not isinstance(n, (int, np.integer)) or n < 1:
    raise ValueError(f"n (devices) must be a positive int; got {n!r}.")
  if seq % (2 * n):
    raise ValueError(
        f"causal zig-zag needs the sequence length divisible by 2 x devices "
        f"= {2 * n}; got seq {seq} on {n} devices.")


def zigzag_positions(seq: int, n: int) -> np.ndarray:
  """int32 [seq]: the original position of each slot of the zig-zag order."""
  _check(seq, n)
  c = seq // (2 * n)
  order = []
  for i in range(n):
    order += [i, 2 * n - 1 - i]
  return np.concatenate([np.arange(j * c, (j + 1) * c) for j in order]
                        ).astype(np.int32)


def zigzag(x: jax.Array, n: int) -> jax.Array:
  """[batch, seq, ...] in natural order -> zig-zag order for n devices."""
  return jnp.take(x, jnp.asarray(zigzag_positions(x.shape[1], n)), axis=1)


def unzigzag(x: jax.Array, n: int) -> jax.Array:
  """Inverse of `zigzag` on axis 1."""
  inv = np.argsort(zigzag_positions(x.shape[1], n)).astype(np.int32)
  return jnp.take(x, jnp.asarray(inv), axis=1)


def local_positions(local_seq: int, index, n: int, layout: str) -> jax.Array:
  """int32 [local_seq]: absolute positions of device `index`'s shard.

  layout "zigzag": chunks index and 2n-1-index of local_seq / 2 tokens;
  "contiguous": tokens index * local_seq ... (index + 1) * local_seq - 1.
  """
  if layout == "contiguous":
    return index * local_seq + jnp.arange(local_seq, dtype=jnp.int32)
  c = local_seq // 2
  r = jnp.arange(c, dtype=jnp.int32)
  return jnp.concatenate([index * c + r, (2 * n - 1 - index) * c + r])
