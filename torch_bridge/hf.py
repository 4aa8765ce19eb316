"""Hugging Face transformers integration: `attn_implementation="fold"`.

    import torch_bridge.hf
    torch_bridge.hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fold")
    # or: model.set_attn_implementation("fold")

`register()` adds `fold_attention_forward` to `transformers.AttentionInterface`
and `fold_mask` to `transformers.masking_utils.AttentionMaskInterface` under
the name "fold" (without a mask function transformers hands the attention
function no padding mask at all).

What the attention function handles (decoder models whose attention layers
call `ALL_ATTENTION_FUNCTIONS[...]`: Llama, Mistral, Qwen2/3, Gemma2/3 text,
GPT-OSS, ...):

  * GQA/MQA natively (`module.num_key_value_groups`; K/V are not repeated);
  * `scaling`, `softcap`, `sliding_window` (HF's convention: a query sees
    the `sliding_window` most recent positions, itself included), `s_aux`
    attention sinks (differentiable);
  * padding: the mask function returns the 2D key-padding mask (bool
    [batch, kv_len]) and the attention function turns it into segment ids
    (padded keys match no query), so the kernel stays dense and nothing is
    gathered; packed sequences (position_ids restarting, no attention mask)
    become segment ids too;
  * decoding with transformers' caches: causal masks align bottom-right
    (the last query is the last key), which is how DynamicCache and the
    sliding-window layers lay out keys. A single decode query gets its exact
    row of the mask (one bool per key, O(batch * kv_len) to build), so
    static caches, padding and windows are all exact there; a StaticCache
    prefill drops the unwritten key slots. While decoding, key lengths are
    rounded up to buckets (padded in front with masked keys) so that JAX
    compiles once per bucket, not once per generated token.

Anything else (custom `or`/`and` mask overlays, chunked attention, image
blocks, user-supplied 4D masks, float masks) is computed exactly by a plain
torch fallback, with a warning once: correct, not fast, not the kernel.

Not supported: attention dropout > 0 (raises), `output_attentions`.
Layout cost: transformers hands q/k/v as [batch, heads, seq, head_dim]; the
kernel takes [batch, seq, heads, head_dim], so q, k and v are copied once per
call (as SDPA's transposes would) -- in decoding that is a copy of the cache.
"""

from __future__ import annotations

import math

import torch

from torch_bridge import _runtime as rt
from torch_bridge import settings
from torch_bridge.attention import _call, _dense_static

NAME = "fold"
_BUCKETS = settings.hf_buckets()


def _bucket(n: int) -> int:
  """n rounded up: powers of two up to 128, then 8 steps per octave."""
  if n <= 16:
    return 16
  if n <= 128:
    return 1 << (n - 1).bit_length()
  step = 1 << max(4, (n - 1).bit_length() - 4)
  return -(-n // step) * step


# ----------------------------------------------------------------------------
# Mask function
# ----------------------------------------------------------------------------

_PLAIN = {"causal_mask_function", "bidirectional_mask_function",
          "sliding_window_overlay", "sliding_window_bidirectional_overlay"}


def _closure_vars(fn) -> dict:
  code = getattr(fn, "__code__", None)
  cells = getattr(fn, "__closure__", None) or ()
  if code is None:
    return {}
  return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}


def _describe(fn):
  """(known: bool, packed_sequence_mask or None) for a transformers mask
  function: known means causal/bidirectional, maybe with a sliding window
  and packed sequences, all of which the kernel expresses natively."""
  root = getattr(fn, "__qualname__", "").split(".")[0]
  if root in _PLAIN:
    return True, None
  env = _closure_vars(fn)
  if root == "and_masks":
    packed = None
    for f in env.get("mask_functions", ()):
      ok, p = _describe(f)
      if not ok:
        return False, None
      packed = p if p is not None else packed
    return True, packed
  if root == "remap_positions_for_packed_sequence":
    return _describe(env.get("mask_function"))
  if root == "packed_sequence_mask_function":
    p = env.get("packed_sequence_mask")
    return (p is not None), p
  return False, None


def _as_int(x):
  if isinstance(x, torch.Tensor):
    if torch.compiler.is_compiling():
      return None
    return int(x)
  return int(x)


def _full_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
               mask_function, attention_mask, use_vmap, device):
  from transformers.masking_utils import sdpa_mask
  return sdpa_mask(batch_size=batch_size, q_length=q_length,
                   kv_length=kv_length, q_offset=q_offset,
                   kv_offset=kv_offset, mask_function=mask_function,
                   attention_mask=attention_mask, allow_is_causal_skip=False,
                   allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                   device=device)


def fold_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0,
              kv_offset: int = 0, mask_function=None, attention_mask=None,
              use_vmap: bool = False, device="cpu", **kwargs):
  """The "fold" entry of `AttentionMaskInterface`.

  Returns what `fold_attention_forward` understands:
    None: no padding; causal/window structure from the layer's options.
    bool [batch, n]: key-padding mask of the first n <= kv_length keys (the
      keys after n are dropped: unwritten StaticCache slots).
    int32 [batch, kv_length]: packed-sequence ids (q_length == kv_length).
    bool [batch, 1, q_length, kv_length]: the full mask (HF's sdpa_mask),
      for one decode query (used exactly) or for structures the kernel does
      not express (the torch fallback).
  """
  from transformers.masking_utils import (causal_mask_function,
                                          prepare_padding_mask)
  if mask_function is None:
    mask_function = causal_mask_function
  known, packed = _describe(mask_function)
  known = known and not use_vmap
  q_off = _as_int(q_offset)
  aligned = q_off is not None and q_off + q_length == kv_offset + kv_length
  if q_length == 1:
    if attention_mask is None and known and aligned:
      return None
    return _full_mask(batch_size, 1, kv_length, q_offset, kv_offset,
                      mask_function, attention_mask, use_vmap, device)
  if not known or q_off is None:
    return _full_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                      mask_function, attention_mask, use_vmap, device)
  n = q_off + q_length - kv_offset
  if not 0 < n <= kv_length:
    return _full_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                      mask_function, attention_mask, use_vmap, device)
  if packed is not None and attention_mask is None and n == kv_length:
    return packed.to(device=device, dtype=torch.int32).expand(batch_size, -1)
  if packed is not None:
    return _full_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                      mask_function, attention_mask, use_vmap, device)
  pad = prepare_padding_mask(attention_mask, kv_length, kv_offset)
  if pad is None:
    if n == kv_length:
      return None
    return torch.ones(batch_size, n, dtype=torch.bool, device=device)
  pad = pad[:, kv_offset:kv_offset + n].to(device=device, dtype=torch.bool)
  if n == kv_length and not torch.compiler.is_compiling() and bool(pad.all()):
    return None
  return pad


# ----------------------------------------------------------------------------
# Attention function
# ----------------------------------------------------------------------------

def _fallback(module, query, key, value, mask, scaling, softcap, s_aux, why):
  """Exact eager attention in torch for masks the kernel cannot express."""
  rt.announce(f"torch_bridge.hf: {why}; this attention runs a plain torch "
              "fallback (exact, not the kernel).")
  groups = query.shape[1] // key.shape[1]
  k = key.repeat_interleave(groups, dim=1)
  v = value.repeat_interleave(groups, dim=1)
  s = torch.matmul(query, k.transpose(2, 3)).float() * scaling
  if softcap:
    s = softcap * torch.tanh(s / softcap)
  if mask is not None:
    m = mask[:, :, :, :k.shape[-2]]
    if m.dtype == torch.bool:
      s = s.masked_fill(~m, float("-inf"))
    else:
      s = s + m.float()
  if s_aux is not None:
    sink = s_aux.float().reshape(1, -1, 1, 1).expand(s.shape[0], -1,
                                                     s.shape[2], 1)
    s = torch.cat([s, sink], dim=-1)
  mx = s.amax(dim=-1, keepdim=True)
  mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
  p = torch.exp(s - mx)
  den = p.sum(-1, keepdim=True)
  p = p / torch.where(den > 0, den, torch.ones_like(den))
  if s_aux is not None:
    p = p[..., :-1]
  out = torch.matmul(p.to(v.dtype), v)
  return out.transpose(1, 2).contiguous(), None


def _to_bshd(x, total: int):
  """[b, h, s, d] -> [b, total, h, d] (left-padded with zeros), one copy."""
  b, h, s, d = x.shape
  if total == s:
    return x.transpose(1, 2)  # made contiguous by the bridge
  out = x.new_zeros((b, total, h, d))
  out[:, total - s:] = x.transpose(1, 2)
  return out


def fold_attention_forward(module, query, key, value, attention_mask,
                           dropout: float = 0.0, scaling=None,
                           sliding_window=None, softcap=None, is_causal=None,
                           s_aux=None, **kwargs):
  """The "fold" entry of `AttentionInterface`: q [b, hq, sq, d], k/v
  [b, hkv, sk, d] -> (out [b, sq, hq, d], None)."""
  if dropout and module.training:
    raise NotImplementedError(
        f"attn_implementation='fold' has no attention dropout; got dropout="
        f"{dropout}. Set the config's attention_dropout to 0.")
  b, hq, sq, d = query.shape
  sk = key.shape[2]
  if scaling is None:
    scaling = 1.0 / math.sqrt(d)
  if is_causal is None:
    is_causal = getattr(module, "is_causal", True)
  softcap = float(softcap) if softcap else 0.0
  causal = bool(is_causal)
  mask = attention_mask
  q_seg = k_seg = None
  structure = True  # apply causal / window from the options
  if mask is not None:
    if not isinstance(mask, torch.Tensor):
      raise TypeError("attn_implementation='fold' got an attention mask of "
                      f"type {type(mask).__name__}; expected None or a tensor "
                      "(register the 'fold' mask function: "
                      "torch_bridge.hf.register()).")
    if mask.dim() == 2 and mask.dtype == torch.bool:
      n = mask.shape[1]
      if n < sk:  # unwritten StaticCache slots
        key, value, sk = key[:, :, :n], value[:, :, :n], n
      k_seg = torch.where(mask, 0, -1).to(torch.int32)
      q_seg = torch.zeros((b, sq), dtype=torch.int32, device=query.device)
    elif mask.dim() == 2 and not mask.dtype.is_floating_point:
      if sq != sk:
        raise ValueError("packed-sequence ids need q_len == kv_len; got "
                         f"{sq} and {sk}.")
      q_seg = k_seg = mask.to(torch.int32)
    elif (mask.dim() == 4 and mask.dtype == torch.bool and sq == 1 and
          mask.shape[1] == 1 and mask.shape[-1] >= sk):
      # One decode query: its mask row is exact as key segment ids.
      k_seg = torch.where(mask[:, 0, 0, :sk], 0, -1).to(torch.int32)
      k_seg = k_seg.expand(b, sk)
      q_seg = torch.zeros((b, 1), dtype=torch.int32, device=query.device)
      structure = False
    else:
      why = ("a float (additive) attention mask" if
             mask.dtype.is_floating_point else
             f"a {mask.dim()}D boolean mask the kernel cannot express")
      return _fallback(module, query, key, value, mask, scaling, softcap,
                       s_aux, f"attention_mask is {why}")
  window = (-1, -1)
  if structure and sliding_window is not None and sliding_window > 0:
    sw = int(sliding_window)
    window = (sw - 1, 0) if causal else (sw, sw)
  if not structure:
    causal = False
  # Decoding: round lengths up to buckets (front-padded, masked keys).
  bq, bk = sq, sk
  if _BUCKETS and sq < sk and not torch.compiler.is_compiling():
    bk = _bucket(sk)
    bq = sq if sq == 1 else min(_bucket(sq), bk)
  if bk != sk:
    pad_k = torch.full((b, bk - sk), -1, dtype=torch.int32,
                       device=query.device)
    if k_seg is None:
      k_seg = torch.zeros((b, sk), dtype=torch.int32, device=query.device)
      q_seg = torch.zeros((b, sq), dtype=torch.int32, device=query.device)
    k_seg = torch.cat([pad_k, k_seg], dim=1)
    if bq != sq:
      pad_q = torch.zeros((b, bq - sq), dtype=torch.int32,
                          device=query.device)
      q_seg = torch.cat([pad_q, q_seg], dim=1)
  q = _to_bshd(query, bq)
  k = _to_bshd(key, bk)
  v = _to_bshd(value, bk)
  sinks = s_aux
  static = _static(q, causal, window, softcap, float(scaling), sinks)
  out, _, _ = _call(q, k, v, sinks, q_seg, k_seg, None, None, static,
                    need_lse=False)
  if bq != sq:
    out = out[:, bq - sq:]
  return out, None


_statics: dict = {}


def _static(q, causal, window, softcap, scaling, sinks) -> tuple:
  """`_dense_static`, remembered per layer configuration (every layer of a
  model calls with the same options: the checks run once)."""
  if sinks is not None:
    return _dense_static(q, causal, window, softcap, scaling, sinks)
  key = (q.shape[-1], q.device, q.dtype, causal, window, softcap, scaling)
  static = _statics.get(key)
  if static is None:
    if len(_statics) >= 1024:
      _statics.clear()
    static = _statics[key] = _dense_static(q, causal, window, softcap,
                                           scaling, None)
  return static


def register() -> None:
  """Registers "fold" with transformers' AttentionInterface and
  AttentionMaskInterface (idempotent)."""
  from transformers import AttentionInterface
  from transformers.masking_utils import AttentionMaskInterface
  AttentionInterface.register(NAME, fold_attention_forward)
  AttentionMaskInterface.register(NAME, fold_mask)


__all__ = ["register", "fold_attention_forward", "fold_mask", "NAME"]
