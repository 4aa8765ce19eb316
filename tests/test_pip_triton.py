"""The pip-Triton lowering of the flash kernels (`pallas_kernels.pip_triton`)
checked on CPU: which compiler a trace gets, the custom call it lowers to
(for sm_90, GPU query stubbed; pip Triton really compiles the cubins), and
the protobuf bytes that carry the cubin to jaxlib. Its GPU twins (reference
match, bitwise determinism, the lowering really taken) are in
tests/test_dense.py, parametrised by compiler."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import pip_triton, triton_ir
from pallas_kernels.flash import config


def test_block_choice_per_compiler_setting(monkeypatch):
  """Which compiler each kernel gets, recorded in its (static) blocks:
  "auto" takes the pip-Triton entries where pip Triton can run (the D128
  16-bit forward on sm_90) and XLA's elsewhere; "xla" / "triton" (the
  environment or `compiled_by`, which wins) put every kernel on one."""
  from pallas_kernels.flash.config import BlockSizes, block_sizes_for
  kw = dict(compute_capability=(9, 0), dtype=jnp.bfloat16, interpret=False)
  get = lambda d, mode: block_sizes_for(head_dim=d, mode=mode, **kw)
  monkeypatch.setattr(config, "_pip_triton_ready", lambda: True)
  monkeypatch.delenv("FOLDAX_KERNEL_COMPILER", raising=False)
  assert config.compiler_setting() == config.DEFAULT_COMPILER == "auto"
  pip_fwd = BlockSizes(128, 128, 8, 3, compiler="triton")
  assert get(128, "fwd") == pip_fwd
  xla_bwd = get(128, "bwd")
  assert xla_bwd.compiler == xla_bwd.dq_blocks.compiler == "xla"
  assert get(64, "fwd").compiler == "triton"
  assert block_sizes_for(  # no pip-Triton entry for fp32
      head_dim=128, mode="fwd", compute_capability=(9, 0),
      dtype=jnp.float32, interpret=False).compiler == "xla"
  with config.compiled_by("xla"):
    xla_fwd = get(128, "fwd")
    assert xla_fwd.compiler == "xla" and xla_fwd != pip_fwd
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "triton")
  assert get(128, "fwd") == pip_fwd
  bwd = get(128, "bwd")
  assert (bwd.block_q, bwd.block_k, bwd.num_warps) == (
      xla_bwd.block_q, xla_bwd.block_k, xla_bwd.num_warps)
  assert bwd.compiler == bwd.dq_blocks.compiler == "triton"
  with config.compiled_by("xla"):  # the context wins over the environment
    assert get(128, "fwd") == xla_fwd
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "auto")
  monkeypatch.setattr(config, "_pip_triton_ready", lambda: False)
  assert get(128, "fwd") == xla_fwd  # auto without pip Triton
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "nvcc")
  with pytest.raises(ValueError, match="FOLDAX_KERNEL_COMPILER"):
    get(128, "fwd")
  with pytest.raises(ValueError, match="compiler"):
    with config.compiled_by("nvcc"):
      pass
  with pytest.raises(ValueError, match="compiler"):
    BlockSizes(64, 64, 4, 2, compiler="nvcc")


def test_compiler_params_by_compiler():
  assert type(pip_triton.compiler_params("xla", 4, 2)).__name__ == \
      "CompilerParams"
  p = pip_triton.compiler_params("triton", 8, 3)
  assert isinstance(p, pip_triton.PipTritonCompilerParams)
  assert (p.num_warps, p.num_stages) == (8, 3)


def test_protobuf_wire_format():
  """Known encodings (protobuf's encoding guide): varint 300, a string."""
  assert pip_triton._varint(1) == b"\x01"
  assert pip_triton._varint(300) == b"\xac\x02"
  assert pip_triton._field(2, b"testing") == b"\x12\x07testing"
  assert pip_triton._field_u32(3, 150) == b"\x18\x96\x01"


def test_flash_kernels_lower_to_jaxlib_triton_call(fake_h200, monkeypatch):
  """Blocks for pip Triton: the forward and the recompute backward lower to `triton_kernel_call_ffi` custom calls (none to XLA's Triton
  compile), each with a pip-Triton cubin for sm_90, as many pointer
  arguments as the call has buffers, and Pallas' grid. Capturing IR
  (the torch bridge) still goes through Pallas' own rule."""
  pytest.importorskip("triton")
  from pallas_kernels.flash.tiles import MaskConfig
  from pallas_kernels.flash.backward import flash_backward
  from pallas_kernels.flash.forward import flash_forward
  monkeypatch.setattr(pip_triton, "available", lambda: None)
  calls = []

  def opaque(compiled, num_warps, grid, n_buffers, cc, name):
    calls.append(dict(name=name, warps=num_warps, grid=grid, cc=cc,
                      n=n_buffers, cubin=len(compiled.asm["cubin"]),
                      ptrs=triton_ir.pointer_count(compiled.asm["ttir"])))
    return name.encode()

  monkeypatch.setattr(pip_triton, "kernel_call_opaque", opaque)
  sds = jax.ShapeDtypeStruct
  t, hq, hkv, d = 256, 4, 2, 64
  q, kv = sds((t, hq, d), jnp.bfloat16), sds((t, hkv, d), jnp.bfloat16)
  cu, rows = sds((3,), jnp.int32), sds((hq, t), jnp.float32)
  cfg = MaskConfig.make(causal=True, window_size=(-1, -1), has_segments=False,
                        softcap=0.0, scale=0.125)
  blocks = config.BlockSizes(64, 64, 4, 2, compiler="triton")
  fwd = jax.jit(lambda *a: flash_forward(*a, cfg=cfg, blocks=blocks,
                                         max_seqlen_q=128))
  bwd = jax.jit(lambda *a: flash_backward(
      *a, cfg=cfg, blocks=blocks, max_seqlen_q=128, max_seqlen_k=128,
      dq_mode="recompute"))
  texts = [
      fwd.trace(q, kv, kv, cu, cu).lower(
          lowering_platforms=("cuda",)).as_text(),
      bwd.trace(q, kv, kv, q, rows, q, cu, cu).lower(
          lowering_platforms=("cuda",)).as_text()]
  captured = triton_ir.capture_triton_ir(
      jax.jit(lambda *a: flash_forward(*a, cfg=cfg, blocks=blocks,
                                       max_seqlen_q=128)),
      (q, kv, kv, cu, cu))
  text = "\n".join(texts)
  assert text.count("triton_kernel_call_ffi") == 7
  assert "__gpu$xla.gpu.triton" not in text
  names = [c["name"] for c in calls]
  assert names == ["fold_flash_forward", "fold_flash_forward_contain",
                   "fold_flash_backward_preprocess",
                   "fold_flash_backward_dkdv",
                   "fold_flash_backward_dkdv_contain",
                   "fold_flash_backward_dq", "fold_flash_backward_dq_contain"]
  for c in calls:
    assert c["cc"] == 90 and c["cubin"] > 0 and c["ptrs"] == c["n"], c
  # (heads per wave, tiles, sequences x waves): small heads fit one wave.
  assert calls[0]["grid"] == (hq, 2, 2) and calls[0]["warps"] == 4
  assert calls[3]["grid"] == (hkv, 2, 2)
  # The capture ran Pallas' rule: no further pip-Triton compile.
  assert [n for n, _, _ in captured] == ["fold_flash_forward",
                                         "fold_flash_forward_contain"]
  assert len(calls) == 7


def _lower_small_forward() -> str:
  """StableHLO of a small non-causal forward whose blocks ask for pip
  Triton, lowered for CUDA (fresh jit: Pallas' lowering really runs)."""
  from pallas_kernels.flash.tiles import MaskConfig
  from pallas_kernels.flash.forward import flash_forward
  sds = jax.ShapeDtypeStruct
  q = sds((64, 2, 64), jnp.bfloat16)
  cu = sds((2,), jnp.int32)
  cfg = MaskConfig.make(causal=False, window_size=(-1, -1),
                        has_segments=False, softcap=0.0, scale=0.125)
  blocks = config.BlockSizes(64, 64, 4, 2, compiler="triton")
  fwd = jax.jit(lambda *a: flash_forward(*a, cfg=cfg, blocks=blocks,
                                         max_seqlen_q=64))
  return fwd.trace(q, q, q, cu, cu).lower(
      lowering_platforms=("cuda",)).as_text()


def test_unavailable_pip_triton_is_an_error(fake_h200, monkeypatch):
  """Asked for pip Triton where it cannot run: a clear error at lowering,
  not a silent XLA compile."""
  monkeypatch.setattr(pip_triton, "available", lambda: "no CUDA plugin")
  with pytest.raises(RuntimeError, match="no CUDA plugin"):
    _lower_small_forward()


def test_compile_failure_under_auto_falls_back_once(fake_h200, monkeypatch,
                                                    caplog):
  """With FOLDAX_KERNEL_COMPILER=auto a kernel pip Triton cannot compile is
  compiled by XLA instead, said once; asked for "triton", it is an error."""
  import logging
  monkeypatch.setattr(pip_triton, "available", lambda: None)

  def broken(*a, **k):
    raise RuntimeError("ptxas exploded")

  monkeypatch.setattr(pip_triton, "compile_ttir", broken)
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "auto")
  with caplog.at_level(logging.WARNING, logger="pallas_kernels"):
    text = _lower_small_forward()
    _lower_small_forward()
  assert "__gpu$xla.gpu.triton" in text
  assert "triton_kernel_call_ffi" not in text
  said = [r.getMessage() for r in caplog.records
          if "ptxas exploded" in r.getMessage()]
  # Once per kernel (the forward and its `_contain` twin), not per lowering.
  assert len(said) == 2
  assert "compile fold_flash_forward " in said[0]
  assert "compile fold_flash_forward_contain " in said[1]
  monkeypatch.setenv("FOLDAX_KERNEL_COMPILER", "triton")
  with pytest.raises(RuntimeError, match="ptxas exploded"):
    _lower_small_forward()


def test_auto_needs_the_tested_triton(monkeypatch):
  pytest.importorskip("triton")
  import triton
  monkeypatch.setattr(pip_triton, "available", lambda: None)
  pip_triton.auto_ready.cache_clear()
  try:
    monkeypatch.setattr(triton, "__version__", "3.9.1")
    assert "3.9.1" in pip_triton.auto_ready()
    pip_triton.auto_ready.cache_clear()
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert pip_triton.auto_ready() is None
  finally:
    pip_triton.auto_ready.cache_clear()
