"""The forward logic the linen modules (`modules`) and the nnx modules
(`modules_nnx`) share: each module keeps its own parameters (HF's names) and
calls these with itself, so the two APIs compute the same thing by one
definition.

Layouts: input_ids int [batch, seq] (attention_mask [batch, seq] 0/1) or
packed [total] (cu_seqlens int32 [num_seqs + 1]); hidden [..., hidden].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax.numpy as jnp

from pallas_kernels.varlen import token_positions


def packed_positions(cu_seqlens, total: int):
  """int32 [total]: position of each packed token in its sequence (0 past
  cu_seqlens[-1])."""
  t = jnp.arange(total, dtype=jnp.int32)
  return jnp.where(t < cu_seqlens[-1], token_positions(cu_seqlens, total), 0)


def embed(m, input_ids, token_type_ids, position_ids, mask, deterministic):
  """HF `DebertaV2Embeddings.forward` on module `m` (word, position and
  token-type embeddings, the projection, LayerNorm, the mask, dropout)."""
  cfg = m.config
  x = m.word_embeddings(input_ids)
  if cfg.position_biased_input:
    x = x + m.position_embeddings(position_ids)
  if cfg.type_vocab_size > 0:
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids)
    x = x + m.token_type_embeddings(token_type_ids)
  if (cfg.embedding_size or cfg.hidden_size) != cfg.hidden_size:
    x = m.embed_proj(x)
  x = m.LayerNorm(x)
  if mask is not None:
    x = x * mask[..., None].astype(x.dtype)
  return m.dropout(x, deterministic=deterministic)


def encode(m, layers: Sequence[Callable], rel, hidden, attention_mask, *,
           cu_seqlens, max_seqlen, deterministic, output_hidden_states):
  """HF `DebertaV2Encoder.forward` on module `m`: `layers[i](h, mask, rel,
  cu_seqlens=, max_seqlen=, deterministic=)` in turn, the conv after the
  first. -> last hidden state (and, with output_hidden_states, the tuple of
  all hidden states)."""
  if attention_mask is not None:
    input_mask = attention_mask
  elif cu_seqlens is not None:
    input_mask = jnp.arange(hidden.shape[0]) < cu_seqlens[-1]
  else:
    input_mask = jnp.ones(hidden.shape[:-1], hidden.dtype)
  states = [hidden]
  h = hidden
  for i, layer in enumerate(layers):
    h = layer(h, attention_mask, rel, cu_seqlens=cu_seqlens,
              max_seqlen=max_seqlen, deterministic=deterministic)
    if i == 0 and m.config.conv_kernel_size > 0:
      h = m.conv(hidden, h, input_mask, cu_seqlens=cu_seqlens,
                 deterministic=deterministic)
    states.append(h)
  return (h, tuple(states)) if output_hidden_states else h


def model(m, input_ids, attention_mask, token_type_ids, position_ids, *,
          cu_seqlens, max_seqlen, deterministic, output_hidden_states):
  """HF `DebertaV2Model.forward` on module `m` (its `embeddings` and
  `encoder`), padded or packed."""
  if cu_seqlens is not None:
    if input_ids.ndim != 1:
      raise ValueError("with cu_seqlens, input_ids must be packed [total]; "
                       f"got shape {tuple(input_ids.shape)}.")
    if attention_mask is not None:
      raise ValueError("attention_mask and cu_seqlens are exclusive.")
    cu_seqlens = jnp.asarray(cu_seqlens, jnp.int32)
    total = input_ids.shape[0]
    mask = (jnp.arange(total) < cu_seqlens[-1]).astype(jnp.int32)
    if position_ids is None:
      position_ids = packed_positions(cu_seqlens, total)
    emb = m.embeddings(input_ids, token_type_ids, position_ids, mask,
                       deterministic=deterministic)
    return m.encoder(emb, None, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                     deterministic=deterministic,
                     output_hidden_states=output_hidden_states)
  if position_ids is None:
    position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]),
                                    input_ids.shape)
  emb = m.embeddings(input_ids, token_type_ids, position_ids, attention_mask,
                     deterministic=deterministic)
  return m.encoder(emb, attention_mask, deterministic=deterministic,
                   output_hidden_states=output_hidden_states)
