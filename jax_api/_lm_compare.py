"""`python -m jax_api.train --compare`: training tokens/s of the same model
with foldax attention and with `jax.nn.dot_product_attention` (XLA; cuDNN on
a GPU), also in a child process without XLA's deterministic-ops flag."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from typing import Any, Sequence

from jax_api._backend import _gpu_capability
from jax_api._lm import LMConfig
from jax_api._lm_training import _setup, batches, init_params
from jax_api._xla_flags import child_environment


# --------------------------------------------------------------- comparison --


def _fmt_rate(v) -> str:
  return v if isinstance(v, str) else f"{v:,.0f} tok/s"


def compare_attention(cfg: LMConfig, data, *, seq_len, batch, lr,
                      steps: int = 20, stream=None,
                      impls: Sequence[str] | None = None,
                      total_steps: int | None = None,
                      notes: dict[str, str] | None = None
                      ) -> list[tuple[str, Any]]:
  """tokens/s of training steps with foldax vs jax.nn.dot_product_attention
  (XLA; cuDNN on a GPU) on the same model (no sinks/softcap/window there).
  `total_steps` sets the optimizer schedule (pass the training run's to
  reuse its compiled step); `notes` adds text after an impl's row."""
  stream = stream or sys.stdout
  if impls is None:
    impls = ["fold", "jax:xla"]
    if _gpu_capability() is not None:
      impls.append("jax:cudnn")
  rows = []
  for impl in impls:
    c = dataclasses.replace(cfg, impl=impl, use_sinks=False, softcap=0.0,
                            sliding_window=None)
    try:
      model, tx, step_fn = _setup(c, lr, total_steps or steps)
      params = init_params(model, seq_len)
      opt_state = tx.init(params)
      it = batches(data, seq_len, batch)
      x, y = next(it)
      params, opt_state, loss, _ = step_fn(params, opt_state, x, y)
      loss.block_until_ready()
      t0 = time.perf_counter()
      for _ in range(steps):
        x, y = next(it)
        params, opt_state, loss, _ = step_fn(params, opt_state, x, y)
      loss.block_until_ready()
      rows.append((impl, steps * batch * seq_len / (time.perf_counter() - t0)))
    except Exception as e:  # report and go on (e.g. cuDNN unavailable)
      rows.append((impl, f"failed: {type(e).__name__}: {str(e)[:120]}"))
    note = (notes or {}).get(impl, "")
    stream.write(f"  {impl:<10} {_fmt_rate(rows[-1][1])}{note}\n")
    stream.flush()
  return rows


_TIMES_TAG = "jax_api.train times: "


def _compare_without_det(impls: Sequence[str], size: str, steps: int,
                         seq_len: int, batch: int, lr: float, dtype: str,
                         backend: str, det_steps: int = 2, seed: int = 0,
                         timeout_s: float = 300.0,
                         stream=None) -> list[tuple[str, Any]]:
  """Times `impls` in a child process whose XLA_FLAGS has no deterministic
  ops flag (XLA flags are per process) and, with "fold" among them, re-runs
  `det_steps` training steps there twice (the model's determinism without
  the flag); prints and returns the timing rows."""
  stream = stream or sys.stdout
  cmd = [sys.executable, "-m", "jax_api.train", "--time-impls",
         ",".join(impls), "--no-xla-deterministic", "--size", size,
         "--steps", str(steps), "--seq-len", str(seq_len), "--batch",
         str(batch), "--lr", repr(lr), "--dtype", dtype, "--backend", backend,
         "--det-steps", str(det_steps), "--seed", str(seed)]
  env = child_environment()
  try:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    line = [l for l in proc.stdout.splitlines() if l.startswith(_TIMES_TAG)]
    if proc.returncode != 0 or not line:
      tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
      raise RuntimeError(f"exit {proc.returncode}: {tail[0][:160]}")
    res = json.loads(line[-1][len(_TIMES_TAG):])
    rows, det = [tuple(r) for r in res["rows"]], res["fold_determinism"]
  except Exception as e:
    rows = [(impl, f"failed: {type(e).__name__}: {str(e)[:160]}")
            for impl in impls]
    det = None
  for impl, v in rows:
    note = ("  (cuDNN's default backward)" if impl == "jax:cudnn"
            else "")
    stream.write(f"  {impl:<10} {_fmt_rate(v)}{note}\n")
  if det is not None:
    stream.write(f"  fold determinism without the flag: "
                 f"{'PASS' if det[0] else 'FAIL'}: {det[1]}\n")
  stream.flush()
  return rows
