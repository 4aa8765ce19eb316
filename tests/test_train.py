"""The demo LM of `python -m jax_api.train`, in a test-sized version: loss goes
down, training is bitwise reproducible (and its step has no scatter, the op
that is nondeterministic on GPU), the XLA determinism flag is set in time,
KV-cache generation equals full recomputation, and the command runs end to
end."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

from jax_api import train as tr
from jax_api._corpus import CharTokenizer, corpus_text

SHAPE = dict(d_model=32, num_layers=1, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def data():
  text = corpus_text(40_000)
  tok = CharTokenizer(text)
  return tok, tok.encode(text)


def _cfg(tok, **kw):
  return tr.LMConfig(vocab_size=tok.vocab_size,
                     **{**SHAPE, "backend": "xla", **kw})


def test_corpus_is_deterministic_and_small():
  a = corpus_text(5_000)
  corpus_text.cache_clear()
  assert corpus_text(5_000) == a and len(a) == 5_000
  assert a.isascii() and a.startswith("FABLE 1: ")
  tok = CharTokenizer(corpus_text())
  assert tok.decode(tok.encode(a)) == a and tok.vocab_size < 100


def test_loss_goes_down_and_runs_are_bitwise_identical(data):
  tok, ids = data
  cfg = _cfg(tok, use_sinks=True)
  kw = dict(steps=40, seq_len=32, batch=8, lr=1e-2, progress=False)
  r1 = tr.train(cfg, ids, **kw)
  r2 = tr.train(cfg, ids, **kw)
  first, last = np.mean(r1.losses[:5]), np.mean(r1.losses[-5:])
  assert last < first - 0.5, (first, last)
  assert r1.losses == r2.losses
  for a, b in zip(jax.tree.leaves(r1.params), jax.tree.leaves(r2.params)):
    assert np.array_equal(np.asarray(a).view(np.uint32),
                          np.asarray(b).view(np.uint32))


def test_check_determinism_on_the_kernel(data):
  tok, ids = data
  cfg = _cfg(tok, backend="interpret", sliding_window=8, softcap=20.0)
  ok, detail = tr.check_determinism(cfg, ids, steps=2, seq_len=16, batch=2,
                                    lr=1e-2)
  assert ok, detail


def test_kv_cache_generation_equals_full_recomputation(data):
  tok, ids = data
  cfg = _cfg(tok, use_sinks=True, sliding_window=6)
  model = tr.TinyLM(cfg)
  params = tr.init_params(model, 16, seed=1)
  # Random (untrained) weights give less degenerate greedy paths.
  params = jax.tree.map(
      lambda a: a * 3.0 if a.ndim > 1 else a + 0.5, params)
  prompt = jnp.asarray(np.stack([ids[:5], ids[100:105]]))
  n = 8
  got = tr.generate(cfg, params, prompt, n, temperature=0.0)
  # Greedy by full recomputation in a fixed buffer (causal: the zeros past
  # position t do not reach it), one compile.
  fwd = jax.jit(model.apply)
  seq = jnp.zeros((2, 5 + n), jnp.int32).at[:, :5].set(prompt)
  for t in range(5, 5 + n):
    logits = fwd(params, seq)[:, t - 1]
    seq = seq.at[:, t].set(jnp.argmax(logits, -1).astype(jnp.int32))
  assert np.array_equal(got, np.asarray(seq[:, 5:]))
  # And the logits themselves: prefill + one decode step vs full forward.
  caches = tr.init_caches(cfg, 2, 16)
  lp, caches = jax.jit(lambda p, t, c: model.apply(p, t, c,
                                                   method="prefill"))(
      params, seq[:, :6], caches)
  ld, caches = jax.jit(lambda p, t, c: model.apply(p, t, c,
                                                   method="decode_step"))(
      params, seq[:, 6], caches)
  full = fwd(params, seq)
  np.testing.assert_allclose(lp, full[:, :6], atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(ld, full[:, 6], atol=2e-4, rtol=2e-4)


def test_main_end_to_end(capsys, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  rc = tr.main(["--size", "tiny", "--steps", "4", "--backend", "xla",
                "--seq-len", "16", "--batch", "2", "--gen-tokens", "6",
                "--det-steps", "1"])
  out = capsys.readouterr()
  assert rc == 0
  assert "determinism: PASS" in out.out
  assert "sample (6 tokens" in out.out
  assert "XLA deterministic ops: " in out.out
  assert "4/4" in out.err  # the progress bar


def test_train_step_has_no_scatter(data):
  # A scatter-add (the gradient of a gather: embedding lookup, integer-label
  # cross-entropy) becomes float atomics on GPU: run-to-run different bits.
  tok, _ = data
  cfg = _cfg(tok)
  model, tx, step = tr._setup(cfg, 1e-3, 10)
  params = tr.init_params(model, 16)
  x = jnp.zeros((2, 16), jnp.int32)
  hlo = step.lower(params, tx.init(params), x, x).as_text()
  assert "scatter" not in hlo and "gather" not in hlo


def test_one_hot_embed_is_the_gather_bitwise():
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 50, (3, 7)))
  emb = tr.OneHotEmbed(50, 16, embedding_init=nn.initializers.normal(1.0))
  params = emb.init(jax.random.key(0), ids)
  got = emb.apply(params, ids)
  want = nn.Embed(50, 16).apply(params, ids)
  assert np.array_equal(np.asarray(got).view(np.uint32),
                        np.asarray(want).view(np.uint32))
  logits = jax.random.normal(jax.random.key(1), (3, 7, 50))
  np.testing.assert_allclose(
      tr.cross_entropy(logits, ids),
      optax.softmax_cross_entropy_with_integer_labels(logits, ids),
      rtol=1e-6, atol=1e-6)


def test_enable_xla_deterministic_ops(monkeypatch):
  flag = "--xla_gpu_deterministic_ops"
  # This process's backend is initialised: XLA_FLAGS can no longer change.
  jax.devices()
  monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
  st = tr.enable_xla_deterministic_ops()
  assert not st.on and "already initialised" in st.detail
  assert os.environ["XLA_FLAGS"] == "--xla_foo=1"
  assert not tr.enable_xla_deterministic_ops(False).on
  # An explicit setting wins (and is reported), the last one counting.
  monkeypatch.setenv("XLA_FLAGS", f"{flag}=true --xla_foo=1")
  assert tr.enable_xla_deterministic_ops(False).on
  monkeypatch.setenv("XLA_FLAGS", f"{flag} {flag}=false")
  st = tr.enable_xla_deterministic_ops()
  assert not st.on and "=false" in st.detail
  monkeypatch.setenv("XLA_FLAGS",
                     "--xla_gpu_exclude_nondeterministic_ops=true")
  assert tr.enable_xla_deterministic_ops().on
  assert tr._without_det_flags(
      f"--a=1 {flag}=true --xla_gpu_exclude_nondeterministic_ops --b") == (
          "--a=1 --b")


def test_flag_is_set_before_the_backend_initialises():
  # `python -m jax_api.train` imports the package, then main() edits
  # XLA_FLAGS: that only works while no backend exists, and XLA must read
  # the variable then (checked with a flag whose effect is visible).
  code = (
      "import os, sys, tempfile, jax_api.train as tr\n"
      "from jax._src import xla_bridge\n"
      "assert not xla_bridge.backends_are_initialized()\n"
      "st = tr.enable_xla_deterministic_ops()\n"
      "assert st.on and 'added' in st.detail, st\n"
      "d = tempfile.mkdtemp()\n"
      "os.environ['XLA_FLAGS'] += ' --xla_dump_to=' + d\n"
      "import jax, jax.numpy as jnp\n"
      "jax.jit(lambda x: x + 1)(jnp.ones(2)).block_until_ready()\n"
      "assert os.listdir(d), 'XLA did not read XLA_FLAGS'\n"
      "print('ok')\n")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [env.get("PYTHONPATH")] if p])
  r = subprocess.run([sys.executable, "-c", code], env=env, cwd=root,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def test_time_impls_child_mode(capsys):
  # What `--compare` runs in a child process on a GPU.
  rc = tr.main(["--size", "tiny", "--steps", "3", "--backend", "xla",
                "--seq-len", "16", "--batch", "2", "--time-impls", "fold",
                "--no-xla-deterministic", "--det-steps", "1"])
  out = capsys.readouterr().out
  assert rc == 0
  line = [l for l in out.splitlines() if l.startswith(tr._TIMES_TAG)][-1]
  res = json.loads(line[len(tr._TIMES_TAG):])
  [(impl, rate)] = res["rows"]
  assert impl == "fold" and rate > 0
  assert res["fold_determinism"][0], res
