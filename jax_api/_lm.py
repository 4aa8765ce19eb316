"""The model of `python -m jax_api.train`: `LMConfig`, the run presets
(`SIZES`) and `TinyLM`, a decoder LM of `DecoderAttention` blocks (GQA,
RoPE) whose embedding and loss are one-hot matmuls (no scatter-add in any
gradient: deterministic on GPU)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax import lax

from jax_api.flax.decoder import DecoderAttention
from jax_api.kvcache import FoldKVCache


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
