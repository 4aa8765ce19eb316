"""Token generation under one `jax.jit`: a `lax.while_loop` over tokens.

    step = lambda token, caches: model.apply(params, token, caches,
                                             method="decode_step")
    toks, caches, n = decode_loop(step, last_logits, caches, n_new,
                                  key=jax.random.key(0), temperature=0.8)

Call it inside your own `jax.jit` (with the caches donated) so a whole
generation is one dispatch: no host work per token. `step` is any function
(token int32 [batch], caches) -> (logits [batch, vocab], caches); the caches
are any pytree (e.g. one `FoldKVCache` per layer).

Determinism: the key of token i is `jax.random.split(key, n_new)[i]`, so
the tokens are the same bits for a given key whatever the loop's trip count
(an early stop only skips work after every sequence has ended).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sample_token(logits, key, temperature: float = 0.0):
  """int32 [batch] from logits [batch, vocab]: argmax when temperature <= 0,
  else a categorical draw from softmax(logits / temperature)."""
  if not isinstance(temperature, (int, float)) or isinstance(temperature,
                                                             bool):
    raise TypeError(f"temperature must be a Python float; got "
                    f"{temperature!r}.")
  if temperature <= 0:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


def decode_loop(step, logits, caches, n_new: int, *, key,
                temperature: float = 0.0, eos_id: int | None = None):
  """Generates n_new tokens after a prompt whose last logits are `logits`.

  Args:
    step: (token int32 [batch], caches) -> (logits [batch, vocab], caches).
    logits: [batch, vocab], the prefill's logits at each prompt's last token.
    caches: the pytree `step` threads (already holding the prompts).
    n_new: tokens to generate (a Python int >= 1).
    key: a JAX PRNG key (unused when temperature <= 0).
    temperature: 0 is greedy.
    eos_id: optional token id; a sequence that produced it keeps producing
      it, and the loop stops once every sequence has (remaining columns are
      eos_id). Sequences that ended still go through `step` until then (the
      batch is static); pass `active` masks inside `step` to stop appending.

  Returns:
    (tokens int32 [batch, n_new], caches after the last step, int32 number
    of `step` calls made). The last token is not fed back (n_new - 1 steps
    at most), as when sampling without a cache.
  """
  if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 1:
    raise ValueError(f"n_new must be a Python int >= 1; got {n_new!r}.")
  if logits.ndim != 2:
    raise ValueError(f"logits must have shape [batch, vocab]; got "
                     f"{tuple(logits.shape)}.")
  b = logits.shape[0]
  keys = jax.random.split(key, n_new)
  tok = sample_token(logits, keys[0], temperature)
  buf = jnp.zeros((b, n_new), jnp.int32).at[:, 0].set(tok)
  if eos_id is None:
    done = jnp.zeros((b,), bool)
  else:
    done = tok == eos_id

  def cond(state):
    i, _, _, _, done = state
    return (i < n_new) & ~jnp.all(done)

  def body(state):
    i, tok, caches, buf, done = state
    logits, caches = step(tok, caches)
    nxt = sample_token(logits, keys[i], temperature)
    if eos_id is not None:
      nxt = jnp.where(done, jnp.int32(eos_id), nxt)
      done = done | (nxt == eos_id)
    buf = lax.dynamic_update_slice(buf, nxt[:, None], (0, i))
    return i + 1, nxt, caches, buf, done

  i, _, caches, buf, done = lax.while_loop(
      cond, body, (jnp.int32(1), tok, caches, buf, done))
  if eos_id is not None:
    col = jnp.arange(n_new)[None, :]
    buf = jnp.where(col >= i, jnp.int32(eos_id), buf)
  return buf, caches, i - 1


__all__ = ["decode_loop", "sample_token"]
