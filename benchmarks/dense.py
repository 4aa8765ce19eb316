"""Dense attention benchmark: ours against every incumbent, in one process.

    python -m benchmarks.dense --output results.json [--quick] [--impls a,b]
        [--shapes b2-h16-kv16-s8192-d128-causal ...] [--seqs 1024,8192]
        [--head-dims 128] [--causal true|false|both] [--gqa 1,8]
        [--modes fwd,fwd+bwd] [--budget-s 400] [--target-s 0.15]
    python -m benchmarks.dense --deterministic-cudnn --output det.json [...]
        (run as its own process: it sets XLA_FLAGS=--xla_gpu_deterministic_ops=true
        before JAX starts, and times only cuDNN forward+backward)
    python -m benchmarks.dense --merge a.json b.json --output a.json
    python -m benchmarks.dense --table results.json       (re-print the tables)
    python -m benchmarks.dense --smoke --output smoke.json (CPU, seconds)
    python -m benchmarks.dense --list-impls

Every implementation is timed for the forward and for forward+backward
(gradients with respect to q, k and v for a random output cotangent) on the
same shapes, with the helpers of `benchmarks._timing` (see there how time,
memory and FLOPs are counted). Each (implementation, shape, mode) is guarded:
a failure becomes an `error` string in its record and the run goes on. The
JSON file is rewritten after every shape, so a run killed by a timeout still
leaves every finished measurement behind.

Implementations (exact calls; JAX layout [B, S, H, D], torch [B, H, S, D]):
  ours             jax_api.fold_attn_func(q, k, v, causal=c, backend="pallas")
  jax_cudnn        jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")
  jax_xla          jax.nn.dot_product_attention(..., implementation="xla")   (S <= 4096)
  pallas_mha       jax.experimental.pallas.ops.gpu.attention.mha(q, k, v, segment_ids=None,
                     sm_scale=1/sqrt(D), causal=c)   (default blocks; no GQA: k/v repeated)
  pallas_mha_tuned same with BlockSizes(128, 64, 128, 128, 128, 128)  (not in the default set)
  tokamax          tokamax.dot_product_attention(q, k, v, is_causal=c)
  tokamax_triton   tokamax.dot_product_attention(..., implementation="triton")
  torch_flash      F.scaled_dot_product_attention(q, k, v, is_causal=c, enable_gqa=G>1)
                     inside torch.nn.attention.sdpa_kernel([SDPBackend.FLASH_ATTENTION])
  torch_cudnn      same, SDPBackend.CUDNN_ATTENTION
  torch_flash_det  torch_flash with torch.use_deterministic_algorithms(True) (fwd+bwd only)
  fastflash        fastflash_attention.fast_attention(q, k, v, is_causal=c) (no GQA: repeated)
  jax_cudnn_det    jax_cudnn under XLA_FLAGS=--xla_gpu_deterministic_ops=true
                     (fwd+bwd only; only with --deterministic-cudnn)
When an implementation lacks GQA, k and v are repeated *inside* the timed
function (what a user would have to do), and the record says so in `notes`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import math
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks import _timing as T

REPO = Path(__file__).resolve().parents[1]
XPROF_STUB = Path(__file__).resolve().parent / "xprof_stub"
DET_FLAG = "--xla_gpu_deterministic_ops=true"

MODES = ("fwd", "fwd+bwd")
JAX_IMPLS = ("ours", "jax_cudnn", "jax_xla", "pallas_mha", "pallas_mha_tuned",
             "tokamax", "tokamax_triton", "jax_cudnn_det")
TORCH_IMPLS = ("torch_cudnn", "torch_flash", "torch_flash_det", "fastflash")
ALL_IMPLS = JAX_IMPLS + TORCH_IMPLS
DEFAULT_IMPLS = ("ours", "jax_cudnn", "jax_xla", "pallas_mha", "tokamax",
                 "tokamax_triton", "torch_cudnn", "torch_flash",
                 "torch_flash_det", "fastflash")
SMOKE_IMPLS = ("ours", "jax_xla", "pallas_mha")
FWDBWD_ONLY = ("torch_flash_det", "jax_cudnn_det")
SHORT = {"ours": "ours", "jax_cudnn": "cudnn", "jax_xla": "xla",
         "pallas_mha": "pl_mha", "pallas_mha_tuned": "pl_mha_t",
         "tokamax": "tkx", "tokamax_triton": "tkx_tri",
         "jax_cudnn_det": "cudnn_det", "torch_cudnn": "t_cudnn",
         "torch_flash": "t_flash", "torch_flash_det": "t_fl_det",
         "fastflash": "ffa"}


# ----------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
  B: int
  Hq: int
  Hkv: int
  S: int
  D: int
  causal: bool
  dtype: str = "bf16"

  @property
  def groups(self) -> int:
    return self.Hq // self.Hkv

  def label(self) -> str:
    return (f"B{self.B} H{self.Hq}/{self.Hkv} S{self.S} D{self.D} "
            f"{'causal' if self.causal else 'full'} {self.dtype}")

  def short(self) -> str:
    return (f"{'C' if self.causal else 'N'} D{self.D} S{self.S:<5d} B{self.B:<2d}"
            f" g{self.groups}")

  def fields(self) -> dict:
    return dict(B=self.B, Hq=self.Hq, Hkv=self.Hkv, S=self.S, D=self.D,
                causal=self.causal, dtype=self.dtype)


QUICK_SHAPES = (Shape(2, 16, 16, 8192, 128, True),
                Shape(4, 16, 16, 4096, 64, False))
SMOKE_SHAPES = (Shape(1, 4, 2, 128, 32, True),)


def default_grid(seqs=(1024, 2048, 4096, 8192, 16384), head_dims=(64, 128),
                 causals=(True, False), gqas=(1, 8), tokens=16384, hq=16,
                 dtype="bf16") -> list[Shape]:
  """batch*seq = tokens; ordered by priority (anchor shapes first) so that a
  run cut short by its time budget has the most informative points."""
  out = [s for s in QUICK_SHAPES
         if s.S in seqs and s.D in head_dims and s.causal in causals
         and s.groups in gqas and s.dtype == dtype]
  s_order = [s for s in (8192, 4096, 16384, 2048, 1024) if s in seqs]
  s_order += [s for s in seqs if s not in s_order]
  for g in sorted(gqas):
    for S in s_order:
      for D in sorted(head_dims, reverse=True):
        for c in sorted(causals, reverse=True):
          sh = Shape(max(1, tokens // S), hq, hq // g, S, D, c, dtype)
          if sh not in out:
            out.append(sh)
  return out


def parse_shape(spec: str, dtype: str = "bf16") -> Shape:
  """'b2-h16-kv2-s8192-d128-causal[-bf16]' (also 'g8' for Hkv = H/8, 'full')."""
  vals: dict[str, Any] = dict(causal=False, dtype=dtype)
  g = None
  for tok in re.split(r"[-_:,\s]+", spec.strip().lower()):
    if not tok:
      continue
    if tok in ("causal", "c"):
      vals["causal"] = True
    elif tok in ("full", "nc", "noncausal", "non-causal"):
      vals["causal"] = False
    elif tok in ("bf16", "fp16", "f16", "bfloat16", "float16"):
      vals["dtype"] = "fp16" if "16" in tok and "b" not in tok else "bf16"
    else:
      m = re.fullmatch(r"(b|hq|h|hkv|kv|s|d|g)(\d+)", tok)
      if not m:
        raise ValueError(f"bad token {tok!r} in shape {spec!r}")
      key, v = m.group(1), int(m.group(2))
      if key == "g":
        g = v
      else:
        vals[{"b": "B", "h": "Hq", "hq": "Hq", "kv": "Hkv", "hkv": "Hkv",
              "s": "S", "d": "D"}[key]] = v
  for k in ("B", "Hq", "S", "D"):
    if k not in vals:
      raise ValueError(f"shape {spec!r} lacks {k}")
  if "Hkv" not in vals:
    vals["Hkv"] = vals["Hq"] // (g or 1)
  if vals["Hq"] % vals["Hkv"]:
    raise ValueError(f"Hq must be a multiple of Hkv in {spec!r}")
  return Shape(**vals)


# ----------------------------------------------------------------------------
# Records and helpers
# ----------------------------------------------------------------------------
def _err(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}"
  msg = re.sub(r"\s+", " ", msg)
  return msg[:800]


class Skip(Exception):
  """An implementation does not apply to this shape (not a failure)."""


def new_record(impl: str, shape: Shape, mode: str) -> dict:
  r = dict(impl=impl)
  r.update(shape.fields())
  r.update(mode=mode, ms=None, tflops=None, error=None)
  return r


def _custom_calls(lowered) -> list[str]:
  """Custom-call targets of a lowered JAX function: which kernel really ran
  (cuDNN fMHA, Triton via Pallas, Mosaic GPU, ...)."""
  try:
    txt = lowered.as_text()
  except Exception:
    return []
  names = set(re.findall(r"custom_call\s+@([\w$.\-]+)", txt))
  names |= set(re.findall(r'call_target_name\s*=\s*"([^"]+)"', txt))
  names |= set(re.findall(r'custom_call_target\s*=\s*"([^"]+)"', txt))
  return sorted(names)


def _pkg_version(name: str) -> str | None:
  try:
    return importlib.metadata.version(name)
  except Exception:
    return None


def _git_commit() -> str | None:
  for env in ("FOLDAX_GIT_COMMIT", "GIT_COMMIT"):
    if os.environ.get(env):
      return os.environ[env]
  try:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                       capture_output=True, text=True, timeout=10)
    if r.returncode == 0:
      c = r.stdout.strip()
      d = subprocess.run(["git", "status", "--porcelain", "--",
                          "pallas_kernels", "jax_api"], cwd=REPO,
                         capture_output=True, text=True, timeout=10)
      return c + ("+dirty" if d.stdout.strip() else "")
  except Exception:
    pass
  return None


def _source_hash() -> str:
  """sha256 over our kernel sources: ties results to code without .git."""
  h = hashlib.sha256()
  for pkg in ("pallas_kernels", "jax_api"):
    for p in sorted((REPO / pkg).rglob("*.py")):
      h.update(str(p.relative_to(REPO)).encode())
      h.update(p.read_bytes())
  return h.hexdigest()[:16]


def _nvidia_smi() -> dict:
  try:
    r = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,compute_cap,"
         "memory.total,clocks.max.sm", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=20)
    if r.returncode == 0 and r.stdout.strip():
      f = [x.strip() for x in r.stdout.strip().splitlines()[0].split(",")]
      keys = ["gpu_name", "driver", "compute_capability", "memory_total",
              "max_sm_clock"]
      return dict(zip(keys, f))
  except Exception:
    pass
  return {}


def metadata(argv: list[str], args) -> dict:
  md = dict(
      command=" ".join(["python3", "-m", "benchmarks.dense"] + argv),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      python=sys.version.split()[0],
      host=os.uname().nodename,
      git_commit=_git_commit(),
      source_sha256=_source_hash(),
      xla_flags=os.environ.get("XLA_FLAGS", ""),
      versions={p: _pkg_version(p) for p in (
          "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "torch",
          "triton", "tokamax", "fastflash-attention", "flax", "chex",
          "numpy")},
      conventions=dict(
          flops="4*B*Hq*S*S*D forward, /2 causal, x3.5 forward+backward",
          timing_jax=("AOT-compiled executable, batches of back-to-back calls "
                      "timed on the host with block_until_ready on the last; "
                      "median over batches; input sets rotated to exceed 2x L2"),
          timing_torch=("CUDA events around batches of back-to-back calls; "
                        "median over batches; input sets rotated"),
          fwd_bwd=("forward + gradients wrt q,k,v for a random cotangent "
                   "(jax.vjp / torch.autograd.grad); torch fwd under no_grad"),
          peak_mem_bytes=("bytes a call adds over its inputs: JAX from XLA "
                          "buffer assignment (temp+output), torch from "
                          "max_memory_allocated after a reset"),
          bitwise_repeatable="fwd+bwd run 5x on one input, gradients compared "
                             "bit for bit",
          ratio="ours/x = TFLOP/s of ours / TFLOP/s of x (>1: ours faster)"),
  )
  md.update(_nvidia_smi())
  return md


# ----------------------------------------------------------------------------
# JAX implementations
# ----------------------------------------------------------------------------
class Ctx:
  """Run-wide settings handed to the implementation factories."""

  def __init__(self, args, on_gpu: bool):
    self.on_gpu = on_gpu
    self.interpret = not on_gpu
    self.xla_max_seq = args.xla_max_seq
    self.ours_backend = args.ours_backend or ("pallas" if on_gpu else "interpret")
    self.ours_kwargs = json.loads(args.ours_kwargs) if args.ours_kwargs else {}
    self.target_s = args.target_s
    self.n_batches = args.n_batches
    self.determinism = not args.no_determinism
    self.deadline = time.time() + args.budget_s
    self.import_errors: dict[str, str] = {}

  def out_of_time(self) -> bool:
    return time.time() > self.deadline


def _import(ctx: Ctx, mod: str):
  if mod in ctx.import_errors:
    raise ImportError(ctx.import_errors[mod])
  try:
    return importlib.import_module(mod)
  except Exception as e:  # noqa: BLE001 - any import failure is recorded
    ctx.import_errors[mod] = f"import {mod} failed: {_err(e)}"
    raise ImportError(ctx.import_errors[mod]) from None


def _ensure_xprof_stub():
  """tokamax imports xprof.cli.tools at import time; the real xprof wheel is
  large, so fall back to our two-line stand-in when it is not installed."""
  try:
    importlib.import_module("xprof.cli.tools")
  except Exception:
    p = str(XPROF_STUB)
    if p not in sys.path:
      sys.path.append(p)
    for m in [m for m in sys.modules if m == "xprof" or m.startswith("xprof.")]:
      del sys.modules[m]


def make_jax_attn(name: str, shape: Shape, ctx: Ctx):
  """Returns (attn(q, k, v) -> out [B, S, Hq, D], notes)."""
  import jax
  import jax.numpy as jnp
  c, G, D = shape.causal, shape.groups, shape.D
  notes: list[str] = []

  def repeat_kv(attn):
    if G == 1:
      return attn
    notes.append(f"no GQA support: k/v repeated x{G} inside the timed function")

    def f(q, k, v):
      return attn(q, jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2))
    return f

  if name == "ours":
    mod = _import(ctx, "jax_api")
    fn = getattr(mod, "fold_attn_func", None)
    if fn is None:
      raise AttributeError("jax_api.fold_attn_func does not exist (yet)")
    kw = dict(ctx.ours_kwargs)
    kw.setdefault("backend", ctx.ours_backend)
    notes.append(f"fold_attn_func kwargs: {kw}")
    return (lambda q, k, v: fn(q, k, v, causal=c, **kw)), notes

  if name in ("jax_cudnn", "jax_cudnn_det", "jax_xla"):
    impl = "xla" if name == "jax_xla" else "cudnn"
    if name == "jax_xla" and shape.S > ctx.xla_max_seq:
      raise Skip(f"jax_xla only for S <= {ctx.xla_max_seq}")
    if impl == "cudnn" and not ctx.on_gpu:
      raise Skip("cuDNN needs a GPU")
    if name == "jax_cudnn_det" and DET_FLAG not in os.environ.get("XLA_FLAGS", ""):
      raise RuntimeError("jax_cudnn_det needs XLA_FLAGS=" + DET_FLAG +
                         " set before JAX starts (use --deterministic-cudnn)")
    return (lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=c, implementation=impl)), notes

  if name in ("pallas_mha", "pallas_mha_tuned"):
    pattn = _import(ctx, "jax.experimental.pallas.ops.gpu.attention")
    kw: dict[str, Any] = dict(segment_ids=None, sm_scale=1.0 / math.sqrt(D),
                              causal=c)
    if name == "pallas_mha_tuned":
      kw["block_sizes"] = pattn.BlockSizes(
          block_q=128, block_k=64, block_q_dkv=128, block_kv_dkv=128,
          block_q_dq=128, block_kv_dq=128)
      notes.append("BlockSizes(128,64,128,128,128,128), num_warps auto")
    if ctx.interpret:
      kw["interpret"] = True
      notes.append("interpret=True (no GPU)")
    return repeat_kv(lambda q, k, v: pattn.mha(q, k, v, **kw)), notes

  if name in ("tokamax", "tokamax_triton"):
    _ensure_xprof_stub()
    tkx = _import(ctx, "tokamax")
    kw = {} if name == "tokamax" else dict(implementation="triton")
    return (lambda q, k, v: tkx.dot_product_attention(
        q, k, v, is_causal=c, **kw)), notes

  raise ValueError(f"unknown JAX implementation {name!r}")


def jax_input_sets(shape: Shape, n_sets: int | None, seed: int = 0):
  import jax
  import jax.numpy as jnp
  dt = jnp.bfloat16 if shape.dtype == "bf16" else jnp.float16
  qs = (shape.B, shape.S, shape.Hq, shape.D)
  ks = (shape.B, shape.S, shape.Hkv, shape.D)
  per_set = 2 * (2 * math.prod(qs) + 2 * math.prod(ks))  # q, do, k, v
  n = n_sets or T.n_input_sets(per_set)
  sets = []
  key = jax.random.PRNGKey(seed)
  for _ in range(n):
    key, *kk = jax.random.split(key, 5)
    sets.append((jax.random.normal(kk[0], qs, dt),
                 jax.random.normal(kk[1], ks, dt),
                 jax.random.normal(kk[2], ks, dt),
                 jax.random.normal(kk[3], qs, dt)))
  jax.block_until_ready(sets)
  return sets


def _fwd_and_fwdbwd(attn):
  import jax

  def fwd(q, k, v):
    return attn(q, k, v)

  def fwdbwd(q, k, v, do):
    _, vjp = jax.vjp(attn, q, k, v)
    return vjp(do)
  return fwd, fwdbwd


def run_jax_impl(name: str, shape: Shape, modes, sets, ctx: Ctx,
                 records: list, keep: dict):
  """Times one JAX implementation on one shape, appending records."""
  try:
    attn, notes = make_jax_attn(name, shape, ctx)
    err = None
  except Skip as e:
    attn, notes, err = None, [], f"skipped: {e}"
  except Exception as e:  # noqa: BLE001
    attn, notes, err = None, [], _err(e)
  fwd, fwdbwd = _fwd_and_fwdbwd(attn) if attn else (None, None)
  for mode in modes:
    if mode == "fwd" and name in FWDBWD_ONLY:
      continue
    rec = new_record(name, shape, mode)
    records.append(rec)
    if notes:
      rec["notes"] = list(notes)
    if err or ctx.out_of_time():
      rec["error"] = err or "skipped: time budget exhausted"
      _print_rec(rec)
      continue
    t0 = time.time()
    try:
      f = fwd if mode == "fwd" else fwdbwd
      arg_sets = [s[:3] for s in sets] if mode == "fwd" else list(sets)
      compiled, lowered, csec = T.jax_compile(f, arg_sets[0])
      rec["compile_s"] = round(csec, 2)
      rec["kernels"] = _custom_calls(lowered)
      if ctx.on_gpu:  # exact only when this call sets a new process peak
        rec["peak_mem_runtime_bytes"] = T.jax_peak_delta(compiled, arg_sets[0])
      tm = T.time_jax(compiled, arg_sets, target_s=ctx.target_s,
                      n_batches=ctx.n_batches)
      rec.update(tm)
      rec["tflops"] = T.attention_flops(
          shape.B, shape.Hq, shape.S, shape.S, shape.D, shape.causal,
          mode) / (tm["ms"] * 1e-3) / 1e12
      rec.update(T.jax_memory_analysis(compiled))
      if mode == "fwd+bwd" and ctx.determinism:
        rec["bitwise_repeatable"] = T.bitwise_repeatable(compiled,
                                                         arg_sets[0], n=5)
      keep[(name, mode)] = compiled
    except Exception as e:  # noqa: BLE001
      rec["error"] = _err(e)
      traceback.print_exc(limit=2, file=sys.stderr)
    rec["wall_s"] = round(time.time() - t0, 2)
    _print_rec(rec)


def _rel_err(a, b):
  import jax.numpy as jnp
  a = a.astype(jnp.float32)
  b = b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run_checks(shape: Shape, sets, ctx: Ctx, keep: dict, records: list):
  """Relative error of ours vs cuDNN (vs XLA without a GPU), and of both vs a
  float32 XLA reference at highest precision where it fits in memory."""
  import jax
  import jax.numpy as jnp
  ref_name = "jax_cudnn" if ctx.on_gpu else "jax_xla"
  rec = new_record("ours", shape, "check")
  rec["reference"] = ref_name
  records.append(rec)
  if ("ours", "fwd") not in keep and ("ours", "fwd+bwd") not in keep:
    rec["error"] = "ours not available for this shape"
    return
  if ctx.out_of_time():
    rec["error"] = "skipped: time budget exhausted"
    return
  try:
    q, k, v, do = sets[0]
    for mode in ("fwd", "fwd+bwd"):
      if (ref_name, mode) not in keep and ("ours", mode) in keep:
        attn, _ = make_jax_attn(ref_name, shape, ctx)
        f = _fwd_and_fwdbwd(attn)[0 if mode == "fwd" else 1]
        keep[(ref_name, mode)] = T.jax_compile(f, sets[0][:3] if mode == "fwd"
                                               else sets[0])[0]
    outs = {}
    for who in ("ours", ref_name):
      o = {}
      if (who, "fwd") in keep:
        o["out"] = keep[(who, "fwd")](q, k, v)
      if (who, "fwd+bwd") in keep:
        o["dq"], o["dk"], o["dv"] = keep[(who, "fwd+bwd")](q, k, v, do)
      outs[who] = o
    for key, val in outs["ours"].items():
      if key in outs[ref_name]:
        rec[f"rel_err_{key}"] = _rel_err(val, outs[ref_name][key])
        rec[f"nonfinite_{key}"] = int(jnp.sum(~jnp.isfinite(
            val.astype(jnp.float32))))
    # float32 reference (materialises B*Hq*S*S scores): only where it fits.
    if shape.B * shape.Hq * shape.S * shape.S <= (1 << 30):
      c = shape.causal

      def ref32(q, k, v):
        return jax.nn.dot_product_attention(
            q.astype(jnp.float32), k.astype(jnp.float32),
            v.astype(jnp.float32), is_causal=c, implementation="xla")

      with jax.default_matmul_precision("highest"):
        f32 = {}
        f32["out"] = jax.jit(ref32)(q, k, v)
        f32["dq"], f32["dk"], f32["dv"] = jax.jit(
            lambda q, k, v, do: jax.vjp(ref32, q, k, v)[1](
                do.astype(jnp.float32)))(q, k, v, do)
      rec["vs_float32"] = {
          who: {key: _rel_err(val, f32[key]) for key, val in o.items()}
          for who, o in outs.items()}
    del outs
  except Exception as e:  # noqa: BLE001
    rec["error"] = _err(e)
    traceback.print_exc(limit=2, file=sys.stderr)
  errs = {k: v for k, v in rec.items() if k.startswith("rel_err")}
  print(f"  check ours vs {ref_name}: " +
        " ".join(f"{k[8:]}={v:.2e}" for k, v in errs.items()) +
        _f32_str(rec) +
        (f" ERROR {rec['error']}" if rec.get("error") else ""), flush=True)


def _f32_str(rec: dict) -> str:
  f32 = rec.get("vs_float32")
  if not f32:
    return ""
  return " | vs f32: " + "; ".join(
      f"{SHORT.get(w, w)} " + ",".join(f"{k}={v:.1e}" for k, v in d.items())
      for w, d in f32.items())


# ----------------------------------------------------------------------------
# torch implementations
# ----------------------------------------------------------------------------
def make_torch_attn(name: str, shape: Shape, ctx: Ctx):
  """Returns (attn(q,k,v) -> out [B,H,S,D], attn_repeat_or_None, context
  factory, notes)."""
  torch = _import(ctx, "torch")
  if not torch.cuda.is_available():
    raise Skip("torch sees no CUDA device")
  import torch.nn.functional as F
  c, G = shape.causal, shape.groups
  notes: list[str] = []

  def repeated(attn):
    def f(q, k, v):
      return attn(q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))
    return f

  if name in ("torch_flash", "torch_flash_det", "torch_cudnn"):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = (SDPBackend.CUDNN_ATTENTION if name == "torch_cudnn"
          else SDPBackend.FLASH_ATTENTION)
    det = name == "torch_flash_det"

    @contextlib.contextmanager
    def cm():
      prev = torch.are_deterministic_algorithms_enabled()
      with sdpa_kernel([be]):
        if det:
          torch.use_deterministic_algorithms(True)
        try:
          yield
        finally:
          torch.use_deterministic_algorithms(prev)

    def attn(q, k, v):
      return F.scaled_dot_product_attention(q, k, v, is_causal=c,
                                            enable_gqa=G > 1)

    def plain(q, k, v):
      return F.scaled_dot_product_attention(q, k, v, is_causal=c)
    return attn, (repeated(plain) if G > 1 else None), cm, notes

  if name == "fastflash":
    ffa = _import(ctx, "fastflash_attention")
    fa = ffa.fast_attention

    def attn(q, k, v):
      return fa(q, k, v, is_causal=c)
    if G > 1:
      notes.append(f"no GQA support: k/v repeat_interleave'd x{G} inside the "
                   "timed function")
      attn = repeated(attn)
    return attn, None, contextlib.nullcontext, notes

  raise ValueError(f"unknown torch implementation {name!r}")


def torch_input_sets(shape: Shape, n_sets: int | None, seed: int = 0):
  import torch
  dt = torch.bfloat16 if shape.dtype == "bf16" else torch.float16
  g = torch.Generator(device="cuda")
  g.manual_seed(seed)
  qs = (shape.B, shape.Hq, shape.S, shape.D)
  ks = (shape.B, shape.Hkv, shape.S, shape.D)
  per_set = 2 * (2 * math.prod(qs) + 2 * math.prod(ks))
  n = n_sets or T.n_input_sets(per_set)
  sets = []
  for _ in range(n):
    mk = lambda s: torch.randn(s, device="cuda", dtype=dt, generator=g)
    q, k, v, do = mk(qs), mk(ks), mk(ks), mk(qs)
    for t in (q, k, v):
      t.requires_grad_(True)
    sets.append((q, k, v, do))
  torch.cuda.synchronize()
  return sets


def run_torch_impl(name: str, shape: Shape, modes, sets, ctx: Ctx,
                   records: list, inputs_error: str | None = None):
  import torch
  try:
    attn, attn_rep, cm, notes = make_torch_attn(name, shape, ctx)
    err = inputs_error
  except Skip as e:
    attn, attn_rep, cm, notes, err = None, None, None, [], f"skipped: {e}"
  except Exception as e:  # noqa: BLE001
    attn, attn_rep, cm, notes, err = None, None, None, [], _err(e)

  def fns(a):
    def fwd(q, k, v, do):
      with torch.no_grad():
        return a(q, k, v)

    def fwdbwd(q, k, v, do):
      o = a(q, k, v)
      return torch.autograd.grad(o, (q, k, v), do)
    return fwd, fwdbwd

  for mode in modes:
    if mode == "fwd" and name in FWDBWD_ONLY:
      continue
    rec = new_record(name, shape, mode)
    records.append(rec)
    rec["notes"] = list(notes)
    if err or ctx.out_of_time():
      rec["error"] = err or "skipped: time budget exhausted"
      _print_rec(rec)
      continue
    t0 = time.time()
    candidates = [("native", attn)] + ([("repeat", attn_rep)] if attn_rep else [])
    for kind, a in candidates:
      try:
        f = fns(a)[0 if mode == "fwd" else 1]
        with cm():
          f(*sets[0])  # first call: compiles / autotunes / probes support
          torch.cuda.synchronize()
          tm = T.time_torch(f, sets, target_s=ctx.target_s,
                            n_batches=ctx.n_batches)
          rec.update(tm)
          rec["tflops"] = T.attention_flops(
              shape.B, shape.Hq, shape.S, shape.S, shape.D, shape.causal,
              mode) / (tm["ms"] * 1e-3) / 1e12
          rec.update(T.torch_peak_memory(f, sets[0]))
          if mode == "fwd+bwd" and ctx.determinism:
            rec["bitwise_repeatable"] = T.bitwise_repeatable(f, sets[0], n=5)
        rec["error"] = None
        if kind == "native" and shape.groups > 1 and attn_rep is not None:
          rec["notes"].append("GQA via enable_gqa=True")
        break
      except Exception as e:  # noqa: BLE001
        rec["error"] = _err(e)
        if kind == "native" and attn_rep is not None:
          rec["notes"].append(
              f"enable_gqa=True failed ({_err(e)[:200]}); k/v "
              f"repeat_interleave'd x{shape.groups} inside the timed function")
        else:
          traceback.print_exc(limit=2, file=sys.stderr)
    rec["wall_s"] = round(time.time() - t0, 2)
    _print_rec(rec)


# ----------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------
def _fmt_bytes(n) -> str:
  if n is None:
    return "-"
  for unit in ("B", "K", "M", "G"):
    if abs(n) < 1024:
      return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
    n /= 1024
  return f"{n:.1f}T"


def _print_rec(rec: dict):
  shp = f"B{rec['B']} H{rec['Hq']}/{rec['Hkv']} S{rec['S']} D{rec['D']} " \
        f"{'causal' if rec['causal'] else 'full'}"
  if rec.get("error") and rec.get("ms") is None:
    print(f"  {rec['impl']:16s} {rec['mode']:8s} {shp}: {rec['error'][:240]}",
          flush=True)
    return
  det = rec.get("bitwise_repeatable")
  print(f"  {rec['impl']:16s} {rec['mode']:8s} {shp}: {rec['ms']:9.3f} ms "
        f"{rec['tflops']:7.1f} TFLOP/s  mem {_fmt_bytes(rec.get('peak_mem_bytes'))}"
        + ("" if det is None else f"  repeatable={det}")
        + (f"  compile {rec['compile_s']}s" if "compile_s" in rec else ""),
        flush=True)


def write_json(path: str | None, doc: dict):
  if not path:
    return
  p = Path(path)
  p.parent.mkdir(parents=True, exist_ok=True)
  tmp = p.with_name(p.name + ".tmp")
  tmp.write_text(json.dumps(doc, indent=1, default=str))
  os.replace(tmp, p)


def print_tables(doc: dict, out=None):
  out = out or sys.stdout
  recs = doc.get("records", [])
  key = lambda r: (r["B"], r["Hq"], r["Hkv"], r["S"], r["D"], r["causal"],
                   r.get("dtype", "bf16"))
  impls = []
  for r in recs:
    if r["mode"] != "check" and r["impl"] not in impls:
      impls.append(r["impl"])
  impls.sort(key=lambda i: (ALL_IMPLS.index(i) if i in ALL_IMPLS else 99))
  shapes = []
  for r in recs:
    if key(r) not in shapes:
      shapes.append(key(r))

  def lab(k):
    B, Hq, Hkv, S, D, c, dt = k
    return f"{'C' if c else 'N'} D{D} S{S:<5d} B{B:<2d} g{Hq // Hkv}"

  checks = [r for r in recs if r["mode"] == "check"]
  if checks:
    print("== correctness: ours vs reference (relative L2 error)", file=out)
    for r in checks:
      vals = " ".join(f"{k[8:]}={r[k]:.1e}" for k in r if k.startswith("rel_err"))
      vals += _f32_str(r)
      if r.get("error"):
        vals += f" ERROR {r['error'][:120]}"
      print(f"{lab(key(r)):22s} vs {SHORT.get(r.get('reference'), '?'):6s} {vals}",
            file=out)

  by = {(key(r), r["impl"], r["mode"]): r for r in recs}
  for mode in MODES:
    cols = [i for i in impls if any((s, i, mode) in by for s in shapes)]
    rows = [s for s in shapes if any((s, i, mode) in by for i in cols)]
    if not rows:
      continue
    w = 10
    print(f"\n== {mode}: ms/TFLOP/s  (C causal, N full, g = Hq/Hkv; "
          f"err/skip: see JSON)", file=out)
    print(f"{'shape':22s} " + " ".join(f"{SHORT.get(i, i)[:w]:>{w}s}"
                                       for i in cols), file=out)
    for s in rows:
      cells = []
      for i in cols:
        r = by.get((s, i, mode))
        if r is None:
          cells.append("")
        elif r.get("ms") is None:
          e = r.get("error") or "?"
          cells.append("skip" if e.startswith("skipped") else "err")
        else:
          ms = r["ms"]
          msf = f"{ms:.3f}" if ms < 10 else (f"{ms:.1f}" if ms < 1000 else
                                             f"{ms:.0f}")
          cells.append(f"{msf}/{r['tflops']:.0f}")
      print(f"{lab(s):22s} " + " ".join(f"{c:>{w}s}" for c in cells), file=out)
    others = [i for i in cols if i != "ours"]
    if "ours" in cols and others:
      print(f"-- {mode}: ours/x (TFLOP/s ratio, >1 = ours faster)", file=out)
      print(f"{'shape':22s} " + " ".join(f"{SHORT.get(i, i)[:9]:>9s}"
                                         for i in others), file=out)
      for s in rows:
        o = by.get((s, "ours", mode))
        cells = []
        for i in others:
          r = by.get((s, i, mode))
          if (o and r and o.get("tflops") and r.get("tflops")):
            cells.append(f"{o['tflops'] / r['tflops']:.2f}")
          else:
            cells.append("-")
        print(f"{lab(s):22s} " + " ".join(f"{c:>9s}" for c in cells), file=out)
    dets = [(s, i) for s in rows for i in cols
            if by.get((s, i, mode), {}).get("bitwise_repeatable") is not None]
    if dets:
      rep = {}
      for s, i in dets:
        rep.setdefault(i, set()).add(by[(s, i, mode)]["bitwise_repeatable"])
      print("-- bitwise repeatable backward: " + ", ".join(
          f"{SHORT.get(i, i)}={'yes' if v == {True} else 'no' if v == {False} else 'mixed'}"
          for i, v in rep.items()), file=out)
  errs: dict[str, dict[str, int]] = {}
  for r in recs:
    e = r.get("error")
    if e and r.get("ms") is None:
      errs.setdefault(r["impl"], {}).setdefault(e[:150], 0)
      errs[r["impl"]][e[:150]] += 1
  if errs:
    print("\n-- errors and skips (count x first 150 chars):", file=out)
    for impl, d in errs.items():
      for e, n in list(d.items())[:3]:
        print(f"  {impl}: {n}x {e}", file=out)


def merge(paths: list[str], output: str):
  docs = [json.loads(Path(p).read_text()) for p in paths if Path(p).exists()]
  if not docs:
    raise SystemExit("nothing to merge")
  doc = docs[0]
  doc.setdefault("records", [])
  doc.setdefault("merged_metadata", [])
  for d in docs[1:]:
    doc["records"].extend(d.get("records", []))
    doc["merged_metadata"].append(d.get("metadata", {}))
  write_json(output, doc)
  return doc


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------
def _csv(s: str | None):
  return [x.strip() for x in s.split(",") if x.strip()] if s else None


def build_parser():
  ap = argparse.ArgumentParser(prog="python -m benchmarks.dense",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("--output", "-o", help="JSON file to write")
  ap.add_argument("--quick", action="store_true",
                  help="the two anchor shapes only")
  ap.add_argument("--smoke", action="store_true",
                  help="tiny CPU-friendly run (XLA / interpret impls)")
  ap.add_argument("--deterministic-cudnn", action="store_true",
                  help="time only cuDNN fwd+bwd with " + DET_FLAG)
  ap.add_argument("--impls", help="comma list; see --list-impls")
  ap.add_argument("--skip-impls", help="comma list removed from the set")
  ap.add_argument("--shapes", nargs="+",
                  help="explicit shapes, e.g. b2-h16-kv2-s8192-d128-causal "
                       "(separate with spaces or ';')")
  ap.add_argument("--seqs", help="filter the default grid, e.g. 4096,8192")
  ap.add_argument("--head-dims", help="filter the default grid, e.g. 128")
  ap.add_argument("--causal", choices=("both", "true", "false"), default="both")
  ap.add_argument("--gqa", help="filter the default grid: groups, e.g. 1,8")
  ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
  ap.add_argument("--modes", default="fwd,fwd+bwd")
  ap.add_argument("--budget-s", type=float, default=None,
                  help="stop starting measurements after this many seconds "
                       "(default 150 quick, 360 full, 120 smoke)")
  ap.add_argument("--target-s", type=float, default=None,
                  help="seconds of timed calls per measurement "
                       "(default 0.3 quick, 0.15 full, 0.01 smoke)")
  ap.add_argument("--n-batches", type=int, default=None,
                  help="timed batches per measurement (median over them)")
  ap.add_argument("--xla-max-seq", type=int, default=4096)
  ap.add_argument("--ours-backend", default=None,
                  help="backend= for fold_attn_func (default pallas on GPU, "
                       "interpret on CPU)")
  ap.add_argument("--ours-kwargs", default=None,
                  help="extra JSON kwargs for fold_attn_func")
  ap.add_argument("--no-determinism", action="store_true",
                  help="skip the 5x bitwise backward check")
  ap.add_argument("--no-checks", action="store_true",
                  help="skip the ours-vs-reference error check")
  ap.add_argument("--merge", nargs="+", metavar="JSON",
                  help="merge these JSON files into --output and exit")
  ap.add_argument("--table", metavar="JSON", help="print tables of a JSON")
  ap.add_argument("--list-impls", action="store_true")
  return ap


def select_shapes(args) -> list[Shape]:
  if args.shapes:
    specs = [s for x in args.shapes for s in re.split(r"[;\s]+", x) if s]
    return [parse_shape(s, args.dtype) for s in specs]
  if args.smoke:
    return list(SMOKE_SHAPES)
  if args.quick:
    base = [dataclasses.replace(s, dtype=args.dtype) for s in QUICK_SHAPES]
  else:
    base = default_grid(dtype=args.dtype)
  seqs = _csv(args.seqs)
  hds = _csv(args.head_dims)
  gq = _csv(args.gqa)
  out = []
  for s in base:
    if seqs and str(s.S) not in seqs:
      continue
    if hds and str(s.D) not in hds:
      continue
    if gq and str(s.groups) not in gq:
      continue
    if args.causal != "both" and s.causal != (args.causal == "true"):
      continue
    out.append(s)
  return out


def select_impls(args) -> list[str]:
  if args.deterministic_cudnn:
    impls = ["jax_cudnn_det"]
  elif args.impls:
    impls = _csv(args.impls)
  elif args.smoke:
    impls = list(SMOKE_IMPLS)
  else:
    impls = list(DEFAULT_IMPLS)
  bad = [i for i in impls if i not in ALL_IMPLS]
  if bad:
    raise SystemExit(f"unknown impls {bad}; known: {', '.join(ALL_IMPLS)}")
  skip = set(_csv(args.skip_impls) or [])
  return [i for i in impls if i not in skip]


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if args.list_impls:
    print(__doc__[__doc__.index("Implementations"):])
    return 0
  if args.merge:
    if not args.output:
      raise SystemExit("--merge needs --output")
    doc = merge(args.merge, args.output)
    print(f"merged {len(args.merge)} files into {args.output} "
          f"({len(doc['records'])} records)")
    return 0
  if args.table:
    print_tables(json.loads(Path(args.table).read_text()))
    return 0

  shapes = select_shapes(args)
  impls = select_impls(args)
  modes = ["fwd+bwd"] if args.deterministic_cudnn else _csv(args.modes)
  for m in modes:
    if m not in MODES:
      raise SystemExit(f"unknown mode {m!r}; known: {MODES}")
  if args.budget_s is None:
    args.budget_s = 120 if args.smoke else 150 if args.quick else 360
  if args.target_s is None:
    args.target_s = 0.01 if args.smoke else 0.3 if args.quick else 0.15
  if args.n_batches is None:
    args.n_batches = 3 if args.smoke else 7 if args.quick else 5

  # Environment before JAX / torch start.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if args.deterministic_cudnn:
    flags = os.environ.get("XLA_FLAGS", "")
    if DET_FLAG not in flags:
      os.environ["XLA_FLAGS"] = (flags + " " + DET_FLAG).strip()
  if any(i in TORCH_IMPLS for i in impls):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

  t_start = time.time()
  md = metadata(argv, args)
  md.update(shapes=[s.label() for s in shapes], impls=impls, modes=modes,
            budget_s=args.budget_s, target_s=args.target_s,
            n_batches=args.n_batches)
  records: list[dict] = []
  doc = dict(metadata=md, records=records)

  import jax
  dev = jax.devices()[0]
  on_gpu = dev.platform == "gpu"
  md.update(jax_backend=dev.platform, device_kind=dev.device_kind,
            jax_compute_capability=getattr(dev, "compute_capability", None))
  ctx = Ctx(args, on_gpu)
  print(f"dense benchmark: {len(shapes)} shapes x {len(impls)} impls x "
        f"{modes}; device {dev.device_kind} ({dev.platform}); "
        f"budget {args.budget_s:.0f}s", flush=True)
  write_json(args.output, doc)

  jax_impls = [i for i in impls if i in JAX_IMPLS]
  torch_impls = [i for i in impls if i in TORCH_IMPLS]
  torch_ok = True
  for si, shape in enumerate(shapes):
    print(f"[{si + 1}/{len(shapes)}] {shape.label()}  "
          f"(t={time.time() - t_start:.0f}s)", flush=True)
    if jax_impls:
      keep: dict = {}
      try:
        sets = jax_input_sets(shape, None if on_gpu else 1)
      except Exception as e:  # noqa: BLE001
        sets = None
        for i in jax_impls:
          r = new_record(i, shape, "fwd")
          r["error"] = "inputs: " + _err(e)
          records.append(r)
      if sets is not None:
        for impl in jax_impls:
          run_jax_impl(impl, shape, modes, sets, ctx, records, keep)
        if "ours" in jax_impls and not args.no_checks:
          run_checks(shape, sets, ctx, keep, records)
      del keep, sets
    if torch_impls:
      tsets, terr = None, None
      if torch_ok:
        try:
          torch = _import(ctx, "torch")
          if torch.cuda.is_available():
            tsets = torch_input_sets(shape, None)
        except ImportError as e:
          torch_ok = False
          print(f"  torch unavailable: {_err(e)}", flush=True)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory
          terr = "torch inputs: " + _err(e)
      for impl in torch_impls:
        run_torch_impl(impl, shape, modes, tsets, ctx, records, terr)
      del tsets
      if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()
    md["elapsed_s"] = round(time.time() - t_start, 1)
    write_json(args.output, doc)

  if "torch" in sys.modules:
    try:
      torch = sys.modules["torch"]
      if torch.cuda.is_available():
        md.setdefault("gpu_name", torch.cuda.get_device_name())
        md["torch_compute_capability"] = ".".join(
            map(str, torch.cuda.get_device_capability()))
        md["torch_cuda"] = torch.version.cuda
        md["torch_cudnn"] = torch.backends.cudnn.version()
    except Exception:  # noqa: BLE001
      pass
  stats = T.jax_device_memory_stats()
  if stats:
    md["jax_process_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  md["import_errors"] = ctx.import_errors
  md["elapsed_s"] = round(time.time() - t_start, 1)
  write_json(args.output, doc)
  print_tables(doc)
  n_ok = sum(1 for r in records if r.get("ms") is not None)
  n_err = sum(1 for r in records if r.get("error") and r["mode"] != "check")
  print(f"\n{n_ok} measurements, {n_err} errors/skips, "
        f"{md['elapsed_s']}s -> {args.output}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
