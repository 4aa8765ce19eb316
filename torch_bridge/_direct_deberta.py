"""The DeBERTa inference forward on CUDA tensors without PJRT (see
`torch_bridge._direct` for how kernels are captured and launched): the
position-table GEMM and the disentangled forward kernel of
`jax_api.deberta`'s Pallas path, launched on torch's current stream."""

from __future__ import annotations

import dataclasses
import functools

import torch

from pallas_kernels.triton_ir import capture_triton_ir
from torch_bridge import _runtime as rt
from torch_bridge._direct import (_cached_plan, _jax_dtype, _Kernels,
                                  _on_device, _raw_stream, _sds, enabled)


def _used_lengths(valid: torch.Tensor, s: int) -> torch.Tensor:
  """`jax_api.deberta.attention._used_lengths` in torch: int32 [b], a
  right-padded (or unpadded) row's valid length, else MASKED_ROW (on the
  device, no sync)."""
  from pallas_kernels.deberta.forward import MASKED_ROW
  n = valid.sum(dim=1, dtype=torch.int32)
  prefix = torch.arange(s, device=valid.device, dtype=torch.int32)[None, :] < \
      n[:, None]
  return torch.where((valid == prefix).all(dim=1), n,
                     torch.full_like(n, MASKED_ROW)).contiguous()


@dataclasses.dataclass(frozen=True)
class _DebertaShape:
  b: int
  s: int
  h: int
  d: int
  dtype: torch.dtype
  has_mask: bool
  pos_rows: int  # rows of pos_key / pos_query as given (>= 2*att_span)


def deberta_eligible(cfg, q, cu, seed) -> bool:
  """The DeBERTa forward can take the direct path: dense [b, s, h, d] CUDA
  tensors on the Pallas backend, no dropout (its seed), not packed."""
  return (cfg.backend == "pallas" and cu is None and seed is None and
          cfg.dropout_rate == 0.0 and q.is_cuda and q.dim() == 4 and
          q.dtype in (torch.bfloat16, torch.float16, torch.float32) and
          enabled())


def deberta_plan(cfg, q, pk, pq, mask) -> "DebertaPlan | None":
  pos = pk if pk is not None else pq
  shape = _DebertaShape(q.shape[0], q.shape[1], q.shape[2], q.shape[3],
                        q.dtype, mask is not None,
                        pos.shape[0] if pos is not None else 0)

  def build():
    p = DebertaPlan(cfg, shape, torch.cuda.get_device_capability(q.device))
    rt.announce("torch_bridge: DeBERTa attention on CUDA (inference, no "
                "dropout) launches the Pallas kernels' Triton IR directly on "
                "torch's stream (FOLDAX_TORCH_LAUNCH=jax: through JAX and "
                "DLPack).")
    return p

  return _cached_plan(("deberta", cfg, shape, q.device.index), build,
                      f"DeBERTa attention {shape}")


class DebertaPlan(_Kernels):
  """The position-table GEMM and the disentangled forward kernel of one
  DeBERTa configuration and shape, compiled, and the torch glue around them
  (what `jax_api.deberta.disentangled_attention` does in XLA on its Pallas
  path: flatten [b, s] to tokens, cut the position projections to 2*span
  rows, the int32 token mask). q, k, v: [b, s, h, d]; pos_key, pos_query:
  [>= 2*span, h, d]; mask: int [b, s] or None."""

  def __init__(self, cfg, shape: _DebertaShape, cc, *,
               compile_kernels: bool = True):
    import jax
    import jax.numpy as jnp
    from pallas_kernels.deberta.layout import geometry
    from pallas_kernels.deberta.config import blocks_for
    from pallas_kernels.settings import compiled_by
    from torch_bridge import _deberta_jax
    super().__init__(compile_kernels)
    s = shape
    self.cfg, self.shape = cfg, s
    dt = _jax_dtype(s.dtype)
    geo = geometry(cfg.position_buckets, cfg.max_relative_positions)
    self.slots = 2 * geo.span
    self._slot_table = geo.slot_table()
    x = _sds((s.b, s.s, s.h, s.d), dt)
    pos = _sds((s.pos_rows, s.h, s.d), dt)
    mask = _sds((s.b, s.s), jnp.int32) if s.has_mask else None
    fn = jax.jit(functools.partial(_deberta_jax._jax_attention, cfg))
    with compiled_by("triton"):  # pip Triton's block table (see config)
      got = capture_triton_ir(fn, (x, x, x, pos if cfg.c2p else None,
                                   pos if cfg.p2c else None, mask, None,
                                   None))
      blocks = blocks_for(head_dim=s.d, dtype=dt, interpret=False,
                          compute_capability=cc)
    # Identical pallas_calls (the c2p and p2c tables: one kernel on
    # same-shaped operands) may be lowered once.
    names = list(dict.fromkeys(n for n, _, _ in got))
    want = (["fold_deberta_position_table"] if cfg.c2p or cfg.p2c else []
            ) + ["fold_deberta_forward"]
    if names != want:
      raise RuntimeError(f"torch_bridge: captured {names}; expected {want}")
    # cu, slot, [mask, used lengths], q, k, v, [c2p, p2c], out, lse2
    n_fwd = 2 + 2 * int(s.has_mask) + 3 + int(cfg.c2p) + int(cfg.p2c) + 2
    for name, ttir, grid in got:
      # The c2p and p2c tables are one kernel on same-shaped operands.
      if name in self.ir:
        if ttir != self.ir[name] or grid != self.grids[name]:
          raise RuntimeError("torch_bridge: the two position tables differ")
        continue
      b = blocks.table if name == "fold_deberta_position_table" else \
          blocks.fwd
      need = 3 if name == "fold_deberta_position_table" else n_fwd
      self._add(name, ttir, grid, need, b.num_warps, b.num_stages, cc)
    self._consts = {}

  def _device_consts(self, device):
    c = self._consts.get(device)
    if c is not None:
      return c
    return self._new_device_constant(
        self._consts, device, "cu_seqlens and slot table",
        lambda: ((torch.arange(self.shape.b + 1, dtype=torch.int32) *
                  self.shape.s).to(device),
                 torch.as_tensor(self._slot_table,
                                 dtype=torch.int32).to(device)))

  def _mask_args(self, mask):
    """The kernel's int32 token mask and used lengths (derived once per mask
    tensor: every layer of an encoder gets the same one)."""
    def derive(mask):
      m = mask != 0
      return (m.to(torch.int32).reshape(-1).contiguous(),
              _used_lengths(m, self.shape.s))
    return rt.derived(f"deberta_mask_args/{self.shape.s}", mask, derive)

  def forward(self, q, k, v, pk, pq, mask):
    """out [b, s, h, d] in q's dtype."""
    s = self.shape
    total = s.b * s.s
    with _on_device(q.device):
      stream = _raw_stream(q.device)
      cu, slot = self._device_consts(q.device)
      qf, kf, vf = (x.contiguous().view(total, s.h, s.d) for x in (q, k, v))
      args = [cu, slot]
      if mask is not None:
        args += self._mask_args(mask)
      args += [qf, kf, vf]
      for on, x, pos in ((self.cfg.c2p, qf, pk), (self.cfg.p2c, kf, pq)):
        if on:
          table = torch.empty((total, s.h, self.slots), device=q.device,
                              dtype=q.dtype)
          pos = pos[: self.slots].to(q.dtype).contiguous()
          self._launch("fold_deberta_position_table", x, pos, table,
                       stream=stream)
          args.append(table)
      out = torch.empty_like(qf)
      lse2 = torch.empty((s.h, total), device=q.device, dtype=torch.float32)
      self._launch("fold_deberta_forward", *args, out, lse2, stream=stream)
    return out.view(s.b, s.s, s.h, s.d)
