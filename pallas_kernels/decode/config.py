"""Launch parameters of the decode kernels and the split-count policy.

A decode result's bits depend on the tile size (`block_k`: the order of the
sums inside a chunk), on `num_warps` (Triton's in-register row sums) and on the
cache's chunk size (`chunk_tokens`: where partials are cut). None of these may
depend on the batch, the sequence lengths or the split count, so they come
from a table keyed on the GPU generation, head-dim bucket and dtype only (and
an explicit override, `FOLDAX_DECODE_BLOCKS="block_k,num_warps,num_stages"`,
for tuning). The split count is free: it only decides which program computes
which chunk, never what a chunk computes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels import settings

# A draft (speculative) query block has at most this many tokens; the newest
# `SAMPLE_TILE` keys are sampled for the declared reference, so every draft
# row is guaranteed to see one sampled key.
MAX_DRAFT = 16
SAMPLE_TILE = 16


@dataclasses.dataclass(frozen=True)
class DecodeBlocks:
  """block_k: keys per tile (a power of two >= 16 dividing the page size);
  num_warps, num_stages: Triton launch parameters."""

  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    b = self.block_k
    if b < 16 or b & (b - 1):
      raise ValueError(f"block_k must be a power of two >= 16; got {b}.")


# (compute capability major, head_dim bucket, itemsize) -> blocks. Starting
# points for the H200 (not yet swept: `python -m benchmarks.decode --sweep`).
_TABLE = {
    (9, 64, 2): DecodeBlocks(64, 4, 3),
    (9, 128, 2): DecodeBlocks(64, 4, 3),
    (9, 256, 2): DecodeBlocks(32, 4, 3),
    (9, 64, 4): DecodeBlocks(32, 4, 2),
    (9, 128, 4): DecodeBlocks(32, 4, 2),
    (9, 256, 4): DecodeBlocks(16, 4, 2),
}
_FALLBACK = DecodeBlocks(32, 4, 2)
# CPU interpret mode: small tiles, many tile boundaries on small shapes.
INTERPRET_BLOCKS = DecodeBlocks(16, 4, 1)


def decode_blocks_for(*, compute_capability, head_dim_pad: int, dtype,
                      page_size: int, interpret: bool) -> DecodeBlocks:
  """The shipped tile choice, clipped to the page size (tiles never cross a
  page boundary)."""
  if interpret:
    blocks = INTERPRET_BLOCKS
  else:
    chosen = settings.current().decode_blocks
    if chosen:
      blocks = DecodeBlocks(*chosen)
    else:
      major = compute_capability[0] if compute_capability else 8
      itemsize = min(4, jnp.dtype(dtype).itemsize)
      blocks = _TABLE.get((major, max(64, head_dim_pad), itemsize), _FALLBACK)
  if blocks.block_k > page_size:
    blocks = dataclasses.replace(blocks, block_k=page_size)
  return blocks


def num_sms() -> int:
  """Streaming multiprocessors of the default GPU (132 when unknown)."""
  try:
    dev = jax.devices()[0]
    n = getattr(dev, "core_count", None)
    if dev.platform == "gpu" and n:
      return int(n)
  except Exception:  # pragma: no cover
    pass
  return 132


def default_num_splits(batch: int, heads_kv: int, n_chunks: int,
                       interpret: bool) -> int:
  """Splits so that batch * heads_kv * splits is about 4 programs per SM.

  The choice never changes results (see the module docstring)."""
  if interpret:
    return 1
  target = 4 * num_sms()
  pairs = max(1, batch * heads_kv)
  return int(max(1, min(n_chunks, -(-target // pairs))))
