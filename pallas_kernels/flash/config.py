"""Block sizes and launch parameters, chosen from a table the project ships.

A sequence's bits depend on the tiling (tile boundaries decide the order of
floating-point sums), so the table is keyed on what a caller cannot change
per call without meaning to (GPU generation, head dim, dtype, mode, and the
causal/windowed flag) and never on batch size or sequence length: a sequence
gives the same bits alone, in a padded batch, or packed with others.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

import jax.numpy as jnp

from pallas_kernels import settings

Mode = Literal["fwd", "bwd", "bwd_atomic", "bwd_dq"]
DqMode = settings.DqMode

# How dQ is reduced (both bitwise deterministic): "recompute" runs a second
# kernel that owns each query tile; "atomic" adds integer-grid partials from
# the dK/dV kernel. Measured on the H200 (benchmarks/results/h200): recompute
# 4.7 ms vs atomic 7.1 ms for the B2 H16 S8192 D128 causal backward.
DEFAULT_DQ_MODE: DqMode = settings.DEFAULT_DQ_MODE


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape and Triton launch parameters of one kernel.

  block_q: query rows per tile. block_k: key rows per tile.
  num_warps, num_stages: Triton's warps per program and pipelining depth.
  dq: for the "bwd" (recompute) mode only, the blocks of the separate dQ
    kernel (it owns query tiles, like the forward); None: the same as the
    dK/dV kernel's.
  compiler: what turns the kernel's Triton IR into GPU code: "xla" (XLA's
    built-in Triton, what `jax.jit` does for any Pallas kernel) or "triton"
    (pip Triton, `pallas_kernels.pip_triton`). A field, not a global: the
    blocks are static arguments of the jitted and custom_vjp functions, so
    the compiler is part of every trace's cache key.
  heads_per_wave: the most heads of the launch order's wave
    (`pallas_kernels.flash.tiles.LaunchOrder`); 0 (the default) sizes it
    to L2 from the shapes. The order never changes the bits.
  """

  block_q: int
  block_k: int
  num_warps: int
  num_stages: int
  dq: "BlockSizes | None" = None
  compiler: str = "xla"
  heads_per_wave: int = 0

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      b = getattr(self, name)
      if b < 16 or b & (b - 1):
        raise ValueError(f"{name} must be a power of two >= 16; got {b}.")
    if isinstance(self.dq, dict):  # from a JSON override table
      object.__setattr__(self, "dq", BlockSizes(**self.dq))
    from pallas_kernels.flash.tiles import check_heads_per_wave
    check_heads_per_wave(self.heads_per_wave)
    if self.compiler not in ("xla", "triton"):
      raise ValueError("compiler must be 'xla' or 'triton'; got "
                       f"{self.compiler!r}.")

  @property
  def dq_blocks(self) -> "BlockSizes":
    """Blocks of the recompute-mode dQ kernel."""
    return self.dq if self.dq is not None else self

  def to_dict(self) -> dict:
    out = dict(block_q=self.block_q, block_k=self.block_k,
               num_warps=self.num_warps, num_stages=self.num_stages)
    if self.dq is not None:
      out["dq"] = self.dq.to_dict()
    if self.compiler != "xla":
      out["compiler"] = self.compiler
    if self.heads_per_wave:
      out["heads_per_wave"] = self.heads_per_wave
    return out


# (compute capability major, head_dim bucket, itemsize, mode) -> BlockSizes.
# Measured on the H200 (sm_90) with a tile probe (benchmarks/kernel_probe.py, in git history); the
# FOLDAX_BLOCK_TABLE override file takes the same keys. Mode "bwd_dq" is the
# recompute backward's dQ kernel; without an entry it uses the "bwd" blocks.
_TABLE: dict[tuple[int, int, int, str], BlockSizes] = {
    (9, 64, 2, "fwd"): BlockSizes(128, 64, 8, 3),
    (9, 128, 2, "fwd"): BlockSizes(128, 64, 4, 2),
    (9, 256, 2, "fwd"): BlockSizes(64, 32, 4, 2),
    (9, 64, 4, "fwd"): BlockSizes(64, 32, 4, 2),
    (9, 128, 4, "fwd"): BlockSizes(64, 32, 4, 2),
    (9, 256, 4, "fwd"): BlockSizes(32, 32, 4, 1),
    (9, 64, 2, "bwd"): BlockSizes(64, 64, 4, 2),
    (9, 128, 2, "bwd"): BlockSizes(64, 64, 4, 2),
    # dkdv 64x64 w4 + dq 128x128 w8: fwd+bwd 5.41 ms at B2 H16 S8192 causal
    # (dq 64x64: 5.46; benchmarks/results/h200/bwd-probe-2026-12-03.json).
    (9, 128, 2, "bwd_dq"): BlockSizes(128, 128, 8, 2),
    (9, 256, 2, "bwd"): BlockSizes(32, 64, 8, 1),
    (9, 64, 4, "bwd"): BlockSizes(32, 64, 4, 1),
    (9, 128, 4, "bwd"): BlockSizes(32, 64, 4, 1),
    (9, 256, 4, "bwd"): BlockSizes(16, 32, 4, 1),
    (9, 64, 2, "bwd_atomic"): BlockSizes(64, 128, 8, 2),
    (9, 128, 2, "bwd_atomic"): BlockSizes(64, 128, 8, 2),
    (9, 256, 2, "bwd_atomic"): BlockSizes(32, 64, 8, 1),
    (9, 64, 4, "bwd_atomic"): BlockSizes(32, 64, 4, 1),
    (9, 128, 4, "bwd_atomic"): BlockSizes(32, 64, 4, 1),
    (9, 256, 4, "bwd_atomic"): BlockSizes(16, 32, 4, 1),
}
# Entries for kernels compiled by the pip `triton` package instead of XLA's
# built-in Triton (`pallas_kernels.pip_triton`). The same Triton IR gets
# different code from the two compilers. Measured on the H200 (B2 H16 S8192
# D128 causal bf16): the forward at 128x128 tiles, 8 warps, 3 stages runs
# 1.27 ms compiled by pip Triton against 1.65 ms by XLA, whose best tile
# (128x64, 4 warps) runs 1.36 ms (benchmarks/results/h200/
# triton-compare-2026-12-03 and pip-triton-2026-12-03). The backward is the
# other way round: pip Triton's best dK/dV + dQ pair takes 4.48 ms, XLA's
# 4.05 ms, so it has no entry here and stays with XLA by default.
_TRITON_TABLE: dict[tuple[int, int, int, str], BlockSizes] = {
    (9, 128, 2, "fwd"): BlockSizes(128, 128, 8, 3, compiler="triton"),
    # B4 H16 S2048 D64 causal: 0.149 ms against XLA's best 0.158 (64x64,
    # 4 warps) and 0.175 at these tiles (pip-triton-2026-12-03).
    (9, 64, 2, "fwd"): BlockSizes(128, 64, 8, 3, compiler="triton"),
}
Compiler = Literal["xla", "triton"]
# What compiles a kernel when nothing else says (see settings.KernelSettings).
DEFAULT_COMPILER = settings.DEFAULT_COMPILER
compiled_by = settings.compiled_by
compiled_by_context = settings.compiled_by_context
compiler_setting = settings.compiler_setting


def _pip_triton_ready() -> bool:
  from pallas_kernels import pip_triton
  return pip_triton.auto_ready() is None


# Ampere and others: smaller shared memory than Hopper.
_FALLBACK = {
    (64, 2, "fwd"): BlockSizes(128, 64, 4, 2),
    (128, 2, "fwd"): BlockSizes(64, 64, 4, 2),
    (256, 2, "fwd"): BlockSizes(64, 32, 4, 1),
    (64, 2, "bwd"): BlockSizes(64, 64, 4, 1),
    (128, 2, "bwd"): BlockSizes(64, 64, 4, 1),
    (256, 2, "bwd"): BlockSizes(32, 32, 4, 1),
}
# Interpret mode (CPU): small tiles keep the Python-level emulation fast and
# make tests cross many tile boundaries on small shapes.
INTERPRET_BLOCKS = BlockSizes(16, 16, 4, 1)


def head_dim_bucket(head_dim: int) -> int:
  """Padded head dim the kernel works in (a power of two, at least 16)."""
  p = 16
  while p < head_dim:
    p *= 2
  return p


def _override_table() -> dict:
  path = settings.current().block_table
  if not path:
    return {}
  with open(path) as f:
    raw = json.load(f)
  return {tuple(json.loads(k)): BlockSizes(**v) for k, v in raw.items()}


def block_sizes_for(*, compute_capability: tuple[int, int] | None,
                    head_dim: int, dtype, mode: Mode,
                    interpret: bool) -> BlockSizes:
  """The shipped choice for this GPU generation, head dim, dtype and mode."""
  if interpret:
    return INTERPRET_BLOCKS
  d = max(64, head_dim_bucket(head_dim))
  itemsize = min(4, jnp.dtype(dtype).itemsize)
  major = compute_capability[0] if compute_capability else 8
  override = _override_table()
  setting = compiler_setting()
  use_triton = setting == "triton" or (setting == "auto" and
                                       _pip_triton_ready())
  look = lambda m: _lookup(override, major, d, itemsize, m, use_triton)
  if mode == "bwd_dq":
    # The dQ kernel of the recompute backward: its own entry, else "bwd"'s.
    bs = look("bwd_dq") or dataclasses.replace(
        _lookup_or_fallback(override, major, d, itemsize, "bwd", use_triton),
        dq=None)
  else:
    bs = _lookup_or_fallback(override, major, d, itemsize, mode, use_triton)
    if mode == "bwd" and bs.dq is None:
      dq = look("bwd_dq")
      if dq is not None and dataclasses.replace(dq, dq=None) != bs:
        bs = dataclasses.replace(bs, dq=dataclasses.replace(dq, dq=None))
  if setting != "auto":  # one compiler for every kernel
    bs = with_compiler(bs, setting)
  return bs


def with_compiler(bs: BlockSizes, compiler: str) -> BlockSizes:
  dq = None if bs.dq is None else with_compiler(bs.dq, compiler)
  return dataclasses.replace(bs, dq=dq, compiler=compiler)


def _lookup(override, major, d, itemsize, mode, use_triton):
  key = (major, d, itemsize, mode)
  if key in override:
    return override[key]
  if use_triton and key in _TRITON_TABLE:
    return _TRITON_TABLE[key]
  return _TABLE.get(key)


def _lookup_or_fallback(override, major, d, itemsize, mode, use_triton):
  bs = _lookup(override, major, d, itemsize, mode, use_triton)
  if bs is not None:
    return bs
  bs = _FALLBACK.get((d, 2, "fwd" if mode == "fwd" else "bwd"))
  if bs is None:
    bs = BlockSizes(32, 32, 4, 1)
  if itemsize == 4:
    bs = BlockSizes(max(16, bs.block_q // 2), max(16, bs.block_k // 2),
                    bs.num_warps, 1)
  return bs


def dq_mode() -> DqMode:
  """The dQ reduction of the current settings (see settings.KernelSettings)."""
  return settings.current().dq_mode
