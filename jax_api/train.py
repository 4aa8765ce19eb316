"""`python -m jax_api.train`: a tiny decoder LM on foldax attention, end to end.

  1. trains a character-level decoder LM (`TinyLM`: `DecoderAttention` blocks
     with GQA and RoPE) with a `jax.jit`-compiled step (optax AdamW) on the
     text the package generates (`jax_api._corpus`), with a progress bar
     showing loss and tokens/s;
  2. generates a short sample through the paged KV cache (`FoldKVCache`:
     prefill the prompt, then one token per step, all in one jit);
  3. re-runs a few training steps twice from the same initialisation and
     checks that every gradient and the final parameters are bitwise
     identical, printing the verdict (exit status 1 if not).

Determinism on GPU: the attention kernels' backward is deterministic by
construction, and so is the rest of TinyLM: its token embedding is a one-hot
matmul and its loss a one-hot cross-entropy, so no gradient is a scatter-add
(XLA lowers a scatter-add with repeated indices to float atomics on GPU, and
the order of atomic additions varies run to run). On top of that, `main()`
appends `--xla_gpu_deterministic_ops=true` to XLA_FLAGS before JAX
initialises its backend (XLA reads the variable once, then), unless
XLA_FLAGS already sets it or `--no-xla-deterministic` is given; the output
says whether it was on. Under the flag any remaining scatter is made
deterministic, GEMMs run with deterministic settings and without timing-based
autotuning of GEMM fusions (so the compiled program does not vary between
processes; it can cost some speed), and cuDNN's attention backward uses its
deterministic algorithm. `--compare` measures under the flag, then times
fold and cuDNN without it in a child process (XLA flags are per process),
where it also re-checks fold's determinism.

    python -m jax_api.train                       # CPU: ~1 minute
    python -m jax_api.train --steps 500 --size medium
    python -m jax_api.train --backend interpret --size tiny --steps 20
    python -m jax_api.train --compare             # tokens/s: fold vs jax.nn

Defaults: `--size auto` is "small" on CPU and "large" on an NVIDIA GPU;
`--backend auto` is the XLA path on CPU and the Pallas (Triton) kernels on a
GPU of compute capability 8.0+ (bfloat16 compute there, float32 on CPU).
`--compare` then times the same model with `jax.nn.dot_product_attention`
(XLA, and cuDNN on a GPU) in place of foldax attention.
"""


from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from typing import Sequence

import jax
import numpy as np

from jax_api._backend import _gpu_capability, resolve_backend
from jax_api._corpus import CharTokenizer, corpus_text
from jax_api._lm import (SIZES, LMConfig, OneHotEmbed, TinyLM,  # noqa: F401
                         _MODEL_KEYS, cross_entropy, init_caches)
from jax_api._lm_compare import (_TIMES_TAG, _compare_without_det,
                                 compare_attention)
from jax_api._lm_training import (_setup, batches,  # noqa: F401 (tests)
                                  check_determinism, generate, init_params,
                                  make_train_step, train)
from jax_api._xla_flags import (_without_det_flags,  # noqa: F401
                                enable_xla_deterministic_ops)


__all__ = ["LMConfig", "SIZES", "TinyLM", "init_caches", "make_train_step",
           "batches", "train", "generate", "check_determinism",
           "compare_attention", "init_params", "enable_xla_deterministic_ops",
           "OneHotEmbed", "cross_entropy", "main"]



# --------------------------------------------------------------------- main --


def _parse(argv):
  p = argparse.ArgumentParser(
      prog="python -m jax_api.train",
      description="Train a tiny decoder LM on foldax attention, sample from "
      "it through the KV cache, and check bitwise-deterministic training.")
  p.add_argument("--size", default="auto", choices=["auto", *SIZES],
                 help="model/run preset (auto: small on CPU, large on GPU)")
  p.add_argument("--steps", type=int, default=None)
  p.add_argument("--backend", default="auto",
                 choices=["auto", "pallas", "interpret", "xla"])
  p.add_argument("--seq-len", type=int, default=None)
  p.add_argument("--batch", type=int, default=None)
  p.add_argument("--lr", type=float, default=None)
  p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="compute dtype (default: bfloat16 on GPU, else float32)")
  p.add_argument("--window", type=int, default=None,
                 help="sliding window (keys i-w..i)")
  p.add_argument("--sinks", action="store_true", help="learned sinks")
  p.add_argument("--softcap", type=float, default=0.0)
  p.add_argument("--gen-tokens", type=int, default=None,
                 help="tokens to sample (default: fill the training "
                 "context, at most 200)")
  p.add_argument("--temperature", type=float, default=0.5,
                 help="sampling temperature (0: greedy)")
  p.add_argument("--det-steps", type=int, default=3,
                 help="steps of the determinism re-run (0 skips it)")
  p.add_argument("--compare", action="store_true",
                 help="also time foldax vs jax.nn.dot_product_attention")
  p.add_argument("--xla-deterministic", action=argparse.BooleanOptionalAction,
                 default=True,
                 help="add --xla_gpu_deterministic_ops=true to XLA_FLAGS "
                 "before JAX initialises (default: on; an explicit setting "
                 "in XLA_FLAGS wins)")
  p.add_argument("--time-impls", default=None, help=argparse.SUPPRESS)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--context-parallel", type=int, default=None, metavar="N",
                 help="shard the sequence over N devices (N virtual CPU "
                 "devices on CPU): jax_api.sharding.train_cp")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  if args.context_parallel:  # before JAX starts: it may add CPU devices
    from jax_api.sharding import train_cp
    return train_cp.main(args, sys.modules[__name__])
  # Before anything initialises the JAX backend (jax.devices() below).
  xla_det = enable_xla_deterministic_ops(args.xla_deterministic)
  t0 = time.perf_counter()
  on_gpu = _gpu_capability() is not None
  size = args.size if args.size != "auto" else ("large" if on_gpu else "small")
  preset = SIZES[size]
  steps = args.steps if args.steps is not None else preset["steps"]
  seq_len = args.seq_len or preset["seq_len"]
  batch = args.batch or preset["batch"]
  lr = args.lr or preset["lr"]
  backend = resolve_backend(args.backend, kernel="jax_api.train")
  dtype = args.dtype or ("bfloat16" if backend == "pallas" else "float32")
  text = corpus_text()
  tok = CharTokenizer(text)
  data = tok.encode(text)
  cfg = LMConfig(vocab_size=tok.vocab_size,
                 **{k: preset[k] for k in _MODEL_KEYS},
                 sliding_window=args.window, use_sinks=args.sinks,
                 softcap=args.softcap, dtype=dtype, backend=backend)
  if args.time_impls:  # the child of --compare (see _compare_without_det)
    impls = args.time_impls.split(",")
    rows = compare_attention(cfg, data, seq_len=seq_len, batch=batch, lr=lr,
                             impls=impls, total_steps=steps,
                             stream=sys.stderr)
    det = None
    if "fold" in impls and args.det_steps > 0:  # reuses the timed step
      det = check_determinism(
          dataclasses.replace(cfg, use_sinks=False, softcap=0.0,
                              sliding_window=None),
          data, steps=args.det_steps, seq_len=seq_len, batch=batch, lr=lr,
          seed=args.seed, total_steps=steps)
    print(_TIMES_TAG + json.dumps({"rows": rows, "fold_determinism": det}),
          flush=True)
    return 0
  dev = jax.devices()[0]
  print(f"foldax train: {dev.platform} ({dev.device_kind}), backend "
        f"{backend}, size {size} (d_model {cfg.d_model}, {cfg.num_layers} "
        f"layers, {cfg.num_heads} heads / {cfg.num_kv_heads} kv heads), "
        f"{dtype}, seq_len {seq_len}, batch {batch}, {steps} steps, corpus "
        f"{len(text):,} chars (vocab {tok.vocab_size})", flush=True)
  print(f"XLA deterministic ops: {xla_det.detail}"
        + ("" if on_gpu else "; no effect on CPU"), flush=True)
  res = train(cfg, data, steps=steps, seq_len=seq_len, batch=batch, lr=lr,
              seed=args.seed)
  n_params = sum(x.size for x in jax.tree.leaves(res.params))
  w = max(1, min(10, len(res.losses) // 4))
  first = float(np.mean(res.losses[:w]))
  last = float(np.mean(res.losses[-w:]))
  print(f"trained {n_params:,} params: loss {first:.3f} -> {last:.3f} "
        f"(uniform: {math.log(tok.vocab_size):.3f}); {res.tokens_per_s:,.0f} "
        f"tokens/s after a {res.compile_s:.1f} s first step (compile)",
        flush=True)

  prompt_text = "FABLE 7: "
  prompt = tok.encode(prompt_text)[None]
  n_gen = args.gen_tokens
  if n_gen is None:  # RoPE positions past seq_len were never trained
    n_gen = max(1, min(200, seq_len - prompt.shape[1]))
  tg = time.perf_counter()
  sample = generate(cfg, res.params, prompt, n_gen, seed=args.seed,
                    temperature=args.temperature)
  print(f"sample ({n_gen} tokens through the KV cache, "
        f"{time.perf_counter() - tg:.1f} s incl. compile):")
  print("  " + (prompt_text + tok.decode(sample[0])).replace("\n", "\n  "),
        flush=True)

  ok = True
  if args.det_steps > 0:
    ok, detail = check_determinism(cfg, data, steps=args.det_steps,
                                   seq_len=seq_len, batch=batch, lr=lr,
                                   seed=args.seed, total_steps=steps)
    print(f"determinism: {'PASS' if ok else 'FAIL'}: {detail}"
          + ("" if xla_det.on or not on_gpu else
             " (XLA deterministic ops were off)"), flush=True)
  if args.compare:
    state = "on" if xla_det.on else "off"
    cudnn = ""
    if on_gpu:
      cudnn = ("; cuDNN's backward runs its deterministic algorithm" if
               xla_det.on else "; cuDNN's default backward")
    print(f"attention comparison (training tokens/s, seq_len {seq_len}, "
          f"batch {batch}; XLA deterministic ops {state}{cudnn}):",
          flush=True)
    compare_attention(cfg, data, seq_len=seq_len, batch=batch, lr=lr,
                      total_steps=steps)
    if on_gpu and xla_det.on:
      print("  without XLA deterministic ops (a separate process: XLA flags "
            "are per process):", flush=True)
      _compare_without_det(["fold", "jax:cudnn"], size, steps,
                           seq_len, batch, lr, dtype, backend,
                           det_steps=max(0, min(args.det_steps, 2)),
                           seed=args.seed)
  print(f"total {time.perf_counter() - t0:.1f} s", flush=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
