"""Training, sampling and the determinism check of `python -m jax_api.train`:
seeded batches, the jitted AdamW step, `train` with its progress bar,
`generate` through the paged KV cache, `check_determinism`."""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_api._lm import LMConfig, TinyLM, cross_entropy, init_caches
from jax_api.generate import decode_loop


# ---------------------------------------------------------------- training --


def batches(data: np.ndarray, seq_len: int, batch: int, seed: int = 0):
  """Endless (inputs, targets) int32 [batch, seq_len] at seeded offsets."""
  rng = np.random.default_rng(seed)
  hi = len(data) - seq_len - 1
  while True:
    off = rng.integers(0, hi, size=batch)
    idx = off[:, None] + np.arange(seq_len + 1)[None, :]
    chunk = data[idx]
    yield chunk[:, :-1], chunk[:, 1:]


def make_optimizer(lr: float, steps: int):
  sched = optax.warmup_cosine_decay_schedule(
      0.0, lr, warmup_steps=max(1, min(50, steps // 10)),
      decay_steps=max(2, steps), end_value=lr * 0.1)
  return optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.99, weight_decay=0.01))


def make_train_step(model: TinyLM, tx):
  """jit(params, opt_state, x, y) -> (params, opt_state, loss, grads);
  params and opt_state are donated. The determinism check runs this same
  step (the executable that trains is the one checked)."""

  def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return cross_entropy(logits, y).mean()

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, loss, grads

  return step


@functools.cache
def _setup(cfg: LMConfig, lr: float, steps: int):
  """(model, optimizer, compiled step) per configuration: repeated runs
  (the determinism re-run, tests) reuse one compilation."""
  model = TinyLM(cfg)
  tx = make_optimizer(lr, steps)
  return model, tx, make_train_step(model, tx)


@functools.cache
def _jit_init(cfg: LMConfig):
  return jax.jit(TinyLM(cfg).init)


def init_params(model: TinyLM, seq_len: int, seed: int = 0):
  """Parameters of `model` (one compiled init per config)."""
  x = jnp.zeros((1, seq_len), jnp.int32)
  return _jit_init(model.cfg)(jax.random.key(seed), x)


class _Progress:
  """A plain-text progress bar: \\r updates on a terminal, lines otherwise."""

  def __init__(self, total: int, stream=None, width: int = 24):
    self.total, self.width = total, width
    self.stream = stream or sys.stderr
    self.tty = getattr(self.stream, "isatty", lambda: False)()
    self._last_line = -1

  def update(self, step: int, loss: float, tok_s: float | None):
    frac = step / self.total
    fill = int(frac * self.width)
    rate = "   -- tok/s" if tok_s is None else f"{tok_s:>9,.0f} tok/s"
    msg = (f"[{'#' * fill}{'.' * (self.width - fill)}] {step:>5}/{self.total}"
           f"  loss {loss:6.3f}  {rate}")
    if self.tty:
      self.stream.write("\r" + msg)
      if step == self.total:
        self.stream.write("\n")
    else:
      decile = int(frac * 10)
      if decile != self._last_line or step == self.total:
        self._last_line = decile
        self.stream.write(msg + "\n")
    self.stream.flush()


@dataclasses.dataclass
class TrainResult:
  params: Any
  losses: list[float]
  tokens_per_s: float
  compile_s: float
  train_s: float


def train(cfg: LMConfig, data: np.ndarray, *, steps: int, seq_len: int,
          batch: int, lr: float, seed: int = 0, progress: bool = True,
          log_every: int = 10, stream=None) -> TrainResult:
  """Trains TinyLM(cfg) for `steps` steps; returns params and losses."""
  model, tx, step_fn = _setup(cfg, lr, steps)
  params = init_params(model, seq_len, seed)
  opt_state = tx.init(params)
  it = batches(data, seq_len, batch, seed)
  bar = _Progress(steps, stream) if progress else None
  losses: list[float] = []
  pending = []
  t_start = time.perf_counter()
  t_first = None
  compile_s = 0.0
  for i in range(1, steps + 1):
    x, y = next(it)
    params, opt_state, loss, _ = step_fn(params, opt_state, x, y)
    pending.append(loss)
    if i == 1:
      loss.block_until_ready()
      t_first = time.perf_counter()
      compile_s = t_first - t_start
    if i % log_every == 0 or i == steps or i == 1:
      losses.extend(float(v) for v in pending)  # one sync per log interval
      pending = []
      now = time.perf_counter()
      tok_s = (None if i == 1 else
               (i - 1) * batch * seq_len / max(now - t_first, 1e-9))
      if bar:
        bar.update(i, losses[-1], tok_s)
  jax.block_until_ready(params)
  end = time.perf_counter()
  n_timed = max(steps - 1, 1)
  tok_s = n_timed * batch * seq_len / max(end - t_first, 1e-9)
  return TrainResult(params, losses, tok_s, compile_s, end - t_first)


# -------------------------------------------------------------- generation --


def generate(cfg: LMConfig, params, prompt: np.ndarray, n_new: int, *,
             seed: int = 0, temperature: float = 0.8,
             page_size: int | None = None) -> np.ndarray:
  """Samples n_new tokens after `prompt` (int [batch, t]) through the KV
  cache: one prefill, then one token per step, all in one jit. temperature
  0 is greedy. Returns int32 [batch, n_new]."""
  model = TinyLM(cfg)
  prompt = jnp.asarray(prompt, jnp.int32)
  b, t = prompt.shape
  caches = init_caches(cfg, b, t + n_new, page_size)

  # One dispatch for the whole sample: prefill, then `decode_loop`'s
  # lax.while_loop over tokens, the caches donated (updated in place).
  @functools.partial(jax.jit, donate_argnums=2)
  def run(params, prompt, caches, key):
    logits, caches = model.apply(params, prompt, caches, method="prefill")
    step = lambda tok, c: model.apply(params, tok, c,  # noqa: E731
                                      method="decode_step")
    toks, caches, _ = decode_loop(step, logits[:, -1], caches, n_new,
                                  key=key, temperature=float(temperature))
    return toks, caches

  toks, caches = run(params, prompt, caches, jax.random.key(seed))
  for c in caches:
    c.check()
  return np.asarray(toks)


# ------------------------------------------------------------- determinism --


def _same_bits(a, b) -> bool:
  """Bitwise equality of two pytrees of arrays (compared on device)."""
  def eq(x, y):
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.shape != y.shape or x.dtype != y.dtype:
      return jnp.asarray(False)
    if jnp.issubdtype(x.dtype, jnp.floating):
      u = jnp.dtype(f"uint{x.dtype.itemsize * 8}")
      x = jax.lax.bitcast_convert_type(x, u)
      y = jax.lax.bitcast_convert_type(y, u)
    return jnp.array_equal(x, y)
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(bool(eq(x, y)) for x, y in zip(la, lb))


def check_determinism(cfg: LMConfig, data: np.ndarray, *, steps: int,
                      seq_len: int, batch: int, lr: float, seed: int = 0,
                      total_steps: int | None = None) -> tuple[bool, str]:
  """Runs `steps` training steps twice from the same init and data; returns
  (every gradient and the final params bitwise equal, a one-line detail).
  `total_steps` sets the optimizer schedule (default `steps`); pass the
  training run's to reuse its compiled step."""
  model, tx, step_fn = _setup(cfg, lr, total_steps or steps)
  runs = []
  for _ in range(2):
    params = init_params(model, seq_len, seed)
    opt_state = tx.init(params)
    it = batches(data, seq_len, batch, seed)
    grads_all = []
    for _ in range(steps):
      x, y = next(it)
      params, opt_state, _, grads = step_fn(params, opt_state, x, y)
      grads_all.append(grads)
    runs.append((params, grads_all))
  (p0, g0), (p1, g1) = runs
  bad = [i for i, (a, b) in enumerate(zip(g0, g1)) if not _same_bits(a, b)]
  same_p = _same_bits(p0, p1)
  n_leaves = len(jax.tree.leaves(p0))
  if not bad and same_p:
    return True, (f"{steps} steps x 2 runs: all gradients ({n_leaves} arrays "
                  "per step) and final parameters bitwise identical")
  what = []
  if bad:
    what.append(f"gradients differ at step(s) {[i + 1 for i in bad]}")
  if not same_p:
    what.append("final parameters differ")
  return False, "; ".join(what)
