"""Hugging Face DeBERTa-v2/v3 checkpoints <-> the linen modules' params.

    model, params = from_hf(hf_model)                 # transformers module
    model, params = from_hf(state_dict, config=cfg)   # state dict + config
    hidden = model.apply({"params": params}, input_ids, attention_mask)
    state_dict = to_hf_state_dict(params)             # numpy, HF names

Name mapping: HF `a.b.3.c.weight` <-> params["a"]["b"]["3"]["c"][leaf]
with leaf `kernel` (Linear weight, transposed; conv weight [out, in/g, k]
-> kernel [k, in/g, out]), `embedding` (Embedding weight) or `scale`
(LayerNorm weight); biases keep their name. The `deberta.` prefix of task
models (DebertaV2ForSequenceClassification, ...) maps to params["deberta"]
when converting such a model (from_hf converts its base model only).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_api.deberta.modules import (DebertaV2Config, DebertaV2Model,
                                     DebertaV2ForSequenceClassification)

_EMBEDDINGS = ("word_embeddings", "position_embeddings",
               "token_type_embeddings", "rel_embeddings")
_SKIP_SUFFIXES = ("position_ids",)


def _to_numpy(x):
  if hasattr(x, "detach"):  # torch tensor
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":
      x = x.float()
    return x.numpy()
  return np.asarray(x)


def _leaf_for(path: list[str], leaf: str, value: np.ndarray):
  """(flax leaf name, converted value) for an HF parameter."""
  owner = path[-1] if path else ""
  if leaf == "bias":
    return "bias", value
  if leaf != "weight":
    raise ValueError(f"unexpected parameter {'.'.join(path + [leaf])}")
  if owner == "LayerNorm":
    return "scale", value
  if owner in _EMBEDDINGS:
    return "embedding", value
  if owner == "conv" and value.ndim == 3:
    return "kernel", np.transpose(value, (2, 1, 0))
  if value.ndim != 2:
    raise ValueError(f"unexpected {value.ndim}-D weight at "
                     f"{'.'.join(path)}")
  return "kernel", value.T


def state_dict_to_params(state_dict, *, dtype=jnp.float32) -> dict:
  """HF-named tensors (of a DebertaV2Model, or of a task model with the
  `deberta.` prefix kept) -> nested params dict."""
  params: dict[str, Any] = {}
  for name, value in state_dict.items():
    if name.endswith(_SKIP_SUFFIXES):
      continue
    *path, leaf = name.split(".")
    new_leaf, arr = _leaf_for(path, leaf, _to_numpy(value))
    node = params
    for p in path:
      node = node.setdefault(p, {})
    node[new_leaf] = jnp.asarray(arr, dtype)
  return params


def to_hf_state_dict(params, *, prefix: str = "") -> dict[str, np.ndarray]:
  """Nested params -> {HF name: float32 numpy array} (inverse of
  `state_dict_to_params`). `torch.from_numpy` each value to load into a
  transformers model with `load_state_dict(..., strict=False)` (HF's
  `embeddings.position_ids` buffer is not a parameter)."""
  out = {}

  def walk(node, path):
    for key, val in node.items():
      if isinstance(val, dict) or hasattr(val, "items"):
        walk(val, path + [key])
        continue
      arr = np.asarray(val, np.float32)
      owner = path[-1] if path else ""
      if key == "kernel":
        arr = np.transpose(arr, (2, 1, 0)) if arr.ndim == 3 else arr.T
        leaf = "weight"
      elif key in ("scale", "embedding"):
        leaf = "weight"
      elif key == "bias":
        leaf = "bias"
      else:
        raise ValueError(f"unexpected leaf {'.'.join(path + [key])}")
      del owner
      out[prefix + ".".join(path + [leaf])] = np.ascontiguousarray(arr)

  walk(params, [])
  return out


def from_hf(hf_model_or_state_dict, config=None, *, dtype=jnp.float32,
            param_dtype=jnp.float32, attention_backend: str = "auto",
            precision=None, remat: bool | str = False):
  """Converts a transformers DeBERTa-v2/v3 model (or state dict + config).

  Args:
    hf_model_or_state_dict: a `transformers.DebertaV2Model`, a task model
      with a `.deberta` base (only the base is converted), or a state dict
      (torch tensors or arrays) with HF names (an optional `deberta.` prefix
      is stripped).
    config: a transformers `DebertaV2Config`, its dict, or a
      `jax_api.deberta.modules.DebertaV2Config`; taken from the model when
      omitted.
    dtype, param_dtype: computation and parameter dtypes of the module.
    attention_backend: passed to `disentangled_attention`.
    precision: of the model's matmuls (None: `jax.default_matmul_precision`,
      TF32 for float32 on recent NVIDIA GPUs; "highest": full float32, as
      PyTorch computes by default). See `modules._Common`.
    remat: what training recomputes in the backward (see
      `modules._Common`): False, "ffn" (each layer's feed-forward block:
      most of the activation memory for one more intermediate matmul per
      layer) or True (each whole layer; HF's gradient checkpointing).

  Returns:
    (model, params): the linen `DebertaV2Model` and its params, such that
    `model.apply({"params": params}, input_ids, attention_mask)` is the last
    hidden state [batch, seq, hidden].
  """
  obj = hf_model_or_state_dict
  if hasattr(obj, "state_dict"):
    if config is None:
      config = obj.config
    base = getattr(obj, "deberta", obj)
    sd = base.state_dict()
  else:
    sd = dict(obj)
    if any(k.startswith("deberta.") for k in sd):
      sd = {k[len("deberta."):]: v for k, v in sd.items()
            if k.startswith("deberta.")}
  if config is None:
    raise ValueError("from_hf(state_dict) needs config= (a DebertaV2Config).")
  if not isinstance(config, DebertaV2Config):
    config = DebertaV2Config.from_hf(config)
  params = state_dict_to_params(sd, dtype=param_dtype)
  model = DebertaV2Model(config=config, dtype=dtype, param_dtype=param_dtype,
                         attention_backend=attention_backend,
                         precision=precision, remat=remat)
  return model, params


def from_hf_for_sequence_classification(hf_model, *, dtype=jnp.float32,
                                        param_dtype=jnp.float32,
                                        attention_backend: str = "auto",
                                        precision=None,
                                        remat: bool | str = False):
  """A transformers `DebertaV2ForSequenceClassification` -> (linen
  `DebertaV2ForSequenceClassification`, params); options as `from_hf`."""
  config = DebertaV2Config.from_hf(hf_model.config)
  params = state_dict_to_params(hf_model.state_dict(), dtype=param_dtype)
  model = DebertaV2ForSequenceClassification(
      config=config, dtype=dtype, param_dtype=param_dtype,
      attention_backend=attention_backend, precision=precision, remat=remat)
  return model, params


def from_hf_nnx(hf_model_or_state_dict, config=None, *, dtype=jnp.float32,
                param_dtype=jnp.float32, attention_backend: str = "auto",
                precision=None, seed: int = 0, remat: bool | str = False):
  """As `from_hf`, returning a `flax.nnx` `DebertaV2ModelNNX` with the
  converted weights (seed: its dropout stream; remat: as `from_hf`'s)."""
  from flax import nnx

  from jax_api.deberta.modules_nnx import (DebertaV2ModelNNX,
                                           load_linen_params)
  linen_model, params = from_hf(hf_model_or_state_dict, config, dtype=dtype,
                                param_dtype=param_dtype,
                                attention_backend=attention_backend)
  model = DebertaV2ModelNNX(linen_model.config, dtype=dtype,
                            param_dtype=param_dtype,
                            attention_backend=attention_backend,
                            precision=precision, remat=remat,
                            rngs=nnx.Rngs(seed))
  return load_linen_params(model, params)
