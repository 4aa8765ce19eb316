"""The process environment of `python -m jax_api.train` (the only module of
`jax_api` that reads it): XLA's deterministic-ops flag, which XLA reads from
XLA_FLAGS once, when JAX initialises its first backend, and the environment
of the `--compare` child process."""

from __future__ import annotations

import dataclasses
import os

from pallas_kernels import device


# ------------------------------------------------------ XLA determinism --

_DET_FLAG = "--xla_gpu_deterministic_ops"
_EXCLUDE_FLAG = "--xla_gpu_exclude_nondeterministic_ops"


def _flag_value(flags: str, name: str) -> bool | None:
  """The last setting of boolean flag `name` in an XLA_FLAGS string (a bare
  `--name` is true); None when absent."""
  val = None
  for tok in flags.split():
    key, eq, v = tok.partition("=")
    if key == name:
      val = (not eq) or v.strip().lower() not in ("false", "0", "no", "")
  return val


@dataclasses.dataclass(frozen=True)
class XlaDeterminism:
  on: bool     # XLA_FLAGS asked for deterministic GPU ops when XLA read it
  detail: str  # how that came about, for the output


def enable_xla_deterministic_ops(enable: bool = True) -> XlaDeterminism:
  """Appends --xla_gpu_deterministic_ops=true to XLA_FLAGS when `enable`,
  XLA_FLAGS does not set it already, and no JAX backend is initialised yet.

  XLA parses XLA_FLAGS once, when JAX initialises its first backend (the
  first `jax.devices()`, array creation or compilation; importing jax,
  flax, optax or this package does not do it), so this must run before
  that. An explicit setting in XLA_FLAGS wins over `enable`. On CPU the
  flag changes nothing (XLA:CPU is deterministic).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  det, excl = _flag_value(flags, _DET_FLAG), _flag_value(flags, _EXCLUDE_FLAG)
  if det is not None or excl:
    on = bool(det) or bool(excl)
    which = (f"{_DET_FLAG}={'true' if det else 'false'}" if det is not None
             else f"{_EXCLUDE_FLAG}=true")
    if det is False and excl:
      which += f" {_EXCLUDE_FLAG}=true"
    return XlaDeterminism(on, f"{'on' if on else 'off'} ({which} in "
                          "XLA_FLAGS)")
  if not enable:
    return XlaDeterminism(False, "off (--no-xla-deterministic)")
  if device.backends_initialised():
    return XlaDeterminism(False, (
        "off (the JAX backend was already initialised in this process, "
        f"so XLA_FLAGS can no longer change; set XLA_FLAGS={_DET_FLAG}=true "
        "before starting Python)"))
  os.environ["XLA_FLAGS"] = f"{flags} {_DET_FLAG}=true".strip()
  return XlaDeterminism(True, f"on ({_DET_FLAG}=true, added to XLA_FLAGS "
                        "by jax_api.train)")


def _without_det_flags(flags: str) -> str:
  return " ".join(t for t in flags.split()
                  if t.partition("=")[0] not in (_DET_FLAG, _EXCLUDE_FLAG))


def child_environment() -> dict[str, str]:
  """This process's environment for a child that must run without XLA's
  deterministic-ops flag (XLA flags are per process). This process keeps its
  GPU memory pool (by default 75% of the GPU), so unless the user chose an
  allocator setting the child allocates what it uses rather than a fraction
  up front."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = _without_det_flags(env.get("XLA_FLAGS", ""))
  if not any(k in env for k in device.ALLOCATOR_VARIABLES):
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return env
