"""Decode attention benchmark: ours against the incumbents, in one process.

    python -m benchmarks.decode --output decode.json      (GPU, < 3 min)
    python -m benchmarks.decode --smoke --output s.json   (CPU, seconds)
    python -m benchmarks.decode --sweep --output sweep.json
        (ours only: tile / warps / stages / split count table, for tuning
         pallas_kernels/decode/config.py)
    python -m benchmarks.decode --accuracy --output acc.json
        (CPU or GPU: error of the exact decode model against the float32
         reference on synthetic data; the depth pruning this mode used to
         measure was removed, its results stay in
         benchmarks/results/cpu/decode-depth-2026-12-06/)
    python -m benchmarks.decode --table decode.json       (re-print)

Shapes: one new query token per sequence, every sequence at length T, bf16,
32 query heads, 8 KV heads, head_dim 128: B8 T32768 and B64 T4096 (override
with --shapes b8-t32768,b64-t4096[-h32-kv8-d128]).

Implementations (exact calls):
  ours          pallas_kernels.decode.paged_decode over a page pool [P, 256,
                8, 128] with pages scattered at random (a real paged cache;
                FoldKVCache's layout), num_splits chosen by the kernel
  ours_fp8      the same pages stored in E4M3 with a float32 scale per (page,
                KV head) (FoldKVCache(kv_dtype=jnp.float8_e4m3fn)), dequantised
                in registers; ours_fp8_e5m2 the same in E5M2
  torch_sdpa    F.scaled_dot_product_attention(q [B,32,1,128], k, v
                [B,8,T,128], enable_gqa=True)  (torch's default backend)
  jax_cudnn     jax.nn.dot_product_attention(q [B,1,32,128], k, v [B,T,8,128],
                implementation="cudnn")
  pallas_gqa    jax.experimental.pallas.ops.gpu.decode_attention.gqa(q [B,32,
                128], k, v [B,T,8,128], kv_seq_len=lengths)  (defaults:
                block_k=128, k_splits=16)
  pallas_paged  jax.experimental.pallas.ops.gpu.paged_attention.paged_attention(
                q [B,32,128], k_pages [8,P,16,128], v_pages, block_tables,
                lengths)  (defaults: page 16, 8 pages per block, k_splits=16)

Effective bandwidth = bytes of K and V actually read / time: at bf16
(2 * B * T * Hkv * D * 2) for every bf16 path, the figure of
shared/anchors/README.md (torch: 3.8 TB/s at B8 T32768 on the H200); for the
FP8 paths the FP8 pages plus their scales (about half). tokens/s = B / time.
Each run also records `capacity`: the largest batch at each context T whose
bf16 / FP8 K+V cache (one layer per KV head as in the shape, times --layers)
fits in 80% of the device's memory (the GPU's bytes_limit; on CPU a nominal
80 GiB card, marked as such). Timing: benchmarks/_timing (back-to-back calls, median of batches).
Each implementation is guarded: a failure becomes an `error` string and the
run goes on; the JSON is rewritten after every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import sys
import time
import traceback
from typing import Any

from benchmarks import _timing as T

JAX_IMPLS = ("ours", "ours_fp8", "ours_fp8_e5m2",
             "jax_cudnn", "pallas_gqa", "pallas_paged", "jax_xla")
TORCH_IMPLS = ("torch_sdpa",)
DEFAULT_IMPLS = ("ours", "ours_fp8", "torch_sdpa",
                 "jax_cudnn", "pallas_gqa", "pallas_paged")
SMOKE_IMPLS = ("ours", "ours_fp8", "jax_xla")
FP8_IMPLS = {"ours_fp8": "float8_e4m3fn", "ours_fp8_e5m2": "float8_e5m2"}
PAGE = 256


@dataclasses.dataclass(frozen=True)
class Shape:
  B: int
  T: int
  Hq: int = 32
  Hkv: int = 8
  D: int = 128
  page: int = PAGE

  def label(self) -> str:
    return f"B{self.B} T{self.T} H{self.Hq}/{self.Hkv} D{self.D}"

  def kv_bytes(self) -> int:
    return 2 * self.B * self.T * self.Hkv * self.D * 2

  def fp8_kv_bytes(self) -> int:
    """FP8 K and V pages (1 byte an entry) plus their float32 scales."""
    pages = self.B * -(-self.T // self.page)
    return self.kv_bytes() // 2 + 2 * pages * self.Hkv * 4

  def fields(self) -> dict:
    return dict(B=self.B, T=self.T, Hq=self.Hq, Hkv=self.Hkv, D=self.D,
                page=self.page, dtype="bf16")


DEFAULT_SHAPES = (Shape(8, 32768), Shape(64, 4096))
SMOKE_SHAPES = (Shape(2, 256, 8, 2, 64, 16),)


def parse_shape(spec: str) -> Shape:
  vals: dict[str, int] = {}
  for tok in re.split(r"[-_:,\s]+", spec.strip().lower()):
    if not tok:
      continue
    m = re.fullmatch(r"(b|t|s|h|hq|kv|hkv|d|p|page)(\d+)", tok)
    if not m:
      raise ValueError(f"bad token {tok!r} in shape {spec!r}")
    key = {"b": "B", "t": "T", "s": "T", "h": "Hq", "hq": "Hq", "kv": "Hkv",
           "hkv": "Hkv", "d": "D", "p": "page", "page": "page"}[m.group(1)]
    vals[key] = int(m.group(2))
  if "B" not in vals or "T" not in vals:
    raise ValueError(f"shape {spec!r} needs b<batch> and t<tokens>")
  return Shape(**vals)


def _err(e: BaseException) -> str:
  return re.sub(r"\s+", " ", f"{type(e).__name__}: {e}")[:800]


class Skip(Exception):
  pass


# ----------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------
def make_inputs(shape: Shape, seed: int = 0):
  """q [B,Hq,D], contiguous k, v [B,T,Hkv,D] (bf16) and a scattered page
  pool with its block table; lengths all T."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  b, t = shape.B, shape.T
  q = jax.random.normal(kq, (b, shape.Hq, shape.D), jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, shape.Hkv, shape.D), jnp.bfloat16)
  v = jax.random.normal(kv, (b, t, shape.Hkv, shape.D), jnp.bfloat16)
  lengths = jnp.full((b,), t, jnp.int32)
  n = b * (t // shape.page)
  perm = jnp.asarray(np.random.default_rng(seed).permutation(n), jnp.int32)
  table = perm.reshape(b, t // shape.page)
  inv = jnp.argsort(perm)
  pool = lambda x: x.reshape(n, shape.page, shape.Hkv, shape.D)[inv]
  return dict(q=q, k=k, v=v, lengths=lengths, k_pages=pool(k),
              v_pages=pool(v), table=table)


# ----------------------------------------------------------------------------
# Implementations: each returns (fn, args, notes)
# ----------------------------------------------------------------------------
def make_ours(name: str, shape: Shape, inp: dict, ctx) -> tuple:
  import jax
  import jax.numpy as jnp
  from pallas_kernels.decode import paged_decode
  from pallas_kernels.device import gpu_capability
  interpret = not ctx.on_gpu
  cc = None if interpret else gpu_capability()
  chunk = max(shape.page, ctx.chunk_tokens)
  kw = dict(chunk_tokens=chunk, interpret=interpret, compute_capability=cc,
            num_splits=ctx.num_splits)
  args = [inp["q"], inp["k_pages"], inp["v_pages"], inp["table"],
          inp["lengths"]]
  notes = f"page {shape.page}, chunk {chunk}"
  if name in FP8_IMPLS:
    from pallas_kernels.decode.fp8 import quantise_pages
    dt = jnp.dtype(FP8_IMPLS[name])
    counts = jnp.full((args[1].shape[0],), shape.page, jnp.int32)
    kq, ks = quantise_pages(inp["k_pages"], counts, dt)
    vq, vs = quantise_pages(inp["v_pages"], counts, dt)
    args[1], args[2] = kq, vq
    fn = jax.jit(lambda q, k, v, t, n, ks, vs: paged_decode(
        q, k, v, t, n, k_scales=ks, v_scales=vs, **kw))
    return fn, args + [ks, vs], notes + f", {dt.name} pages + scales"
  fn = jax.jit(lambda q, k, v, t, n: paged_decode(q, k, v, t, n, **kw))
  return fn, args, notes


def make_jax_impl(name: str, shape: Shape, inp: dict, ctx) -> tuple:
  import jax
  import jax.numpy as jnp
  if name.startswith("ours"):
    return make_ours(name, shape, inp, ctx)
  if name in ("jax_cudnn", "jax_xla"):
    if name == "jax_cudnn" and not ctx.on_gpu:
      raise Skip("cuDNN needs an NVIDIA GPU")
    impl = "cudnn" if name == "jax_cudnn" else "xla"
    fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q[:, None], k, v, implementation=impl)[:, 0])
    return fn, [inp["q"], inp["k"], inp["v"]], f"implementation={impl!r}"
  if not ctx.on_gpu:
    raise Skip("the Pallas Triton kernels need an NVIDIA GPU")
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    if name == "pallas_gqa":
      from jax.experimental.pallas.ops.gpu import decode_attention as da
      fn = jax.jit(lambda q, k, v, n: da.gqa(q, k, v, kv_seq_len=n))
      return (fn, [inp["q"], inp["k"], inp["v"], inp["lengths"]],
              "decode_attention.gqa defaults (block_k 128, k_splits 16)")
    if name == "pallas_paged":
      from jax.experimental.pallas.ops.gpu import paged_attention as pa
      page = 16
      n = shape.B * (shape.T // page)
      kp = inp["k"].reshape(n, page, shape.Hkv, shape.D).transpose(2, 0, 1, 3)
      vp = inp["v"].reshape(n, page, shape.Hkv, shape.D).transpose(2, 0, 1, 3)
      table = jnp.arange(n, dtype=jnp.int32).reshape(shape.B, -1)
      fn = jax.jit(lambda q, k, v, t, n: pa.paged_attention(q, k, v, t, n))
      # paged_attention applies no softmax scale (raw q.k logits): hand it q
      # pre-scaled by 1/sqrt(D), outside the timed call, so that its output
      # is comparable with everyone else's.
      q_scaled = (inp["q"].astype(jnp.float32) * shape.D ** -0.5).astype(
          inp["q"].dtype)
      return (fn, [q_scaled, kp, vp, table, inp["lengths"]],
              "paged_attention defaults (page 16, 8 pages/block, k_splits 16);"
              " q pre-scaled by 1/sqrt(D) (the op applies no softmax scale)")
  raise ValueError(f"unknown implementation {name!r}")


def run_jax(name: str, shape: Shape, inp: dict, ctx, keep: dict) -> dict:
  import jax
  import numpy as np
  rec = new_record(name, shape)
  try:
    fn, args, notes = make_jax_impl(name, shape, inp, ctx)
    rec["notes"] = notes
    compiled, lowered, secs = T.jax_compile(fn, args)
    rec["compile_s"] = round(secs, 2)
    out = jax.block_until_ready(compiled(*args))
    keep[name] = np.asarray(out.astype(np.float32))
    t = T.time_jax(compiled, [args], target_s=ctx.target_s,
                   n_batches=ctx.n_batches)
    _fill(rec, shape, t)
    if name in FP8_IMPLS:  # bandwidth over the bytes actually read
      rec["kv_bytes"] = shape.fp8_kv_bytes()
      rec["eff_tbs"] = rec["kv_bytes"] / (rec["ms"] / 1e3) / 1e12
    rec.update(T.jax_memory_analysis(compiled))
    if name == "ours" and ctx.determinism:
      rec["bitwise_repeatable"] = T.bitwise_repeatable(compiled, args, n=3)
  except Skip as e:
    rec["error"] = f"skipped: {e}"
  except Exception as e:  # noqa: BLE001
    rec["error"] = _err(e)
    if ctx.verbose:
      traceback.print_exc()
  return rec


def run_torch(name: str, shape: Shape, inp: dict, ctx, keep: dict) -> dict:
  import numpy as np
  rec = new_record(name, shape)
  try:
    if not ctx.on_gpu:
      raise Skip("torch timing needs CUDA")
    import torch
    import torch.nn.functional as F
    if not torch.cuda.is_available():
      raise Skip("torch.cuda is not available")
    dev = torch.device("cuda")

    def to(x):
      try:  # zero-copy from the JAX buffer
        return torch.from_dlpack(x).to(dev, torch.bfloat16)
      except Exception:  # noqa: BLE001
        return torch.from_numpy(np.asarray(x.astype(np.float32))).to(
            dev, torch.bfloat16)
    q = to(inp["q"])[:, :, None]  # [B, Hq, 1, D]
    k = to(inp["k"]).transpose(1, 2).contiguous()  # [B, Hkv, T, D]
    v = to(inp["v"]).transpose(1, 2).contiguous()

    def fn(q, k, v):
      with torch.no_grad():
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    out = fn(q, k, v)
    torch.cuda.synchronize()
    keep[name] = out[:, :, 0].float().cpu().numpy()
    rec["notes"] = "F.scaled_dot_product_attention(enable_gqa=True)"
    t = T.time_torch(fn, [(q, k, v)], target_s=ctx.target_s,
                     n_batches=ctx.n_batches)
    _fill(rec, shape, t)
    del q, k, v, out
    torch.cuda.empty_cache()
  except Skip as e:
    rec["error"] = f"skipped: {e}"
  except Exception as e:  # noqa: BLE001
    rec["error"] = _err(e)
  return rec


def new_record(impl: str, shape: Shape) -> dict:
  r = dict(impl=impl)
  r.update(shape.fields())
  r.update(ms=None, eff_tbs=None, tokens_per_s=None, error=None)
  return r


def _fill(rec: dict, shape: Shape, t: dict):
  rec.update(t)
  s = rec["ms"] / 1e3
  rec["eff_tbs"] = shape.kv_bytes() / s / 1e12
  rec["tokens_per_s"] = shape.B / s
  rec["kv_bytes"] = shape.kv_bytes()


def add_checks(recs: list, keep: dict):
  """Relative error of every output against ours (and ours against a float32
  reference where it is cheap enough)."""
  import numpy as np
  base = keep.get("ours")
  for rec in recs:
    o = keep.get(rec["impl"])
    if base is None or o is None or rec["impl"] == "ours":
      continue
    o = np.asarray(o).reshape(base.shape)
    rec["rel_err_vs_ours"] = float(np.linalg.norm(o - base) /
                                   max(np.linalg.norm(base), 1e-30))


# ----------------------------------------------------------------------------
# Accuracy: the exact model's error (synthetic data, float32 outputs)
# ----------------------------------------------------------------------------
def accuracy(ctx) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from pallas_kernels.decode import contiguous_as_pages, xla_decode
  from pallas_kernels.reference import paged_decode_reference
  model = jax.jit(xla_decode)
  b, t, hq, hkv, d, s = 2, ctx.acc_tokens, 8, 2, 128, 256
  out = []

  def data(kind, sigma, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, d))
    k = rng.standard_normal((b, t, hkv, d))
    v = rng.standard_normal((b, t, hkv, d))
    if kind == "structured":  # shared key direction and a sink-like token 0
      mu = rng.standard_normal((1, 1, hkv, d))
      k = k * 0.5 + mu
      k[:, 0] += 3 * mu[:, 0]
    if kind == "peaked":  # a few keys aligned with the query, rest random
      for i in range(b):
        hot = rng.choice(t, 16, replace=False)
        qn = q[i].reshape(hkv, hq // hkv, d).mean(1)
        k[i, hot] += 2.0 * qn[None] / np.linalg.norm(qn, axis=-1,
                                                     keepdims=True) * d ** .5
    q, k = q * sigma ** 0.5, k * sigma ** 0.5
    f = lambda x: jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(
        jnp.float32)
    return f(q), f(k), f(v)

  for kind in ("random", "structured", "peaked"):
    for sigma in (1.0, 4.0):
      q, k, v = data(kind, sigma)
      lengths = jnp.array([t, t - 100], jnp.int32)
      kp, table = contiguous_as_pages(k, s)
      vp, _ = contiguous_as_pages(v, s)
      ref = np.asarray(paged_decode_reference(q, kp, vp, table, lengths)[0],
                       np.float64)
      rel = lambda o: float(np.linalg.norm(np.asarray(o, np.float64) - ref) /
                            np.linalg.norm(ref))
      base = dict(data=kind, sigma=sigma, T=t, D=d, page=s)
      out.append(dict(base, option="exact",
                      rel_err=rel(model(q, kp, vp, table, lengths))))
      print(f"  {kind:10s} sigma={sigma}: exact={out[-1]['rel_err']:.1e}",
            flush=True)
  return out


def capacity(shapes, on_gpu: bool, layers: int = 1) -> dict:
  """Largest batch at each shape's T whose K+V cache (bf16 / FP8 pages +
  scales, `layers` layers) fits in 80% of the device's memory."""
  import jax
  limit, source = None, "nominal 80 GiB (no GPU)"
  if on_gpu:
    try:
      limit = jax.devices()[0].memory_stats()["bytes_limit"]
      source = "bytes_limit of " + jax.devices()[0].device_kind
    except Exception:  # noqa: BLE001
      limit = None
  if limit is None:
    limit, source = 80 * 2 ** 30, "nominal 80 GiB (no memory stats)"
  budget = 0.8 * limit
  rows = []
  for sh in shapes:
    one = dataclasses.replace(sh, B=1)
    per = dict(bf16=one.kv_bytes() * layers, fp8=one.fp8_kv_bytes() * layers)
    rows.append(dict(T=sh.T, Hkv=sh.Hkv, D=sh.D, page=sh.page, layers=layers,
                     **{f"max_batch_{k}": int(budget // v)
                        for k, v in per.items()},
                     **{f"max_tokens_{k}": int(budget // v) * sh.T
                        for k, v in per.items()}))
  return dict(memory_bytes=int(limit), source=source, fraction=0.8,
              rows=rows)


# ----------------------------------------------------------------------------
# Sweep (ours only)
# ----------------------------------------------------------------------------
SWEEP_BLOCKS = ("32,4,2", "32,4,3", "64,4,2", "64,4,3", "64,4,4", "64,8,3",
                "128,4,2", "128,8,2", "128,8,3")


def sweep(shapes, ctx, doc, path):
  from pallas_kernels import settings
  from pallas_kernels.decode.config import num_sms
  for shape in shapes:
    inp = make_inputs(shape)
    pairs = shape.B * shape.Hkv
    chunks = shape.T // ctx.chunk_tokens
    split_opts = sorted({max(1, min(chunks, x)) for x in (
        -(-2 * num_sms() // pairs), -(-4 * num_sms() // pairs),
        -(-8 * num_sms() // pairs))})
    for blocks in ctx.sweep_blocks:
      for ns in split_opts:
        if ctx.out_of_time():
          return
        ctx.num_splits = ns
        # Traced (and so planned) inside the settings: their tiles.
        with settings.use(settings.KernelSettings(decode_blocks=tuple(
            int(x) for x in blocks.split(",")))):
          rec = run_jax("ours", shape, inp, ctx, {})
        rec.update(blocks=blocks, num_splits=ns)
        doc["records"].append(rec)
        _print(rec)
        write_json(path, doc)
    ctx.num_splits = None


# ----------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------
class Ctx:
  def __init__(self, args, on_gpu: bool):
    self.on_gpu = on_gpu
    self.target_s = args.target_s
    self.n_batches = args.n_batches
    self.num_splits = args.num_splits
    self.chunk_tokens = args.chunk_tokens
    self.determinism = not args.no_determinism
    self.deadline = time.time() + args.budget_s
    self.verbose = args.verbose
    self.acc_tokens = args.acc_tokens
    self.sweep_blocks = (args.sweep_blocks.split(";") if args.sweep_blocks
                         else SWEEP_BLOCKS)

  def out_of_time(self) -> bool:
    return time.time() > self.deadline


def metadata(argv, on_gpu) -> dict:
  import importlib.metadata as im
  import jax

  def ver(p):
    try:
      return im.version(p)
    except Exception:
      return None
  try:
    from benchmarks.dense import _git_commit, _nvidia_smi, _source_hash
    extra = dict(git_commit=_git_commit(), source_sha256=_source_hash())
    extra.update(_nvidia_smi())
  except Exception:  # pragma: no cover
    extra = {}
  md = dict(
      command=" ".join(["python3", "-m", "benchmarks.decode"] + argv),
      date=datetime.datetime.now(datetime.timezone.utc).isoformat(
          timespec="seconds"),
      jax_backend=jax.default_backend(), on_gpu=on_gpu,
      devices=[str(d) for d in jax.devices()],
      versions={p: ver(p) for p in ("jax", "jaxlib", "jax-cuda13-plugin",
                                    "torch", "triton", "numpy")},
      conventions=dict(
          eff_tbs="K and V bytes at bf16 (2*B*T*Hkv*D*2) / time, TB/s",
          tokens_per_s="B / time (one new token per sequence per call)",
          timing="benchmarks/_timing: back-to-back calls, median of batches",
          rel_err_vs_ours="||x - ours|| / ||ours|| on the same inputs"),
      decode_blocks_env=os.environ.get("FOLDAX_DECODE_BLOCKS"))
  md.update(extra)
  return md


def write_json(path, doc):
  if not path:
    return
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=1, default=str)
  os.replace(tmp, path)


def _print(rec: dict):
  if rec.get("error"):
    print(f"  {rec['impl']:14s} {rec['error'][:150]}", flush=True)
    return
  extra = ""
  if "rel_err_vs_ours" in rec:
    extra = f"  err vs ours {rec['rel_err_vs_ours']:.1e}"
  if "blocks" in rec:
    extra += f"  blocks {rec['blocks']} splits {rec['num_splits']}"
  print(f"  {rec['impl']:14s} {rec['ms']:8.4f} ms  {rec['eff_tbs']:6.2f} TB/s"
        f"  {rec['tokens_per_s']:10.0f} tok/s  compile "
        f"{rec.get('compile_s', 0):.1f}s{extra}", flush=True)


def print_tables(doc: dict):
  recs = [r for r in doc.get("records", []) if "ms" in r]
  shapes = []
  for r in recs:
    key = (r["B"], r["T"])
    if key not in shapes:
      shapes.append(key)
  print(f"{'impl':14s}" + "".join(f"  B{b} T{t:<6d}".ljust(26)
                                   for b, t in shapes))
  impls = []
  for r in recs:
    if r["impl"] not in impls:
      impls.append(r["impl"])
  for impl in impls:
    row = f"{impl:14s}"
    for b, t in shapes:
      rr = [r for r in recs if r["impl"] == impl and (r["B"], r["T"]) == (b, t)]
      if rr and rr[0].get("ms"):
        row += f"  {rr[0]['ms']:.3f} ms {rr[0]['eff_tbs']:.2f} TB/s".ljust(26)
      else:
        row += "  -".ljust(26)
    print(row)


def build_parser():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--output")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--sweep", action="store_true")
  p.add_argument("--accuracy", action="store_true")
  p.add_argument("--table")
  p.add_argument("--impls")
  p.add_argument("--shapes")
  p.add_argument("--num-splits", type=int, default=None)
  p.add_argument("--chunk-tokens", type=int, default=1024)
  p.add_argument("--sweep-blocks", help="';'-separated 'block_k,warps,stages'")
  p.add_argument("--target-s", type=float, default=0.2)
  p.add_argument("--n-batches", type=int, default=5)
  p.add_argument("--budget-s", type=float, default=150.0)
  p.add_argument("--acc-tokens", type=int, default=4096)
  p.add_argument("--layers", type=int, default=1,
                 help="layers counted in the capacity table")
  p.add_argument("--no-determinism", action="store_true")
  p.add_argument("--verbose", action="store_true")
  return p


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args = build_parser().parse_args(argv)
  if args.table:
    with open(args.table) as f:
      print_tables(json.load(f))
    return 0
  # torch shares the GPU: JAX must not grab 75% of it up front.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  import jax
  on_gpu = jax.devices()[0].platform == "gpu"
  t0 = time.time()
  ctx = Ctx(args, on_gpu)
  doc = dict(metadata=metadata(argv, on_gpu), records=[])
  if args.smoke:
    ctx.target_s, ctx.n_batches, ctx.chunk_tokens = 0.05, 2, 32
    args.acc_tokens = min(args.acc_tokens, 512)
    ctx.acc_tokens = args.acc_tokens
  if args.accuracy:
    print("accuracy (relative error vs the float32 reference):", flush=True)
    doc["records"] = accuracy(ctx)
    doc["metadata"]["elapsed_s"] = round(time.time() - t0, 1)
    write_json(args.output, doc)
    return 0
  shapes = ([parse_shape(s) for s in args.shapes.split(",")] if args.shapes
            else list(SMOKE_SHAPES if args.smoke else DEFAULT_SHAPES))
  if args.sweep:
    sweep(shapes, ctx, doc, args.output)
    doc["metadata"]["elapsed_s"] = round(time.time() - t0, 1)
    write_json(args.output, doc)
    return 0
  impls = (args.impls.split(",") if args.impls else
           list(SMOKE_IMPLS if args.smoke else DEFAULT_IMPLS))
  doc["capacity"] = capacity(shapes, on_gpu, args.layers)
  for row in doc["capacity"]["rows"]:
    print(f"80% of memory ({doc['capacity']['source']}): T{row['T']} "
          f"max batch bf16 {row['max_batch_bf16']}, FP8 "
          f"{row['max_batch_fp8']}", flush=True)
  for shape in shapes:
    print(f"{shape.label()}  (K+V {shape.kv_bytes() / 1e9:.2f} GB)",
          flush=True)
    inp = make_inputs(shape)
    keep: dict[str, Any] = {}
    recs = []
    for name in impls:
      if ctx.out_of_time():
        rec = new_record(name, shape)
        rec["error"] = "skipped: out of time budget"
      elif name in TORCH_IMPLS:
        rec = run_torch(name, shape, inp, ctx, keep)
      else:
        rec = run_jax(name, shape, inp, ctx, keep)
      recs.append(rec)
      add_checks([rec], keep)
      _print(rec)
      doc["records"].append(rec)
      write_json(args.output, doc)
    ours = next((r for r in recs if r["impl"] == "ours" and r["ms"]), None)
    if ours:
      for r in recs:
        if r["ms"] and r is not ours:
          r["speedup_of_ours"] = r["ms"] / ours["ms"]
          if r["impl"] in FP8_IMPLS:  # FP8 tokens/s over our bf16 path's
            r["tokens_per_s_vs_ours_bf16"] = (r["tokens_per_s"] /
                                              ours["tokens_per_s"])
    del inp, keep
  doc["metadata"]["elapsed_s"] = round(time.time() - t0, 1)
  write_json(args.output, doc)
  print_tables(doc)
  return 0


if __name__ == "__main__":
  sys.exit(main())
