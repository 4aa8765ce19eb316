"""Pallas kernels compiled by pip Triton and launched by jaxlib's Triton call.

Under `jax.jit`, Pallas hands the Triton IR of a `pallas_call` to XLA, which
compiles it with the Triton fork built into XLA. On the H200 that compile
of our flash forward runs 20-25% slower at 8 warps than pip Triton's
compile of the *same IR* (benchmarks/results/h200/triton-compare-2026-12-03:
1.65 ms against 1.30 ms at 128x128 tiles, B2 H16 S8192 D128 causal). So
for the kernels that ask for it, this module replaces Pallas' GPU lowering:

1. Pallas' own lowering turns the kernel's jaxpr into Triton IR (unchanged:
   same kernel source, masking and reduction order).
2. pip Triton compiles the IR to a cubin, its TTIR stage included (see
   `compile_ttir`).
3. The `pallas_call` lowers to jaxlib's `triton_kernel_call_ffi` custom call
   (the one jax-triton uses), carrying that cubin: XLA launches it on its
   stream like any other kernel and compiles nothing.

A kernel opts in through its compiler params: `compiler_params(...)` returns
`PipTritonCompilerParams` for blocks whose `compiler` is "triton" (see
`pallas_kernels.flash.config`: the block table says which kernels pip Triton
compiles best) and Pallas' plain `CompilerParams` otherwise. Pallas picks a
lowering rule by the params' type, so no other Pallas kernel in the process
is affected.

Arguments of the launched kernel are the `pallas_call`'s operands then its
results (aliased outputs share their input's buffer), then the two scratch
pointers every Triton 3 kernel takes, which jaxlib appends.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import tempfile
import zlib

from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, settings, triton_ir


@dataclasses.dataclass(frozen=True)
class PipTritonCompilerParams(plgpu.CompilerParams):
  """Pallas' Triton compiler params, for a kernel pip Triton compiles."""


def compiler_params(compiler: str, num_warps: int,
                    num_stages: int) -> plgpu.CompilerParams:
  """A kernel's compiler params for `compiler` (`BlockSizes.compiler`):
  "triton" gives `PipTritonCompilerParams` (and registers the lowering rule
  below), "xla" Pallas' own."""
  if compiler == "triton":
    _register()
    return PipTritonCompilerParams(num_warps=num_warps, num_stages=num_stages)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# The pip Triton the pip-Triton table entries were measured with; "auto"
# uses pip Triton only with this minor version (other versions: set
# FOLDAX_KERNEL_COMPILER=triton explicitly).
TESTED_TRITON = (3, 6)


@functools.cache
def auto_ready() -> str | None:
  """None if FOLDAX_KERNEL_COMPILER=auto may use pip Triton here, else why
  not (one line)."""
  why = available()
  if why is not None:
    return why
  import triton
  got = tuple(int(x) for x in triton.__version__.split(".")[:2])
  if got != TESTED_TRITON:
    return (f"pip triton {triton.__version__} is not the tested "
            f"{TESTED_TRITON[0]}.{TESTED_TRITON[1]}")
  return None


@functools.cache
def available() -> str | None:
  """None if pip Triton and jaxlib's Triton call can serve this process,
  else why not (one line)."""
  try:
    import triton  # noqa: F401
    from triton.backends.compiler import GPUTarget  # noqa: F401
  except Exception as e:  # noqa: BLE001
    return f"pip triton is not importable ({type(e).__name__}: {e})"
  gpu_triton = compat.gpu_triton
  if gpu_triton is None:
    return f"jaxlib's gpu_triton is missing ({compat.GPU_TRITON_ERROR})"
  if not hasattr(gpu_triton, "TritonKernel"):
    return "jaxlib has no CUDA Triton call (no CUDA plugin)"
  return None


# ----------------------------------------------------------------------------
# pip Triton's compile of one kernel's IR
# ----------------------------------------------------------------------------

@functools.cache
def _ir_dir() -> str:
  return tempfile.mkdtemp(prefix="foldax_ttir_")


def _ttir_passes(path: str, target, options: dict) -> str:
  """The Triton IR after Triton's own TTIR stage (inlining, canonicalising,
  CSE, loop unrolling: what XLA's pipeline and a `@triton.jit` compile run
  first). `triton.compile` of an IR file skips that stage, and without it
  the dK/dV kernel spills 352 bytes per thread on sm_90."""
  from triton.compiler.compiler import IRSource, make_backend
  from triton._C.libtriton import ir
  backend = make_backend(target)
  opts = backend.parse_options(options)
  ctx = ir.context()
  src = IRSource(path, ctx, backend)
  stages = {}
  backend.add_stages(stages, opts, src.language)
  mod = src.module
  mod.context = ctx
  return str(stages["ttir"](mod, {}))


def compile_ttir(name: str, ttir: str, num_warps: int, num_stages: int,
                 cc: tuple[int, int]):
  """pip Triton's compile (a `triton.compiler.CompiledKernel`) of one
  kernel's Triton IR for compute capability cc, every stage included
  (cached on disk by Triton, keyed on the IR's hash)."""
  import triton
  from triton.backends.compiler import GPUTarget
  target = GPUTarget("cuda", cc[0] * 10 + cc[1], 32)
  options = dict(num_warps=num_warps, num_stages=num_stages)
  digest = hashlib.sha256(
      f"{ttir}{num_warps}{num_stages}{cc}".encode()).hexdigest()[:16]
  path = os.path.join(_ir_dir(), f"{name}_{digest}.ttir")
  if not os.path.exists(path):
    raw = path[: -len(".ttir")] + ".raw.ttir"
    with open(raw, "w") as f:
      f.write(ttir)
    with open(path, "w") as f:
      f.write(_ttir_passes(raw, target, options))
  return triton.compile(path, target=target, options=options)


# ----------------------------------------------------------------------------
# The custom call
# ----------------------------------------------------------------------------

def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    b = n & 0x7F
    n >>= 7
    out.append(b | (0x80 if n else 0))
    if not n:
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """One length-delimited protobuf field."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _field_u32(number: int, value: int) -> bytes:
  return _varint(number << 3) + _varint(value)


def kernel_call_opaque(compiled, num_warps: int, grid: tuple[int, int, int],
                       n_buffers: int, cc: int, call_name: str) -> bytes:
  """The custom call's `opaque`: a zlib-compressed `TritonAnyKernelCall`
  (jaxlib/gpu/triton.proto) launching `compiled` (pip Triton's kernel,
  cubin included) on n_buffers pointer arguments.

  jaxlib's Python constructors cannot set `TritonKernel.module_image` (the
  cubin). Protobuf merges a repeated occurrence of a message field into the
  first, so the serialised call gets one more `kernel_call.kernel` carrying
  only the module image: jaxlib then loads that cubin instead of compiling
  the PTX with its own ptxas."""
  gpu_triton = compat.gpu_triton
  md = compiled.metadata
  scratch = []
  if getattr(md, "global_scratch_size", 0):
    scratch = [md.global_scratch_size, md.global_scratch_align]
  kernel = gpu_triton.TritonKernel(md.name, num_warps, 1, md.shared,
                                   compiled.asm["ptx"], "", cc, *scratch)
  params = [gpu_triton.create_array_parameter(0, 0)
            for _ in range(n_buffers)]
  call = gpu_triton.TritonKernelCall(kernel, *grid, params)
  proto = call.to_proto(call_name, b"")
  image = (_field(1, compiled.asm["cubin"]) + _field(2, md.name.encode()) +
           _field_u32(3, md.shared))
  # TritonAnyKernelCall.kernel_call(1) . TritonKernelCall.kernel(1) .
  # TritonKernel.module_image(11)
  proto += _field(1, _field(1, _field(11, image)))
  return zlib.compress(proto)


def _lowering(ctx, *in_nodes, jaxpr, grid_mapping, compiler_params,
              input_output_aliases, debug, **params):
  """Pallas' GPU lowering rule for `PipTritonCompilerParams` kernels."""
  import jax
  mlir = compat.mlir
  gpu_info_lib = compat.triton_gpu_info
  lowering = compat.triton_lowering
  pallas_rule = compat.triton_pallas_call

  def pallas_own_rule():  # XLA compiles the same IR
    return pallas_rule.pallas_call_lowering(
        ctx, *in_nodes, jaxpr=jaxpr, grid_mapping=grid_mapping,
        compiler_params=compiler_params,
        input_output_aliases=input_output_aliases, debug=debug, **params)

  if triton_ir.capturing():
    # Lowered only to capture the IR (no GPU needed).
    return pallas_own_rule()
  why = available()
  if why is not None:
    raise RuntimeError(
        f"A kernel compiled by pip Triton (FOLDAX_KERNEL_COMPILER=triton or "
        f"compiled_by('triton')) needs pip Triton and jaxlib's CUDA Triton "
        f"call, but {why}. Use FOLDAX_KERNEL_COMPILER=xla or 'auto'.")
  if grid_mapping.num_dynamic_grid_bounds or grid_mapping.num_index_operands:
    raise NotImplementedError("pip-Triton lowering: static grids only")
  cc = gpu_info_lib.get_gpu_info().compute_capability
  name = mlir.sanitize_name(jaxpr.debug_info.func_name)
  result = lowering.lower_jaxpr_to_triton_module(
      jaxpr, grid_mapping, "cuda", cc or None, mlir_ctx=ctx.module_context)
  ttir = result.module.operation.get_asm(enable_debug_info=False)
  n_buffers = len(in_nodes) + len(ctx.avals_out)
  got = triton_ir.pointer_count(ttir)
  if got != n_buffers:
    raise RuntimeError(f"pip-Triton lowering: {name} takes {got} pointers, "
                       f"the call has {n_buffers} buffers")
  num_warps = compiler_params.num_warps or 4
  num_stages = compiler_params.num_stages or 3
  cc_pair = (cc // 10, cc % 10) if isinstance(cc, int) else tuple(cc)
  try:
    compiled = compile_ttir(name, ttir, num_warps, num_stages, cc_pair)
  except Exception as e:  # noqa: BLE001
    if settings.compiler_setting() != "auto":
      raise
    # Asked for "auto": say so once, and let XLA compile this kernel.
    _warn_once(f"pallas_kernels: pip Triton could not compile {name} "
               f"({type(e).__name__}: {str(e)[:200]}); XLA compiles it "
               "instead (FOLDAX_KERNEL_COMPILER=auto).")
    return pallas_own_rule()
  grid = pallas_rule.normalize_grid(result.grid)
  opaque = kernel_call_opaque(compiled, num_warps, grid, n_buffers,
                              cc_pair[0] * 10 + cc_pair[1], name)
  rule = jax.ffi.ffi_lowering(
      "triton_kernel_call_ffi", api_version=4,
      operand_output_aliases=dict(input_output_aliases))
  return rule(ctx, *in_nodes, opaque=opaque)


_warned: set = set()


def _warn_once(msg: str) -> None:
  if msg not in _warned:
    _warned.add(msg)
    import logging
    logging.getLogger("pallas_kernels").warning(msg)


@functools.cache
def _register() -> None:
  # Pallas registers its own rules on first lowering; `compat` imported its
  # module already, so that registration cannot race ours (ours is for our
  # type only).
  compat.pallas_core.register_lowering_rule(PipTritonCompilerParams, _lowering,
                                     "gpu")
