"""Flax DeBERTa-v2 vs Hugging Face transformers (float32, tiny random
configs built here; no downloads): hidden states, gradients, padded vs
packed, checkpoint round trip, and a jit-compiled fine-tuning step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_api.deberta.convert import (from_hf,
                                     from_hf_for_sequence_classification,
                                     from_hf_nnx, to_hf_state_dict)
from jax_api.deberta.modules import DebertaV2Config, DebertaV2Model
from jax_api.deberta.modules_nnx import linen_params

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf  # noqa: E402

# Acceptance: hidden states within 1e-4 and gradients within 1e-3 (float32;
# observed ~2e-6 and ~1e-5).
HIDDEN_ATOL = 1e-4
GRAD_ATOL = 1e-3

VOCAB, HIDDEN = 64, 32
LENGTHS = [40, 23, 0]  # full, ragged, fully padded
SEQ = 40


def _hf_config(**over):
  kw = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=48,
            max_position_embeddings=64, relative_attention=True,
            position_buckets=8, max_relative_positions=16,
            pos_att_type="p2c|c2p", share_att_key=False,
            norm_rel_ebd="layer_norm", position_biased_input=False,
            type_vocab_size=0, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0)
  kw.update(over)
  return transformers.DebertaV2Config(**kw)


def _hf_model(cfg, seed=0):
  torch.manual_seed(seed)
  m = hf.DebertaV2Model(cfg).float().eval()
  # HF's init (std 0.02) gives near-uniform attention; O(1) scores make
  # every position term matter.
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "LayerNorm" in name:
        p.normal_(1.0 if name.endswith("weight") else 0.0, 0.1)
      else:
        p.normal_(0.0, 0.2)
  return m


def _batch(seed=0, lengths=LENGTHS, seq=SEQ, hidden=HIDDEN):
  rng = np.random.default_rng(seed)
  ids = rng.integers(1, VOCAB, (len(lengths), seq))
  mask = (np.arange(seq)[None] < np.asarray(lengths)[:, None]).astype(
      np.int64)
  ids = np.where(mask == 1, ids, 0)
  w = rng.standard_normal((len(lengths), seq, hidden)).astype(np.float32)
  return ids, mask, w * mask[:, :, None]


def _hf_forward_backward(m, ids, mask, w, **kw):
  m.zero_grad()
  out = m(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
          **kw).last_hidden_state
  # The loss reads real tokens only (padded ones differ by convention).
  (out * torch.from_numpy(w)).sum().backward()
  grads = {n: p.grad.numpy() for n, p in m.named_parameters()
           if p.grad is not None}
  return out.detach().numpy(), grads


def _jax_forward_backward(model, params, ids, mask, w, **kw):
  def loss(p):
    out = model.apply({"params": p}, jnp.asarray(ids), jnp.asarray(mask),
                      **kw)
    return jnp.sum(out * w), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return np.asarray(out), to_hf_state_dict(grads)


def _compare(out, ref_out, grads, ref_grads, mask, grad_scale_tol=0.0):
  """grad_scale_tol widens each gradient's tolerance by that fraction of its
  largest magnitude: sums over many tokens (embedding gradients) accumulate
  in a different order on the GPU, so their error scales with the array."""
  valid = mask.astype(bool)
  np.testing.assert_allclose(out[valid], ref_out[valid], atol=HIDDEN_ATOL,
                             rtol=0)
  assert np.all(np.isfinite(out))
  assert set(ref_grads) <= set(grads)
  for name, g in ref_grads.items():
    atol = GRAD_ATOL + grad_scale_tol * float(np.max(np.abs(g)))
    np.testing.assert_allclose(grads[name], g, atol=atol, rtol=0,
                               err_msg=name)


@pytest.fixture(scope="module")
def main_case():
  m = _hf_model(_hf_config())
  ids, mask, w = _batch()
  ref_out, ref_grads = _hf_forward_backward(m, ids, mask, w)
  model, params = from_hf(m, attention_backend="interpret")
  out, grads = _jax_forward_backward(model, params, ids, mask, w)
  return dict(m=m, ids=ids, mask=mask, w=w, ref_out=ref_out,
              ref_grads=ref_grads, model=model, params=params, out=out,
              grads=grads)


def test_hf_parity_kernel_backend(main_case):
  c = main_case
  _compare(c["out"], c["ref_out"], c["grads"], c["ref_grads"], c["mask"])
  # The relative embeddings and both position projections get gradients.
  for name in ("encoder.rel_embeddings.weight",
               "encoder.layer.0.attention.self.pos_key_proj.weight",
               "encoder.layer.1.attention.self.pos_query_proj.weight"):
    assert np.abs(c["grads"][name]).max() > 1e-3, name


@pytest.mark.parametrize("remat", [True, "ffn"])
def test_remat_same_params_and_gradients(main_case, remat):
  """remat=True (each layer recomputed in the backward) and remat="ffn"
  (each feed-forward block) keep the parameter tree and give the HF
  gradients too, with dropout on (the recomputation draws the same
  masks)."""
  c = main_case
  m = c["model"]
  rm, _ = from_hf(c["m"], attention_backend="interpret", remat=remat)
  assert rm.remat == remat and not m.remat
  assert jax.tree.structure(rm.init(jax.random.key(0), jnp.asarray(c["ids"]),
                                    jnp.asarray(c["mask"]))["params"]) == \
      jax.tree.structure(c["params"])
  out, grads = _jax_forward_backward(rm, c["params"], c["ids"], c["mask"],
                                     c["w"])
  _compare(out, c["ref_out"], grads, c["ref_grads"], c["mask"])
  kw = dict(deterministic=False, rngs={"dropout": jax.random.key(7)})
  a = _jax_forward_backward(m, c["params"], c["ids"], c["mask"], c["w"], **kw)
  b = _jax_forward_backward(rm, c["params"], c["ids"], c["mask"], c["w"],
                            **kw)
  np.testing.assert_allclose(b[0], a[0], atol=1e-5, rtol=0)
  for name, g in a[1].items():
    np.testing.assert_allclose(b[1][name], g, atol=GRAD_ATOL, rtol=0,
                               err_msg=name)


def test_remat_rejects_unknown_mode(main_case):
  c = main_case
  bad = DebertaV2Model(config=c["model"].config, remat="everything")
  with pytest.raises(ValueError, match="remat must be"):
    bad.init(jax.random.key(0), jnp.asarray(c["ids"]), jnp.asarray(c["mask"]))


def test_padded_and_packed_agree(main_case):
  c = main_case
  ids, mask = c["ids"], c["mask"]
  valid = mask.astype(bool)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)
  packed_ids = jnp.asarray(ids[valid])
  apply = jax.jit(functools.partial(c["model"].apply, max_seqlen=SEQ))
  out_p = apply({"params": c["params"]}, packed_ids, cu_seqlens=cu)
  assert out_p.shape == (sum(LENGTHS), HIDDEN)
  np.testing.assert_allclose(np.asarray(out_p), c["out"][valid], atol=1e-5,
                             rtol=0)


def test_init_tree_matches_converted_and_state_dict_round_trip(main_case):
  c = main_case
  init = jax.eval_shape(
      c["model"].clone(attention_backend="xla").init, jax.random.key(0),
      jnp.asarray(c["ids"][:1, :8]), jnp.asarray(c["mask"][:1, :8]))["params"]
  shapes = lambda t: jax.tree_util.tree_map(lambda x: tuple(x.shape), t)
  assert shapes(init) == shapes(c["params"])
  sd = to_hf_state_dict(c["params"])
  hf_sd = {k: v.numpy() for k, v in c["m"].state_dict().items()
           if not k.endswith("position_ids")}
  assert set(sd) == set(hf_sd)
  for k in sd:
    np.testing.assert_array_equal(sd[k], hf_sd[k], err_msg=k)
  # A fresh HF model loaded from the converted params gives the same output.
  fresh = hf.DebertaV2Model(c["m"].config).float().eval()
  missing, unexpected = fresh.load_state_dict(
      {k: torch.from_numpy(v) for k, v in sd.items()}, strict=False)
  assert not unexpected and all(k.endswith("position_ids") for k in missing)
  with torch.no_grad():
    out = fresh(torch.from_numpy(c["ids"]),
                attention_mask=torch.from_numpy(c["mask"])).last_hidden_state
  np.testing.assert_array_equal(out.numpy(), c["ref_out"])
  # From a state dict (with a task model's "deberta." prefix) + config.
  model2, params2 = from_hf(
      {"deberta." + k: torch.from_numpy(v) for k, v in sd.items()},
      config=c["m"].config, attention_backend="xla")
  assert shapes(params2) == shapes(c["params"])


def test_hf_parity_other_options_xla_backend():
  # share_att_key, conv, absolute positions, token types, embed_proj,
  # c2p only, no log buckets.
  cfg = _hf_config(share_att_key=True, conv_kernel_size=3, conv_groups=2,
                   position_biased_input=True, type_vocab_size=2,
                   embedding_size=24, pos_att_type="c2p", position_buckets=-1,
                   max_relative_positions=12, norm_rel_ebd="none",
                   hidden_act="gelu_new")
  m = _hf_model(cfg, seed=1)
  ids, mask, w = _batch(seed=1)
  tt = (np.arange(SEQ)[None] >= 20).astype(np.int64).repeat(len(LENGTHS), 0)
  ref_out, ref_grads = _hf_forward_backward(
      m, ids, mask, w, token_type_ids=torch.from_numpy(tt))
  model, params = from_hf(m, attention_backend="xla")
  out, grads = _jax_forward_backward(model, params, ids, mask, w,
                                     token_type_ids=jnp.asarray(tt))
  _compare(out, ref_out, grads, ref_grads, mask)
  # Packed: the conv never reads across sequences.
  valid = mask.astype(bool)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)
  out_p = jax.jit(functools.partial(model.apply, max_seqlen=SEQ))(
      {"params": params}, jnp.asarray(ids[valid]),
      token_type_ids=jnp.asarray(tt[valid]), cu_seqlens=cu)
  np.testing.assert_allclose(np.asarray(out_p), out[valid], atol=1e-5,
                             rtol=0)


def test_precision_reaches_every_matmul():
  # precision="highest" is what float32 parity with PyTorch needs on a GPU
  # (XLA's default float32 matmul there is TF32); CPU ignores it, so check
  # the program: every dot of the forward and backward asks for HIGHEST.
  cfg = DebertaV2Config.from_hf(_hf_config(
      conv_kernel_size=3, conv_groups=2, embedding_size=24,
      position_biased_input=True, type_vocab_size=2))
  ids = jnp.ones((2, 8), jnp.int32)
  mask = jnp.ones((2, 8), jnp.int32)

  def dots(precision):
    model = DebertaV2Model(config=cfg, attention_backend="xla",
                           precision=precision)
    params = jax.eval_shape(model.init, jax.random.key(0), ids, mask)
    loss = lambda p: jnp.sum(model.apply(p, ids, mask) ** 2)
    hlo = jax.jit(jax.grad(loss)).lower(params).as_text()
    lines = [l for l in hlo.splitlines()
             if "dot_general" in l or "convolution" in l]
    assert lines
    return lines

  assert all("HIGHEST" in l for l in dots("highest"))
  assert not all("HIGHEST" in l for l in dots(None))  # the test has teeth


def test_config_round_trip():
  hf_cfg = _hf_config(pos_att_type="p2c|c2p")
  cfg = DebertaV2Config.from_hf(hf_cfg)
  assert cfg.pos_att_type == ("p2c", "c2p")
  assert cfg.pos_ebd_size == 8 and cfg.resolved_max_relative_positions == 16
  again = DebertaV2Config.from_hf(transformers.DebertaV2Config(
      **cfg.to_hf_dict()))
  assert again == cfg


def test_finetune_step_loss_decreases():
  optax = pytest.importorskip("optax")
  cfg = _hf_config(num_labels=2, hidden_dropout_prob=0.1,
                   attention_probs_dropout_prob=0.1)
  torch.manual_seed(0)
  hf_cls = hf.DebertaV2ForSequenceClassification(cfg).float().eval()
  model, params = from_hf_for_sequence_classification(
      hf_cls, attention_backend="auto")
  assert set(params) == {"deberta", "pooler", "classifier"}
  # Synthetic task: does token 7 occur in the (ragged) sequence?
  rng = np.random.default_rng(0)
  n, s = 32, 24
  ids = rng.integers(8, VOCAB, (n, s))
  labels = rng.integers(0, 2, n)
  lengths = rng.integers(6, s + 1, n)
  for i in range(n):
    if labels[i]:
      ids[i, rng.integers(1, lengths[i])] = 7
  mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int32)
  ids = jnp.asarray(np.where(mask == 1, ids, 0))
  mask, labels = jnp.asarray(mask), jnp.asarray(labels)
  tx = optax.adamw(3e-3, weight_decay=0.01)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, key):
    def loss_fn(p):
      logits = model.apply({"params": p}, ids, mask, deterministic=False,
                           rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, labels).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses = []
  key = jax.random.key(0)
  for _ in range(25):
    key, sub = jax.random.split(key)
    params, opt_state, loss = step(params, opt_state, sub)
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses


def _nnx_out_and_grads(model, ids, mask, w):
  """The nnx model's output and the gradients of sum(out * w), jitted."""
  from flax import nnx

  @nnx.jit
  def run(model):
    def loss(model):
      out = model(ids, mask)
      return jnp.sum(out * w), out
    (_, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return out, grads
  return run(model)


def test_nnx_model_matches_linen_and_hf(main_case):
  from flax import nnx
  c = main_case
  model = from_hf_nnx(c["m"], attention_backend="xla")
  assert set(to_hf_state_dict(linen_params(model))) == set(
      to_hf_state_dict(c["params"]))
  model.eval()
  ids, mask, w = (jnp.asarray(x) for x in (c["ids"], c["mask"], c["w"]))
  out, grads = _nnx_out_and_grads(model, ids, mask, w)
  g = to_hf_state_dict(linen_params(grads))
  _compare(np.asarray(out), c["ref_out"], g, c["ref_grads"], c["mask"])
  # Training mode draws dropout masks from the module's rngs.
  cfg = _hf_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
  m2 = from_hf_nnx(_hf_model(cfg), attention_backend="xla")
  m2.train()
  f = nnx.jit(lambda model: model(ids, mask))
  assert float(jnp.abs(f(m2) - f(m2)).max()) > 0


@pytest.mark.parametrize("remat", [True, "ffn"])
def test_nnx_remat_same_outputs_and_gradients(main_case, remat):
  """The nnx model's remat gives the same output and gradients in training
  mode (the recomputation draws the same dropout masks)."""
  c = main_case
  cfg = _hf_config(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
  hf_model = _hf_model(cfg)
  ids, mask, w = (jnp.asarray(x) for x in (c["ids"], c["mask"], c["w"]))
  res = []
  for r in (False, remat):
    model = from_hf_nnx(hf_model, attention_backend="xla", seed=3, remat=r)
    model.train()
    out, grads = _nnx_out_and_grads(model, ids, mask, w)
    res.append((np.asarray(out), to_hf_state_dict(linen_params(grads))))
  (a, ga), (b, gb) = res
  plain = from_hf_nnx(hf_model, attention_backend="xla", seed=3)
  plain.eval()
  assert float(np.abs(a - np.asarray(plain(ids, mask))).max()) > 1e-3  # dropout on
  np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
  assert set(ga) == set(gb)
  for name, g in ga.items():
    np.testing.assert_allclose(gb[name], g, atol=GRAD_ATOL, rtol=0,
                               err_msg=name)


# ---------------------------------------------------------------------------
# GPU (the lead's H200 run).


def _has_gpu():
  try:
    return jax.devices()[0].platform == "gpu"
  except RuntimeError:
    return False


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
def test_gpu_hf_parity_pallas_backend():
  cfg = _hf_config(position_buckets=256, max_relative_positions=512,
                   max_position_embeddings=512, num_attention_heads=2,
                   hidden_size=128, intermediate_size=256)
  m = _hf_model(cfg)
  ids, mask, w = _batch(lengths=[500, 300, 0], seq=500, hidden=128)
  # The reference runs on the CPU in float32: full-precision matmuls
  # (torch.backends.cuda.matmul.allow_tf32 concerns CUDA tensors only).
  assert {(p.device.type, p.dtype) for p in m.parameters()} == {
      ("cpu", torch.float32)}
  ref_out, ref_grads = _hf_forward_backward(m, ids, mask, w)
  # XLA's default float32 matmul on the GPU is TF32 (~1e-3 off): ask for
  # full float32 in the model's projections. The attention kernels use
  # full-precision dots for float32 inputs anyway.
  model, params = from_hf(m, attention_backend="pallas", precision="highest")
  out, grads = _jax_forward_backward(model, params, ids, mask, w)
  # Measured on the H200: embedding gradients (|g| up to ~120, sums over
  # ~800 tokens) differ from torch-CPU by up to 5e-3 (4e-5 of their scale).
  _compare(out, ref_out, grads, ref_grads, mask, grad_scale_tol=1e-4)
  # jax.default_matmul_precision gives the same program (precision=None
  # follows it).
  model0, _ = from_hf(m, attention_backend="pallas")
  with jax.default_matmul_precision("highest"):
    out0, grads0 = _jax_forward_backward(model0, params, ids, mask, w)
  _compare(out0, ref_out, grads0, ref_grads, mask, grad_scale_tol=1e-4)


# A fine-tuning step (dropout on, AdamW) run twice from the same state in
# one process; prints whether every gradient and the parameters have the
# same bits. argv: attention backend.
_FINETUNE_TWICE = r"""
import sys
import jax, jax.numpy as jnp, numpy as np, optax
from jax_api.deberta.modules import (DebertaV2Config,
                                     DebertaV2ForSequenceClassification)
cfg = DebertaV2Config(
    vocab_size=1000, hidden_size=128, num_hidden_layers=2,
    num_attention_heads=2, intermediate_size=256, max_position_embeddings=512,
    relative_attention=True, position_buckets=256, max_relative_positions=512,
    pos_att_type=("p2c", "c2p"), norm_rel_ebd="layer_norm",
    position_biased_input=True, type_vocab_size=2, hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1, num_labels=2)
model = DebertaV2ForSequenceClassification(config=cfg,
                                           attention_backend=sys.argv[1])
rng = np.random.default_rng(0)
n, s = 16, 256
lengths = rng.integers(32, s + 1, n)
mask = jnp.asarray(np.arange(s)[None] < lengths[:, None], jnp.int32)
ids = jnp.asarray(rng.integers(1, 1000, (n, s))) * mask  # repeated ids
tt = jnp.asarray(rng.integers(0, 2, (n, s)))
labels = jnp.asarray(rng.integers(0, 2, n))
params = model.init(jax.random.key(0), ids, mask, tt)["params"]
tx = optax.adamw(1e-3, weight_decay=0.01)

@jax.jit
def step(params, opt_state, key):
  def loss_fn(p):
    logits = model.apply({"params": p}, ids, mask, tt, deterministic=False,
                         rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, labels).mean()
  grads = jax.grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, grads

def run():
  p, o, key, out = params, tx.init(params), jax.random.key(1), []
  for _ in range(3):
    key, sub = jax.random.split(key)
    p, o, g = step(p, o, sub)
    out.append(g)
  return p, out

bits = lambda t: [np.asarray(x).view(np.uint32) for x in jax.tree.leaves(t)]
a, b = bits(run()), bits(run())
print("bitwise identical:", all(np.array_equal(x, y) for x, y in zip(a, b)))
"""


def _run_finetune_twice(backend, xla_flags):
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  env["PYTHONPATH"] = os.pathsep.join(
      [root] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  r = subprocess.run([sys.executable, "-c", _FINETUNE_TWICE, backend],
                     env=env, cwd=root, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU")
def test_gpu_finetune_bitwise_deterministic_with_xla_flag():
  # The embeddings' gradients are scatter-adds (float atomics on GPU unless
  # XLA's deterministic ops are on); the attention backward is
  # deterministic by construction. XLA reads XLA_FLAGS once per process,
  # hence the child process.
  out = _run_finetune_twice("pallas", "--xla_gpu_deterministic_ops=true")
  assert "bitwise identical: True" in out, out
