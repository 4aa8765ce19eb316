"""Kernel settings: one frozen value instead of environment switches.

`KernelSettings` says which compiler builds the Triton kernels, how the dense
backward reduces dQ, and where tile tables come from. The public functions of
`jax_api` take one as `config=`; it is resolved when the call is traced and
becomes part of the kernels' static arguments, so two calls with different
settings never share a compiled kernel by mistake.

Where no `config` is passed, `from_environment()` gives the documented
defaults, read from these variables (this is the only module of
`pallas_kernels` that reads the environment):

  FOLDAX_KERNEL_COMPILER   "auto" (default), "xla" or "triton"
  FOLDAX_DQ_MODE           "recompute" (default) or "atomic"
  FOLDAX_BLOCK_TABLE       JSON file of dense tile overrides
  FOLDAX_DECODE_BLOCKS     "block_k,num_warps,num_stages" for decode
  FOLDAX_DEBERTA_BLOCKS    JSON file of DeBERTa tile overrides
  FOLDAX_DEBERTA_GATHER    "direct" or "transposed" (same bits either way)
  FOLDAX_DEBERTA_SPLIT_TILES  "1" / "0": full tiles without load masks

They are read each time a call is traced without `config`: inside a
`jax.jit` that was already traced, a later change has no effect (pass
`config=` to choose per call).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from typing import Literal

Compiler = Literal["auto", "xla", "triton"]
DqMode = Literal["atomic", "recompute"]

DEFAULT_COMPILER: Compiler = "auto"
DEFAULT_DQ_MODE: DqMode = "recompute"
_COMPILERS = ("auto", "xla", "triton")
_DQ_MODES = ("atomic", "recompute")
_GATHERS = ("direct", "transposed")


@dataclasses.dataclass(frozen=True)
class KernelSettings:
  """How the kernels are built (hashable: part of the trace key).

  compiler: "auto" takes a kernel's pip-Triton tile entry where one exists
    and pip Triton is usable, else XLA compiles it; "xla" / "triton" use
    that compiler for every kernel.
  dq_mode: "recompute" (dQ by its own kernel) or "atomic" (the integer-grid
    atomic reduction); both are bitwise deterministic.
  block_table: path of a JSON file of dense tile overrides, or None.
  decode_blocks: (block_k, num_warps, num_stages) for decode, or None for
    the shipped table.
  deberta_blocks: path of a JSON file of DeBERTa tile overrides, or None.
  deberta_gather: "direct", "transposed" or None (chosen by compiler).
  deberta_split_tiles: run full tiles without load masks; None: on GPUs,
    off in interpret mode.
  """

  compiler: Compiler = DEFAULT_COMPILER
  dq_mode: DqMode = DEFAULT_DQ_MODE
  block_table: str | None = None
  decode_blocks: tuple[int, int, int] | None = None
  deberta_blocks: str | None = None
  deberta_gather: str | None = None
  deberta_split_tiles: bool | None = None

  def __post_init__(self):
    _check("compiler", self.compiler, _COMPILERS)
    _check("dq_mode", self.dq_mode, _DQ_MODES)
    if self.deberta_gather is not None:
      _check("deberta_gather", self.deberta_gather, _GATHERS)
    if self.decode_blocks is not None:
      blocks = tuple(self.decode_blocks)
      if len(blocks) != 3 or not all(
          isinstance(x, int) and x > 0 for x in blocks):
        raise ValueError("decode_blocks must be three positive ints "
                         f"(block_k, num_warps, num_stages); got "
                         f"{self.decode_blocks!r}.")
      object.__setattr__(self, "decode_blocks", blocks)


def _check(name: str, value, allowed) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}; got {value!r}.")


def _env_choice(env: dict, var: str, default, allowed):
  value = env[var] or default
  if value is not None and value not in allowed:
    quoted = ", ".join(repr(a) for a in allowed)
    raise ValueError(f"{var} must be one of {quoted}; got {value!r}.")
  return value


_VARIABLES = ("FOLDAX_KERNEL_COMPILER", "FOLDAX_DQ_MODE", "FOLDAX_BLOCK_TABLE",
              "FOLDAX_DECODE_BLOCKS", "FOLDAX_DEBERTA_BLOCKS",
              "FOLDAX_DEBERTA_GATHER", "FOLDAX_DEBERTA_SPLIT_TILES")


def from_environment() -> KernelSettings:
  """The defaults: KernelSettings from the FOLDAX_* variables above (one
  value per combination of their values, so a call costs seven lookups)."""
  return _settings_for(tuple(os.environ.get(v) for v in _VARIABLES))


@functools.lru_cache(maxsize=64)
def _settings_for(values: tuple) -> KernelSettings:
  env = dict(zip(_VARIABLES, values))
  decode = env["FOLDAX_DECODE_BLOCKS"]
  decode_blocks = None
  if decode:
    try:
      decode_blocks = tuple(int(x) for x in decode.split(","))
    except ValueError:
      raise ValueError("FOLDAX_DECODE_BLOCKS must be 'block_k,num_warps,"
                       f"num_stages'; got {decode!r}.") from None
  return KernelSettings(
      compiler=_env_choice(env, "FOLDAX_KERNEL_COMPILER", DEFAULT_COMPILER,
                           _COMPILERS),
      dq_mode=_env_choice(env, "FOLDAX_DQ_MODE", DEFAULT_DQ_MODE, _DQ_MODES),
      block_table=env["FOLDAX_BLOCK_TABLE"] or None,
      decode_blocks=decode_blocks,
      deberta_blocks=env["FOLDAX_DEBERTA_BLOCKS"] or None,
      deberta_gather=_env_choice(env, "FOLDAX_DEBERTA_GATHER", None,
                                 _GATHERS),
      deberta_split_tiles={"1": True, "0": False}.get(
          env["FOLDAX_DEBERTA_SPLIT_TILES"] or ""))


_active: contextvars.ContextVar[KernelSettings | None] = (
    contextvars.ContextVar("foldax_kernel_settings", default=None))
_compiler: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "foldax_kernel_compiler", default=None)


def current() -> KernelSettings:
  """The settings of the enclosing `use(...)`, else `from_environment()`."""
  s = _active.get()
  return from_environment() if s is None else s


@contextlib.contextmanager
def use(settings: KernelSettings | None):
  """Kernel plans made inside this context follow `settings` (None: the
  enclosing settings or the environment's)."""
  if settings is None:
    yield
    return
  if not isinstance(settings, KernelSettings):
    raise TypeError("config must be a pallas_kernels.settings.KernelSettings "
                    f"(jax_api.KernelSettings); got {type(settings).__name__}.")
  token = _active.set(settings)
  try:
    yield
  finally:
    _active.reset(token)


@contextlib.contextmanager
def compiled_by(compiler: Literal["xla", "triton"]):
  """Block sizes looked up inside this context are for kernels compiled by
  `compiler` ("xla" or "triton", see flash.config.BlockSizes.compiler),
  whatever the settings say. The torch bridge's direct launch, which
  compiles every kernel with pip Triton itself, looks its blocks up inside
  compiled_by("triton")."""
  if compiler not in ("xla", "triton"):
    raise ValueError(f"compiler must be 'xla' or 'triton'; got {compiler!r}.")
  token = _compiler.set(compiler)
  try:
    yield
  finally:
    _compiler.reset(token)


def compiled_by_context() -> str | None:
  """The compiler of an enclosing `compiled_by`, else None (the kernels
  whose only GPU path is XLA's, such as DeBERTa's through JAX, follow
  `compiled_by` alone, not the settings' compiler)."""
  return _compiler.get()


def compiler_setting() -> str:
  """"xla", "triton" or "auto": `compiled_by`'s, else the settings'."""
  c = _compiler.get()
  return current().compiler if c is None else c


def accepts_config(fn):
  """Gives a public function a `config: KernelSettings | None = None`
  keyword: its body (the kernel plan it makes while tracing) runs inside
  `use(config)`."""
  @functools.wraps(fn)
  def wrapper(*args, config: KernelSettings | None = None, **kwargs):
    with use(config):
      return fn(*args, **kwargs)
  return wrapper
