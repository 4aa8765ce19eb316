"""attn_implementation="fold" in Hugging Face decoders, against "eager".

Tiny random configs built here (no downloads): Llama-style (GQA),
Qwen2-style (sliding window on the second layer), Gemma2-style (logit
soft-cap, alternating windows) and GPT-OSS-style (attention sinks). For each:
logits with left and right padding, one training step's gradients, greedy
`generate` with transformers' cache, and a packed (padding-free) batch.
DeBERTa-v2 (masked LM) through `torch_bridge.optimize_deberta`: the swap
keeps the state dict, logits and gradients match eager with padding, packed
inputs match the sequences run alone, dropout follows torch's seed.
CPU: the bridge runs JAX's XLA path.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_bridge  # noqa: E402
import torch_bridge.hf  # noqa: E402

torch_bridge.hf.register()

VOCAB = 97
SEQ = 10


def _llama():
  from transformers import LlamaConfig, LlamaForCausalLM
  cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=64)
  return LlamaForCausalLM(cfg)


def _qwen2():
  from transformers import Qwen2Config, Qwen2ForCausalLM
  cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, max_position_embeddings=64,
                    use_sliding_window=True, sliding_window=4,
                    max_window_layers=1)
  assert cfg.layer_types == ["full_attention", "sliding_attention"]
  return Qwen2ForCausalLM(cfg)


def _gemma2():
  from transformers import Gemma2Config, Gemma2ForCausalLM
  cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16,
                     max_position_embeddings=64, sliding_window=4,
                     attn_logit_softcapping=2.0, final_logit_softcapping=None,
                     query_pre_attn_scalar=16)
  return Gemma2ForCausalLM(cfg)


def _gpt_oss():
  from transformers import GptOssConfig, GptOssForCausalLM
  cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, num_local_experts=2,
                     num_experts_per_tok=1, max_position_embeddings=64,
                     sliding_window=4)
  model = GptOssForCausalLM(cfg)
  with torch.no_grad():  # sinks start at zero; make them matter
    for layer in model.model.layers:
      layer.self_attn.sinks.normal_(0, 1)
  return model


MODELS = {"llama": _llama, "qwen2": _qwen2, "gemma2": _gemma2,
          "gpt_oss": _gpt_oss}


class Spy:
  """Counts calls of the fold attention function and of its fallback."""

  def __init__(self, monkeypatch):
    self.calls = self.fallbacks = 0
    fwd, fb = torch_bridge.hf.fold_attention_forward, torch_bridge.hf._fallback

    def counted_fwd(*a, **k):
      self.calls += 1
      return fwd(*a, **k)

    def counted_fb(*a, **k):
      self.fallbacks += 1
      return fb(*a, **k)

    monkeypatch.setattr(torch_bridge.hf, "_fallback", counted_fb)
    from transformers import AttentionInterface
    monkeypatch.setitem(AttentionInterface._global_mapping, "fold",
                        counted_fwd)


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request):
  torch.manual_seed(0)
  eager = MODELS[request.param]()
  eager.set_attn_implementation("eager")
  eager.eval()
  fold = copy.deepcopy(eager)
  fold.set_attn_implementation("fold")
  assert fold.config._attn_implementation == "fold"
  return request.param, eager, fold


def _batch(padding: str):
  g = torch.Generator().manual_seed(1)
  ids = torch.randint(3, VOCAB, (3, SEQ), generator=g)
  am = torch.ones(3, SEQ, dtype=torch.long)
  if padding == "left":
    am[1, :3] = 0
    am[2, :6] = 0
  elif padding == "right":
    am[1, 7:] = 0
    am[2, 4:] = 0
  ids = ids.masked_fill(am == 0, 0)
  return ids, am


@pytest.mark.parametrize("padding", ["left", "right"])
def test_logits_match_eager(pair, padding, monkeypatch):
  name, eager, fold = pair
  spy = Spy(monkeypatch)
  ids, am = _batch(padding)
  with torch.no_grad():
    ref = eager(input_ids=ids, attention_mask=am).logits
    out = fold(input_ids=ids, attention_mask=am).logits
  valid = am.bool()
  torch.testing.assert_close(out[valid], ref[valid], atol=2e-5, rtol=2e-5)
  assert spy.calls == 2 and spy.fallbacks == 0


@pytest.mark.parametrize("padding", ["left", "right"])
def test_training_step_gradients_match_eager(pair, padding, monkeypatch):
  name, eager, fold = pair
  spy = Spy(monkeypatch)
  ids, am = _batch(padding)
  # Positions after a pad predict from a pad row, whose output is
  # implementation-defined (eager: a uniform average, fold and FA2: zero).
  labels = ids.masked_fill(am == 0, -100)
  labels[:, 1:] = labels[:, 1:].masked_fill(am[:, :-1] == 0, -100)
  grads = []
  for model in (eager, fold):
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                  if p.grad is not None})
    model.eval()
  assert grads[0].keys() == grads[1].keys()
  if name == "gpt_oss":
    assert any("sinks" in n for n in grads[1])
  for n in grads[0]:
    torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5,
                               rtol=1e-4, msg=f"{name}: {n}")
  assert spy.calls == 2 and spy.fallbacks == 0


def test_generate_greedy_matches_eager(pair, monkeypatch):
  name, eager, fold = pair
  spy = Spy(monkeypatch)
  ids, am = _batch("left")
  kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=6,
            do_sample=False, pad_token_id=0)
  ref = eager.generate(**kw)
  out = fold.generate(**kw)
  assert torch.equal(out, ref)
  # Prefill plus five cached decode steps, per layer; no fallback.
  assert spy.calls == 6 * 2 and spy.fallbacks == 0


def test_packed_sequences_match_eager(pair, monkeypatch):
  name, eager, fold = pair
  spy = Spy(monkeypatch)
  g = torch.Generator().manual_seed(2)
  ids = torch.randint(3, VOCAB, (1, 11), generator=g)
  pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5]])
  with torch.no_grad():  # transformers packs only without a cache
    ref = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
    out = fold(input_ids=ids, position_ids=pos, use_cache=False).logits
  torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
  # Each sequence alone gives the same logits (the packing is respected).
  # GPT-OSS builds its masks without position_ids, so transformers does not
  # pack there (eager mixes the sequences too; matching it is all we can do).
  if name == "gpt_oss":
    return
  with torch.no_grad():
    alone = fold(input_ids=ids[:, 5:], use_cache=False).logits
  torch.testing.assert_close(out[:, 5:], alone, atol=2e-5, rtol=2e-5)
  assert spy.fallbacks == 0


def test_mask_function_outputs():
  from transformers.masking_utils import (and_masks, causal_mask_function,
                                          or_masks,
                                          sliding_window_causal_mask_function)
  fm = torch_bridge.hf.fold_mask
  pad = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
  # No padding: nothing to pass (structure comes from the layer's options).
  assert fm(2, 4, 4, attention_mask=torch.ones(2, 4, dtype=torch.bool)) is None
  # Padding: the key-padding mask.
  assert torch.equal(fm(2, 4, 4, attention_mask=pad), pad)
  # A StaticCache-like prefill (keys past the queries unwritten): sliced.
  m = fm(2, 3, 8, q_offset=0, attention_mask=pad[:, :3])
  assert m.shape == (2, 3)
  # One decode query: its exact mask row, window included.
  m = fm(2, 1, 4, q_offset=3, mask_function=
         sliding_window_causal_mask_function(2), attention_mask=pad)
  assert m.shape == (2, 1, 1, 4)
  assert m[1, 0, 0].tolist() == [False, False, True, True]
  # Overlays the kernel cannot express: a full mask (torch fallback).
  other = or_masks(causal_mask_function, lambda b, h, q, k: k == 0)
  assert fm(1, 4, 4, mask_function=other).shape == (1, 1, 4, 4)
  chunked = and_masks(causal_mask_function, lambda b, h, q, k: q - k < 2)
  assert fm(1, 4, 4, mask_function=chunked).dim() == 4


def test_fallback_matches_eager_for_custom_4d_mask(monkeypatch):
  torch.manual_seed(3)
  eager = _llama().eval()
  eager.set_attn_implementation("eager")
  fold = copy.deepcopy(eager)
  fold.set_attn_implementation("fold")
  spy = Spy(monkeypatch)
  ids = torch.randint(3, VOCAB, (1, 6))
  mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
  mask[..., 0] = True  # a 4D mask of the user's own
  fmask = torch.zeros(1, 1, 6, 6).masked_fill(~mask, torch.finfo(
      torch.float32).min)
  with torch.no_grad():
    ref = eager(input_ids=ids, attention_mask=fmask).logits
    out = fold(input_ids=ids, attention_mask=fmask).logits
  torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
  assert spy.fallbacks == 2


def test_bucket_sizes():
  b = torch_bridge.hf._bucket
  assert [b(n) for n in (1, 16, 17, 33, 128, 129, 300, 1000, 5000)] == [
      16, 16, 32, 64, 128, 144, 320, 1024, 5120]
  for n in range(1, 5000, 7):
    assert n <= b(n) <= (max(16, 2 * n - 2) if n <= 128 else 1.125 * n)


def test_dropout_is_refused():
  model = _llama()
  model.config.attention_dropout = 0.1
  for layer in model.model.layers:
    layer.self_attn.attention_dropout = 0.1
  model.set_attn_implementation("fold")
  model.train()
  with pytest.raises(NotImplementedError, match="dropout"):
    model(input_ids=torch.randint(3, VOCAB, (1, 4)))


# ----------------------------------------------------------------------------
# DeBERTa-v2/v3: torch_bridge.optimize_deberta (module swap)
# ----------------------------------------------------------------------------

def _deberta(share_att_key=True, position_biased_input=False, dropout=0.0):
  from transformers import DebertaV2Config, DebertaV2ForMaskedLM
  cfg = DebertaV2Config(
      vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
      num_attention_heads=4, intermediate_size=96, max_position_embeddings=64,
      relative_attention=True, position_buckets=8, max_relative_positions=16,
      pos_att_type=["p2c", "c2p"], share_att_key=share_att_key,
      norm_rel_ebd="layer_norm", position_biased_input=position_biased_input,
      hidden_dropout_prob=0.0, attention_probs_dropout_prob=dropout)
  return DebertaV2ForMaskedLM(cfg)


@pytest.fixture(scope="module", params=[True, False],
                ids=["share_att_key", "pos_proj"])
def deberta_pair(request):
  torch.manual_seed(4)
  eager = _deberta(share_att_key=request.param).eval()
  fold = torch_bridge.optimize_deberta(copy.deepcopy(eager))
  return eager, fold


def test_deberta_swap_keeps_weights_and_names(deberta_pair):
  from transformers.models.deberta_v2.modeling_deberta_v2 import \
      DisentangledSelfAttention
  eager, fold = deberta_pair
  swapped = [m for m in fold.modules()
             if isinstance(m, torch_bridge.deberta.FoldDisentangledSelfAttention)]
  assert len(swapped) == 2
  assert all(isinstance(m, DisentangledSelfAttention) for m in swapped)
  a, b = eager.state_dict(), fold.state_dict()
  assert a.keys() == b.keys()
  assert all(torch.equal(a[k], b[k]) for k in a)
  # The encoder no longer builds HF's [b, 1, s, s] mask and relative
  # positions (the fold attention needs neither).
  fold_enc = torch_bridge.deberta.FoldDebertaV2Encoder
  assert sum(isinstance(m, fold_enc) for m in fold.modules()) == 1
  back = torch_bridge.deberta.restore(copy.deepcopy(fold))
  assert not any(isinstance(m, (torch_bridge.deberta.FoldDisentangledSelfAttention,
                                fold_enc))
                 for m in back.modules())


def test_deberta_fused_projections_match_the_modules(deberta_pair):
  """The swapped attention projects q, k, v (and, with share_att_key, the
  relative embeddings) in one batched GEMM: the same values as the three
  nn.Linear modules; a hooked projection is run as a module instead."""
  from torch_bridge.deberta import _fused_projections
  _, fold = deberta_pair
  attn = next(m for m in fold.modules()
              if isinstance(m, torch_bridge.deberta.FoldDisentangledSelfAttention))
  torch.manual_seed(0)
  x = torch.randn(2, 7, 64)
  rel = torch.randn(16, 64)
  with torch.no_grad():
    q, k, v, rq, rk = _fused_projections(attn, x, rel)
    want = [attn.query_proj(x), attn.key_proj(x), attn.value_proj(x),
            attn.query_proj(rel), attn.key_proj(rel)]
  for got, w in zip((q, k, v, rq, rk), want):
    assert got.is_contiguous()
    torch.testing.assert_close(got, w.reshape(got.shape), atol=1e-5,
                               rtol=1e-5)
  assert _fused_projections(attn, x, None)[3] is None
  # A weight changed in place through `.data` (invisible to version
  # counters, as an EMA update does it) is seen by the next call.
  k1 = _fused_projections(attn, x, rel)[1]
  attn.key_proj.weight.data.mul_(2.0)
  try:
    with torch.no_grad():
      k2 = _fused_projections(attn, x, rel)[1]
      torch.testing.assert_close(k2, attn.key_proj(x).reshape(k2.shape),
                                 atol=1e-5, rtol=1e-5)
    assert not torch.allclose(k1, k2)
  finally:
    attn.key_proj.weight.data.div_(2.0)
  handle = attn.key_proj.register_forward_hook(lambda *a: None)
  try:
    assert _fused_projections(attn, x, rel) is None
  finally:
    handle.remove()
  # Past the token limit (GPU-bound: the modules' fused bias epilogue wins).
  limit = torch_bridge.deberta.FUSED_PROJECTIONS_MAX_TOKENS
  assert _fused_projections(attn, torch.randn(1, limit, 64), None) is not None
  assert _fused_projections(attn, torch.randn(1, limit + 1, 64), None) is None


def test_deberta_fallback_to_hf_attention_matches_eager(deberta_pair):
  """output_attentions=True needs HF's attention: it gets back the
  [b, 1, s, s] mask and relative positions the swapped encoder skips."""
  eager, fold = deberta_pair
  ids, am = _batch("right")
  with torch.no_grad():
    ref = eager(input_ids=ids, attention_mask=am, output_attentions=True)
    out = fold(input_ids=ids, attention_mask=am, output_attentions=True)
  valid = am.bool()
  torch.testing.assert_close(out.logits[valid], ref.logits[valid], atol=2e-5,
                             rtol=2e-5)
  for a, r in zip(out.attentions, ref.attentions):
    torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-5)


def test_deberta_logits_and_gradients_match_eager(deberta_pair):
  eager, fold = deberta_pair
  ids, am = _batch("right")
  with torch.no_grad():
    ref = eager(input_ids=ids, attention_mask=am).logits
    out = fold(input_ids=ids, attention_mask=am).logits
  valid = am.bool()
  torch.testing.assert_close(out[valid], ref[valid], atol=2e-5, rtol=2e-5)
  labels = ids.masked_fill(am == 0, -100)
  grads = []
  for model in (eager, fold):
    model.train()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, attention_mask=am, labels=labels).loss.backward()
    grads.append({n: p.grad.clone() for n, p in model.named_parameters()
                  if p.grad is not None})
    model.eval()
  assert grads[0].keys() == grads[1].keys()
  for n in grads[0]:
    torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5,
                               rtol=1e-4, msg=n)


def test_deberta_packed_matches_separate_sequences(deberta_pair):
  eager, fold = deberta_pair
  g = torch.Generator().manual_seed(5)
  ids = torch.randint(3, VOCAB, (1, 12), generator=g)
  cu = torch.tensor([0, 5, 12], dtype=torch.int32)
  with torch.no_grad():
    with torch_bridge.deberta.packed(cu, max_seqlen=7):
      out = fold(input_ids=ids).logits
    for i in range(2):
      ref = eager(input_ids=ids[:, cu[i]:cu[i + 1]]).logits
      torch.testing.assert_close(out[:, cu[i]:cu[i + 1]], ref, atol=2e-5,
                                 rtol=2e-5)


def test_deberta_dropout_is_seeded_by_torch():
  torch.manual_seed(6)
  model = torch_bridge.optimize_deberta(_deberta(dropout=0.3)).train()
  ids = torch.randint(3, VOCAB, (2, 8))
  outs = []
  for seed in (0, 0, 1):
    torch.manual_seed(seed)
    outs.append(model(input_ids=ids).logits.detach())
  assert torch.equal(outs[0], outs[1])
  assert not torch.equal(outs[0], outs[2])
  model.eval()
  with torch.no_grad():
    assert torch.equal(model(input_ids=ids).logits,
                       model(input_ids=ids).logits)


def test_deberta_custom_op_opcheck():
  q, k, v = (torch.randn(1, 6, 2, 8, requires_grad=True) for _ in range(3))
  pk = torch.randn(16, 2, 8, requires_grad=True)
  pq = torch.randn(16, 2, 8, requires_grad=True)
  mask = torch.ones(1, 6, dtype=torch.int32)
  args = (q, k, v, pk, pq, mask, None, None, "xla", 8, 16, True, True, 0.0, 0)
  torch.library.opcheck(torch.ops.foldax.deberta_fwd.default, args,
                        test_utils=("test_schema",
                                    "test_autograd_registration",
                                    "test_faketensor"))


HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (
    8, 0)
gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU (sm80+)")


@pytest.mark.gpu
@gpu
def test_gpu_llama_fold_matches_eager_and_generates():
  torch.manual_seed(10)
  eager = _llama().cuda().eval()
  eager.set_attn_implementation("eager")
  fold = copy.deepcopy(eager)
  fold.set_attn_implementation("fold")
  ids, am = (x.cuda() for x in _batch("left"))
  with torch.no_grad():
    ref = eager(input_ids=ids, attention_mask=am).logits
    out = fold(input_ids=ids, attention_mask=am).logits
  valid = am.bool()
  torch.testing.assert_close(out[valid], ref[valid], atol=2e-4, rtol=2e-4)
  kw = dict(input_ids=ids, attention_mask=am, max_new_tokens=8,
            do_sample=False, pad_token_id=0)
  assert torch.equal(fold.generate(**kw), eager.generate(**kw))


@pytest.mark.gpu
@gpu
def test_gpu_deberta_matches_eager_bf16():
  torch.manual_seed(11)
  eager = _deberta().cuda().eval()
  fold = torch_bridge.optimize_deberta(copy.deepcopy(eager))
  ids, am = (x.cuda() for x in _batch("right"))
  with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
    ref = eager(input_ids=ids, attention_mask=am).logits.float()
    out = fold(input_ids=ids, attention_mask=am).logits.float()
  valid = am.bool()
  torch.testing.assert_close(out[valid], ref[valid], atol=5e-2, rtol=5e-2)
