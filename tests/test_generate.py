"""`jax_api.generate.decode_loop`: one jit, same tokens as a Python loop
(greedy and sampled), early stop at eos, validation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api.generate import decode_loop, sample_token

V = 11


def _step(tok, caches):
  """A toy model: logits from the token and a running state."""
  state = caches * 3 + tok
  logits = jnp.sin(state[:, None] * (1.0 + jnp.arange(V)[None, :]))
  return logits, state


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_decode_loop_equals_a_python_loop(temperature):
  logits0 = jnp.asarray(np.random.default_rng(0).standard_normal((3, V)),
                        jnp.float32)
  caches = jnp.arange(3, dtype=jnp.int32)
  key = jax.random.key(5)
  n = 6
  run = jax.jit(lambda l, c, k: decode_loop(_step, l, c, n, key=k,
                                            temperature=temperature))
  toks, out_c, steps = run(logits0, caches, key)
  keys = jax.random.split(key, n)
  tok = sample_token(logits0, keys[0], temperature)
  want, c = [tok], caches
  for i in range(1, n):
    logits, c = _step(tok, c)
    tok = sample_token(logits, keys[i], temperature)
    want.append(tok)
  np.testing.assert_array_equal(np.asarray(toks), np.stack(want, 1))
  np.testing.assert_array_equal(np.asarray(out_c), np.asarray(c))
  assert int(steps) == n - 1


def test_decode_loop_stops_at_eos():
  def step(tok, c):  # emits c + 1 until it reaches 4 (the eos id)
    nxt = jnp.minimum(c + 1, 4)
    return jax.nn.one_hot(nxt, V) * 10.0, nxt

  logits0 = jax.nn.one_hot(jnp.array([1, 2]), V) * 10.0
  toks, _, steps = jax.jit(lambda l, c: decode_loop(
      step, l, c, 8, key=jax.random.key(0), eos_id=4))(logits0,
                                                       jnp.array([1, 2]))
  np.testing.assert_array_equal(np.asarray(toks),
                                [[1, 2, 3, 4, 4, 4, 4, 4],
                                 [2, 3, 4, 4, 4, 4, 4, 4]])
  assert int(steps) == 3  # stopped once both rows ended


def test_decode_loop_validation():
  with pytest.raises(ValueError, match="n_new"):
    decode_loop(_step, jnp.zeros((1, V)), jnp.zeros((1,), jnp.int32), 0,
                key=jax.random.key(0))
  with pytest.raises(ValueError, match="logits"):
    decode_loop(_step, jnp.zeros((V,)), jnp.zeros((1,), jnp.int32), 2,
                key=jax.random.key(0))
