"""DeBERTa-v2/v3 in JAX: disentangled attention (Pallas kernels with a
deterministic backward), Flax modules mirroring Hugging Face's parameter
names, and checkpoint conversion.

    from jax_api.deberta import disentangled_attention, from_hf
    model, params = from_hf(hf_model)
    hidden = model.apply({"params": params}, input_ids, attention_mask)
"""

from jax_api.deberta.attention import disentangled_attention
from jax_api.deberta.convert import (from_hf,
                                     from_hf_for_sequence_classification,
                                     from_hf_nnx, state_dict_to_params,
                                     to_hf_state_dict)
from jax_api.deberta.modules import (DebertaV2Config, DebertaV2Encoder,
                                     DebertaV2ForSequenceClassification,
                                     DebertaV2Model, DebertaV2SelfAttention)
from jax_api.deberta.modules_nnx import (DebertaV2EncoderNNX,
                                         DebertaV2ModelNNX,
                                         DebertaV2SelfAttentionNNX,
                                         linen_params, load_linen_params)

__all__ = [
    "disentangled_attention", "from_hf", "from_hf_for_sequence_classification",
    "to_hf_state_dict", "state_dict_to_params", "DebertaV2Config",
    "DebertaV2SelfAttention", "DebertaV2Encoder", "DebertaV2Model",
    "DebertaV2ForSequenceClassification", "from_hf_nnx",
    "DebertaV2SelfAttentionNNX", "DebertaV2EncoderNNX", "DebertaV2ModelNNX",
    "load_linen_params", "linen_params",
]
