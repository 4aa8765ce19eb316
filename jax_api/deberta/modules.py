"""Flax linen DeBERTa-v2/v3 whose parameter tree mirrors Hugging Face's.

HF name -> params path: dots become nesting, `weight` becomes `kernel`
(Linear, transposed), `embedding` (Embedding) or `scale` (LayerNorm), so
`encoder.layer.3.attention.self.query_proj.weight` is
`params["encoder"]["layer"]["3"]["attention"]["self"]["query_proj"]["kernel"]`
(see `convert.py`). Attention runs through
`jax_api.deberta.disentangled_attention` (Pallas kernels on GPU).

Inputs may be a padded batch (`input_ids [batch, seq]` with an optional
`attention_mask`) or packed sequences (`input_ids [total]` with
`cu_seqlens`); positions restart in each packed sequence, and a padded batch
and its packed form give the same hidden states on real tokens. Conventions
differ from HF on padded tokens only: HF's attention averages all values for
a fully masked query row, here it outputs 0 (the last hidden state of
padded tokens differs; real tokens agree).

Precision: `precision=` (every module, and `convert.from_hf`) applies to the
model's matmuls; the default None follows `jax.default_matmul_precision`,
which on NVIDIA GPUs runs float32 matmuls in TF32. "highest" gives full
float32 (HF float32 parity within ~1e-5). The attention uses
full-precision dots for float32 inputs in any case.

Determinism on GPU: the attention backward of the Pallas kernels is
deterministic by construction, but the embedding lookups (word, position,
token type) are gathers whose gradients are scatter-adds, which XLA runs
with float atomics on GPU (as are the gathers in the "xla" attention
backend's gradient): fine-tuning is bitwise reproducible only with
XLA_FLAGS containing `--xla_gpu_deterministic_ops=true`, set before JAX
initialises its backend.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_api import _lean_ops as lean
from jax_api.deberta.attention import disentangled_attention
from jax_api.deberta.config import DebertaV2Config, activation  # noqa: F401
from pallas_kernels.varlen import token_seq_ids, token_seq_ids_clipped


def _dense(features, m: "_Common", use_bias=True, name=None):
  """nn.Dense with the module `m`'s dtype, param_dtype and precision."""
  return nn.Dense(features, use_bias=use_bias, dtype=m.dtype,
                  param_dtype=m.param_dtype, precision=m.precision, name=name,
                  kernel_init=nn.initializers.normal(0.02))


def _layer_norm(cfg, dtype, param_dtype, name=None):
  return lean.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=dtype,
                        param_dtype=param_dtype, name=name)


class _Common(nn.Module):
  """Attributes shared by the modules (and passed down to their children).

  precision: of the model's matmuls (projections, feed-forward, conv,
    embed_proj, pooler, classifier), as `nn.Dense`'s: None follows
    `jax.default_matmul_precision`, which on NVIDIA GPUs (Ampere+) runs
    float32 matmuls in TF32 (~1e-3 relative error). Pass "highest" for
    full float32 (e.g. parity with PyTorch, whose float32 matmuls are full
    precision by default). The attention itself always uses full-precision
    dots for float32 inputs, whatever this is.
  remat: what training recomputes in the backward instead of keeping
    (`flax.linen.remat`; same parameters, same dropout masks):
    False: nothing. "ffn": each layer's feed-forward block (the
    intermediate matmul, GELU, output matmul, dropout and LayerNorm; its
    [tokens, intermediate] activations are the largest a layer keeps) at
    the cost of one more intermediate matmul per layer. True (or "layer"):
    each whole layer (HF's gradient checkpointing): only each layer's input
    is kept, at the cost of one more forward per layer.
  """

  config: DebertaV2Config
  dtype: Any = jnp.float32  # computation dtype
  param_dtype: Any = jnp.float32
  attention_backend: str = "auto"
  precision: Any = None
  remat: bool | str = False

  def _child_kw(self) -> dict:
    return dict(config=self.config, dtype=self.dtype,
                param_dtype=self.param_dtype,
                attention_backend=self.attention_backend,
                precision=self.precision, remat=self.remat)


class DebertaV2SelfAttention(_Common):
  """HF `DisentangledSelfAttention`: projections + disentangled attention.

  __call__(hidden, attention_mask, rel_embeddings, cu_seqlens=None,
  max_seqlen=None, deterministic=True): hidden [batch, seq, hidden] (or
  packed [total, hidden] with cu_seqlens); rel_embeddings [2*att_span,
  hidden] (the encoder's normalised relative embeddings).
  """

  def setup(self):
    cfg = self.config
    all_head = cfg.num_attention_heads * cfg.head_size
    mk = lambda name, bias=True: _dense(all_head, self, bias, name)
    self.query_proj = mk("query_proj")
    self.key_proj = mk("key_proj")
    self.value_proj = mk("value_proj")
    if cfg.relative_attention and not cfg.share_att_key:
      if "c2p" in cfg.pos_att_type:
        self.pos_key_proj = mk("pos_key_proj")
      if "p2c" in cfg.pos_att_type:
        self.pos_query_proj = mk("pos_query_proj")
    self.pos_dropout = lean.Dropout(cfg.hidden_dropout_prob)

  def __call__(self, hidden, attention_mask=None, rel_embeddings=None, *,
               cu_seqlens=None, max_seqlen=None, deterministic: bool = True):
    cfg = self.config
    rel = None
    if cfg.relative_attention:
      rel = self.pos_dropout(rel_embeddings, deterministic=deterministic)
    rate = cfg.attention_probs_dropout_prob
    rng = None
    if not deterministic and rate > 0.0:
      rng = self.make_rng("dropout")
    return _self_attention(
        cfg, hidden, rel, self.query_proj, self.key_proj, self.value_proj,
        getattr(self, "pos_key_proj", None),
        getattr(self, "pos_query_proj", None), attention_mask, cu_seqlens,
        max_seqlen, rng, self.dtype, self.attention_backend)


def _self_attention(cfg, hidden, rel, query_proj, key_proj, value_proj,
                    pos_key_proj, pos_query_proj, attention_mask, cu_seqlens,
                    max_seqlen, dropout_rng, dtype, backend):
  """HF DisentangledSelfAttention.forward from the projections on (shared
  by the linen and nnx modules). rel: the (dropped-out) relative
  embeddings or None; dropout_rng None means no attention dropout."""
  heads, hd = cfg.num_attention_heads, cfg.head_size
  split = lambda x: x.reshape(*x.shape[:-1], heads, hd)
  q = split(query_proj(hidden))
  k = split(key_proj(hidden))
  v = split(value_proj(hidden))
  types = tuple(cfg.pos_att_type)
  n_terms = 1 + ("c2p" in types) + ("p2c" in types)
  pk = pq = None
  if cfg.relative_attention:
    rel = rel[: 2 * cfg.pos_ebd_size].astype(dtype)
    if "c2p" in types:
      pk = split((key_proj if cfg.share_att_key else pos_key_proj)(rel))
    if "p2c" in types:
      pq = split((query_proj if cfg.share_att_key else pos_query_proj)(rel))
  else:
    # HF still divides by sqrt(head_dim * n_terms) without position terms.
    q = q * jnp.asarray(1.0 / n_terms ** 0.5, q.dtype)
    types = ()
  rate = cfg.attention_probs_dropout_prob if dropout_rng is not None else 0.0
  out = disentangled_attention(
      q, k, v, pk, pq,
      attention_mask=None if cu_seqlens is not None else attention_mask,
      cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
      position_buckets=cfg.position_buckets,
      max_relative_positions=cfg.resolved_max_relative_positions,
      pos_att_type=types, dropout_rate=rate, dropout_rng=dropout_rng,
      backend=backend)
  return out.reshape(*out.shape[:-2], heads * hd)


class DebertaV2SelfOutput(_Common):

  def setup(self):
    cfg = self.config
    self.dense = _dense(cfg.hidden_size, self)
    self.LayerNorm = _layer_norm(cfg, self.dtype, self.param_dtype)
    self.dropout = lean.Dropout(cfg.hidden_dropout_prob)

  def __call__(self, hidden, input_tensor, deterministic=True):
    h = self.dropout(self.dense(hidden), deterministic=deterministic)
    return self.LayerNorm(h + input_tensor)


class DebertaV2Attention(_Common):

  def setup(self):
    kw = self._child_kw()
    self.self = DebertaV2SelfAttention(**kw)
    self.output = DebertaV2SelfOutput(**kw)

  def __call__(self, hidden, attention_mask, rel_embeddings, *,
               cu_seqlens=None, max_seqlen=None, deterministic=True):
    ctx = self.self(hidden, attention_mask, rel_embeddings,
                    cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                    deterministic=deterministic)
    return self.output(ctx, hidden, deterministic=deterministic)


class DebertaV2Intermediate(_Common):

  def setup(self):
    self.dense = _dense(self.config.intermediate_size, self)

  def __call__(self, hidden):
    return activation(self.config.hidden_act)(self.dense(hidden))


class DebertaV2Output(_Common):

  def setup(self):
    cfg = self.config
    self.dense = _dense(cfg.hidden_size, self)
    self.LayerNorm = _layer_norm(cfg, self.dtype, self.param_dtype)
    self.dropout = lean.Dropout(cfg.hidden_dropout_prob)

  def __call__(self, hidden, input_tensor, deterministic=True):
    h = self.dropout(self.dense(hidden), deterministic=deterministic)
    return self.LayerNorm(h + input_tensor)


class DebertaV2Layer(_Common):

  def setup(self):
    kw = self._child_kw()
    self.attention = DebertaV2Attention(**kw)
    self.intermediate = DebertaV2Intermediate(**kw)
    self.output = DebertaV2Output(**kw)

  def __call__(self, hidden, attention_mask, rel_embeddings,
               cu_seqlens=None, max_seqlen=None, deterministic=True):
    att = self.attention(hidden, attention_mask, rel_embeddings,
                         cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         deterministic=deterministic)
    if _remat_mode(self.remat) == "ffn":
      return _ffn_remat(self, att, deterministic)
    return _ffn(self, att, deterministic)


def _ffn(layer, att, deterministic):
  """The feed-forward block of a linen or nnx layer (same attribute names)."""
  return layer.output(layer.intermediate(att), att,
                      deterministic=deterministic)


# The feed-forward block recomputed in the backward (remat="ffn"): a lifted
# function of the layer, so parameter names stay intermediate.* / output.*.
_ffn_remat = nn.remat(_ffn, static_argnums=(2,))


def _remat_mode(remat) -> str | None:
  """None, "ffn" or "layer" for a `remat` attribute value."""
  if remat is False or remat is None:
    return None
  if remat is True or remat == "layer":
    return "layer"
  if remat == "ffn":
    return "ffn"
  raise ValueError(f"remat must be False, True, 'layer' or 'ffn'; got "
                   f"{remat!r}.")


class _LayerCollection(_Common):
  """Holds the layers under the names "0", "1", ... (HF's `layer.{i}`)."""

  def setup(self):
    # remat: max_seqlen and deterministic (positions 5, 6 counting self)
    # are Python values the layer branches on.
    cls = (nn.remat(DebertaV2Layer, static_argnums=(5, 6))
           if _remat_mode(self.remat) == "layer" else DebertaV2Layer)
    self.layers = [cls(**self._child_kw(), name=str(i))
                   for i in range(self.config.num_hidden_layers)]

  def __call__(self, i, hidden, attention_mask, rel_embeddings, *,
               cu_seqlens=None, max_seqlen=None, deterministic=True):
    return self.layers[i](hidden, attention_mask, rel_embeddings, cu_seqlens,
                          max_seqlen, deterministic)


def _same_sequence_shift(x, shift: int, cu_seqlens):
  """x shifted by `shift` tokens along the sequence axis, zero where the
  source token is outside the sequence. x: [batch, seq, c] or packed
  [total, c] (with cu_seqlens). A pad and a static slice, not a gather: the
  gradient is a slice too (a gather's is a scatter-add, float atomics on
  GPU)."""
  axis = x.ndim - 2
  n = x.shape[axis]
  widths = [(0, 0)] * x.ndim
  widths[axis] = (max(-shift, 0), max(shift, 0))
  y = jax.lax.slice_in_dim(jnp.pad(x, widths), max(shift, 0),
                           max(shift, 0) + n, axis=axis)
  if cu_seqlens is None:
    return y
  idx = jnp.arange(n) + shift
  sid = token_seq_ids(cu_seqlens, n)
  inside = (idx >= 0) & (idx < n) & (sid[jnp.clip(idx, 0, n - 1)] == sid)
  return jnp.where(inside[:, None], y, 0)


class _ConvParams(nn.Module):
  """`encoder.conv.conv`: kernel [kernel_size, hidden / groups, hidden] (HF
  weight [hidden, hidden / groups, kernel_size] transposed) and bias."""

  kernel_size: int
  in_per_group: int
  features: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    kernel = self.param("kernel", nn.initializers.normal(0.02),
                        (self.kernel_size, self.in_per_group, self.features),
                        self.param_dtype)
    bias = self.param("bias", nn.initializers.zeros, (self.features,),
                      self.param_dtype)
    return kernel, bias


def _conv1d(cfg, kernel, bias, hidden, cu_seqlens, dtype, precision=None):
  """HF's Conv1d (padding (k - 1) // 2, groups) along the sequence, never
  reading across packed sequences. kernel [k, hidden / groups, hidden]."""
  ks, groups, c = cfg.conv_kernel_size, cfg.conv_groups, cfg.hidden_size
  cg = c // groups
  kernel = kernel.astype(dtype)
  pad = (ks - 1) // 2
  out = jnp.zeros(hidden.shape[:-1] + (c,), jnp.float32)
  for t in range(ks):
    xs = _same_sequence_shift(hidden, t - pad, cu_seqlens)
    xs = xs.reshape(*xs.shape[:-1], groups, cg)
    # Output channel o = g * cg + p reads input channels of group g.
    w = kernel[t].reshape(cg, groups, cg).transpose(1, 0, 2)  # [g, in, p]
    out = out + jnp.einsum("...gi,gip->...gp", xs, w, precision=precision,
                           preferred_element_type=jnp.float32).reshape(
                               out.shape)
  return (out + bias).astype(dtype)


class ConvLayer(_Common):
  """HF `ConvLayer` (DeBERTa-v2's conv after the first layer), as
  `encoder.conv` with children `conv` and `LayerNorm`. Never mixes packed
  sequences."""

  @nn.compact
  def __call__(self, hidden, residual, input_mask, cu_seqlens=None,
               deterministic=True):
    cfg = self.config
    ks, groups, c = cfg.conv_kernel_size, cfg.conv_groups, cfg.hidden_size
    cg = c // groups
    kernel, bias = _ConvParams(ks, cg, c, self.param_dtype, name="conv")()
    out = _conv1d(cfg, kernel, bias, hidden, cu_seqlens, self.dtype,
                  self.precision)
    m = input_mask[..., None].astype(out.dtype)
    out = out * m
    out = activation(cfg.conv_act)(
        lean.Dropout(cfg.hidden_dropout_prob)(out, deterministic=deterministic))
    y = _layer_norm(cfg, self.dtype, self.param_dtype, name="LayerNorm")(
        residual + out)
    return y * m


class DebertaV2Encoder(_Common):
  """Layer stack, relative embeddings (with their LayerNorm) and the
  optional conv. __call__(hidden, attention_mask, ...) -> last hidden state
  (and, with output_hidden_states, the tuple of all hidden states)."""

  def setup(self):
    cfg = self.config
    kw = self._child_kw()
    self.layer = _LayerCollection(**kw)
    if cfg.relative_attention:
      self.rel_embeddings = nn.Embed(
          2 * cfg.pos_ebd_size, cfg.hidden_size, dtype=self.dtype,
          param_dtype=self.param_dtype,
          embedding_init=nn.initializers.normal(0.02))
    if "layer_norm" in cfg.norm_rel_ebd_list:
      self.LayerNorm = _layer_norm(cfg, self.dtype, self.param_dtype)
    if cfg.conv_kernel_size > 0:
      self.conv = ConvLayer(**kw)

  def get_rel_embedding(self):
    cfg = self.config
    if not cfg.relative_attention:
      return None
    rel = self.rel_embeddings.embedding
    if "layer_norm" in cfg.norm_rel_ebd_list:
      rel = self.LayerNorm(rel)
    return rel

  def __call__(self, hidden, attention_mask=None, *, cu_seqlens=None,
               max_seqlen=None, deterministic: bool = True,
               output_hidden_states: bool = False):
    cfg = self.config
    if attention_mask is not None:
      input_mask = attention_mask
    elif cu_seqlens is not None:
      input_mask = jnp.arange(hidden.shape[0]) < cu_seqlens[-1]
    else:
      input_mask = jnp.ones(hidden.shape[:-1], hidden.dtype)
    rel = self.get_rel_embedding()
    states = [hidden]
    h = hidden
    for i in range(cfg.num_hidden_layers):
      h = self.layer(i, h, attention_mask, rel, cu_seqlens=cu_seqlens,
                     max_seqlen=max_seqlen, deterministic=deterministic)
      if i == 0 and cfg.conv_kernel_size > 0:
        h = self.conv(hidden, h, input_mask, cu_seqlens=cu_seqlens,
                      deterministic=deterministic)
      states.append(h)
    return (h, tuple(states)) if output_hidden_states else h


class DebertaV2Embeddings(_Common):

  def setup(self):
    cfg = self.config
    esize = cfg.embedding_size or cfg.hidden_size
    emb = lambda n: nn.Embed(n, esize, dtype=self.dtype,
                             param_dtype=self.param_dtype,
                             embedding_init=nn.initializers.normal(0.02))
    self.word_embeddings = emb(cfg.vocab_size)
    if cfg.position_biased_input:
      self.position_embeddings = emb(cfg.max_position_embeddings)
    if cfg.type_vocab_size > 0:
      self.token_type_embeddings = emb(cfg.type_vocab_size)
    if esize != cfg.hidden_size:
      self.embed_proj = _dense(cfg.hidden_size, self, use_bias=False)
    self.LayerNorm = _layer_norm(cfg, self.dtype, self.param_dtype)
    self.dropout = lean.Dropout(cfg.hidden_dropout_prob)

  def __call__(self, input_ids, token_type_ids=None, position_ids=None,
               mask=None, deterministic=True):
    cfg = self.config
    x = self.word_embeddings(input_ids)
    if cfg.position_biased_input:
      x = x + self.position_embeddings(position_ids)
    if cfg.type_vocab_size > 0:
      if token_type_ids is None:
        token_type_ids = jnp.zeros_like(input_ids)
      x = x + self.token_type_embeddings(token_type_ids)
    if (cfg.embedding_size or cfg.hidden_size) != cfg.hidden_size:
      x = self.embed_proj(x)
    x = self.LayerNorm(x)
    if mask is not None:
      x = x * mask[..., None].astype(x.dtype)
    return self.dropout(x, deterministic=deterministic)


def packed_positions(cu_seqlens, total: int):
  """int32 [total]: position of each packed token in its sequence (0 past
  cu_seqlens[-1])."""
  t = jnp.arange(total, dtype=jnp.int32)
  sid = token_seq_ids_clipped(cu_seqlens, total)
  return jnp.where(t < cu_seqlens[-1], t - cu_seqlens[sid], 0)


class DebertaV2Model(_Common):
  """HF `DebertaV2Model`: embeddings + encoder.

  model.apply({"params": params}, input_ids, attention_mask) -> last hidden
  state [batch, seq, hidden]. Packed: input_ids [total] with cu_seqlens
  (and max_seqlen under jit) -> [total, hidden]. Pass
  deterministic=False with rngs={"dropout": key} to train with dropout.
  """

  def setup(self):
    kw = self._child_kw()
    self.embeddings = DebertaV2Embeddings(**kw)
    self.encoder = DebertaV2Encoder(**kw)

  def __call__(self, input_ids, attention_mask=None, token_type_ids=None,
               position_ids=None, *, cu_seqlens=None, max_seqlen=None,
               deterministic: bool = True,
               output_hidden_states: bool = False):
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
      emb = self.embeddings(input_ids, token_type_ids, position_ids, mask,
                            deterministic=deterministic)
      return self.encoder(emb, None, cu_seqlens=cu_seqlens,
                          max_seqlen=max_seqlen, deterministic=deterministic,
                          output_hidden_states=output_hidden_states)
    if position_ids is None:
      position_ids = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]),
                                      input_ids.shape)
    mask = attention_mask
    emb = self.embeddings(input_ids, token_type_ids, position_ids, mask,
                          deterministic=deterministic)
    return self.encoder(emb, mask, deterministic=deterministic,
                        output_hidden_states=output_hidden_states)


class ContextPooler(_Common):
  """HF `ContextPooler`: dense + activation on the first token."""

  def setup(self):
    cfg = self.config
    self.dense = _dense(cfg.pooler_hidden_size or cfg.hidden_size, self)
    self.dropout = lean.Dropout(cfg.pooler_dropout)

  def __call__(self, hidden, deterministic=True):
    x = self.dropout(hidden[..., 0, :], deterministic=deterministic)
    return activation(self.config.pooler_hidden_act)(self.dense(x))


class DebertaV2ForSequenceClassification(_Common):
  """HF `DebertaV2ForSequenceClassification` (params: deberta, pooler,
  classifier); returns logits [batch, num_labels]. Padded input only."""

  def setup(self):
    kw = self._child_kw()
    self.deberta = DebertaV2Model(**kw)
    self.pooler = ContextPooler(**kw)
    self.classifier = _dense(self.config.num_labels, self)
    self.dropout = lean.Dropout(self.config.hidden_dropout_prob)

  def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *,
               deterministic: bool = True):
    h = self.deberta(input_ids, attention_mask, token_type_ids,
                     deterministic=deterministic)
    pooled = self.pooler(h, deterministic=deterministic)
    return self.classifier(self.dropout(pooled, deterministic=deterministic))
