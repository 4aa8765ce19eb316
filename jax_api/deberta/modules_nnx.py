"""flax.nnx DeBERTa-v2/v3: the counterparts of `modules` (linen), with the
same structure and names (layers are an nnx.List indexed 0, 1, ...;
`nnx.state(model, nnx.Param)` mirrors the linen params with integer layer
keys). Dropout follows nnx's convention: modules start in training mode;
`model.eval()` makes them deterministic (or pass deterministic= per call).
Attention dropout draws from the `dropout` stream of the rngs given at
construction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_api import _lean_ops as lean
from jax_api.deberta.modules import (DebertaV2Config, _conv1d, _ffn,
                                     _remat_mode,
                                     _self_attention, activation,
                                     packed_positions)


def _nnx_linear(n_in, n_out, dtype, param_dtype, rngs, bias=True,
                precision=None):
  return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype,
                    param_dtype=param_dtype, precision=precision,
                    kernel_init=nnx.initializers.normal(0.02), rngs=rngs)


class _LeanLayerNormNNX(nnx.LayerNorm):
  """nnx.LayerNorm's parameters with `_lean_ops.layer_norm` (the linen
  modules' LayerNorm: same numerics, lean backward)."""

  def __call__(self, x, *, mask=None):
    if mask is not None:
      return super().__call__(x, mask=mask)
    dtype = self.dtype or jnp.result_type(x.dtype, self.param_dtype)
    return lean.layer_norm(x, self.scale[...], self.bias[...],
                           float(self.epsilon), jnp.dtype(dtype))


def _nnx_layer_norm(cfg, dtype, param_dtype, rngs):
  return _LeanLayerNormNNX(cfg.hidden_size, epsilon=cfg.layer_norm_eps,
                           dtype=dtype, param_dtype=param_dtype, rngs=rngs)


def _nnx_det(module, deterministic):
  return module.deterministic if deterministic is None else deterministic


class DebertaV2SelfAttentionNNX(nnx.Module):
  """nnx `DisentangledSelfAttention` (see `DebertaV2SelfAttention`)."""

  def __init__(self, config: DebertaV2Config, *, dtype=jnp.float32,
               param_dtype=jnp.float32, attention_backend: str = "auto",
               precision=None, rngs: nnx.Rngs):
    cfg = config
    self.config = cfg
    self.dtype = dtype
    self.attention_backend = attention_backend
    all_head = cfg.num_attention_heads * cfg.head_size
    mk = lambda: _nnx_linear(cfg.hidden_size, all_head, dtype, param_dtype,
                             rngs, precision=precision)
    self.query_proj = mk()
    self.key_proj = mk()
    self.value_proj = mk()
    if cfg.relative_attention and not cfg.share_att_key:
      if "c2p" in cfg.pos_att_type:
        self.pos_key_proj = mk()
      if "p2c" in cfg.pos_att_type:
        self.pos_query_proj = mk()
    self.pos_dropout = lean.DropoutNNX(cfg.hidden_dropout_prob, rngs=rngs)
    self.rngs = rngs
    self.deterministic = False

  def __call__(self, hidden, attention_mask=None, rel_embeddings=None, *,
               cu_seqlens=None, max_seqlen=None, deterministic=None):
    cfg = self.config
    det = _nnx_det(self, deterministic)
    rel = None
    if cfg.relative_attention:
      rel = self.pos_dropout(rel_embeddings, deterministic=det)
    rng = None
    if not det and cfg.attention_probs_dropout_prob > 0.0:
      rng = self.rngs.dropout()
    return _self_attention(
        cfg, hidden, rel, self.query_proj, self.key_proj, self.value_proj,
        getattr(self, "pos_key_proj", None),
        getattr(self, "pos_query_proj", None), attention_mask, cu_seqlens,
        max_seqlen, rng, self.dtype, self.attention_backend)


class _DenseLayerNormNNX(nnx.Module):
  """HF SelfOutput / Output: dense, dropout, LayerNorm(h + residual)."""

  def __init__(self, cfg, n_in, dtype, param_dtype, rngs, precision=None):
    self.dense = _nnx_linear(n_in, cfg.hidden_size, dtype, param_dtype, rngs,
                             precision=precision)
    self.LayerNorm = _nnx_layer_norm(cfg, dtype, param_dtype, rngs)
    self.dropout = lean.DropoutNNX(cfg.hidden_dropout_prob, rngs=rngs)

  def __call__(self, hidden, input_tensor, deterministic=None):
    h = self.dropout(self.dense(hidden), deterministic=deterministic)
    return self.LayerNorm(h + input_tensor)


class _AttentionNNX(nnx.Module):

  def __init__(self, cfg, dtype, param_dtype, backend, rngs, precision=None):
    self.self = DebertaV2SelfAttentionNNX(
        cfg, dtype=dtype, param_dtype=param_dtype, attention_backend=backend,
        precision=precision, rngs=rngs)
    self.output = _DenseLayerNormNNX(cfg, cfg.num_attention_heads *
                                     cfg.head_size, dtype, param_dtype, rngs,
                                     precision)

  def __call__(self, hidden, attention_mask, rel, *, cu_seqlens=None,
               max_seqlen=None, deterministic=None):
    ctx = self.self(hidden, attention_mask, rel, cu_seqlens=cu_seqlens,
                    max_seqlen=max_seqlen, deterministic=deterministic)
    return self.output(ctx, hidden, deterministic=deterministic)


class _IntermediateNNX(nnx.Module):

  def __init__(self, cfg, dtype, param_dtype, rngs, precision=None):
    self.act = cfg.hidden_act
    self.dense = _nnx_linear(cfg.hidden_size, cfg.intermediate_size, dtype,
                             param_dtype, rngs, precision=precision)

  def __call__(self, hidden):
    return activation(self.act)(self.dense(hidden))


class _LayerNNX(nnx.Module):

  def __init__(self, cfg, dtype, param_dtype, backend, rngs, precision=None,
               remat=False):
    self.attention = _AttentionNNX(cfg, dtype, param_dtype, backend, rngs,
                                   precision)
    self.intermediate = _IntermediateNNX(cfg, dtype, param_dtype, rngs,
                                         precision)
    self.output = _DenseLayerNormNNX(cfg, cfg.intermediate_size, dtype,
                                     param_dtype, rngs, precision)
    self.remat_mode = _remat_mode(remat)

  def __call__(self, hidden, attention_mask, rel, *, cu_seqlens=None,
               max_seqlen=None, deterministic=None):
    if self.remat_mode == "layer":
      return _nnx_layer_remat(self, hidden, attention_mask, rel, cu_seqlens,
                              max_seqlen, deterministic)
    return _nnx_layer(self, hidden, attention_mask, rel, cu_seqlens,
                      max_seqlen, deterministic)


def _nnx_layer(layer, hidden, attention_mask, rel, cu_seqlens, max_seqlen,
               deterministic):
  att = layer.attention(hidden, attention_mask, rel, cu_seqlens=cu_seqlens,
                        max_seqlen=max_seqlen, deterministic=deterministic)
  if layer.remat_mode == "ffn":
    return _nnx_ffn_remat(layer, att, deterministic)
  return _ffn(layer, att, deterministic)


# remat (as the linen model's): max_seqlen and deterministic are Python
# values the layer branches on.
_nnx_layer_remat = nnx.remat(_nnx_layer, static_argnums=(5, 6))
_nnx_ffn_remat = nnx.remat(_ffn, static_argnums=(2,))


class _ConvParamsNNX(nnx.Module):

  def __init__(self, cfg, param_dtype, rngs):
    c = cfg.hidden_size
    self.kernel = nnx.Param(nnx.initializers.normal(0.02)(
        rngs.params(), (cfg.conv_kernel_size, c // cfg.conv_groups, c),
        param_dtype))
    self.bias = nnx.Param(jnp.zeros((c,), param_dtype))


class _ConvLayerNNX(nnx.Module):

  def __init__(self, cfg, dtype, param_dtype, rngs, precision=None):
    self.config = cfg
    self.dtype = dtype
    self.precision = precision
    self.conv = _ConvParamsNNX(cfg, param_dtype, rngs)
    self.LayerNorm = _nnx_layer_norm(cfg, dtype, param_dtype, rngs)
    self.dropout = lean.DropoutNNX(cfg.hidden_dropout_prob, rngs=rngs)

  def __call__(self, hidden, residual, input_mask, cu_seqlens=None,
               deterministic=None):
    cfg = self.config
    out = _conv1d(cfg, self.conv.kernel[...], self.conv.bias[...], hidden,
                  cu_seqlens, self.dtype, self.precision)
    m = input_mask[..., None].astype(out.dtype)
    out = activation(cfg.conv_act)(self.dropout(out * m,
                                                deterministic=deterministic))
    return self.LayerNorm(residual + out) * m


class DebertaV2EncoderNNX(nnx.Module):
  """nnx `DebertaV2Encoder` (see the linen class)."""

  def __init__(self, config: DebertaV2Config, *, dtype=jnp.float32,
               param_dtype=jnp.float32, attention_backend: str = "auto",
               precision=None, remat: bool | str = False, rngs: nnx.Rngs):
    cfg = config
    self.config = cfg
    self.layer = nnx.List([
        _LayerNNX(cfg, dtype, param_dtype, attention_backend, rngs,
                  precision, remat)
        for _ in range(cfg.num_hidden_layers)])
    if cfg.relative_attention:
      self.rel_embeddings = nnx.Embed(
          2 * cfg.pos_ebd_size, cfg.hidden_size, dtype=dtype,
          param_dtype=param_dtype,
          embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
    if "layer_norm" in cfg.norm_rel_ebd_list:
      self.LayerNorm = _nnx_layer_norm(cfg, dtype, param_dtype, rngs)
    if cfg.conv_kernel_size > 0:
      self.conv = _ConvLayerNNX(cfg, dtype, param_dtype, rngs, precision)

  def get_rel_embedding(self):
    cfg = self.config
    if not cfg.relative_attention:
      return None
    rel = self.rel_embeddings.embedding[...]
    if "layer_norm" in cfg.norm_rel_ebd_list:
      rel = self.LayerNorm(rel)
    return rel

  def __call__(self, hidden, attention_mask=None, *, cu_seqlens=None,
               max_seqlen=None, deterministic=None,
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
    for i, layer in enumerate(self.layer):
      h = layer(h, attention_mask, rel, cu_seqlens=cu_seqlens,
                max_seqlen=max_seqlen, deterministic=deterministic)
      if i == 0 and cfg.conv_kernel_size > 0:
        h = self.conv(hidden, h, input_mask, cu_seqlens=cu_seqlens,
                      deterministic=deterministic)
      states.append(h)
    return (h, tuple(states)) if output_hidden_states else h


class _EmbeddingsNNX(nnx.Module):

  def __init__(self, cfg, dtype, param_dtype, rngs, precision=None):
    self.config = cfg
    esize = cfg.embedding_size or cfg.hidden_size
    emb = lambda n: nnx.Embed(n, esize, dtype=dtype, param_dtype=param_dtype,
                              embedding_init=nnx.initializers.normal(0.02),
                              rngs=rngs)
    self.word_embeddings = emb(cfg.vocab_size)
    if cfg.position_biased_input:
      self.position_embeddings = emb(cfg.max_position_embeddings)
    if cfg.type_vocab_size > 0:
      self.token_type_embeddings = emb(cfg.type_vocab_size)
    if esize != cfg.hidden_size:
      self.embed_proj = _nnx_linear(esize, cfg.hidden_size, dtype,
                                    param_dtype, rngs, bias=False,
                                    precision=precision)
    self.LayerNorm = _nnx_layer_norm(cfg, dtype, param_dtype, rngs)
    self.dropout = lean.DropoutNNX(cfg.hidden_dropout_prob, rngs=rngs)

  def __call__(self, input_ids, token_type_ids=None, position_ids=None,
               mask=None, deterministic=None):
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


class DebertaV2ModelNNX(nnx.Module):
  """nnx `DebertaV2Model`: model(input_ids, attention_mask) -> last hidden
  state; packed input with cu_seqlens and `remat` as in the linen class."""

  def __init__(self, config: DebertaV2Config, *, dtype=jnp.float32,
               param_dtype=jnp.float32, attention_backend: str = "auto",
               precision=None, remat: bool | str = False, rngs: nnx.Rngs):
    self.config = config
    self.embeddings = _EmbeddingsNNX(config, dtype, param_dtype, rngs,
                                     precision)
    self.encoder = DebertaV2EncoderNNX(
        config, dtype=dtype, param_dtype=param_dtype,
        attention_backend=attention_backend, precision=precision,
        remat=remat, rngs=rngs)

  def __call__(self, input_ids, attention_mask=None, token_type_ids=None,
               position_ids=None, *, cu_seqlens=None, max_seqlen=None,
               deterministic=None, output_hidden_states: bool = False):
    if cu_seqlens is not None:
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
    emb = self.embeddings(input_ids, token_type_ids, position_ids,
                          attention_mask, deterministic=deterministic)
    return self.encoder(emb, attention_mask, deterministic=deterministic,
                        output_hidden_states=output_hidden_states)


def _int_layer_keys(tree, to_int: bool):
  if not isinstance(tree, dict):
    return tree
  out = {}
  for k, v in tree.items():
    if k == "layer" and isinstance(v, dict):
      v = {(int(i) if to_int else str(i)): _int_layer_keys(x, to_int)
           for i, x in v.items()}
      out[k] = v
    else:
      out[k] = _int_layer_keys(v, to_int)
  return out


def load_linen_params(model: nnx.Module, params) -> nnx.Module:
  """Copies linen-layout params (e.g. from `convert.from_hf`) into an nnx
  DeBERTa module in place; returns it."""
  state = nnx.state(model, nnx.Param)
  want = state.to_pure_dict()
  got = _int_layer_keys(jax.tree_util.tree_map(lambda x: x, dict(params)),
                        True)
  wshape = jax.tree_util.tree_map(lambda x: tuple(x.shape), want)
  gshape = jax.tree_util.tree_map(lambda x: tuple(jnp.shape(x)), got)
  if wshape != gshape:
    raise ValueError("params do not match the nnx module's structure")
  nnx.replace_by_pure_dict(state, got)
  nnx.update(model, state)
  return model


def linen_params(model: nnx.Module) -> dict:
  """The nnx module's params in the linen layout (string layer keys), e.g.
  for `convert.to_hf_state_dict`."""
  return _int_layer_keys(nnx.state(model, nnx.Param).to_pure_dict(), False)
