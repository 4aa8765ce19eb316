"""DeBERTa-v3-base encoder benchmark: foldax (JAX model and torch bridge)
against Hugging Face eager, disentangled-flash and flashdeberta, in one run.

    python -m benchmarks.deberta --output deberta.json [--quick] [--smoke]
    FOLDAX_DEBERTA_H2H=fold_torch,disentangled_flash \
      python -m benchmarks.deberta --output h2h.json --quick
        (forward points only, the implementations alternating per round:
        the fair ratio on a machine whose speed drifts)
        [--budget-s 140] [--points ...] [--impls ...] [--train-impls ...]
    python -m benchmarks.run --suite deberta --output r.json   (same code)

The acceptance benchmark of the DeBERTa issue: the full DeBERTa-v3-base
encoder (12 layers, hidden 768, 12 heads of 64, intermediate 3072,
position_buckets 256, max_position_embeddings 512, relative attention with
c2p|p2c, layer-normed relative embeddings, shared attention key, vocabulary
128100; random weights, built in code) on one GPU:

  fp16 forward  B4 L2048, B16 L512 (dense), B16 L512 ragged (lengths L/8..L,
                padding masked), B1 L2048, B1 L8192
  bf16 training step  B8 L512, B2 L2048

Implementations ("impl" in the records):

  fold_jax            jax_api.deberta.DebertaV2Model (Flax linen, weights
                      from `from_hf` of the same torch model), jitted forward
                      / jitted value_and_grad + SGD step
  fold_jax_ffn        the same training step with `remat="ffn"` (each
                      layer's feed-forward block recomputed in the backward;
                      training points only)
  fold_jax_remat      the same training step with `remat=True` (each layer
                      recomputed in the backward; training points only)
  fold_torch          the Hugging Face model after
                      `torch_bridge.optimize_deberta(model)` (attention on
                      foldax's JAX kernel through DLPack)
  disentangled_flash  disentangled-flash 1.1.1, `optimize_deberta(model,
                      sequence_lengths=[...])` + `encoder.activate_shape(L)`
                      for inference, `optimize_deberta(model,
                      inference=False)` for training
  hf_eager            transformers DebertaV2Model (its only attention: eager)
  flashdeberta        flashdeberta 0.0.8 `FlashDebertaV2Model` with the same
                      weights (forward; its training step only if the budget
                      leaves time at the end)

A peer that does not import is recorded with error "not installed: ...".

Definitions (also in the JSON's metadata.conventions):

* forward: `model(input_ids, attention_mask)` under `torch.no_grad()` in
  eval mode (dropout off), or the jitted `model.apply(params, ids, mask)`;
  every implementation gets the [B, L] 0/1 attention mask (all ones for
  dense points), as a tokenizer gives it.
* training step: train mode with the config's dropout (hidden 0.1,
  attention 0.1), loss = mean(last_hidden_state.float()**2), backward, plain
  SGD update (lr 1e-6, no momentum; torch: `optimizer.zero_grad(
  set_to_none=True)` first), bf16 parameters and activations (no fp32
  master copy, no autocast) for every implementation.
* time: median over batches of back-to-back calls after warm-up. torch: CUDA
  events on the current stream around each batch (`ms`), and the host clock
  around the batch with a device-wide `torch.cuda.synchronize()` (`ms_host`;
  this one also waits for JAX's streams, the check for fold_torch). JAX:
  host clock around each batch, `block_until_ready` on the last output
  (`benchmarks._timing.time_jax`; for training the parameters are threaded
  through the donated step). Batch sizes are chosen so that a measurement
  takes about `target_s` seconds. `first_call_s`: the first call (Triton /
  JAX compilation included); `compile_s`: JAX ahead-of-time compile.
* peak memory of a training step (`peak_mem_bytes`): the model's parameter
  bytes + what one step allocates at its peak over what was allocated before
  it (gradients, activations, workspaces; the [B, L] inputs excluded).
  torch: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats`;
  fold_torch adds the JAX-side bytes (the attention outputs JAX holds between
  forward and backward, or the rise of JAX's process peak during the step,
  whichever is larger). fold_jax: XLA's buffer assignment of the compiled
  step (arguments + temporaries + outputs - donated aliases), i.e. the
  parameters, inputs and everything the step allocates.

Budget: the suite stops starting measurements when its budget (default 140 s
on a GPU with --quick, env FOLDAX_DEBERTA_BUDGET_S or --budget-s) is spent;
points run in acceptance order (B4 L2048 forward, B8 L512 training step
first) and the JSON is rewritten after every measurement, so a run cut short
by `benchmarks.run --timeout-s` keeps what finished.

Without a GPU (or with --smoke) the same code runs a tiny configuration
(1 layer, hidden 64, 2 heads, position_buckets 32, vocabulary 1000; B2
L64) on the CPU in a few seconds per implementation (a harness check;
times mean nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
_T_IMPORT = time.time()  # the budget counts from here (imports included)

from benchmarks import _timing as T  # noqa: E402  (no jax/torch at import)
from benchmarks import dense as D  # noqa: E402

IMPLS = ("fold_jax", "fold_jax_ffn", "fold_jax_remat", "fold_torch", "disentangled_flash", "hf_eager",
         "flashdeberta")
OURS = ("fold_jax", "fold_jax_ffn", "fold_jax_remat", "fold_torch")
TRAIN_ONLY = ("fold_jax_ffn", "fold_jax_remat")


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  mode: str  # "fwd" | "train"
  B: int
  L: int
  ragged: bool = False

  @property
  def dtype(self) -> str:
    return "fp16" if self.mode == "fwd" else "bf16"

  @property
  def label(self) -> str:
    kind = "fp16 forward" if self.mode == "fwd" else "bf16 train step"
    return f"{kind} B{self.B} L{self.L}" + (" ragged" if self.ragged else "")


# Acceptance-critical points first.
GPU_POINTS = (
    Point("fwd-b4-l2048", "fwd", 4, 2048),
    Point("train-b8-l512", "train", 8, 512),
    Point("fwd-b16-l512", "fwd", 16, 512),
    Point("fwd-b16-l512-ragged", "fwd", 16, 512, ragged=True),
    Point("fwd-b1-l2048", "fwd", 1, 2048),
    Point("train-b2-l2048", "train", 2, 2048),
    Point("fwd-b1-l8192", "fwd", 1, 8192),
)
SMOKE_POINTS = (
    Point("fwd-b2-l64", "fwd", 2, 64),
    Point("train-b2-l64", "train", 2, 64),
    Point("fwd-b2-l64-ragged", "fwd", 2, 64, ragged=True),
)

# shared/anchors/README.md (H200, 2026-12-02, one run each): for reference
# only; every ratio in this file is computed from the same run.
ANCHORS_H200 = {
    "source": "shared/anchors/README.md, H200 2026-12-02, torch 2.11, "
              "transformers 5.17 (not this run)",
    "hf_eager": {"fwd-b16-l512": 22.3, "fwd-b16-l512-ragged": 23.1,
                 "fwd-b1-l2048": 20.2, "fwd-b4-l2048": 69.1,
                 "train-b8-l512": [56.6, "4.9 GiB"],
                 "train-b2-l2048": [101.6, "10.6 GiB"]},
    "disentangled_flash": {"fwd-b16-l512": 8.2, "fwd-b16-l512-ragged": 10.9,
                           "fwd-b1-l2048": 7.6, "fwd-b4-l2048": 21.2,
                           "train-b8-l512": [74.2, "2.7 GiB"],
                           "train-b2-l2048": [101.7, "2.7 GiB"]},
    "flashdeberta": {"fwd-b16-l512": 13.6, "fwd-b16-l512-ragged": 19.6,
                     "fwd-b1-l2048": 13.9, "fwd-b4-l2048": 28.2},
}
# The torch-bridge issue's points (those of the anchors table).
BRIDGE_POINTS = ("fwd-b16-l512", "fwd-b16-l512-ragged", "fwd-b1-l2048",
                 "fwd-b4-l2048", "train-b8-l512", "train-b2-l2048")

SGD_LR = 1e-6


def hf_config_kwargs(smoke: bool) -> dict:
  """microsoft/deberta-v3-base's config.json (random weights)."""
  kw = dict(vocab_size=128100, hidden_size=768, num_hidden_layers=12,
            num_attention_heads=12, intermediate_size=3072, hidden_act="gelu",
            hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
            max_position_embeddings=512, type_vocab_size=0,
            initializer_range=0.02, layer_norm_eps=1e-7,
            relative_attention=True, max_relative_positions=-1,
            position_buckets=256, pos_att_type=["p2c", "c2p"],
            norm_rel_ebd="layer_norm", share_att_key=True,
            position_biased_input=False, pad_token_id=0)
  if smoke:
    kw.update(vocab_size=1000, hidden_size=64, num_hidden_layers=1,
              num_attention_heads=2, intermediate_size=128,
              position_buckets=32, max_position_embeddings=128)
  return kw


def point_inputs(B: int, L: int, ragged: bool, vocab: int):
  """(input_ids, attention_mask, lengths) of a point, torch CPU tensors
  [B, L]: random ids from a fixed seed; with `ragged`, lengths L/8 .. L
  spread evenly and shuffled, padding id 0 after each length."""
  import torch
  g = torch.Generator().manual_seed(1)
  ids = torch.randint(1, vocab, (B, L), generator=g)
  if ragged:
    lo = L // 8
    lens = [lo + (i * (L - lo)) // max(1, B - 1) for i in range(B)]
    perm = torch.randperm(B, generator=g).tolist()
    lens = [lens[i] for i in perm]
  else:
    lens = [L] * B
  mask = (torch.arange(L)[None, :] < torch.tensor(lens)[:, None]).long()
  return ids * mask, mask, lens  # pad_token_id 0 on padding


def _err(e: BaseException) -> str:
  return D._err(e)


def _pkg_version(name: str) -> str | None:
  return D._pkg_version(name)


# ----------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------
class Suite:
  """Models, inputs, records and the budget of one run."""

  def __init__(self, args, argv: list[str]):
    import jax
    import torch
    self.t0 = _T_IMPORT
    self.args = args
    self.output = args.output
    self.cuda = torch.cuda.is_available() and not args.smoke_cpu
    self.jax_gpu = jax.devices()[0].platform == "gpu"
    self.smoke = bool(args.smoke) or not (self.cuda and self.jax_gpu)
    self.device = torch.device("cuda" if self.cuda else "cpu")
    if not self.cuda:
      # torch's CPU thread pool and XLA's spin against each other on a small
      # machine (every op ~15 ms on 2 cores); one torch thread avoids that.
      torch.set_num_threads(1)
    quick = bool(getattr(args, "quick", False))
    env_budget = os.environ.get("FOLDAX_DEBERTA_BUDGET_S")
    if args.budget_s is not None:
      self.budget = float(args.budget_s)
    elif env_budget:
      self.budget = float(env_budget)
    else:
      self.budget = 120.0 if self.smoke else (140.0 if quick else 420.0)
    if self.smoke:
      self.target_fwd, self.target_train, self.n_batches = 0.01, 0.01, 2
    elif quick:
      self.target_fwd, self.target_train, self.n_batches = 0.3, 0.45, 5
    else:
      self.target_fwd, self.target_train, self.n_batches = 1.0, 1.5, 7
    points = SMOKE_POINTS if self.smoke else GPU_POINTS
    want = (getattr(args, "points", None) or
            os.environ.get("FOLDAX_DEBERTA_POINTS", ""))
    if want:
      names = [w.strip() for w in want.split(",") if w.strip()]
      bad = [n for n in names if n not in {p.name for p in points}]
      if bad:
        raise SystemExit(f"unknown points {bad}; known: "
                         f"{[p.name for p in points]}")
      points = tuple(p for p in points if p.name in names)
    self.points = points
    want = (getattr(args, "impls", None) or
            os.environ.get("FOLDAX_DEBERTA_IMPLS", ""))
    self.impls = tuple(i for i in IMPLS if not want or i in want.split(","))
    want = (getattr(args, "train_impls", None) or
            os.environ.get("FOLDAX_DEBERTA_TRAIN_IMPLS", ""))
    # At training points: these of self.impls (all of them by default).
    self.train_impls = tuple(i for i in self.impls
                             if not want or i in want.split(","))
    self.records: list[dict] = []
    self.cache: dict[Any, Any] = {}
    self.md = self._metadata(argv, jax, torch, quick)
    self.write()

  # --- bookkeeping --------------------------------------------------------
  def elapsed(self) -> float:
    return time.time() - self.t0

  def remaining(self) -> float:
    return self.budget - self.elapsed()

  def write(self, final: bool = False):
    self.md["elapsed_s"] = round(self.elapsed(), 1)
    self.md["complete"] = final
    self.md["targets"] = evaluate_targets(self.records)
    D.write_json(self.output, dict(status="ok", metadata=self.md,
                                   records=self.records))

  def _metadata(self, argv, jax, torch, quick) -> dict:
    md = D.metadata(argv, None)
    prog = ("benchmarks.run" if getattr(self.args, "child", None)
            else "benchmarks.deberta")
    md["command"] = " ".join(["python", "-m", prog] + argv)
    md["suite"] = "deberta"
    dev = jax.devices()[0]
    md.update(jax_backend=dev.platform, device_kind=dev.device_kind,
              jax_compute_capability=getattr(dev, "compute_capability", None))
    if self.cuda:
      cc = torch.cuda.get_device_capability()
      md.update(torch_cuda=torch.version.cuda,
                torch_cudnn=torch.backends.cudnn.version(),
                torch_compute_capability=f"{cc[0]}.{cc[1]}",
                torch_device=torch.cuda.get_device_name())
    for p in ("transformers", "disentangled-flash", "flashdeberta", "einops",
              "torch", "triton", "flax", "jax", "jaxlib"):
      md["versions"][p] = _pkg_version(p)
    md["smoke"] = self.smoke
    md["quick"] = quick
    md["impls"] = list(self.impls)
    md["train_impls"] = list(self.train_impls)
    md["budget_s"] = self.budget
    md["config"] = hf_config_kwargs(self.smoke)
    md["config_note"] = (
        "DeBERTa-v3-base (microsoft/deberta-v3-base config.json), random "
        "weights; full vocabulary 128100 (its embedding is 98M of the 184M "
        "parameters: it matters for training-step memory, not encoder time)"
        if not self.smoke else
        "smoke configuration (tiny model, CPU): times mean nothing")
    md["points"] = [dataclasses.asdict(p) | {"label": p.label}
                    for p in self.points]
    md["anchors_h200"] = ANCHORS_H200
    md["targets_definition"] = TARGETS_DEFINITION
    md["conventions"] = dict(
        forward="model(input_ids, attention_mask) under no_grad, eval mode; "
                "[B, L] 0/1 mask to every implementation (all ones when "
                "dense); fold_jax: jitted model.apply",
        train_step="train mode (dropout 0.1/0.1), loss=mean(h.float()**2), "
                   "backward, SGD lr 1e-6; bf16 parameters, no autocast",
        timing_torch="CUDA events around batches of back-to-back calls "
                     "(ms), host clock + torch.cuda.synchronize (ms_host); "
                     "median over batches",
        timing_jax="host clock around batches of back-to-back calls, "
                   "block_until_ready on the last; median over batches",
        peak_mem_bytes="training step: parameter bytes + peak allocation "
                       "of one step over what was allocated before it; "
                       "torch max_memory_allocated (fold_torch + JAX-side "
                       "bytes); fold_jax XLA buffer assignment (arguments "
                       "+ temporaries + outputs - aliases)",
        speedup="speedup_vs_X = X's time / this time (> 1: faster than X)",
        flops="not counted (whole-model times)")
    return md

  def _skip(self, need_s: float) -> str | None:
    if self.remaining() < need_s:
      return (f"skipped: suite budget ({self.budget:.0f} s) nearly spent "
              f"({self.elapsed():.0f} s elapsed, ~{need_s:.0f} s needed)")
    return None

  # --- models ---------------------------------------------------------------
  def hf_config(self):
    from transformers import DebertaV2Config
    cfg = DebertaV2Config(**hf_config_kwargs(self.smoke))
    try:
      cfg._attn_implementation = "eager"
    except Exception:  # noqa: BLE001
      pass
    return cfg

  def base(self):
    """The fp32 Hugging Face model every implementation copies."""
    if "base" not in self.cache:
      import torch
      from transformers import DebertaV2Model
      torch.manual_seed(0)
      t = time.perf_counter()
      with torch.device(self.device):
        m = DebertaV2Model(self.hf_config())
      m.eval()
      self.cache["base"] = m
      self.md["model_build_s"] = round(time.perf_counter() - t, 2)
      self.md["n_params"] = sum(p.numel() for p in m.parameters())
    return self.cache["base"]

  def torch_dtype(self, point: Point):
    import torch
    if self.smoke and not self.cuda:
      return torch.float32  # CPU: fp16/bf16 matmuls are slow or missing
    return torch.float16 if point.mode == "fwd" else torch.bfloat16

  def hf(self, dtype):
    key = ("hf", dtype)
    if key not in self.cache:
      self.cache[key] = copy.deepcopy(self.base()).to(dtype).eval()
    return self.cache[key]

  def df(self, dtype, train: bool):
    key = ("df", dtype, train)
    if key not in self.cache:
      try:
        import disentangled_flash as dfl
      except Exception as e:  # noqa: BLE001
        self.cache[key] = ImportError(f"not installed: {_err(e)}")
        return self.cache[key]
      m = copy.deepcopy(self.hf(dtype))
      backend = "triton" if self.cuda else "torch"
      if train:
        m.train()
        dfl.optimize_deberta(m, backend=backend, inference=False)
      else:
        m.eval()
        lengths = sorted({p.L for p in self.points if p.mode == "fwd"})
        dfl.optimize_deberta(m, backend=backend, sequence_lengths=lengths)
      if not isinstance(m.encoder, dfl.DebertaV2OptimizedEncoder):
        self.cache[key] = RuntimeError(
            "disentangled_flash kept the Hugging Face encoder (Triton or "
            "the shape unsupported here)")
      else:
        m.encoder._foldax_backend = backend
        self.cache[key] = m
    return self.cache[key]

  def fd(self, dtype):
    key = ("fd", dtype)
    if key not in self.cache:
      try:
        import flashdeberta
      except Exception as e:  # noqa: BLE001
        self.cache[key] = ImportError(f"not installed: {_err(e)}")
        return self.cache[key]
      src = self.hf(dtype)
      note = "FlashDebertaV2Model(config) + load_state_dict"
      try:
        import torch
        with torch.device(self.device):
          m = flashdeberta.FlashDebertaV2Model(self.hf_config())
        missing, unexpected = m.load_state_dict(src.state_dict(),
                                                strict=False)
        if missing:
          raise RuntimeError(f"missing keys {missing[:4]}")
        m = m.to(dtype).eval()
      except Exception as e:  # noqa: BLE001
        # Same computation: HF's model with flashdeberta's attention class.
        m = copy.deepcopy(src)
        from transformers.models.deberta_v2.modeling_deberta_v2 import \
            DisentangledSelfAttention
        for mod in m.modules():
          if type(mod) is DisentangledSelfAttention:
            mod.__class__ = flashdeberta.FlashDisentangledSelfAttention
        note = ("HF DebertaV2Model with its attention modules' class set to "
                "flashdeberta.FlashDisentangledSelfAttention (the class "
                f"FlashDebertaV2Model uses; building that failed: {_err(e)})")
      m._foldax_note = note
      self.cache[key] = m
    return self.cache[key]

  def jax_model(self, jdtype, remat: bool = False):
    key = ("jax", str(jdtype), remat)
    if key not in self.cache:
      import jax
      import jax.numpy as jnp
      from jax_api.deberta import DebertaV2Model, from_hf
      if "jax_fp32" not in self.cache:
        t = time.perf_counter()
        model32, p32 = from_hf(self.base(), param_dtype=jnp.float32)
        self.cache["jax_fp32"] = (model32, p32)
        self.md["jax_convert_s"] = round(time.perf_counter() - t, 2)
      model32, p32 = self.cache["jax_fp32"]
      model = DebertaV2Model(config=model32.config, dtype=jdtype,
                             param_dtype=jdtype, attention_backend="auto",
                             remat=remat)
      params = jax.tree.map(lambda a: jnp.asarray(a, jdtype), p32)
      self.cache[key] = (model, params)
    return self.cache[key]

  def jax_dtype(self, point: Point):
    import jax.numpy as jnp
    if self.smoke and not self.jax_gpu:
      return jnp.float32
    return jnp.float16 if point.mode == "fwd" else jnp.bfloat16

  # --- inputs ---------------------------------------------------------------
  def inputs(self, point: Point):
    key = ("inputs", point.B, point.L, point.ragged)
    if key not in self.cache:
      ids, mask, lens = point_inputs(point.B, point.L, point.ragged,
                                     hf_config_kwargs(self.smoke)["vocab_size"])
      self.cache[key] = (ids.to(self.device), mask.to(self.device), lens)
    return self.cache[key]

  def jax_inputs(self, point: Point):
    import jax.numpy as jnp
    ids, mask, _ = self.inputs(point)
    return (jnp.asarray(ids.cpu().numpy(), jnp.int32),
            jnp.asarray(mask.cpu().numpy(), jnp.int32))

  # --- timing ---------------------------------------------------------------
  def sync(self):
    if self.cuda:
      import torch
      torch.cuda.synchronize()

  def time_torch(self, fn: Callable[[], Any], target_s: float) -> dict:
    """fn() already ran once (the first call). One more warm-up call, an
    estimate, then batches: CUDA events (ms) and host clock + device sync
    (ms_host)."""
    import torch
    fn()
    self.sync()
    t = time.perf_counter()
    fn()
    self.sync()
    est = time.perf_counter() - t
    nb = self.n_batches if est < 0.1 else min(self.n_batches, 3)
    nb, n = T._plan(est, target_s, nb, 5000)
    ev, host = [], []
    if self.cuda:
      start = torch.cuda.Event(enable_timing=True)
      end = torch.cuda.Event(enable_timing=True)
    for _ in range(nb):
      self.sync()
      h0 = time.perf_counter()
      if self.cuda:
        start.record()
      for _ in range(n):
        fn()
      if self.cuda:
        end.record()
      self.sync()
      host.append((time.perf_counter() - h0) / n)
      if self.cuda:
        ev.append(start.elapsed_time(end) / 1e3 / n)
    samples = ev if self.cuda else host
    out = T._summary(samples, n, dict(
        timer=("cuda events, back-to-back batches" if self.cuda else
               "host clock, back-to-back batches (CPU)")))
    hs = sorted(host)
    out["ms_host"] = hs[len(hs) // 2] * 1e3
    return out

  # --- measurements ---------------------------------------------------------
  def record(self, point: Point, impl: str, **kw) -> dict:
    dtype, label = point.dtype, point.label
    if self.smoke and not self.cuda:
      dtype = "fp32"
      label = label.replace("fp16 ", "").replace("bf16 ", "") + " (fp32, CPU)"
    r = dict(kind="model", point=point.name, label=label,
             mode=point.mode, impl=impl, B=point.B, L=point.L, S=point.L,
             Hq=12 if not self.smoke else 2, D=64 if not self.smoke else 32,
             dtype=dtype, ragged=point.ragged,
             tokens=sum(self.inputs(point)[2]), ms=None, error=None,
             notes=[])
    r.update(kw)
    return r

  def measure(self, point: Point, impl: str) -> dict:
    rec = self.record(point, impl)
    need = {"fold_jax": 25.0 if point.mode == "train" else 12.0,
            "fold_jax_ffn": 25.0, "fold_jax_remat": 25.0}.get(impl, 4.0)
    key = ("compiled", impl, point.mode, point.B, point.L)
    if impl not in ("fold_jax",) + TRAIN_ONLY or key in self.cache:
      need = 3.0
    skip = self._skip(need)
    if skip:
      rec["error"] = skip
      return rec
    t0 = time.time()
    try:
      fn = getattr(self, f"_{point.mode}_{impl}")
      fn(point, rec)
    except Exception as e:  # noqa: BLE001
      rec["error"] = _err(e)
      rec["ms"] = None
    finally:
      rec["wall_s"] = round(time.time() - t0, 2)
      if self.cuda:
        import torch
        torch.cuda.empty_cache()
    return rec

  # forward -----------------------------------------------------------------
  def _torch_fwd(self, point, rec, model, before=None):
    import torch
    ids, mask, _ = self.inputs(point)

    def call():
      return model(input_ids=ids, attention_mask=mask).last_hidden_state
    with torch.no_grad():
      if before:
        before()
      t = time.perf_counter()
      out = call()
      self.sync()
      rec["first_call_s"] = round(time.perf_counter() - t, 3)
      rec["finite"] = bool(torch.isfinite(out[mask.bool()]).all())
      del out
      rec.update(self.time_torch(call, self.target_fwd))

  def _fwd_hf_eager(self, point, rec):
    self._torch_fwd(point, rec, self.hf(self.torch_dtype(point)))

  @contextlib.contextmanager
  def fold_torch(self, dtype):
    """The cached HF model with `torch_bridge.optimize_deberta` applied,
    restored on exit (the other implementations share that model)."""
    import torch_bridge
    from torch_bridge import deberta as tbd
    m = self.hf(dtype)
    torch_bridge.optimize_deberta(m)
    try:
      yield m
    finally:
      tbd.restore(m)

  def _fwd_fold_torch(self, point, rec):
    with self.fold_torch(self.torch_dtype(point)) as m:
      self._torch_fwd(point, rec, m)
    m = self.hf(self.torch_dtype(point))
    try:
      rec["hf_mask_relpos_ms"] = self._hf_encoder_overhead(point, m)
    except Exception as e:  # noqa: BLE001
      rec["notes"].append(f"hf_mask_relpos_ms: {_err(e)}")

  def _hf_encoder_overhead(self, point, m) -> float:
    """What HF's encoder spends per forward, before any layer, on the
    [B, 1, L, L] mask and the [1, L, L] bucketed relative positions
    (kept by optimize_deberta; disentangled-flash's encoder skips both)."""
    import torch
    ids, mask, _ = self.inputs(point)
    enc = m.encoder
    h = torch.empty(point.B, point.L, m.config.hidden_size,
                    dtype=next(m.parameters()).dtype, device=self.device)

    def call():
      return enc.get_attention_mask(mask), enc.get_rel_pos(h)
    with torch.no_grad():
      call()
      return self.time_torch(call, min(self.target_fwd, 0.1))["ms"]

  def _fwd_disentangled_flash(self, point, rec):
    m = self.df(self.torch_dtype(point), train=False)
    if isinstance(m, Exception):
      raise m
    rec["notes"].append(f"backend={m.encoder._foldax_backend}; "
                        f"activate_shape({point.L})")
    self._torch_fwd(point, rec, m,
                    before=lambda: m.encoder.activate_shape(point.L))

  def _fwd_flashdeberta(self, point, rec):
    m = self.fd(self.torch_dtype(point))
    if isinstance(m, Exception):
      raise m
    rec["notes"].append(m._foldax_note)
    self._torch_fwd(point, rec, m)

  def _fwd_fold_jax(self, point, rec):
    import jax
    import jax.numpy as jnp
    model, params = self.jax_model(self.jax_dtype(point))
    ids, mask = self.jax_inputs(point)
    key = ("compiled", "fold_jax", "fwd", point.B, point.L)
    if key not in self.cache:
      f = jax.jit(lambda p, i, m: model.apply({"params": p}, i, m))
      compiled, _, csec = T.jax_compile(f, (params, ids, mask))
      self.cache[key] = (compiled, csec)
      rec["compile_s"] = round(csec, 2)
    else:
      rec["notes"].append("compiled executable shared with the dense point "
                          "(same shapes)")
    compiled = self.cache[key][0]
    t = time.perf_counter()
    out = jax.block_until_ready(compiled(params, ids, mask))
    rec["first_call_s"] = round(time.perf_counter() - t, 3)
    valid = jnp.asarray(mask, bool)
    rec["finite"] = bool(jnp.all(jnp.isfinite(out[valid])))
    del out
    rec.update(T.time_jax(compiled, [(params, ids, mask)],
                          target_s=self.target_fwd,
                          n_batches=self.n_batches, warmup=1))
    rec.update({k: v for k, v in T.jax_memory_analysis(compiled).items()
                if k != "peak_mem_bytes"})
    from jax_api._backend import resolve_backend
    rec["notes"].append(f"attention backend {resolve_backend('auto')!r}")

  # training ----------------------------------------------------------------
  def _torch_train(self, point, rec, model, jax_side: bool = False):
    import torch
    ids, mask, _ = self.inputs(point)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)

    def step():
      opt.zero_grad(set_to_none=True)
      h = model(input_ids=ids, attention_mask=mask).last_hidden_state
      loss = h.float().pow(2).mean()
      loss.backward()
      opt.step()
      return loss

    try:
      t = time.perf_counter()
      loss = step()
      self.sync()
      rec["first_call_s"] = round(time.perf_counter() - t, 3)
      rec["finite"] = bool(torch.isfinite(loss.detach()).item())
      rec["loss"] = float(loss.detach())
      rec.update(self._torch_step_memory(model, opt, ids, mask, jax_side))
      rec.update(self.time_torch(step, self.target_train))
    finally:
      opt.zero_grad(set_to_none=True)
      model.eval()

  def _torch_step_memory(self, model, opt, ids, mask, jax_side) -> dict:
    import torch
    pbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out = dict(param_bytes=pbytes)
    if not self.cuda:
      return out
    opt.zero_grad(set_to_none=True)
    self.sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    j0 = _jax_mem() if jax_side else None
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    loss = h.float().pow(2).mean()
    self.sync()
    j1 = _jax_mem() if jax_side else None
    loss.backward()
    del h, loss
    opt.step()
    self.sync()
    j2 = _jax_mem() if jax_side else None
    peak = torch.cuda.max_memory_allocated() - base
    out.update(torch_step_peak_bytes=int(peak))
    total = pbytes + peak
    src = ("param bytes + torch.cuda.max_memory_allocated() over the "
           "allocation before the step")
    if jax_side and j0 and j1 and j2:
      held = j1["bytes_in_use"] - j0["bytes_in_use"]
      rise = max(0, max(j1["peak_bytes_in_use"], j2["peak_bytes_in_use"])
                 - j0["peak_bytes_in_use"])
      extra = max(held, rise, 0)
      out.update(jax_held_after_fwd_bytes=int(held),
                 jax_peak_rise_bytes=int(rise), jax_side_bytes=int(extra))
      total += extra
      src += (" + JAX-side bytes (held between forward and backward, or the "
              "rise of JAX's process peak, whichever is larger)")
    elif jax_side:
      out["jax_side_bytes"] = None
      src += " (JAX memory_stats unavailable: JAX-side bytes not counted)"
    opt.zero_grad(set_to_none=True)
    out.update(peak_mem_bytes=int(total), mem_source=src)
    return out

  def _train_hf_eager(self, point, rec):
    self._torch_train(point, rec, self.hf(self.torch_dtype(point)))

  def _train_fold_torch(self, point, rec):
    with self.fold_torch(self.torch_dtype(point)) as m:
      self._torch_train(point, rec, m, jax_side=True)

  def _train_disentangled_flash(self, point, rec):
    m = self.df(self.torch_dtype(point), train=True)
    if isinstance(m, Exception):
      raise m
    rec["notes"].append(f"backend={m.encoder._foldax_backend}, "
                        "optimize_deberta(model, inference=False)")
    self._torch_train(point, rec, m)

  def _train_flashdeberta(self, point, rec):
    m = self.fd(self.torch_dtype(point))
    if isinstance(m, Exception):
      raise m
    rec["notes"].append(m._foldax_note)
    self._torch_train(point, rec, m)

  def _train_fold_jax_remat(self, point, rec):
    self._train_fold_jax(point, rec, remat=True)

  def _train_fold_jax_ffn(self, point, rec):
    self._train_fold_jax(point, rec, remat="ffn")

  def _train_fold_jax(self, point, rec, remat: bool | str = False):
    import jax
    import jax.numpy as jnp
    jdt = self.jax_dtype(point)
    # fold_jax_remat: the training step recomputes each layer's forward in
    # the backward (DebertaV2Model(remat=True)); fold_jax_ffn: only each
    # layer's feed-forward block (remat="ffn").
    model, params0 = self.jax_model(jdt, remat=remat)
    rec["remat"] = remat
    if remat == "ffn":
      rec["notes"].append("remat='ffn': each layer's feed-forward block "
                          "recomputed in the backward")
    elif remat:
      rec["notes"].append("remat=True: each encoder layer recomputed in the "
                          "backward")
    ids, mask = self.jax_inputs(point)
    rng = jax.random.key(0)
    step = jax_train_step(model)

    key = ("compiled", "fold_jax", "train", point.B, point.L, remat)
    # The step donates its parameters: work on a copy.
    state = jax.tree.map(jnp.copy, params0)
    if key not in self.cache:
      t = time.perf_counter()
      compiled = jax.jit(step, donate_argnums=0).lower(
          state, ids, mask, rng).compile()
      self.cache[key] = compiled
      rec["compile_s"] = round(time.perf_counter() - t, 2)
    compiled = self.cache[key]
    t = time.perf_counter()
    state, loss = compiled(state, ids, mask, rng)
    jax.block_until_ready(loss)
    rec["first_call_s"] = round(time.perf_counter() - t, 3)
    rec["finite"] = bool(jnp.isfinite(loss))
    rec["loss"] = float(loss)
    box = [state]

    def call():
      box[0], l_ = compiled(box[0], ids, mask, rng)
      return l_
    # warm-up, estimate, batches (host clock, block on the last loss)
    jax.block_until_ready(call())
    t = time.perf_counter()
    jax.block_until_ready(call())
    est = time.perf_counter() - t
    nb = self.n_batches if est < 0.1 else min(self.n_batches, 3)
    nb, n = T._plan(est, self.target_train, nb, 5000)
    samples = []
    for _ in range(nb):
      t = time.perf_counter()
      out = None
      for _ in range(n):
        out = call()
      jax.block_until_ready(out)
      samples.append((time.perf_counter() - t) / n)
    rec.update(T._summary(samples, n, dict(
        timer="host, back-to-back batches (donated step)")))
    ma = T.jax_memory_analysis(compiled)
    pbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params0))
    rec["param_bytes"] = int(pbytes)
    if ma:
      try:
        m = compiled.memory_analysis()
        total = (int(m.argument_size_in_bytes) + int(m.temp_size_in_bytes)
                 + int(m.output_size_in_bytes) - int(m.alias_size_in_bytes))
        rec.update(peak_mem_bytes=total,
                   mem_temp_bytes=ma.get("mem_temp_bytes"),
                   mem_argument_bytes=ma.get("mem_argument_bytes"),
                   mem_output_bytes=ma.get("mem_output_bytes"),
                   mem_alias_bytes=int(m.alias_size_in_bytes),
                   mem_source="XLA buffer assignment of the compiled step: "
                              "arguments (params, inputs) + temporaries + "
                              "outputs - donated aliases")
      except Exception as e:  # noqa: BLE001
        rec["notes"].append(f"memory analysis: {_err(e)}")
    del box, state
    from jax_api._backend import resolve_backend
    rec["notes"].append(f"attention backend {resolve_backend('auto')!r}; "
                        "dropout on (rngs={'dropout': key})")

  # --- head to head -----------------------------------------------------------
  def _h2h_models(self, impls, dtype, L: int, stack) -> dict:
    """impl -> torch model, all alive at once. `fold_torch` swaps the
    cached HF model's classes in place (undone when `stack` closes), so the
    others are copies made before the swap."""
    models = {}
    for impl in impls:
      if impl == "disentangled_flash":
        m = self.df(dtype, train=False)
        if isinstance(m, Exception):
          raise m
        m.encoder.activate_shape(L)
        models[impl] = m
      elif impl == "hf_eager":
        key = ("hf_h2h", dtype)
        if key not in self.cache:
          self.cache[key] = copy.deepcopy(self.hf(dtype))
        models[impl] = self.cache[key]
      elif impl != "fold_torch":
        raise ValueError(f"head_to_head: no torch model for {impl}")
    if "fold_torch" in impls:
      models["fold_torch"] = stack.enter_context(self.fold_torch(dtype))
    return {i: models[i] for i in impls}

  def head_to_head(self, impls: tuple[str, ...], rounds: int = 8):
    """Forward points, timed for `impls` in alternating rounds (A B, B A,
    ...) of one batch each, so that drift of the machine (clocks, host
    contention: the same implementation measured 8.4 and 12.1 ms in two
    calls) falls on every implementation alike. Records kind="h2h" with
    each implementation's median batch time and the median of the
    per-round ratios against the first implementation."""
    import torch
    for point in self.points:
      if point.mode != "fwd":
        continue
      ids, mask, _ = self.inputs(point)
      dtype = self.torch_dtype(point)
      with contextlib.ExitStack() as stack:
        calls = self._h2h_models(impls, dtype, point.L, stack)
        fns = {i: (lambda m=m: m(input_ids=ids, attention_mask=mask
                                 ).last_hidden_state)
               for i, m in calls.items()}
        times = {i: [] for i in impls}
        with torch.no_grad():
          for fn in fns.values():  # warm-up and the batch size
            fn()
          self.sync()
          t = time.perf_counter()
          fns[impls[0]]()
          self.sync()
          n = max(1, min(50, int(self.target_fwd / 2 /
                                 max(time.perf_counter() - t, 1e-6))))
          for r in range(rounds):
            for impl in (impls if r % 2 == 0 else impls[::-1]):
              self.sync()
              t = time.perf_counter()
              for _ in range(n):
                fns[impl]()
              self.sync()
              times[impl].append((time.perf_counter() - t) / n * 1e3)
      base = impls[0]
      for impl in impls:
        ratios = [b / a for a, b in zip(times[base], times[impl])]
        rec = dict(kind="h2h", point=point.name, label=point.label,
                   impl=impl, B=point.B, L=point.L, ragged=point.ragged,
                   dtype=point.dtype, ms=statistics.median(times[impl]),
                   ms_rounds=[round(x, 3) for x in times[impl]],
                   calls_per_round=n, rounds=rounds,
                   timer="host clock around n calls + device sync, "
                         "implementations alternating per round",
                   time_vs_first=statistics.median(ratios), first=base)
        self.records.append(rec)
        print(f"  h2h {point.label:28s} {impl:20s} {rec['ms']:8.2f} ms "
              f"(rounds {min(times[impl]):.2f}-{max(times[impl]):.2f}); "
              f"time / {base}: {rec['time_vs_first']:.3f}", flush=True)
      self.write()

  # --- the points -------------------------------------------------------------
  def run_point(self, point: Point):
    print(f"== {point.label} (t={self.elapsed():.0f}s)", flush=True)
    for impl in self.impls:
      if point.mode == "train" and impl == "flashdeberta":
        continue  # optional, at the end
      if point.mode != "train" and impl in TRAIN_ONLY:
        continue
      if point.mode == "train" and impl not in self.train_impls:
        continue
      rec = self.measure(point, impl)
      self.records.append(rec)
      self._finish_point(point)
      _print(rec)
      self.write()

  def _finish_point(self, point: Point):
    by = {r["impl"]: r for r in self.records
          if r.get("kind") == "model" and r["point"] == point.name}
    add_ratios(by)

  def run(self) -> dict:
    h2h = os.environ.get("FOLDAX_DEBERTA_H2H", "")
    if h2h:  # only the head-to-head rounds
      self.head_to_head(tuple(i.strip() for i in h2h.split(",") if i.strip()))
      self.write(final=True)
      return dict(status="ok", metadata=self.md, records=self.records)
    for p in self.points:
      self.run_point(p)
    # Optional extras, only with time to spare.
    for p in self.points:
      if p.mode == "train" and "flashdeberta" in self.train_impls:
        print(f"== optional: flashdeberta {p.label}", flush=True)
        rec = self.measure(p, "flashdeberta")
        if rec["error"] and rec["error"].startswith("skipped"):
          rec["error"] = ("skipped: optional (flashdeberta training is not "
                          "in the acceptance criteria) and " + rec["error"]
                          [len("skipped: "):])
        self.records.append(rec)
        self._finish_point(p)
        _print(rec)
        self.write()
    self.kernel_level()
    self.write(final=True)
    return dict(status="ok", metadata=self.md, records=self.records)

  # --- kernel-level records (the former minimal suite) -----------------------
  def kernel_level(self):
    """jax_api.deberta.disentangled_attention: Pallas kernel against its own
    XLA path, forward and forward+backward (one DeBERTa-v3-base layer's
    attention on a GPU), when the budget leaves time."""
    try:
      from jax_api.deberta import disentangled_attention
      from pallas_kernels.deberta.layout import geometry
    except Exception as e:  # noqa: BLE001
      self.md["kernel_level"] = f"not available: {_err(e)}"
      return
    import jax
    import jax.numpy as jnp
    if self.smoke:
      shapes = [(1, 2, 64, 32)]
      pb, mrp, dt, ours_be = 32, 64, jnp.float32, "interpret"
      if self.jax_gpu:
        ours_be = "pallas"
      target = 0.01
    else:
      shapes = [(8, 12, 512, 64)]
      pb, mrp, dt, ours_be = 256, 512, jnp.bfloat16, "pallas"
      target = 0.15
    span = geometry(pb, mrp).span
    dtname = "bf16" if dt == jnp.bfloat16 else "fp32"
    self.md["kernel_level"] = dict(
        position_buckets=pb, max_relative_positions=mrp,
        pos_att_type="c2p|p2c",
        fwd_bwd="forward + vjp wrt q, k, v, pos_key, pos_query",
        note="kind='kernel' records: the attention op alone")
    for (B, H, S, Dh) in shapes:
      ks = jax.random.split(jax.random.key(0), 6)
      q, k, v, do = (jax.random.normal(kk, (B, S, H, Dh), dt)
                     for kk in ks[:4])
      pk = jax.random.normal(ks[4], (2 * span, H, Dh), dt)
      pq = jax.random.normal(ks[5], (2 * span, H, Dh), dt)
      for impl, be in (("ours", ours_be), ("ours_xla", "xla")):
        if impl == "ours" and be == "interpret":
          for mode in ("fwd", "fwd+bwd"):
            self.records.append(dict(
                kind="kernel", impl=impl, B=B, Hq=H, Hkv=H, S=S, D=Dh,
                causal=False, dtype=dtname, mode=mode, ms=None, tflops=None,
                error="skipped: smoke run (the Pallas kernel in interpret "
                      "mode compiles for ~15 s on a CPU; "
                      "tests/test_deberta_kernel.py covers it)"))
          continue
        def attn(q, k, v, pk, pq, be=be):
          return disentangled_attention(q, k, v, pk, pq, position_buckets=pb,
                                        max_relative_positions=mrp,
                                        backend=be)

        def fwdbwd(q, k, v, pk, pq, do, attn=attn):
          return jax.vjp(attn, q, k, v, pk, pq)[1](do)
        for mode, fn, a in (("fwd", attn, (q, k, v, pk, pq)),
                            ("fwd+bwd", fwdbwd, (q, k, v, pk, pq, do))):
          rec = dict(kind="kernel", impl=impl, B=B, Hq=H, Hkv=H, S=S, D=Dh,
                     causal=False, dtype=dtname, mode=mode, ms=None,
                     tflops=None, error=None, notes=[f"backend={be!r}"])
          skip = self._skip(5.0 if self.smoke else 8.0)
          if self.smoke and mode == "fwd+bwd":
            skip = "skipped: smoke run (the forward shows the harness works)"
          if skip:
            rec["error"] = skip
          else:
            t0 = time.time()
            try:
              compiled, _, csec = T.jax_compile(fn, a)
              rec["compile_s"] = round(csec, 2)
              rec.update(T.time_jax(compiled, [a], target_s=target,
                                    n_batches=5))
              rec.update(T.jax_memory_analysis(compiled))
              if mode == "fwd+bwd":
                rec["bitwise_repeatable"] = T.bitwise_repeatable(compiled, a,
                                                                 n=3)
            except Exception as e:  # noqa: BLE001
              rec["error"] = _err(e)
            rec["wall_s"] = round(time.time() - t0, 2)
          self.records.append(rec)
          print(f"  kernel {impl:9s} {mode:8s} B{B} H{H} S{S} D{Dh}: "
                + (f"{rec['ms']:.3f} ms" if rec.get("ms") else
                   str(rec["error"])), flush=True)
          self.write()


def _jax_mem() -> dict | None:
  s = T.jax_device_memory_stats()
  if not s or "bytes_in_use" not in s:
    return None
  return dict(bytes_in_use=int(s["bytes_in_use"]),
              peak_bytes_in_use=int(s.get("peak_bytes_in_use",
                                          s["bytes_in_use"])))


def _print(rec: dict):
  head = f"  {rec['impl']:19s} {rec['label']:32s}: "
  if rec.get("ms") is None:
    print(head + str(rec.get("error")), flush=True)
    return
  s = f"{rec['ms']:8.2f} ms"
  if rec.get("speedup_vs_hf_eager"):
    s += f"  {rec['speedup_vs_hf_eager']:.2f}x HF"
  if rec.get("speedup_vs_disentangled_flash"):
    s += f"  {rec['speedup_vs_disentangled_flash']:.2f}x DF"
  if rec.get("peak_mem_bytes"):
    s += f"  peak {rec['peak_mem_bytes'] / 2**30:.2f} GiB"
  for k in ("compile_s", "first_call_s"):
    if rec.get(k) is not None:
      s += f"  {k}={rec[k]}"
  print(head + s, flush=True)


def jax_train_step(model):
  """step(params, input_ids, mask, dropout_key) -> (params, loss): the JAX
  model's training step (mean-square of the last hidden state, dropout on,
  SGD update), as timed for fold_jax."""
  import jax
  import jax.numpy as jnp

  def loss_fn(p, i, m, k):
    h = model.apply({"params": p}, i, m, deterministic=False,
                    rngs={"dropout": k})
    return jnp.mean(jnp.square(h.astype(jnp.float32)))

  def step(p, i, m, k):
    loss, g = jax.value_and_grad(loss_fn)(p, i, m, k)
    p = jax.tree.map(lambda a, b: (a - SGD_LR * b).astype(a.dtype), p, g)
    return p, loss
  return step


# ----------------------------------------------------------------------------
# Ratios and targets (pure functions of the records; plot.py reuses them)
# ----------------------------------------------------------------------------
def _ok(r: dict | None) -> bool:
  return bool(r) and r.get("ms") is not None


def add_ratios(by_impl: dict[str, dict]):
  """speedup_vs_hf_eager, speedup_vs_disentangled_flash (time ratios, > 1:
  faster) and mem_vs_disentangled_flash on the records of one point."""
  for ref, key in (("hf_eager", "speedup_vs_hf_eager"),
                   ("disentangled_flash", "speedup_vs_disentangled_flash")):
    base = by_impl.get(ref)
    for impl, r in by_impl.items():
      if impl != ref and _ok(r) and _ok(base):
        r[key] = base["ms"] / r["ms"]
  df = by_impl.get("disentangled_flash")
  for impl, r in by_impl.items():
    if (impl != "disentangled_flash" and r.get("peak_mem_bytes")
        and df and df.get("peak_mem_bytes")):
      r["mem_vs_disentangled_flash"] = r["peak_mem_bytes"] / df[
          "peak_mem_bytes"]


TARGETS_DEFINITION = {
    "deberta_issue": (
        "for the implementation named (fold_jax: the JAX model; "
        "fold_jax_ffn / fold_jax_remat: the same with remat='ffn' / "
        "remat=True, timed at training points only (their forward checks "
        "are fold_jax's: the same inference forward); "
        "fold_torch: "
        "the HF model through torch_bridge): forward >= 3x hf_eager at B4 "
        "L2048; forward at least as fast as disentangled_flash at every "
        "forward point; training step >= 1.5x hf_eager at every training "
        "point with peak memory <= disentangled_flash's"),
    "bridge_issue": (
        "fold_torch at least as fast as disentangled_flash at the points "
        "of shared/anchors/README.md (forward B16 L512 dense and ragged, "
        "B1 L2048, B4 L2048; training step B8 L512, B2 L2048)"),
}


def _check(rec_ours, rec_ref, what: str, need: float | None = None,
           mem: bool = False) -> dict:
  if not _ok(rec_ours) or not _ok(rec_ref):
    missing = [n for n, r in (("ours", rec_ours), ("reference", rec_ref))
               if not _ok(r)]
    why = "; ".join(f"{n}: {(r or {}).get('error') or 'not measured'}"
                    for n, r in (("ours", rec_ours), ("reference", rec_ref))
                    if not _ok(r))
    return dict(met=None, what=what, note=f"not measured ({why})"[:300],
                missing=missing)
  if mem:
    a, b = rec_ours.get("peak_mem_bytes"), rec_ref.get("peak_mem_bytes")
    if not a or not b:
      return dict(met=None, what=what, note="peak memory not measured")
    return dict(met=bool(a <= b), what=what, value_gib=round(a / 2**30, 3),
                reference_gib=round(b / 2**30, 3), ratio=round(a / b, 3))
  ratio = rec_ref["ms"] / rec_ours["ms"]
  return dict(met=bool(ratio >= need), what=what, speedup=round(ratio, 3),
              threshold=need, ms=round(rec_ours["ms"], 3),
              reference_ms=round(rec_ref["ms"], 3))


def evaluate_targets(records: list[dict]) -> dict:
  by: dict[str, dict[str, dict]] = {}
  for r in records:
    if r.get("kind") == "model":
      by.setdefault(r["point"], {})[r["impl"]] = r
  out: dict[str, Any] = {"deberta_issue": {}, "bridge_issue": {}}

  def get(point, impl):
    return by.get(point, {}).get(impl)

  fwd_points = [p for p in by if by[p] and next(iter(by[p].values()))
                ["mode"] == "fwd"]
  train_points = [p for p in by if p not in fwd_points]
  for ours in OURS:
    checks = {}
    # A training-only variant's forward is fold_jax's: remat changes only
    # what the backward recomputes, the inference forward is the same model.
    fwd_impl, tag = ((("fold_jax", " (fold_jax's forward)")
                      if ours in TRAIN_ONLY else (ours, "")))
    if "fwd-b4-l2048" in by:
      checks["fwd-b4-l2048 >= 3x hf_eager" + tag] = _check(
          get("fwd-b4-l2048", fwd_impl), get("fwd-b4-l2048", "hf_eager"),
          "forward vs hf_eager", 3.0)
    for p in fwd_points:
      checks[f"{p} >= disentangled_flash" + tag] = _check(
          get(p, fwd_impl), get(p, "disentangled_flash"),
          "forward vs disentangled_flash", 1.0)
    for p in train_points:
      checks[f"{p} >= 1.5x hf_eager"] = _check(
          get(p, ours), get(p, "hf_eager"), "train step vs hf_eager", 1.5)
      checks[f"{p} peak memory <= disentangled_flash"] = _check(
          get(p, ours), get(p, "disentangled_flash"),
          "train step peak memory vs disentangled_flash", mem=True)
    out["deberta_issue"][ours] = _summarise(checks)
  checks = {}
  for p in BRIDGE_POINTS:
    if p in by:
      checks[f"{p} >= disentangled_flash"] = _check(
          get(p, "fold_torch"), get(p, "disentangled_flash"),
          "fold_torch vs disentangled_flash", 1.0)
  out["bridge_issue"]["fold_torch"] = _summarise(checks)
  return out


def _summarise(checks: dict) -> dict:
  vals = [c["met"] for c in checks.values()]
  if not vals:
    met = None
  elif all(v is True for v in vals):
    met = True
  elif any(v is False for v in vals):
    met = False
  else:
    met = None  # nothing failed, something not measured
  return dict(met=met, checks=checks)


# ----------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------
def run(args, argv: list[str]) -> dict:
  """`benchmarks.run --child deberta` and `python -m benchmarks.deberta`."""
  for a, default in (("budget_s", None), ("smoke_cpu", False),
                     ("quick", False), ("smoke", False), ("points", None),
                     ("impls", None)):
    if not hasattr(args, a):
      setattr(args, a, default)
  try:
    import jax  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from jax_api.deberta import from_hf  # noqa: F401
  except Exception as e:  # noqa: BLE001
    return dict(status="not available", records=[],
                note=f"torch, transformers or jax_api.deberta: {_err(e)}")
  suite = Suite(args, argv)
  return suite.run()


def build_parser():
  ap = argparse.ArgumentParser(prog="python -m benchmarks.deberta",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--output", "-o", default="deberta.json")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny configuration (default without a GPU)")
  ap.add_argument("--smoke-cpu", action="store_true",
                  help=argparse.SUPPRESS)
  ap.add_argument("--quick", action="store_true",
                  help="fewer repetitions (the device run's setting)")
  ap.add_argument("--points", default=None,
                  help="comma-separated point names (default all; env "
                       "FOLDAX_DEBERTA_POINTS), e.g. train-b2-l2048,"
                       "fwd-b1-l8192")
  ap.add_argument("--impls", default=None,
                  help=f"comma-separated subset of {','.join(IMPLS)} (env "
                       "FOLDAX_DEBERTA_IMPLS)")
  ap.add_argument("--train-impls", default=None,
                  help="of those, the ones timed at training points (default "
                       "all; env FOLDAX_DEBERTA_TRAIN_IMPLS), e.g. "
                       "fold_jax_ffn,disentangled_flash,hf_eager")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="stop starting measurements after this many seconds "
                       "(default 140 with --quick on a GPU, 420 without)")
  return ap


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  t0 = time.time()
  try:
    doc = run(args, argv)
  except Exception as e:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    doc = dict(status="error", note=_err(e), records=[])
  doc.setdefault("metadata", {})["elapsed_s"] = round(time.time() - t0, 1)
  D.write_json(args.output, doc)
  print_summary(doc)
  return 0


def print_summary(doc: dict):
  tg = (doc.get("metadata") or {}).get("targets") or {}
  for issue, per in tg.items():
    for impl, s in per.items():
      print(f"[deberta] target {issue} / {impl}: met={s['met']}")
      for name, c in s["checks"].items():
        v = c.get("speedup", c.get("ratio"))
        print(f"    {name}: met={c['met']}"
              + (f" ({v})" if v is not None else f" ({c.get('note', '')})"))


if __name__ == "__main__":
  sys.exit(main())
