"""`python -m jax_api.train --context-parallel N`: the demo LM trained with
its sequence axis sharded over N devices (GPUs, or N virtual CPU devices).

The model code is unchanged: the batch is placed on `make_mesh(context=N,
explicit=True)` as `P(None, "context")` and the parameters replicated, so
every attention call sees a sequence-sharded q under `jax.jit` and runs
round the ring (`jax_api.sharding.route`); XLA partitions the rest of the
step (embeddings, MLPs and norms per token, the loss mean and the parameter
gradients by all-reduces).
"""

from __future__ import annotations

import time

__all__ = ["main"]


def _ensure_cpu_devices(n: int) -> None:
  """N virtual CPU devices, if the backend has not started yet (the count
  is fixed when JAX initialises). It does not touch GPUs."""
  import jax
  try:
    jax.config.update("jax_num_cpu_devices", max(
        n, int(jax.config.jax_num_cpu_devices or 1)))
  except RuntimeError:  # a backend already started: keep its devices
    pass


def main(args, lm) -> int:
  """Trains with `args.context_parallel` devices on the sequence axis.

  args: `jax_api.train`'s parsed arguments; lm: the `jax_api.train` module
  (passed in, so this module does not import it back). Returns the exit
  status."""
  n = int(args.context_parallel)
  if n < 1:
    raise ValueError(f"--context-parallel must be >= 1; got {n}.")
  _ensure_cpu_devices(n)

  import jax
  import numpy as np
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jax_api._corpus import CharTokenizer, corpus_text
  from jax_api.sharding.mesh import make_mesh

  devices = jax.devices()
  if len(devices) < n:
    raise ValueError(
        f"--context-parallel {n}: only {len(devices)} {devices[0].platform} "
        f"devices (on CPU the count is fixed when JAX starts: JAX had "
        f"started before this run could ask for {n}).")
  on_gpu = devices[0].platform == "gpu"
  size = args.size if args.size != "auto" else ("small" if on_gpu else "tiny")
  preset = lm.SIZES[size]
  steps = args.steps if args.steps is not None else 20
  seq_len = args.seq_len or preset["seq_len"]
  batch = args.batch or preset["batch"]
  lr = args.lr or preset["lr"]
  if seq_len % n:
    raise ValueError(f"--seq-len {seq_len} must be divisible by "
                     f"--context-parallel {n}.")
  if args.backend not in ("auto", "xla", "pallas", "interpret"):
    raise ValueError(f"--backend: --context-parallel runs the ring "
                     f"('auto', 'xla', 'pallas' or 'interpret'); got "
                     f"{args.backend!r}.")
  text = corpus_text()
  tok = CharTokenizer(text)
  data = tok.encode(text)
  cfg = lm.LMConfig(vocab_size=tok.vocab_size,
                   **{k: preset[k] for k in ("d_model", "num_layers",
                                             "num_heads", "num_kv_heads")},
                   sliding_window=args.window, use_sinks=args.sinks,
                   softcap=args.softcap, dtype=args.dtype or "float32",
                   backend=args.backend)
  mesh = make_mesh(context=n, devices=devices, explicit=True)
  tokens = NamedSharding(mesh, P(None, "context"))
  replicated = NamedSharding(mesh, P())
  print(f"foldax train --context-parallel {n}: {devices[0].platform} x {n}, "
        f"size {size}, seq_len {seq_len} ({seq_len // n} per device), batch "
        f"{batch}, {steps} steps", flush=True)

  model = lm.TinyLM(cfg)
  tx = optax.adamw(lr)
  step = lm.make_train_step(model, tx)
  params = jax.device_put(lm.init_params(model, seq_len, args.seed),
                          replicated)
  opt_state = jax.device_put(tx.init(params), replicated)
  it = lm.batches(data, seq_len, batch, args.seed)
  losses = []
  t0 = time.perf_counter()
  t1 = None
  for i in range(steps):
    x, y = (jax.device_put(a, tokens) for a in next(it))
    params, opt_state, loss, _ = step(params, opt_state, x, y)
    losses.append(float(loss))
    if i == 0:
      t1 = time.perf_counter()
  dt = time.perf_counter() - (t1 or t0)
  tok_s = max(steps - 1, 1) * batch * seq_len / max(dt, 1e-9)
  ok = bool(np.all(np.isfinite(losses)))
  print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps; "
        f"{tok_s:,.0f} tokens/s after a {(t1 or t0) - t0:.1f} s first step; "
        f"{'finite' if ok else 'NON-FINITE'}", flush=True)
  return 0 if ok else 1
