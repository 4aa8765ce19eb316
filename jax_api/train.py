"""`python -m jax_api.train`: a tiny decoder LM on foldax attention, end to end.

  1. trains a character-level decoder LM (`TinyLM`: `DecoderAttention` blocks
     with GQA and RoPE) with a `jax.jit`-compiled step (optax AdamW) on the
     text the package generates (`jax_api._corpus`), with a progress bar
     showing loss and tokens/s;
  2. generates a short sample through the paged KV cache (`FoldKVCache`:
     prefill the prompt, then one token per step, all in one jit);
  3. re-runs a few training steps twice from the same initialisation and
     checks that every gradient and the final parameters are bitwise
     identical, printing the verdict (exit status 1 if not).

Determinism on GPU: the attention kernels' backward is deterministic by
construction, and so is the rest of TinyLM: its token embedding is a one-hot
matmul and its loss a one-hot cross-entropy, so no gradient is a scatter-add
(XLA lowers a scatter-add with repeated indices to float atomics on GPU, and
the order of atomic additions varies run to run). On top of that, `main()`
appends `--xla_gpu_deterministic_ops=true` to XLA_FLAGS before JAX
initialises its backend (XLA reads the variable once, then), unless
XLA_FLAGS already sets it or `--no-xla-deterministic` is given; the output
says whether it was on. Under the flag any remaining scatter is made
deterministic, GEMMs run with deterministic settings and without timing-based
autotuning of GEMM fusions (so the compiled program does not vary between
processes; it can cost some speed), and cuDNN's attention backward uses its
deterministic algorithm. `--compare` measures under the flag, then times
fold and cuDNN without it in a child process (XLA flags are per process),
where it also re-checks fold's determinism.

    python -m jax_api.train                       # CPU: ~1 minute
    python -m jax_api.train --steps 500 --size medium
    python -m jax_api.train --backend interpret --size tiny --steps 20
    python -m jax_api.train --compare             # tokens/s: fold vs jax.nn

Defaults: `--size auto` is "small" on CPU and "large" on an NVIDIA GPU;
`--backend auto` is the XLA path on CPU and the Pallas (Triton) kernels on a
GPU of compute capability 8.0+ (bfloat16 compute there, float32 on CPU).
`--compare` then times the same model with `jax.nn.dot_product_attention`
(XLA, and cuDNN on a GPU) in place of foldax attention.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax import lax

from jax_api._backend import _gpu_capability, resolve_backend
from jax_api._corpus import CharTokenizer, corpus_text
from jax_api.flax.decoder import DecoderAttention
from jax_api.generate import decode_loop
from jax_api.kvcache import FoldKVCache

__all__ = ["LMConfig", "SIZES", "TinyLM", "init_caches", "make_train_step",
           "batches", "train", "generate", "check_determinism",
           "compare_attention", "init_params", "enable_xla_deterministic_ops",
           "OneHotEmbed", "cross_entropy", "main"]


@dataclasses.dataclass(frozen=True)
class LMConfig:
  vocab_size: int
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  mlp_mult: int = 4
  sliding_window: int | None = None
  use_sinks: bool = False
  softcap: float = 0.0
  dtype: str = "float32"
  backend: str = "auto"
  impl: str = "fold"

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


# name: model shape and the run's defaults (seq_len, batch, steps, lr).
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                 seq_len=32, batch=4, steps=30, lr=3e-3),
    "small": dict(d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  seq_len=128, batch=16, steps=200, lr=3e-3),
    "medium": dict(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
                   seq_len=256, batch=16, steps=500, lr=2e-3),
    "large": dict(d_model=1024, num_layers=8, num_heads=8, num_kv_heads=2,
                  seq_len=2048, batch=16, steps=600, lr=6e-4),
}
_MODEL_KEYS = ("d_model", "num_layers", "num_heads", "num_kv_heads")


# ----------------------------------------------------------------- model ----


class Block(nn.Module):
  cfg: LMConfig

  def setup(self):
    c = self.cfg
    dt = jnp.dtype(c.dtype)
    self.ln1 = nn.RMSNorm(dtype=dt)
    self.attn = DecoderAttention(
        num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        sliding_window=c.sliding_window, use_sinks=c.use_sinks,
        softcap=c.softcap, use_bias=False, dtype=dt, backend=c.backend,
        impl=c.impl)
    self.ln2 = nn.RMSNorm(dtype=dt)
    self.mlp_in = nn.Dense(c.mlp_mult * c.d_model, use_bias=False, dtype=dt)
    self.mlp_out = nn.Dense(c.d_model, use_bias=False, dtype=dt)

  def _mlp(self, x):
    return x + self.mlp_out(nn.gelu(self.mlp_in(self.ln2(x))))

  def __call__(self, x, segment_ids=None):
    return self._mlp(x + self.attn(self.ln1(x), segment_ids=segment_ids))

  def prefill(self, x, cache, lengths=None):
    h, cache = self.attn.prefill(self.ln1(x), cache, lengths)
    return self._mlp(x + h), cache

  def decode_step(self, x, cache):
    h, cache = self.attn.decode_step(self.ln1(x), cache)
    return self._mlp(x + h), cache


class OneHotEmbed(nn.Embed):
  """`nn.Embed` (same parameter) whose lookup is one_hot(ids) @ table.

  The gradient of a gather (`jnp.take`, nn.Embed's lookup) is a scatter-add
  that XLA lowers to float atomics on GPU, so with repeated token ids the
  table's gradient changes bits from run to run. The one-hot matmul's
  gradient is a matmul (a fixed-order reduction). At HIGHEST precision the
  forward is exact (1 * x plus exact zeros), i.e. bitwise the gather. Meant
  for small vocabularies (here ~70 characters: [tokens, vocab] x [vocab,
  d_model] is a few GFLOP); for a large vocabulary use the XLA flag instead.
  """

  def __call__(self, inputs):
    if not jnp.issubdtype(inputs.dtype, jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    (table,) = self.promote_dtype(self.embedding, dtype=self.dtype,
                                  inexact=False)
    onehot = jax.nn.one_hot(inputs, self.num_embeddings, dtype=table.dtype)
    return jnp.dot(onehot, table, precision=lax.Precision.HIGHEST)


def cross_entropy(logits, labels):
  """Softmax cross-entropy with integer labels, written with a one-hot
  product (no gather, so no scatter-add in the gradient)."""
  onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
  return optax.softmax_cross_entropy(logits, onehot)


class TinyLM(nn.Module):
  """Character-level decoder LM: embed -> blocks -> RMSNorm -> tied logits.

  `__call__(tokens [b, t])` -> float32 logits [b, t, vocab] (causal);
  `prefill(tokens, caches, lengths=None)` -> (logits, caches);
  `decode_step(token [b], caches)` -> (logits [b, vocab], caches), with
  `caches` from `init_caches` (one FoldKVCache per layer).
  """

  cfg: LMConfig

  def setup(self):
    c = self.cfg
    self.embed = OneHotEmbed(c.vocab_size, c.d_model,
                          embedding_init=nn.initializers.normal(0.02))
    self.blocks = [Block(c) for _ in range(c.num_layers)]
    self.norm = nn.RMSNorm(dtype=jnp.dtype(c.dtype))

  def _logits(self, h):
    return self.embed.attend(self.norm(h).astype(jnp.float32))

  def __call__(self, tokens, segment_ids=None):
    h = self.embed(tokens).astype(self.cfg.dtype)
    for blk in self.blocks:
      h = blk(h, segment_ids)
    return self._logits(h)

  def prefill(self, tokens, caches, lengths=None):
    h = self.embed(tokens).astype(self.cfg.dtype)
    new = []
    for blk, cache in zip(self.blocks, caches):
      h, cache = blk.prefill(h, cache, lengths)
      new.append(cache)
    return self._logits(h), tuple(new)

  def decode_step(self, token, caches):
    h = self.embed(token).astype(self.cfg.dtype)
    new = []
    for blk, cache in zip(self.blocks, caches):
      h, cache = blk.decode_step(h, cache)
      new.append(cache)
    return self._logits(h), tuple(new)


def init_caches(cfg: LMConfig, batch: int, max_len: int,
                page_size: int | None = None) -> tuple[FoldKVCache, ...]:
  """One empty FoldKVCache per layer, in the model's compute dtype."""
  attn = DecoderAttention(num_heads=cfg.num_heads,
                          num_kv_heads=cfg.num_kv_heads)
  return tuple(attn.init_cache(batch, max_len, cfg.d_model,
                               dtype=jnp.dtype(cfg.dtype),
                               page_size=page_size)
               for _ in range(cfg.num_layers))


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


def _backend_initialised() -> bool:
  try:
    from jax._src import xla_bridge
    return xla_bridge.backends_are_initialized()
  except (ImportError, AttributeError):  # private API moved: assume so
    return True


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
  if _backend_initialised():
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
  env = dict(os.environ)
  env["XLA_FLAGS"] = _without_det_flags(env.get("XLA_FLAGS", ""))
  # This process keeps its GPU memory pool (by default 75% of the GPU):
  # the child allocates what it uses rather than a fraction up front.
  if not any(k in env for k in ("XLA_PYTHON_CLIENT_PREALLOCATE",
                                "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                "XLA_PYTHON_CLIENT_ALLOCATOR")):
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
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


# --------------------------------------------------------------------- main --


def _parse(argv):
  p = argparse.ArgumentParser(
      prog="python -m jax_api.train",
      description="Train a tiny decoder LM on foldax attention, sample from "
      "it through the KV cache, and check bitwise-deterministic training.")
  p.add_argument("--size", default="auto", choices=["auto", *SIZES],
                 help="model/run preset (auto: small on CPU, large on GPU)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--backend", default="auto",
                 choices=["auto", "pallas", "interpret", "xla"])
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--lr", type=float, default=None)
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="compute dtype (default: bfloat16 on GPU, else float32)")
  p.add_argument("--window", type=int, default=None,
                 help="sliding window (keys i-w..i)")
  p.add_argument("--sinks", action="store_true", help="learned sinks")
  p.add_argument("--softcap", type=float, default=0.0)
  p.add_argument("--gen-tokens", type=int, default=None,
                 help="tokens to sample (default: fill the training "
                 "context, at most 200)")
  p.add_argument("--temperature", type=float, default=0.5,
                 help="sampling temperature (0: greedy)")
  p.add_argument("--det-steps", type=int, default=3,
                 help="steps of the determinism re-run (0 skips it)")
  p.add_argument("--compare", action="store_true",
                 help="also time foldax vs jax.nn.dot_product_attention")
  p.add_argument("--xla-deterministic", action=argparse.BooleanOptionalAction,
                 default=True,
                 help="add --xla_gpu_deterministic_ops=true to XLA_FLAGS "
                 "before JAX initialises (default: on; an explicit setting "
                 "in XLA_FLAGS wins)")
  p.add_argument("--time-impls", default=None, help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--context-parallel", type=int, default=None, metavar="N",
                 help="shard the sequence over N devices (N virtual CPU "
                 "devices on CPU): jax_api.sharding.train_cp")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  if args.context_parallel:  # before JAX starts: it may add CPU devices
    from jax_api.sharding import train_cp
    return train_cp.main(args, sys.modules[__name__])
  # Before anything initialises the JAX backend (jax.devices() below).
  xla_det = enable_xla_deterministic_ops(args.xla_deterministic)
  t0 = time.perf_counter()
  on_gpu = _gpu_capability() is not None
  size = args.size if args.size != "auto" else ("large" if on_gpu else "small")
  preset = SIZES[size]
  steps = args.steps if args.steps is not None else preset["steps"]
  seq_len = args.seq_len or preset["seq_len"]
  batch = args.batch or preset["batch"]
  lr = args.lr or preset["lr"]
  backend = resolve_backend(args.backend, kernel="jax_api.train")
  dtype = args.dtype or ("bfloat16" if backend == "pallas" else "float32")
  text = corpus_text()
  tok = CharTokenizer(text)
  data = tok.encode(text)
  cfg = LMConfig(vocab_size=tok.vocab_size,
                 **{k: preset[k] for k in _MODEL_KEYS},
                 sliding_window=args.window, use_sinks=args.sinks,
                 softcap=args.softcap, dtype=dtype, backend=backend)
  if args.time_impls:  # the child of --compare (see _compare_without_det)
    impls = args.time_impls.split(",")
    rows = compare_attention(cfg, data, seq_len=seq_len, batch=batch, lr=lr,
                             impls=impls, total_steps=steps,
                             stream=sys.stderr)
    det = None
    if "fold" in impls and args.det_steps > 0:  # reuses the timed step
      det = check_determinism(
          dataclasses.replace(cfg, use_sinks=False, softcap=0.0,
                              sliding_window=None),
          data, steps=args.det_steps, seq_len=seq_len, batch=batch, lr=lr,
          seed=args.seed, total_steps=steps)
    print(_TIMES_TAG + json.dumps({"rows": rows, "fold_determinism": det}),
          flush=True)
    return 0
  dev = jax.devices()[0]
  print(f"foldax train: {dev.platform} ({dev.device_kind}), backend "
        f"{backend}, size {size} (d_model {cfg.d_model}, {cfg.num_layers} "
        f"layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads), "
        f"{dtype}, seq_len {seq_len}, batch {batch}, {steps} steps, corpus "
        f"{len(text):,} chars (vocab {tok.vocab_size})", flush=True)
  print(f"XLA deterministic ops: {xla_det.detail}"
        + ("" if on_gpu else "; no effect on CPU"), flush=True)
  res = train(cfg, data, steps=steps, seq_len=seq_len, batch=batch, lr=lr,
              seed=args.seed)
  n_params = sum(x.size for x in jax.tree.leaves(res.params))
  w = max(1, min(10, len(res.losses) // 4))
  first = float(np.mean(res.losses[:w]))
  last = float(np.mean(res.losses[-w:]))
  print(f"trained {n_params:,} params: loss {first:.3f} -> {last:.3f} "
        f"(uniform: {math.log(tok.vocab_size):.3f}); {res.tokens_per_s:,.0f} "
        f"tokens/s after a {res.compile_s:.1f} s first step (compile)",
        flush=True)

  prompt_text = "FABLE 7: "
  prompt = tok.encode(prompt_text)[None]
  n_gen = args.gen_tokens
  if n_gen is None:  # RoPE positions past seq_len were never trained
    n_gen = max(1, min(200, seq_len - prompt.shape[1]))
  tg = time.perf_counter()
  sample = generate(cfg, res.params, prompt, n_gen, seed=args.seed,
                    temperature=args.temperature)
  print(f"sample ({n_gen} tokens through the KV cache, "
        f"{time.perf_counter() - tg:.1f} s incl. compile):")
  print("  " + (prompt_text + tok.decode(sample[0])).replace("\n", "\n  "),
        flush=True)

  ok = True
  if args.det_steps > 0:
    ok, detail = check_determinism(cfg, data, steps=args.det_steps,
                                   seq_len=seq_len, batch=batch, lr=lr,
                                   seed=args.seed, total_steps=steps)
    print(f"determinism: {'PASS' if ok else 'FAIL'}: {detail}"
          + ("" if xla_det.on or not on_gpu else
             " (XLA deterministic ops were off)"), flush=True)
  if args.compare:
    state = "on" if xla_det.on else "off"
    cudnn = ""
    if on_gpu:
      cudnn = ("; cuDNN's backward runs its deterministic algorithm" if
               xla_det.on else "; cuDNN's default backward")
    print(f"attention comparison (training tokens/s, seq_len {seq_len}, "
          f"batch {batch}; XLA deterministic ops {state}{cudnn}):",
          flush=True)
    compare_attention(cfg, data, seq_len=seq_len, batch=batch, lr=lr,
                      total_steps=steps)
    if on_gpu and xla_det.on:
      print("  without XLA deterministic ops (a separate process: XLA flags "
            "are per process):", flush=True)
      _compare_without_det(["fold", "jax:cudnn"], size, steps,
                           seq_len, batch, lr, dtype, backend,
                           det_steps=max(0, min(args.det_steps, 2)),
                           seed=args.seed)
  print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
