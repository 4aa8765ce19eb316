"""DeBERTa-v2/v3 model configuration (Hugging Face's `DebertaV2Config`
fields) and the activations it names."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax.numpy as jnp

from jax_api import _lean_ops as lean

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
