"""`python -m jax_api.train --context-parallel 2` on 2 virtual CPU devices
(a subprocess: the device count is fixed when JAX initialises)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_train_context_parallel_2_cpu():
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)  # the flag must add the 2 devices itself
  res = subprocess.run(
      [sys.executable, "-m", "jax_api.train", "--context-parallel", "2",
       "--size", "tiny", "--steps", "2", "--seq-len", "16", "--batch", "2"],
      env=env, capture_output=True, text=True, timeout=240)
  out = res.stdout + res.stderr
  assert res.returncode == 0, out
  assert "cpu x 2" in out and "finite" in out, out
  # The attention went round the ring (not a replicated fallback).
  assert "ring_attention runs its per-block XLA path" in out, out
