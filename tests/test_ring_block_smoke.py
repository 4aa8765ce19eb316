"""benchmarks/ring_block.py on CPU: the harness runs and prints the
projection's named inputs (tiny shapes; the XLA path only, for speed)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ring_block_smoke_json():
  env = dict(os.environ, PYTHONPATH=str(_ROOT), JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-m", "benchmarks.ring_block",
                        "--smoke", "--impls", "xla_f32,ring_step"], cwd=_ROOT, env=env,
                       capture_output=True, text=True, timeout=240)
  assert res.returncode == 0, res.stdout + res.stderr
  doc = json.loads(res.stdout)
  assert len(doc["rows"]) == 12 and all("ms" in r for r in doc["rows"])
  for impl in ("xla_f32", "ring_step"):
    names = doc["projection_inputs"][f"{impl}_S64"]
    assert all(names[k] > 0 for k in ("T_DIAG_FWD", "T_OFF_FWD",
                                      "T_DIAG_FWDBWD", "T_OFF_FWDBWD"))
