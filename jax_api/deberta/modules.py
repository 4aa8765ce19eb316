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

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_api import _lean_ops as lean
from jax_api.deberta.attention import disentangled_attention
from pallas_kernels.varlen import token_seq_ids, token_seq_ids_clipped

_ACTS = {
    "gelu": lean.gelu_erf,
    "gelu_new": lambda x: nn.gelu(x, approximate=True),
    "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
    "gelu_fast": lambda x: nn.gelu(x, approximate=True),
    "relu": nn.relu,
    "tanh": jnp.tanh,
    "silu": nn.silu,
    "swish": nn.silu,
    "sigmoid": nn.sigmoid,
}


def activation(name: str):
  try:
    return _ACTS[name]
  except KeyError:
    raise ValueError(f"unsupported activation {name!r}; supported: "
                     f"{sorted(_ACTS)}") from None


@dataclasses.dataclass(frozen=True)
class DebertaV2Config:
  """The fields of transformers' DebertaV2Config the encoder uses (HF
  defaults), with HF's resolution of max_relative_positions and
  pos_att_type applied by `from_hf`."""

  vocab_size: int = 128100
  hidden_size: int = 1536
  num_hidden_layers: int = 24
  num_attention_heads: int = 24
  intermediate_size: int = 6144
  hidden_act: str = "gelu"
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1
  max_position_embeddings: int = 512
  type_vocab_size: int = 0
  layer_norm_eps: float = 1e-7
  relative_attention: bool = False
  max_relative_positions: int = -1
  position_buckets: int = -1
  pos_att_type: tuple[str, ...] = ()
  share_att_key: bool = False
  norm_rel_ebd: str = "none"
  position_biased_input: bool = True
  embedding_size: int | None = None
  pad_token_id: int = 0
  attention_head_size: int | None = None
  conv_kernel_size: int = 0
  conv_groups: int = 1
  conv_act: str = "tanh"
  pooler_hidden_size: int | None = None
  pooler_hidden_act: str = "gelu"
  pooler_dropout: float = 0.0
  num_labels: int = 2

  @classmethod
  def from_hf(cls, hf_config) -> "DebertaV2Config":
    """From a transformers DebertaV2Config (or its to_dict())."""
    d = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    kw = {}
    for f in dataclasses.fields(cls):
      if f.name in d and d[f.name] is not None:
        kw[f.name] = d[f.name]
    pat = d.get("pos_att_type") or ()
    if isinstance(pat, str):
      pat = [x.strip() for x in pat.lower().split("|") if x.strip()]
    kw["pos_att_type"] = tuple(pat)
    if "id2label" in d and d["id2label"]:
      kw["num_labels"] = len(d["id2label"])
    return cls(**kw)

  def to_hf_dict(self) -> dict:
    d = dataclasses.asdict(self)
    d["pos_att_type"] = list(self.pos_att_type)
    for key in ("embedding_size", "attention_head_size", "pooler_hidden_size"):
      if d[key] is None:
        del d[key]
    d.pop("num_labels")
    return d

  @property
  def head_size(self) -> int:
    return self.attention_head_size or (self.hidden_size //
                                        self.num_attention_heads)

  @property
  def resolved_max_relative_positions(self) -> int:
    m = self.max_relative_positions
    return self.max_position_embeddings if m < 1 else m

  @property
  def pos_ebd_size(self) -> int:
    """HF's att_span: rel_embeddings has 2 * pos_ebd_size rows."""
    if self.position_buckets > 0:
      return self.position_buckets
    return self.resolved_max_relative_positions

  @property
  def norm_rel_ebd_list(self) -> list[str]:
    return [x.strip() for x in self.norm_rel_ebd.lower().split("|")]


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


# ---------------------------------------------------------------------------
# flax.nnx counterparts: the same structure and names (layers are an
# nnx.List indexed 0, 1, ...; `nnx.state(model, nnx.Param)` mirrors the
# linen params with integer layer keys). Dropout follows nnx's convention:
# modules start in training mode; `model.eval()` makes them deterministic
# (or pass deterministic= per call). Attention dropout draws from the
# `dropout` stream of the rngs given at construction.

from flax import nnx  # noqa: E402


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
