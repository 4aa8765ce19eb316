"""Static options and block sizes of the disentangled-attention kernels.

Block sizes, like the dense kernel's, depend only on the GPU generation, head
dim, dtype and kernel, never on batch size or sequence length: a sequence's
bits do not depend on what else is in the batch. FOLDAX_DEBERTA_BLOCKS may
name a JSON file {"<kernel>/<head_dim>/<itemsize>": {"block_q": .., ...}}
overriding entries (kernel: fwd, bwd_kv, bwd_q, band, table) for tuning on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels import settings
from pallas_kernels.deberta.layout import Geometry
from pallas_kernels.flash.config import BlockSizes

KERNELS = ("fwd", "bwd_kv", "bwd_q", "band", "table")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Options baked into a kernel (hashed into its compile cache key)."""

  geometry: Geometry
  c2p: bool
  p2c: bool
  has_mask: bool  # factorised token padding mask
  dropout_rate: float  # 0.0: off
  head_dim: int
  # Run full tiles (inside the sequence) without load masks. Only load
  # masks differ between the variants (the float operations are the same),
  # so the bits do not depend on it; interpret mode turns it off to halve
  # the traced loop bodies (compile time).
  split_full_tiles: bool = True
  # How a band tile reads the table whose rows run along the tile's second
  # axis (p2c in the forward, c2p in the backward): "transposed" gathers
  # it with that axis first (neighbouring lanes read neighbouring columns of
  # one table row) and transposes the tile in shared memory; "direct"
  # gathers it in the tile's own orientation, with one slot gather for both
  # tables and no transpose. The gathered values are the same, so the bits
  # do not depend on it. Measured on the H200 for pip Triton's compile of
  # the forward (benchmarks/results/h200/deberta-direct-2026-12-03/): one
  # DeBERTa-v3-base layer at B16 L512 in 0.355 ms direct (64x64 tiles)
  # against 0.440 ms transposed (its best tile, 64x32).
  gather: str = "transposed"

  def __post_init__(self):
    if self.gather not in ("transposed", "direct"):
      raise ValueError(f"gather must be 'transposed' or 'direct'; got "
                       f"{self.gather!r}.")

  @property
  def n_terms(self) -> int:
    return 1 + int(self.c2p) + int(self.p2c)

  @property
  def scale(self) -> float:
    """1 / sqrt(head_dim * n_terms), HF's float32 divisor inverted."""
    c = np.sqrt(np.float32(self.head_dim) * np.float32(self.n_terms),
                dtype=np.float32)
    return float(1.0 / float(c))

  @property
  def has_pos(self) -> bool:
    return self.c2p or self.p2c

  @property
  def has_dropout(self) -> bool:
    return self.dropout_rate > 0.0

  @property
  def keep_scale(self) -> float:
    return 1.0 / (1.0 - self.dropout_rate)


@dataclasses.dataclass(frozen=True)
class DebertaBlocks:
  fwd: BlockSizes
  bwd_kv: BlockSizes  # dK, dV and the p2c band (owns key tiles)
  bwd_q: BlockSizes  # dQ and the c2p band (owns query tiles)
  band: BlockSizes  # block_q: token rows; block_k: band columns per step
  table: BlockSizes  # position-table GEMM: block_q rows, block_k columns


# Hopper (sm_90). The 16-bit forward entry comes from an H200 sweep of the
# whole DeBERTa-v3-base encoder (a sweep since removed, in git history:
# benchmarks/results/h200/deberta-sweep-2026-12-03/): 64x128 with 4 warps ran
# B16 L512 in 7.31 ms against 8.07 ms for the earlier 128x64 with 8 warps
# (ragged padding: 7.02 against 7.97 ms); the table GEMM's 128x128/8 warps
# stayed the fastest of five.
_H100 = {
    ("fwd", 2): BlockSizes(64, 128, 4, 2),
    ("fwd", 4): BlockSizes(64, 32, 4, 1),
    ("bwd_kv", 2): BlockSizes(64, 64, 4, 1),
    ("bwd_kv", 4): BlockSizes(32, 32, 4, 1),
    ("bwd_q", 2): BlockSizes(64, 64, 4, 1),
    ("bwd_q", 4): BlockSizes(32, 32, 4, 1),
    ("band", 2): BlockSizes(64, 64, 4, 2),
    ("band", 4): BlockSizes(64, 32, 4, 2),
    ("table", 2): BlockSizes(128, 128, 8, 1),
    ("table", 4): BlockSizes(64, 64, 4, 1),
}
# The same kernels' Triton IR compiled by pip Triton (the torch bridge's
# direct launch, which looks its blocks up inside
# `flash.config.compiled_by("triton")`). The two compilers make different
# code of one IR: at 64x128 / 4 warps / 2 stages, XLA's runs both position
# tables and the forward of one DeBERTa-v3-base layer at B16 L512 in 0.324
# ms, pip Triton's in 0.508 ms (transposed gathers). With direct gathers
# (KernelConfig.gather, which pip Triton's path uses), 64x64 with 4 warps
# and 2 stages was the fastest of six over the three points: 0.355 ms
# there, 0.235 ms ragged, 0.865 ms at B4 L2048
# (benchmarks/results/h200/deberta-direct-2026-12-03/).
_H100_PIP_TRITON = {
    ("fwd", 2): BlockSizes(64, 64, 4, 2),
}
INTERPRET_BLOCKS = DebertaBlocks(*(BlockSizes(16, 16, 4, 1),) * 4,
                                 BlockSizes(16, 32, 4, 1))


def _override() -> dict:
  path = settings.current().deberta_blocks
  if not path:
    return {}
  with open(path) as f:
    return {k: BlockSizes(**v) for k, v in json.load(f).items()}


def blocks_for(*, head_dim: int, dtype, interpret: bool,
               compute_capability=None) -> DebertaBlocks:
  if interpret:
    return INTERPRET_BLOCKS
  itemsize = min(4, jnp.dtype(dtype).itemsize)
  over = _override()
  pip = settings.compiled_by_context() == "triton"
  picks = []
  for kern in KERNELS:
    b = _H100[(kern, itemsize)]
    if pip and head_dim <= 64 and (kern, itemsize) in _H100_PIP_TRITON:
      b = _H100_PIP_TRITON[(kern, itemsize)]  # measured at head_dim 64
    elif head_dim > 64 and kern not in ("band", "table"):  # registers: halve the key side
      b = BlockSizes(b.block_q, max(16, b.block_k // 2), max(b.num_warps, 8)
                     if itemsize == 2 else b.num_warps, b.num_stages)
    if compute_capability is not None and compute_capability[0] < 9:
      b = BlockSizes(min(b.block_q, 64), min(b.block_k, 64), b.num_warps, 1)
    b = over.get(f"{kern}/{head_dim}/{itemsize}", b)
    picks.append(b)
  return DebertaBlocks(*picks)


def gather_orientation() -> str:
  """KernelConfig.gather for the compiler in use, chosen like the tiles:
  "direct" for pip Triton's compile (the torch bridge's direct launch,
  inside `flash.config.compiled_by("triton")`), where it measured faster;
  "transposed" for XLA's. KernelSettings.deberta_gather ("direct" / "transposed")
  overrides both (for measuring); the bits are the same either way."""
  chosen = settings.current().deberta_gather
  if chosen:
    return chosen
  return ("direct" if settings.compiled_by_context() == "triton" else
          "transposed")


def head_dim_pad(head_dim: int) -> int:
  return max(16, 1 << math.ceil(math.log2(head_dim)))
