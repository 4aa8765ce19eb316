"""Figures and a Markdown table from benchmark JSON.

    python -m benchmarks.plot results.json [more.json ...] \\
        [--output-dir benchmarks/results/h200/] [--title-suffix TEXT]

Reads what `python -m benchmarks.run` writes (a `suites` mapping) or what a
single suite writes (`python -m benchmarks.dense`: `metadata` + `records`),
and writes into --output-dir (default `benchmarks/results/<gpu>/`), one figure
per question a user asks:

  <suite>_speedup.png          "How much faster is foldax than what I use
                               now?": time of each competitor / time of ours,
                               per shape, forward and forward+backward
                               (>1: ours is faster); backward passes that
                               are not bitwise repeatable are marked.
  <suite>_latency_vs_seqlen.png  "How does it scale with sequence length?"
                               (only when the JSON has >= 2 lengths of one
                               shape family): latency and speedup vs length.
  <suite>_memory.png           "How much memory does it need?": peak bytes a
                               call adds over its inputs, per shape.
  decode_bandwidth.png         "How close to the memory bandwidth does decode
                               get?" (when decode records carry TB/s).
  table.md                     every number behind the figures, with the
                               provenance (GPU, driver, versions, commit,
                               command, date, source JSON).

Only matplotlib (Agg) and the standard library are used; nothing here imports
JAX or torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

REPO = Path(__file__).resolve().parents[1]
MODES = ("fwd", "fwd+bwd")
MODE_TITLE = {"fwd": "forward", "fwd+bwd": "forward + backward"}

# Display names: what a user knows the competitor as.
IMPL_NAMES = {
    "ours": "foldax (ours)",
    "jax_cudnn": "cuDNN via jax.nn.dot_product_attention",
    "jax_cudnn_det": "cuDNN via JAX, XLA deterministic ops",
    "jax_xla": "XLA via jax.nn.dot_product_attention",
    "pallas_mha": "JAX Pallas ops.gpu.attention",
    "pallas_mha_tuned": "JAX Pallas attention, tuned blocks",
    "tokamax": "tokamax (default: Mosaic GPU)",
    "tokamax_triton": "tokamax, Triton",
    "torch_cudnn": "torch SDPA, cuDNN",
    "torch_flash": "torch SDPA, flash (FA2)",
    "torch_flash_det": "torch SDPA flash, deterministic",
    "fastflash": "fastflash-attention",
    # deberta / bridge suites (benchmarks.run)
    "ours_xla": "foldax XLA path",
    "hf_torch": "Hugging Face eager (torch)",
    "bridge": "foldax via torch_bridge",
    "jax_direct": "foldax called from JAX",
    "torch_sdpa": "torch SDPA",
    # decode suite (benchmarks.decode); ours_v8 and ours_depth16 (options
    # since removed; depth: issue 29) label the runs of results/ that
    # measured them
    "ours_v8": "foldax, values as 2×E4M3 (v8)",
    "ours_depth16": "foldax, depth=16 (approximate cut)",
    "ours_fp8": "foldax, FP8 cache (E4M3)",
    "ours_fp8_e5m2": "foldax, FP8 cache (E5M2)",
    "pallas_gqa": "JAX Pallas decode_attention.gqa",
    "pallas_paged": "JAX Pallas paged_attention",
}
IMPL_VERSION_PKG = {"tokamax": "tokamax", "tokamax_triton": "tokamax",
                    "fastflash": "fastflash-attention"}
IMPL_ORDER = ("ours", "ours_v8", "ours_depth16", "ours_fp8", "ours_fp8_e5m2",
              "pallas_gqa", "pallas_paged",
              "jax_cudnn", "jax_cudnn_det", "torch_cudnn",
              "torch_flash", "torch_flash_det", "tokamax", "tokamax_triton",
              "fastflash", "pallas_mha", "pallas_mha_tuned", "jax_xla",
              "ours_xla", "hf_torch", "bridge", "jax_direct", "torch_sdpa")
OURS_COLOR = "#d62728"
# One colour per competitor in every figure.
IMPL_COLORS = {
    "jax_cudnn": "#1f77b4", "jax_cudnn_det": "#17becf", "torch_cudnn": "#9467bd",
    "torch_flash": "#8c564b", "torch_flash_det": "#e377c2",
    "tokamax": "#2ca02c", "tokamax_triton": "#bcbd22", "fastflash": "#ff7f0e",
    "pallas_mha": "#7f7f7f", "pallas_mha_tuned": "#393b79",
    "jax_xla": "#637939", "ours_xla": "#ff9896", "hf_torch": "#8c6d31",
    "bridge": "#d62728", "jax_direct": "#1f77b4", "torch_sdpa": "#8c564b"}
IMPL_MARKERS = {
    "jax_cudnn": "s", "jax_cudnn_det": "D", "torch_cudnn": "^",
    "torch_flash": "v", "torch_flash_det": "<", "tokamax": ">",
    "tokamax_triton": "p", "fastflash": "h", "pallas_mha": "*",
    "pallas_mha_tuned": "X", "jax_xla": "P", "ours_xla": "d"}
PALETTE = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#ff7f0e", "#393b79", "#637939", "#8c6d31",
           "#843c39", "#7b4173")
# Bandwidth keys a decode record may carry (TB/s, or GB/s scaled below).
BW_KEYS_TBS = ("eff_tbs", "tbps", "tb_s", "tb_per_s", "bandwidth_tbs", "bw_tbs",
               "hbm_tbs", "TB/s")
BW_KEYS_GBS = ("gbps", "gb_s", "gb_per_s", "bandwidth_gbs", "bw_gbs")
CTX_KEYS = ("T", "context", "context_len", "ctx", "kv_len", "seq_k", "Sk",
            "cache_len", "length", "S")
HBM_PEAK_TBS = {"H200": 4.8, "H100": 3.35, "A100": 2.0}


# ----------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------
def _suite_of(doc: dict) -> str:
  cmd = str(doc.get("metadata", {}).get("command", ""))
  m = re.search(r"benchmarks\.(\w+)", cmd)
  if m and m.group(1) not in ("run", "plot"):
    return m.group(1)
  return doc.get("metadata", {}).get("suite", "dense")


def load(paths: Iterable[str | os.PathLike]) -> dict:
  """-> {"metadata": first file's metadata, "sources": [paths],
         "suites": {name: {"metadata", "records", "status", "note"}}}."""
  out: dict[str, Any] = dict(metadata={}, sources=[], suites={})
  for p in paths:
    p = Path(p)
    doc = json.loads(p.read_text())
    out["sources"].append(str(p))
    if "suites" in doc:
      if not out["metadata"]:
        out["metadata"] = dict(doc.get("metadata", {}))
      for name, s in doc["suites"].items():
        tgt = out["suites"].setdefault(name, dict(metadata=s.get("metadata",
                                                                  {}),
                                                  records=[]))
        tgt["records"].extend(s.get("records", []) or [])
        for k in ("status", "note", "returncode", "elapsed_s"):
          if k in s:
            tgt[k] = s[k]
    else:
      name = _suite_of(doc)
      if not out["metadata"]:
        out["metadata"] = dict(doc.get("metadata", {}))
      tgt = out["suites"].setdefault(name, dict(
          metadata=doc.get("metadata", {}), records=[], status="ok"))
      tgt["records"].extend(doc.get("records", []))
  return out


def gpu_slug(md: dict) -> str:
  name = str(md.get("gpu_name") or md.get("device_kind") or "cpu")
  name = re.sub(r"^(NVIDIA|Tesla)\s+", "", name.strip(), flags=re.I)
  slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
  return slug or "cpu"


# ----------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------
def shape_key(r: dict) -> tuple:
  return (r.get("B"), r.get("Hq"), r.get("Hkv"), r.get("S"), r.get("D"),
          bool(r.get("causal")), r.get("dtype", "bf16"))


def shape_label(k: tuple, multiline: bool = False) -> str:
  B, Hq, Hkv, S, D, c, dt = k
  heads = f"H{Hq}" if Hq == Hkv else f"H{Hq}/KV{Hkv}"
  parts = [f"B{B} {heads}", f"S{S} D{D}",
           ("causal" if c else "non-causal") + (f" {dt}" if dt != "bf16" else "")]
  return "\n".join(parts) if multiline else " ".join(parts)


def family_key(k: tuple) -> tuple:
  B, Hq, Hkv, S, D, c, dt = k
  return (Hq, Hkv, D, c, dt)


def family_label(f: tuple) -> str:
  Hq, Hkv, D, c, dt = f
  heads = f"H{Hq}" if Hq == Hkv else f"H{Hq}/KV{Hkv} (GQA)"
  return f"{heads} D{D} {'causal' if c else 'non-causal'} {dt}"


def ok(r: dict | None) -> bool:
  return bool(r) and r.get("ms") is not None and not (
      isinstance(r.get("ms"), float) and math.isnan(r["ms"]))


def index(records: list[dict]) -> dict:
  return {(shape_key(r), r["impl"], r["mode"]): r for r in records
          if r.get("mode") in MODES and "impl" in r}


def impls_of(records: list[dict]) -> list[str]:
  seen = []
  for r in records:
    if r.get("mode") in MODES and r.get("impl") not in seen and ok(r):
      seen.append(r["impl"])
  return sorted(seen, key=lambda i: (IMPL_ORDER.index(i) if i in IMPL_ORDER
                                     else len(IMPL_ORDER), i))


def shapes_of(records: list[dict]) -> list[tuple]:
  out = []
  for r in records:
    if r.get("mode") in MODES and shape_key(r) not in out:
      out.append(shape_key(r))
  return out


def impl_name(impl: str, md: dict | None = None) -> str:
  n = IMPL_NAMES.get(impl, impl)
  pkg = IMPL_VERSION_PKG.get(impl)
  v = ((md or {}).get("versions") or {}).get(pkg) if pkg else None
  if v and v not in n:
    n = n.replace(pkg, f"{pkg} {v}", 1) if pkg in n else f"{n} {v}"
  return n


def repeatable_summary(by: dict, impl: str, shapes: list[tuple]) -> bool | None:
  vals = {by[(s, impl, "fwd+bwd")].get("bitwise_repeatable")
          for s in shapes if (s, impl, "fwd+bwd") in by}
  vals.discard(None)
  if not vals:
    return None
  return True if vals == {True} else False if vals == {False} else None


def fmt_ms(ms: float) -> str:
  return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def fmt_bytes(n: float | None) -> str:
  if n is None:
    return "–"
  for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if abs(n) >= f:
      v = n / f
      return f"{v:.1f} {unit}" if v < 100 else f"{v:.0f} {unit}"
  return f"{n:.0f} B"


def device_label(md: dict) -> str:
  gpu = md.get("gpu_name")
  if gpu:
    return str(gpu)
  kind = str(md.get("device_kind") or md.get("jax_backend") or "cpu")
  return (f"{kind.upper() if kind.lower() == 'cpu' else kind}: smoke run, "
          "times show the harness works, not speed")


def provenance(md: dict, sources: list[str]) -> str:
  gpu = md.get("gpu_name") or md.get("device_kind") or "CPU"
  cc = md.get("compute_capability") or md.get("jax_compute_capability")
  v = md.get("versions") or {}
  bits = [f"{gpu}" + (f" (SM {cc})" if cc else ""),
          str(md.get("date", ""))[:10]]
  if v.get("jax"):
    bits.append(f"jax {v['jax']}")
  if v.get("torch"):
    bits.append(f"torch {v['torch']}")
  if md.get("git_commit"):
    bits.append(f"commit {str(md['git_commit']).split()[0][:10]}")
  if sources:
    bits.append("data: " + ", ".join(Path(s).name for s in sources))
  return " · ".join(b for b in bits if b)


# ----------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------
def _plt():
  import matplotlib
  matplotlib.use("Agg", force=True)
  import matplotlib.pyplot as plt
  plt.rcParams.update({
      "font.size": 10, "axes.titlesize": 12, "axes.labelsize": 10.5,
      "figure.titlesize": 14, "legend.fontsize": 9, "axes.spines.top": False,
      "axes.spines.right": False, "savefig.facecolor": "white",
      "figure.facecolor": "white"})
  return plt


def _footer(fig, text: str, y: float = 0.005):
  fig.text(0.5, y, text, ha="center", va="bottom", fontsize=8, color="#555555",
           wrap=True)


def speedup_figure(records: list[dict], md: dict, path: Path, *,
                   suite: str = "dense", sources=()) -> Path | None:
  """Heatmaps (competitor x shape) of competitor time / our time."""
  plt = _plt()
  from matplotlib.colors import TwoSlopeNorm
  by = index(records)
  shapes = shapes_of(records)
  impls = impls_of(records)
  if "ours" not in impls or len(impls) < 2:
    return None
  others = [i for i in impls if i != "ours"]
  modes = [m for m in MODES if any((s, "ours", m) in by and ok(by[(s, "ours",
                                                                    m)])
                                   for s in shapes)]
  if not modes:
    return None
  rows_per_mode = {m: [i for i in others if any(ok(by.get((s, i, m)))
                                               for s in shapes)]
                   for m in modes}
  n_rows = max(len(v) for v in rows_per_mode.values())
  ncol = len(shapes)
  fig_w = max(12.0, len(modes) * (3.4 + 1.25 * ncol))
  fig_h = 2.9 + 0.45 * n_rows
  fig, axes = plt.subplots(1, len(modes), figsize=(fig_w, fig_h),
                           squeeze=False)
  # log2 ratio on a diverging map: 0.5x and 2x equally far from 1x.
  norm = TwoSlopeNorm(vmin=-1.0, vcenter=0.0, vmax=1.0)
  cmap = plt.get_cmap("RdYlGn")
  for ax, mode in zip(axes[0], modes):
    rows = rows_per_mode[mode]
    data = [[None] * ncol for _ in rows]
    for i, impl in enumerate(rows):
      for j, s in enumerate(shapes):
        o, r = by.get((s, "ours", mode)), by.get((s, impl, mode))
        if ok(o) and ok(r):
          data[i][j] = r["ms"] / o["ms"]
    grid = [[math.log2(v) if v else float("nan") for v in row] for row in data]
    ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto")
    for i, impl in enumerate(rows):
      for j, s in enumerate(shapes):
        v = data[i][j]
        if v is None:
          ax.text(j, i, "n/a", ha="center", va="center", fontsize=9,
                  color="#777777")
          continue
        txt = f"{v:.2f}×"
        rec = by.get((s, impl, mode)) or {}
        nd = mode == "fwd+bwd" and rec.get("bitwise_repeatable") is False
        tc = "black" if abs(math.log2(v)) < 0.75 else "white"
        ax.text(j, i - (0.12 if nd else 0), txt, ha="center", va="center",
                fontsize=10.5, fontweight="bold", color=tc)
        if nd:
          ax.text(j, i + 0.28, "not repeatable", ha="center", va="center",
                  fontsize=7, style="italic", color=tc)
    ax.set_xticks(range(ncol))
    ax.set_xticklabels([shape_label(s, multiline=True) for s in shapes],
                       fontsize=8.5)
    ax.xaxis.tick_top()
    ax.set_yticks(range(len(rows)))
    ylabels = []
    for impl in rows:
      n = impl_name(impl, md)
      ylabels.append(n)
    ax.set_yticklabels(ylabels if ax is axes[0][0] or True else [])
    ax.set_title(MODE_TITLE[mode], pad=42, fontweight="bold")
    for sp in ax.spines.values():
      sp.set_visible(False)
    ax.set_xticks([x - 0.5 for x in range(1, ncol)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="both", length=0)
  gpu = device_label(md)
  fig.suptitle(f"How much faster is foldax than what you use now? "
               f"({suite}, {gpu})", y=1 - 0.08 / fig_h, va="top")
  ours_rep = repeatable_summary(by, "ours", shapes)
  sub = ("cell = competitor's median time ÷ foldax's median time:  "
         "green (> 1×) foldax is faster,  red (< 1×) foldax is slower")
  if ours_rep:
    sub += ("\nfoldax's backward was bitwise repeatable on every shape; "
            "'not repeatable' marks competitors whose gradients changed "
            "between runs")
  fig.text(0.5, 1 - 0.48 / fig_h, sub, ha="center", va="top",
           fontsize=9, color="#333333", linespacing=1.5)
  _footer(fig, provenance(md, list(sources)))
  fig.tight_layout(rect=(0, 0.3 / fig_h, 1, 1 - 0.85 / fig_h))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def _impl_styles(impls: list[str]) -> dict:
  out, k = {}, 0
  for i in impls:
    if i == "ours":
      out[i] = dict(color=OURS_COLOR, lw=3.0, marker="o", ms=7, zorder=5)
    else:
      out[i] = dict(color=IMPL_COLORS.get(i, PALETTE[k % len(PALETTE)]),
                    lw=1.6, marker=IMPL_MARKERS.get(i, "osD^v<>ph*"[k % 10]),
                    ms=6, zorder=3, alpha=0.9)
      k += 1
  return out


def _ms_axis(ax):
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0,
                                                      5.0, 7.0)))
  ax.yaxis.set_major_formatter(FuncFormatter(
      lambda v, _: f"{v:g}"))
  ax.yaxis.set_minor_formatter(NullFormatter())


def _bytes_axis(ax):
  from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
  ax.xaxis.set_major_locator(LogLocator(base=10))
  def tick(v, _):
    for unit, f in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
      if v >= f:
        return f"{v / f:g} {unit}"
    return f"{v:g} B"
  ax.xaxis.set_major_formatter(FuncFormatter(tick))
  ax.xaxis.set_minor_formatter(NullFormatter())


def seqlen_figure(records: list[dict], md: dict, path: Path, *,
                  suite: str = "dense", sources=()) -> Path | None:
  """Latency and speedup vs sequence length, one column per mode, for each
  shape family with >= 2 lengths (the family with most lengths first)."""
  by = index(records)
  shapes = shapes_of(records)
  fams: dict[tuple, list[tuple]] = {}
  for s in shapes:
    fams.setdefault(family_key(s), []).append(s)
  fams = {f: sorted(v, key=lambda s: s[3]) for f, v in fams.items()
          if len({s[3] for s in v}) >= 2}
  if not fams:
    return None
  plt = _plt()
  impls = impls_of(records)
  styles = _impl_styles(impls)
  fam_list = sorted(fams, key=lambda f: -len(fams[f]))
  modes = [m for m in MODES if any(ok(by.get((s, i, m))) for s in shapes
                                   for i in impls)]
  nrows = 2 * len(fam_list)
  fig, axes = plt.subplots(nrows, len(modes), figsize=(6.2 * len(modes) + 3.2,
                                                       3.4 * nrows),
                           squeeze=False)
  handles = {}
  for fi, fam in enumerate(fam_list):
    fs = fams[fam]
    tokens = {s[0] * s[3] for s in fs}
    bnote = (f"batch × length = {tokens.pop():,} tokens per call"
             if len(tokens) == 1 else "batch: " + ", ".join(
                 f"B{s[0]}@S{s[3]}" for s in fs))
    for mi, mode in enumerate(modes):
      ax_l, ax_s = axes[2 * fi][mi], axes[2 * fi + 1][mi]
      for impl in impls:
        pts = [(s[3], by[(s, impl, mode)]["ms"]) for s in fs
               if ok(by.get((s, impl, mode)))]
        if not pts:
          continue
        xs, ys = zip(*pts)
        h, = ax_l.plot(xs, ys, label=impl_name(impl, md), **styles[impl])
        handles.setdefault(impl, h)
        if impl != "ours":
          sp = [(s[3], by[(s, impl, mode)]["ms"] / by[(s, "ours", mode)]["ms"])
                for s in fs if ok(by.get((s, impl, mode)))
                and ok(by.get((s, "ours", mode)))]
          if sp:
            ax_s.plot(*zip(*sp), **styles[impl])
      ax_s.axhline(1.0, color=OURS_COLOR, lw=2.0, ls="--", zorder=4)
      lens = sorted({s[3] for s in fs})
      for ax in (ax_l, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lens)
        ax.set_xticklabels([f"{x:,}" for x in lens])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
      ax_l.set_yscale("log")
      _ms_axis(ax_l)
      ax_l.set_ylabel("median time per call (ms, log)")
      ax_l.set_title(f"{MODE_TITLE[mode]} — {family_label(fam)}\n{bnote}",
                     fontsize=10.5)
      ax_s.set_ylabel("competitor ÷ foldax time\n(> 1: foldax faster)")
      ax_s.set_xlabel("sequence length (tokens)")
  fig.legend([handles[i] for i in impls if i in handles],
             [impl_name(i, md) for i in impls if i in handles],
             loc="center right", frameon=False, bbox_to_anchor=(1.0, 0.5))
  gpu = device_label(md)
  fig.suptitle(f"How does time grow with sequence length? ({suite}, {gpu})")
  _footer(fig, provenance(md, list(sources)))
  fig.align_ylabels()
  right = 1 - 3.0 / (6.2 * len(modes) + 3.2)
  fig.tight_layout(rect=(0, 0.03, right, 0.97))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def memory_figure(records: list[dict], md: dict, path: Path, *,
                  suite: str = "dense", sources=()) -> Path | None:
  """Horizontal bars (log x) of peak memory per implementation, one panel per
  shape; forward+backward dark, forward light."""
  by = index(records)
  shapes = shapes_of(records)
  impls = [i for i in impls_of(records)
           if any(by.get((s, i, m), {}).get("peak_mem_bytes")
                  for s in shapes for m in MODES)]
  if not impls:
    return None
  plt = _plt()
  import matplotlib.patches as mpatches
  ncol = min(2, len(shapes))
  nrow = math.ceil(len(shapes) / ncol)
  fig, axes = plt.subplots(nrow, ncol, figsize=(3.0 + 5.4 * ncol, 0.9 + 0.48 *
                                                len(impls) * nrow + 0.9 * nrow),
                           squeeze=False)
  for ax in axes.flat[len(shapes):]:
    ax.axis("off")
  col_of = {id(ax): c for r_ in axes for c, ax in enumerate(r_)}
  allv = [by[(s, i, m)]["peak_mem_bytes"] for s in shapes for i in impls
          for m in MODES if by.get((s, i, m), {}).get("peak_mem_bytes")]
  lo, hi = min(allv), max(allv)
  for ax, s in zip(axes.flat, shapes):
    ys = list(range(len(impls)))[::-1]
    ours_fb = (by.get((s, "ours", "fwd+bwd")) or {}).get("peak_mem_bytes")
    for y, impl in zip(ys, impls):
      col = OURS_COLOR if impl == "ours" else "#4c72b0"
      fb = (by.get((s, impl, "fwd+bwd")) or {}).get("peak_mem_bytes")
      fw = (by.get((s, impl, "fwd")) or {}).get("peak_mem_bytes")
      if fb:
        ax.barh(y + 0.19, fb, height=0.38, color=col)
        lab = fmt_bytes(fb)
        if ours_fb and impl != "ours":
          lab += f"  ({fb / ours_fb:.1f}× ours)"
        ax.text(fb * 1.08, y + 0.19, lab, va="center", fontsize=8)
      if fw:
        ax.barh(y - 0.19, fw, height=0.38, color=col, alpha=0.35)
        ax.text(fw * 1.08, y - 0.19, fmt_bytes(fw), va="center", fontsize=7.5,
                color="#555555")
    ax.set_yticks(ys)
    if col_of[id(ax)] == 0:
      ax.set_yticklabels([impl_name(i, md) for i in impls], fontsize=8.5)
      for t, impl in zip(ax.get_yticklabels(), impls):
        if impl == "ours":
          t.set_color(OURS_COLOR)
          t.set_fontweight("bold")
    else:
      ax.set_yticklabels([])
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.5, hi * 8)
    _bytes_axis(ax)
    ax.set_title(shape_label(s), fontsize=10.5)
    ax.set_xlabel("peak memory one call adds over its inputs (log scale)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.tick_params(axis="y", length=0)
  handles = [mpatches.Patch(color="#4c72b0", label="forward + backward"),
             mpatches.Patch(color="#4c72b0", alpha=0.35, label="forward"),
             mpatches.Patch(color=OURS_COLOR, label="foldax (ours)")]
  fig.legend(handles=handles, loc="upper center", ncol=3, frameon=False,
             bbox_to_anchor=(0.5, 0.955))
  gpu = device_label(md)
  fig.suptitle(f"How much memory does attention need? ({suite}, {gpu})")
  conv = (md.get("conventions") or {}).get("peak_mem_bytes", "")
  _footer(fig, (("JAX: XLA buffer assignment (temporaries + outputs); "
                 "torch: max_memory_allocated after a reset, minus what was "
                 "allocated before the call.\n" if conv else "")
                + provenance(md, list(sources))))
  fig.tight_layout(rect=(0, 0.045, 1, 0.93))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def _first(r: dict, keys) -> Any:
  for k in keys:
    if r.get(k) is not None:
      return k, r[k]
  return None, None


def decode_bw(r: dict) -> float | None:
  """Achieved bandwidth of a decode record in TB/s, whatever its key."""
  _, bw = _first(r, BW_KEYS_TBS)
  if bw is None:
    _, g = _first(r, BW_KEYS_GBS)
    bw = g / 1e3 if g is not None else None
  return None if bw is None else float(bw)


def decode_shape(r: dict) -> str:
  _, ctx = _first(r, CTX_KEYS)
  bits = []
  for k in ("B", "batch"):
    if r.get(k) is not None:
      bits.append(f"B{r[k]}")
      break
  if ctx is not None:
    bits.append(f"context {_tokens(ctx)}")
  if r.get("Hq") is not None and r.get("Hkv") is not None:
    bits.append(f"H{r['Hq']}/KV{r['Hkv']}")
  for k in ("D", "head_dim"):
    if r.get(k) is not None:
      bits.append(f"D{r[k]}")
      break
  if r.get("dtype"):
    bits.append(str(r["dtype"]))
  return " ".join(bits)


def decode_groups(records: list[dict]) -> dict:
  """{shape label: {impl: record}} for decode records that carry a time or
  an error (records of other kinds, e.g. accuracy rows, are left out)."""
  out: dict[str, dict] = {}
  for r in records:
    if "impl" not in r or r.get("mode") in MODES or r.get("mode") == "check":
      continue
    if r.get("ms") is None and decode_bw(r) is None and not r.get("error"):
      continue
    out.setdefault(decode_shape(r), {})[r["impl"]] = r
  return out


def _tokens(x: float) -> str:
  x = int(x)
  if x >= 1024 and x % 1024 == 0:
    return f"{x // 1024}k"
  return f"{x:,}"


def decode_figure(records: list[dict], md: dict, path: Path, *,
                  sources=()) -> Path | None:
  """Horizontal bars of achieved TB/s per implementation, one panel per
  decode shape, with the GPU's HBM peak marked."""
  groups = {k: v for k, v in decode_groups(records).items()
            if any(decode_bw(r) for r in v.values())}
  if not groups:
    return None
  plt = _plt()
  impls = []
  for g in groups.values():
    for i, r in g.items():
      if decode_bw(r) and i not in impls:
        impls.append(i)
  impls.sort(key=lambda i: (0 if i == "ours" else 1 if i.startswith("ours")
                            else 2, IMPL_ORDER.index(i) if i in IMPL_ORDER
                            else len(IMPL_ORDER), i))
  n = len(groups)
  ncol = min(2, n)
  nrow = math.ceil(n / ncol)
  fig_w = 3.2 + 5.6 * ncol
  fig_h = 1.6 + nrow * (0.9 + 0.42 * len(impls))
  fig, axes = plt.subplots(nrow, ncol, figsize=(fig_w, fig_h), squeeze=False)
  for ax in axes.flat[n:]:
    ax.axis("off")
  gpu = str(md.get("gpu_name") or "")
  peak = next((v for k, v in HBM_PEAK_TBS.items() if k in gpu), None)
  top = max([peak or 0] + [decode_bw(r) or 0 for g in groups.values()
                           for r in g.values()])
  for k, (ax, (label, g)) in enumerate(zip(axes.flat, groups.items())):
    ys = list(range(len(impls)))[::-1]
    for y, impl in zip(ys, impls):
      r = g.get(impl)
      bw = decode_bw(r) if r else None
      col = OURS_COLOR if impl == "ours" else (
          "#f4a09c" if impl.startswith("ours") else "#4c72b0")
      if bw:
        ax.barh(y, bw, height=0.65, color=col)
        txt = f"{bw:.2f} TB/s"
        if r.get("ms") is not None:
          txt += f"  ·  {fmt_ms(r['ms'])} ms"
        ax.text(bw + top * 0.01, y, txt, va="center", fontsize=8)
      else:
        why = "error" if (r or {}).get("error") else "not run"
        ax.text(top * 0.01, y, why, va="center", fontsize=8, color="#777777")
    if peak:
      ax.axvline(peak, color="#444444", ls=":", lw=1.3)
      ax.text(peak, len(impls) - 0.45, f"HBM peak {peak} TB/s ", ha="right",
              va="bottom", fontsize=8, color="#444444")
    ax.set_xlim(0, top * 1.35)
    ax.set_ylim(-0.6, len(impls) - 0.1)
    ax.set_yticks(ys)
    if k % ncol == 0:
      ax.set_yticklabels([impl_name(i, md) for i in impls], fontsize=8.5)
      for t, impl in zip(ax.get_yticklabels(), impls):
        if impl == "ours":
          t.set_color(OURS_COLOR)
          t.set_fontweight("bold")
    else:
      ax.set_yticklabels([])
    ax.tick_params(axis="y", length=0)
    ax.set_title(label, fontsize=10.5)
    ax.set_xlabel("achieved bandwidth (TB/s; higher is better)")
    ax.grid(True, axis="x", alpha=0.3)
  fig.suptitle("How close to the memory bandwidth does decode get? "
               f"({device_label(md)})")
  conv = (md.get("conventions") or {})
  note = ("bandwidth = bytes of K and V read per step ÷ median step time"
          if not conv.get("bandwidth") else str(conv["bandwidth"]))
  _footer(fig, note + ".\n" + provenance(md, list(sources)))
  fig.tight_layout(rect=(0, 0.5 / fig_h, 1, 1 - 0.45 / fig_h))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


# ----------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------
def _cell(r: dict | None, with_tflops: bool = True) -> str:
  if not r:
    return ""
  if not ok(r):
    e = str(r.get("error") or "")
    return "skipped" if e.startswith("skipped") else "error"
  s = f"{fmt_ms(r['ms'])}"
  t = r.get("tflops")
  if with_tflops and t is not None:
    s += f" ({t:.0f})" if t >= 10 else f" ({t:.2g})"
  return s


def suite_table(name: str, suite: dict, md: dict) -> list[str]:
  recs = suite.get("records", [])
  by = index(recs)
  shapes = shapes_of(recs)
  impls = [i for i in impls_of(recs)]
  failed = sorted({r["impl"] for r in recs if r.get("mode") in MODES
                   and not ok(r)} - set(impls))
  lines: list[str] = []
  has_tflops = any(r.get("tflops") for r in recs)
  for s in shapes:
    lines.append(f"\n**{shape_label(s)}**\n")
    unit = " ms (TFLOP/s)" if has_tflops else " ms"
    hdr = ["implementation", "forward" + unit, "forward+backward" + unit,
           "foldax speedup fwd / fwd+bwd", "peak memory fwd+bwd",
           "backward bitwise repeatable"]
    lines.append("| " + " | ".join(hdr) + " |")
    lines.append("|---|---:|---:|---:|---:|---|")
    o = {m: by.get((s, "ours", m)) for m in MODES}
    for impl in impls + failed:
      rs = {m: by.get((s, impl, m)) for m in MODES}
      if not any(rs.values()):
        continue
      sp = []
      for m in MODES:
        if impl != "ours" and ok(rs[m]) and ok(o[m]):
          sp.append(f"{rs[m]['ms'] / o[m]['ms']:.2f}×")
        else:
          sp.append("–")
      rep = (rs["fwd+bwd"] or {}).get("bitwise_repeatable")
      name_ = impl_name(impl, md)
      if impl == "ours":
        name_ = f"**{name_}**"
      mem = fmt_bytes((rs["fwd+bwd"] or {}).get("peak_mem_bytes"))
      lines.append("| " + " | ".join([
          name_, _cell(rs["fwd"], has_tflops) or "–",
          _cell(rs["fwd+bwd"], has_tflops) or "–",
          "–" if impl == "ours" else " / ".join(sp), mem,
          "–" if rep is None else ("yes" if rep else "**no**")]) + " |")
  ovh = [r for r in recs if r.get("overhead_us") is not None]
  if ovh:
    lines.append("\nBridge overhead (bridge time minus calling JAX directly):"
                 " " + "; ".join(f"{shape_label(shape_key(r))} {r['mode']}: "
                                 f"{r['overhead_us']:.0f} µs" for r in ovh))
  checks = [r for r in recs if r.get("mode") == "check"
            and any(k.startswith("rel_err") for k in r)]
  if checks:
    lines.append("\nAccuracy of foldax (relative L2 error against "
                 f"{checks[0].get('reference', 'the reference')}):\n")
    lines.append("| shape | out | dq | dk | dv |")
    lines.append("|---|---:|---:|---:|---:|")
    for r in checks:
      lines.append("| " + " | ".join(
          [shape_label(shape_key(r))] + [
              f"{r[f'rel_err_{k}']:.1e}" if r.get(f"rel_err_{k}") is not None
              else "–" for k in ("out", "dq", "dk", "dv")]) + " |")
  return lines


def decode_table(suite: dict, md: dict) -> list[str]:
  groups = decode_groups(suite.get("records", []))
  if not groups:
    return []
  lines = []
  for label, g in groups.items():
    lines.append(f"\n**{label}**\n")
    lines.append("| implementation | time per step (ms) | TB/s | tokens/s | "
                 "foldax speedup | peak memory | bitwise repeatable |")
    lines.append("|---|---:|---:|---:|---:|---:|---|")
    o = g.get("ours")
    order = sorted(g, key=lambda i: (0 if i == "ours" else 1 if
                                     i.startswith("ours") else 2, i))
    for impl in order:
      r = g[impl]
      bw = decode_bw(r)
      rep = r.get("bitwise_repeatable")
      sp = (f"{r['ms'] / o['ms']:.2f}×" if impl != "ours" and ok(o) and ok(r)
            else "–")
      name = impl_name(impl, md)
      lines.append("| " + " | ".join([
          f"**{name}**" if impl == "ours" else name,
          fmt_ms(r["ms"]) if ok(r) else ("error" if r.get("error") else "–"),
          f"{bw:.2f}" if bw is not None else "–",
          f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "–",
          sp, fmt_bytes(r.get("peak_mem_bytes")),
          "–" if rep is None else ("yes" if rep else "**no**")]) + " |")
  return lines


def write_table(data: dict, out_dir: Path, figures: list[Path]) -> Path:
  md = data["metadata"]
  v = md.get("versions") or {}
  L = ["# Benchmark results", ""]
  gpu = device_label(md)
  cc = md.get("compute_capability") or md.get("jax_compute_capability")
  L.append(f"- {'GPU' if md.get('gpu_name') else 'device'}: {gpu}" + (f" (compute capability {cc})" if cc else "")
           + (f", driver {md['driver']}" if md.get("driver") else ""))
  L.append(f"- date: {md.get('date', '?')}; commit: "
           f"{md.get('git_commit', '?')}")
  vs = ", ".join(f"{k} {x}" for k, x in v.items() if x)
  if vs:
    L.append(f"- versions: {vs}")
  if md.get("device_command"):
    L.append(f"- command (device): `{md['device_command']}`")
  if md.get("command"):
    L.append(f"- command: `{md['command']}`")
  L.append("- source JSON: " + ", ".join(
      f"[`{Path(s).name}`]({os.path.relpath(Path(s).resolve(), out_dir.resolve())})"
      for s in data["sources"]))
  def rel(p):
    p = Path(p).resolve()
    try:
      return str(p.relative_to(REPO))
    except ValueError:
      return str(p)
  L.append("- figures and this table: `python -m benchmarks.plot "
           + " ".join(rel(s) for s in data["sources"])
           + f" --output-dir {rel(out_dir)}/`")
  conv = md.get("conventions") or {}
  if conv:
    L.append("\nTimes are medians; in parentheses TFLOP/s "
             f"({conv.get('flops', '')}). Speedup = competitor's time ÷ "
             "foldax's time (> 1: foldax is faster). Peak memory: bytes one "
             "call adds over its inputs.")
  if figures:
    L.append("\nFigures: " + ", ".join(f"[{p.stem}]({p.name})"
                                       for p in figures))
  for name, suite in data["suites"].items():
    L.append(f"\n## {name}")
    status = suite.get("status", "ok")
    if status != "ok" or suite.get("note"):
      L.append(f"\nstatus: {status}" + (f" — {suite['note']}"
                                        if suite.get("note") else ""))
    if name == "decode":
      L.extend(decode_table(suite, md))
      if any(r.get("mode") in MODES for r in suite.get("records", [])):
        L.extend(suite_table(name, suite, md))
    elif name == "bridge":
      L.extend(bridge_table(suite, md))
    elif name == "deberta":
      smd = dict(md)
      smd.update({k: v for k, v in (suite.get("metadata") or {}).items()
                  if k == "versions" and v})
      L.extend(deberta_table(suite, smd))
      rest = deberta_split(suite.get("records", []))[1]
      if rest:
        L.append("\n### Attention op alone (jax_api.deberta."
                 "disentangled_attention)")
        L.extend(suite_table(name, dict(suite, records=rest), md))
    else:
      L.extend(suite_table(name, suite, md))
  p = out_dir / "table.md"
  p.write_text("\n".join(L).rstrip() + "\n")
  return p


# ----------------------------------------------------------------------------
# Bridge suite (benchmarks.bridge): overhead, ratio, Llama training step
# ----------------------------------------------------------------------------
def _bridge_attn(records: list[dict]) -> dict:
  """{(S, mode): {impl: record}} of the bridge suite's attention records."""
  out: dict = {}
  for r in records:
    if r.get("mode") in MODES and r.get("impl") and r.get("S") is not None:
      out.setdefault((r["S"], r["mode"]), {})[r["impl"]] = r
  return out


def _bridge_llama(records: list[dict]) -> dict:
  return {r["impl"]: r for r in records
          if r.get("model") == "llama" and r.get("mode") == "train_step"}


BRIDGE_TARGETS = {
    "overhead_fwd": "overhead fwd ≤ 25 µs",
    "overhead_fwd_bwd": "overhead fwd+bwd ≤ 25 µs",
    "ratio_fwd": "long fwd ≤ 1.03×",
    "ratio_fwd_bwd": "long fwd+bwd ≤ 1.03×",
    "llama_train_step": "Llama step ≤ sdpa",
    "llama_fold_grads_bitwise": "fold grads bitwise"}


def _met_word(t: dict | None) -> str:
  if not t or t.get("met") is None:
    return "not measured"
  return "met" if t["met"] else "NOT met"



def _finish_mode_axis(ax, xs, modes, ylabel: str, title: str):
  """x axis of the bridge panels (one group per mode), labels and legend."""
  ax.set_xticks(xs)
  ax.set_xticklabels([MODE_TITLE[m] for m in modes])
  ax.tick_params(axis="x", pad=27)
  ax.set_xlim(-0.6, len(modes) - 0.4)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=11)
  ax.legend(loc="upper left", fontsize=8.5, frameon=False)
  ax.grid(True, axis="y", alpha=0.3)

def bridge_figure(records: list[dict], md: dict, smd: dict, path: Path, *,
                  sources=()) -> Path | None:
  """Three panels: the bridge's per-call overhead at the small shape (µs,
  the ≤ 25 µs target), bridge ÷ JAX at the long shape (the ≤ 1.03 target),
  and the Llama training step with attn_implementation fold vs sdpa."""
  attn = _bridge_attn(records)
  llama = _bridge_llama(records)
  brs = {k: v["bridge"] for k, v in attn.items()
         if ok(v.get("bridge")) and v["bridge"].get("overhead_us") is not None}
  if not brs and not any(ok(r) for r in llama.values()):
    return None
  plt = _plt()
  targets = smd.get("targets") or {}
  seqs = sorted({s for s, _ in brs})
  small = seqs[0] if seqs else None
  large = seqs[-1] if len(seqs) > 1 else None
  fig, axes = plt.subplots(1, 3, figsize=(16.5, 5.6),
                           gridspec_kw=dict(width_ratios=[1.15, 1, 1]))
  col_b = IMPL_COLORS["bridge"]
  modes = [m for m in MODES if any(k[1] == m for k in brs)]

  def shape_of(r):
    return f"B{r['B']} H{r['Hq']} S{r['S']} D{r['D']} {r.get('dtype', '')}"

  def subtitle(seq):
    r = brs.get((seq, modes[0])) if modes else None
    return shape_of(r) + " causal" if r else ""

  # (a) per-call overhead, µs
  ax = axes[0]
  if small is not None:
    xs = list(range(len(modes)))
    w = 0.36
    vals, pvals = [], []
    for x, m in zip(xs, modes):
      r = brs.get((small, m))
      v = r["overhead_us"] if r else 0
      pv = (r or {}).get("overhead_pipelined_us")
      vals.append(v)
      pvals.append(pv)
      ax.bar(x - w / 2, v, w, color=col_b, label="synchronised per call"
             if x == 0 else None)
      ax.text(x - w / 2, max(v, 0), f"{v:.1f} µs", ha="center",
              va="bottom", fontsize=9, fontweight="bold")
      if pv is not None:
        ax.bar(x + w / 2, pv, w, color="white", edgecolor=col_b, hatch="//",
               label="pipelined (back-to-back)" if x == 0 else None)
        ax.text(x + w / 2, max(pv, 0), f"{pv:.1f}", ha="center",
                va="bottom", fontsize=8.5)
      if r:
        ax.text(x, -0.015, f"JAX {r['ms'] / r['ratio'] * 1e3:.0f} µs\n"
                f"bridge {r['ms'] * 1e3:.0f} µs", ha="center", va="top",
                fontsize=8, color="#555555",
                transform=ax.get_xaxis_transform())
    lim = (targets.get("overhead_fwd") or {}).get("limit_us", 25.0)
    top = max([lim * 1.25] + [v for v in vals + pvals if v is not None])
    ax.axhline(lim, color="#2ca02c", ls="--", lw=1.4,
               label=f"target ≤ {lim:g} µs")
    naive = 213.0
    if naive <= top * 1.6:
      ax.axhline(naive, color="#888888", ls=":", lw=1.2,
                 label="naive DLPack round trip (213 µs)")
      top = max(top, naive)
    ax.set_ylim(min(0, min(v for v in vals + pvals if v is not None) * 1.2),
                top * 1.45)
    _finish_mode_axis(ax, xs, modes, "bridge time − JAX time per call (µs)",
                      "How much does the bridge add per call?\n" + subtitle(small))
  else:
    ax.axis("off")

  # (b) bridge / JAX at the long shape
  ax = axes[1]
  if large is not None:
    xs = list(range(len(modes)))
    w = 0.36
    vals = []
    for x, m in zip(xs, modes):
      r = brs.get((large, m))
      if not r:
        continue
      v, pv = r["ratio"], r.get("ratio_pipelined")
      vals += [v] + ([pv] if pv is not None else [])
      ax.bar(x - w / 2, v - 1, w, bottom=1, color=col_b,
             label="synchronised per call" if x == 0 else None)
      ax.text(x - w / 2, max(v, 1), f"{v:.3f}", ha="center", va="bottom",
              fontsize=9, fontweight="bold")
      if pv is not None:
        ax.bar(x + w / 2, pv - 1, w, bottom=1, color="white", edgecolor=col_b,
               hatch="//", label="pipelined" if x == 0 else None)
        ax.text(x + w / 2, max(pv, 1), f"{pv:.3f}", ha="center", va="bottom",
                fontsize=8.5)
      ax.text(x, -0.015, f"JAX {fmt_ms(r['ms'] / r['ratio'])} ms\nbridge "
              f"{fmt_ms(r['ms'])} ms", ha="center", va="top", fontsize=8,
              color="#555555", transform=ax.get_xaxis_transform())
    lim = (targets.get("ratio_fwd") or {}).get("limit", 1.03)
    ax.axhline(1.0, color="#444444", lw=0.8)
    ax.axhline(lim, color="#2ca02c", ls="--", lw=1.4,
               label=f"target ≤ {lim:g}×")
    hi = max([lim + 0.02] + vals)
    lo = min([0.98] + vals)
    pad = (hi - lo) * 0.15
    ax.set_ylim(lo - pad, hi + 3 * pad)
    _finish_mode_axis(ax, xs, modes, "bridge time ÷ JAX time (1 = no cost)",
                      "Does the bridge cost anything on long sequences?\n" + subtitle(large))
  else:
    ax.axis("off")

  # (c) Llama training step
  ax = axes[2]
  impls = [i for i in ("fold", "sdpa") if i in llama]
  if impls:
    names = {"fold": 'attn_implementation="fold"\n(foldax via torch_bridge)',
             "sdpa": 'attn_implementation="sdpa"\n'
                     + ("(torch flash)" if "flash" in str(
                         llama.get("sdpa", {}).get("sdpa_backend", ""))
                        else "(torch SDPA)")}
    ys = list(range(len(impls)))[::-1]
    top = max([r.get("ms") or 0 for r in llama.values()] + [1e-9])
    for y, i in zip(ys, impls):
      r = llama[i]
      col = IMPL_COLORS["bridge"] if i == "fold" else IMPL_COLORS["torch_sdpa"]
      rep = r.get("grads_bitwise_repeatable")
      rep_s = ("gradients bitwise repeatable" if rep else
               "gradients NOT bitwise repeatable" if rep is False else "")
      if ok(r):
        ax.barh(y, r["ms"], height=0.55, color=col)
        ax.text(r["ms"] + top * 0.02, y + 0.08,
                f"{fmt_ms(r['ms'])} ms · {r.get('tokens_per_s', 0):,.0f} tok/s",
                va="bottom", fontsize=8.5)
        ax.text(r["ms"] + top * 0.02, y - 0.05, rep_s, va="top", fontsize=8.5,
                color="#2ca02c" if rep else "#d62728")
      else:
        ax.text(top * 0.02, y, "error: " + str(r.get("error"))[:60],
                va="center", fontsize=8, color="#777777")
    ax.set_yticks(ys)
    ax.set_yticklabels([names[i] for i in impls], fontsize=8.5)
    ax.set_ylim(-0.6, len(impls) - 0.4)
    ax.set_xlim(0, top * 1.9)
    ax.set_xlabel("training step, median (ms; lower is better)")
    f = llama.get("fold", {})
    ratio = f.get("ratio_vs_sdpa")
    cfgs = (f"Llama h{f.get('hidden')} L{f.get('layers')} "
            f"H{f.get('Hq')}/KV{f.get('Hkv')} · B{f.get('B')} S{f.get('S')} "
            f"{f.get('dtype', '')}")
    ax.set_title("Does a Llama train as fast with fold?\n" + cfgs,
                 fontsize=11)
    if ratio:
      ax.text(0.98, 0.02, f"fold ÷ sdpa = {ratio:.3f}\n(< 1: fold faster)",
              transform=ax.transAxes, ha="right", va="bottom", fontsize=9,
              fontweight="bold")
    ax.grid(True, axis="x", alpha=0.3)
  else:
    ax.axis("off")

  summary = [f"{BRIDGE_TARGETS.get(k, k)}: {_met_word(v)}"
             for k, v in targets.items()]
  fig.suptitle("foldax from PyTorch (torch_bridge) — " + device_label(md))
  step = (llama.get("fold") or {}).get("step", "")
  timer = (llama.get("fold") or {}).get("timer", "")
  note = ("Targets: " + "; ".join(summary) + ".\n" if summary else "")
  note += ("Per call: host time from call to synchronised results, median "
           "over interleaved rounds; JAX = the same jitted functions on JAX "
           "arrays." + (f" Llama step = {step} ({timer}), median."
                        if step else "") + "\n" + provenance(md, list(sources)))
  _footer(fig, note)
  fig.tight_layout(rect=(0, 0.1, 1, 0.95))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def bridge_table(suite: dict, md: dict) -> list[str]:
  recs = suite.get("records", [])
  smd = suite.get("metadata") or {}
  L: list[str] = []
  targets = smd.get("targets") or {}
  if targets:
    L.append("\n**Targets**\n")
    L.append("| target | measured | limit | |")
    L.append("|---|---:|---:|---|")
    for name, t in targets.items():
      if "value_us" in t:
        val = "–" if t["value_us"] is None else f"{t['value_us']:.1f} µs"
        if t.get("pipelined_us") is not None:
          val += f" (pipelined {t['pipelined_us']:.1f})"
        lim = f"≤ {t['limit_us']:g} µs"
      elif name == "llama_fold_grads_bitwise":
        val = (f"{t.get('mismatches')} of {t.get('tensors')} gradients "
               f"differ over {t.get('runs')} runs" if t.get("tensors") else "–")
        sd = t.get("sdpa_grads_bitwise")
        if sd is not None:
          val += f" (sdpa: {'repeatable' if sd else 'not repeatable'})"
        lim = "bitwise"
      else:
        v = t.get("value")
        val = "–" if v is None else f"{v:.3f}×"
        if t.get("pipelined") is not None:
          val += f" (pipelined {t['pipelined']:.3f}×)"
        lim = f"≤ {t.get('limit', 1):g}×"
      what = BRIDGE_TARGETS.get(name, name)
      if t.get("shape"):
        what += f" ({t['shape']}, {t.get('mode')})"
      word = _met_word(t)
      if t.get("met_pipelined") is not None and t["met_pipelined"] != t.get(
          "met"):
        word += (" (pipelined: " + ("met" if t["met_pipelined"] else
                                     "NOT met") + ")")
      L.append(f"| {what} | {val} | {lim} | {word} |")
  attn = _bridge_attn(recs)
  if attn:
    L.append("\n**Per call** (µs: host time from the call to synchronised "
             "results, median; pipelined: back-to-back calls)\n")
    L.append("| shape | mode | implementation | per call (µs) | pipelined "
             "(µs) | bridge − JAX (µs) | bridge ÷ JAX |")
    L.append("|---|---|---|---:|---:|---:|---:|")
    for (S, mode), g in sorted(attn.items()):
      order = [i for i in ("jax_direct", "bridge", "jax_api", "torch_sdpa")
               if i in g] + sorted(set(g) - {"jax_direct", "bridge",
                                             "jax_api", "torch_sdpa"})
      for i in order:
        r = g[i]
        shp = f"B{r['B']} H{r['Hq']} S{S} D{r['D']} {r.get('dtype', '')}"
        if not ok(r):
          L.append(f"| {shp} | {mode} | {impl_name(i, md)} | error | | | |")
          continue
        ovh = (f"{r['overhead_us']:+.1f}" if r.get("overhead_us") is not None
               else "–")
        if r.get("overhead_pipelined_us") is not None:
          ovh += f" ({r['overhead_pipelined_us']:+.1f})"
        rat = f"{r['ratio']:.3f}" if r.get("ratio") else "–"
        if r.get("ratio_pipelined"):
          rat += f" ({r['ratio_pipelined']:.3f})"
        pipe = (f"{r['ms_pipelined'] * 1e3:.1f}" if r.get("ms_pipelined")
                is not None else "–")
        L.append(f"| {shp} | {mode} | {impl_name(i, md)} | "
                 f"{r['ms'] * 1e3:.1f} | {pipe} | {ovh} | {rat} |")
  parts = [r for r in recs if r.get("impl") == "bridge_parts"
           and r.get("import3_us") is not None]
  for r in parts:
    L.append(f"\nComponents at S{r['S']} (host cost, back-to-back): DLPack "
             f"import of q, k, v {r['import3_us']:.1f} µs, export of out, lse"
             f" {r['export2_us']:.1f} µs."
             + (f" Synchronisation floors: a trivial jitted JAX call + "
                f"block_until_ready {r['jax_trivial_call_us']:.1f} µs, a "
                f"trivial torch op + torch.cuda.synchronize "
                f"{r['torch_trivial_op_us']:.1f} µs." if
                r.get("jax_trivial_call_us") is not None else ""))
  llama = _bridge_llama(recs)
  if llama:
    f = llama.get("fold") or next(iter(llama.values()))
    L.append(f"\n**Llama training step** (h{f.get('hidden')}, "
             f"{f.get('layers')} layers, {f.get('Hq')} heads / {f.get('Hkv')}"
             f" kv, head dim {f.get('D')}, vocab {f.get('vocab')}, batch "
             f"{f.get('B')} × seq {f.get('S')}, {f.get('dtype')}, "
             f"{(f.get('n_params') or 0) / 1e6:.3g}M parameters; step = "
             f"{f.get('step')})\n")
    L.append("| attn_implementation | step (ms) | tokens/s | ÷ sdpa | "
             "gradients bitwise repeatable | loss | torch peak memory |")
    L.append("|---|---:|---:|---:|---|---:|---:|")
    for i in ("fold", "sdpa"):
      r = llama.get(i)
      if not r:
        continue
      rep = r.get("grads_bitwise_repeatable")
      rep_s = ("–" if rep is None else "yes" if rep else
               f"**no** ({r.get('grad_mismatches')} of "
               f"{r.get('grad_tensors')} differ)")
      name = i + (f" ({r['sdpa_backend']})" if r.get("sdpa_backend") else "")
      L.append("| " + " | ".join([
          name, fmt_ms(r["ms"]) if ok(r) else "error",
          f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "–",
          f"{r['ratio_vs_sdpa']:.3f}" if r.get("ratio_vs_sdpa") else "–",
          rep_s, f"{r['loss']:.4f}" if r.get("loss") is not None else "–",
          fmt_bytes(r.get("torch_peak_mem_bytes"))]) + " |")
    if f.get("grad_rel_l2_vs_sdpa") is not None:
      L.append(f"\nfold vs sdpa from the same weights: loss difference "
               f"{f.get('loss_minus_sdpa', 0):+.2e}, gradients' relative L2 "
               f"difference {f['grad_rel_l2_vs_sdpa']:.2e}.")
    errs = [f"{i}: {r['error']}" for i, r in llama.items() if r.get("error")]
    if errs:
      L.append("\nerrors: " + "; ".join(errs))
  return L


# ----------------------------------------------------------------------------
# DeBERTa model suite (benchmarks/deberta.py: records with kind="model")
# ----------------------------------------------------------------------------
DEBERTA_ORDER = ("fold_jax", "fold_jax_ffn", "fold_jax_remat", "fold_torch",
                 "disentangled_flash", "flashdeberta", "hf_eager")
DEBERTA_OURS = ("fold_jax", "fold_jax_ffn", "fold_jax_remat", "fold_torch")
DEBERTA_NAMES = {
    "fold_jax": "foldax JAX model (jax_api.deberta)",
    "fold_jax_ffn": "foldax JAX model, remat='ffn'",
    "fold_jax_remat": "foldax JAX model, remat=True",
    "fold_torch": "HF + foldax torch_bridge.optimize_deberta",
    "disentangled_flash": "disentangled-flash",
    "flashdeberta": "flashdeberta",
    "hf_eager": "Hugging Face eager",
}
DEBERTA_PKG = {"disentangled_flash": "disentangled-flash",
               "flashdeberta": "flashdeberta", "hf_eager": "transformers"}
DEBERTA_COLORS = {"fold_jax": OURS_COLOR, "fold_jax_ffn": "#e377c2",
                  "fold_jax_remat": "#9467bd",
                  "fold_torch": "#ff7f0e",
                  "disentangled_flash": "#1f77b4", "flashdeberta": "#2ca02c",
                  "hf_eager": "#7f7f7f"}
DEBERTA_POINT_ORDER = ("fwd-b16-l512", "fwd-b16-l512-ragged", "fwd-b1-l2048",
                       "fwd-b4-l2048", "fwd-b1-l8192", "train-b8-l512",
                       "train-b2-l2048")
DEBERTA_TARGET_LINES = {"fwd-b4-l2048": 3.0, "train-b8-l512": 1.5,
                        "train-b2-l2048": 1.5}


def deberta_split(records: list[dict]) -> tuple[list[dict], list[dict]]:
  """(model-level records, the rest: kernel-level records for the generic
  figures)."""
  model = [r for r in records if r.get("kind") == "model"]
  return model, [r for r in records if r.get("kind") != "model"]


def deberta_name(impl: str, md: dict | None = None) -> str:
  n = DEBERTA_NAMES.get(impl, impl)
  pkg = DEBERTA_PKG.get(impl)
  v = ((md or {}).get("versions") or {}).get(pkg) if pkg else None
  return f"{n} {v}" if v else n


def deberta_points(model: list[dict]) -> dict[str, dict[str, dict]]:
  """{point: {impl: record}} in display order, the ratios recomputed from
  the times (so that merged files agree), last record of a pair wins."""
  by: dict[str, dict[str, dict]] = {}
  for r in model:
    by.setdefault(r["point"], {})[r["impl"]] = dict(r)
  for recs in by.values():
    for ref, key in (("hf_eager", "speedup_vs_hf_eager"),
                     ("disentangled_flash", "speedup_vs_disentangled_flash")):
      b = recs.get(ref)
      for impl, r in recs.items():
        r.pop(key, None)
        if impl != ref and ok(r) and ok(b):
          r[key] = b["ms"] / r["ms"]
  order = {p: i for i, p in enumerate(DEBERTA_POINT_ORDER)}
  first = {p: i for i, p in enumerate(by)}
  keys = sorted(by, key=lambda p: (0 if next(iter(by[p].values()))["mode"] ==
                                   "fwd" else 1, order.get(p, 99), first[p]))
  return {k: by[k] for k in keys}


def _deberta_impls(points: dict) -> list[str]:
  seen = {i for recs in points.values() for i in recs}
  return [i for i in DEBERTA_ORDER if i in seen] + sorted(
      seen - set(DEBERTA_ORDER))


def _point_title(recs: dict) -> str:
  r = next(iter(recs.values()))
  return str(r.get("label") or r.get("point"))


def _point_short(recs: dict) -> str:
  r = next(iter(recs.values()))
  return f"B{r.get('B')} L{r.get('L')}" + (" ragged" if r.get("ragged")
                                           else "")


def _model_note(md: dict) -> str:
  cfg = md.get("config") or {}
  if not cfg:
    return "DeBERTa-v3-base"
  nl = cfg.get("num_hidden_layers")
  return (f"{nl} layer{'' if nl == 1 else 's'}, hidden "
          f"{cfg.get('hidden_size')}, {cfg.get('num_attention_heads')} heads, "
          f"position_buckets {cfg.get('position_buckets')}, vocabulary "
          f"{cfg.get('vocab_size')}, random weights"
          + (" (smoke configuration)" if md.get("smoke") else ""))


def _mem_scale(nbytes_max: float) -> tuple[float, str]:
  return (2**30, "GiB") if nbytes_max >= 2**29 else (2**20, "MiB")


def _why(r: dict | None) -> str:
  e = str((r or {}).get("error") or "not run")
  if e.startswith("skipped"):
    return "skipped (budget)" if "budget" in e else "skipped"
  if "not installed" in e:
    return "not installed"
  return "error"


def deberta_forward_figure(model: list[dict], md: dict, path: Path, *,
                           sources=()) -> Path | None:
  """One panel per forward point: median time per implementation, with the
  speedup over Hugging Face eager."""
  pts = {p: v for p, v in deberta_points(model).items()
         if next(iter(v.values()))["mode"] == "fwd"}
  if not any(ok(r) for v in pts.values() for r in v.values()):
    return None
  plt = _plt()
  impls = _deberta_impls(pts)
  n = len(pts)
  ncol = min(3, n)
  nrow = math.ceil(n / ncol)
  fig_w = 3.6 + 4.6 * ncol
  fig_h = 1.7 + nrow * (0.9 + 0.42 * len(impls))
  fig, axes = plt.subplots(nrow, ncol, figsize=(fig_w, fig_h), squeeze=False)
  for ax in axes.flat[n:]:
    ax.axis("off")
  for k, (ax, (p, recs)) in enumerate(zip(axes.flat, pts.items())):
    ys = list(range(len(impls)))[::-1]
    top = max([r["ms"] for r in recs.values() if ok(r)] or [1.0])
    for y, impl in zip(ys, impls):
      r = recs.get(impl)
      if ok(r):
        ax.barh(y, r["ms"], height=0.66, color=DEBERTA_COLORS.get(impl,
                                                                 "#4c72b0"))
        txt = f"{fmt_ms(r['ms'])} ms"
        if r.get("speedup_vs_hf_eager"):
          txt += f"  ·  {r['speedup_vs_hf_eager']:.2f}× HF"
        ax.text(r["ms"] + top * 0.015, y, txt, va="center", fontsize=8)
      else:
        ax.text(top * 0.015, y, _why(r), va="center", fontsize=8,
                color="#777777", style="italic")
    ax.set_xlim(0, top * 1.6)
    ax.set_ylim(-0.6, len(impls) - 0.4)
    ax.set_yticks(ys)
    if k % ncol == 0:
      ax.set_yticklabels([deberta_name(i, md) for i in impls], fontsize=8.5)
      for t, impl in zip(ax.get_yticklabels(), impls):
        if impl in DEBERTA_OURS:
          t.set_color(DEBERTA_COLORS[impl])
          t.set_fontweight("bold")
    else:
      ax.set_yticklabels([])
    ax.tick_params(axis="y", length=0)
    ax.set_title(_point_title(recs), fontsize=10.5)
    ax.set_xlabel("median time per forward (ms; lower is better)")
    ax.grid(True, axis="x", alpha=0.3)
  fig.suptitle("How long does a DeBERTa-v3-base forward take? "
               f"({device_label(md)})")
  _footer(fig, _model_note(md) + "; [B, L] padding mask to every "
               "implementation.\n" + provenance(md, list(sources)))
  fig.tight_layout(rect=(0, 0.55 / fig_h, 1, 1 - 0.35 / fig_h))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def deberta_speedup_figure(model: list[dict], md: dict, path: Path, *,
                           sources=()) -> Path | None:
  """Grouped bars per point: speedup over Hugging Face eager (top) and over
  disentangled-flash (bottom), with the acceptance targets marked."""
  pts = deberta_points(model)
  impls = _deberta_impls(pts)
  rows = [("hf_eager", "speedup_vs_hf_eager", "Hugging Face eager"),
          ("disentangled_flash", "speedup_vs_disentangled_flash",
           "disentangled-flash")]
  rows = [x for x in rows if any(recs.get(i, {}).get(x[1])
                                 for recs in pts.values() for i in impls)]
  if not rows:
    return None
  plt = _plt()
  names = list(pts)
  fig_w = max(10.0, 2.2 + 1.55 * len(names))
  fig_h = 1.6 + 3.3 * len(rows)
  fig, axes = plt.subplots(len(rows), 1, figsize=(fig_w, fig_h),
                           squeeze=False)
  handles: dict = {}
  for ax, (ref, key, ref_name) in zip(axes[:, 0], rows):
    bars = [i for i in impls if i != ref and any(
        pts[p].get(i, {}).get(key) for p in names)]
    w = 0.8 / max(1, len(bars))
    vals = [pts[p][i][key] for p in names for i in bars
            if pts[p].get(i, {}).get(key)]
    lo, hi = min(vals + [1.0]), max(vals + [1.0])
    for j, impl in enumerate(bars):
      for x, p in enumerate(names):
        v = pts[p].get(impl, {}).get(key)
        if not v:
          continue
        xx = x - 0.4 + w * (j + 0.5)
        h = ax.bar(xx, v, width=w * 0.92, color=DEBERTA_COLORS.get(
            impl, "#4c72b0"))
        handles.setdefault(impl, h)
        ax.text(xx, v * 1.04, f"{v:.2f}×", ha="center", va="bottom",
                fontsize=7.5, rotation=90 if len(bars) > 3 else 0)
    ax.axhline(1.0, color="#333333", lw=1.2, ls="--")
    if ref == "hf_eager":
      for x, p in enumerate(names):
        t = DEBERTA_TARGET_LINES.get(p)
        if t:
          ax.plot([x - 0.45, x + 0.45], [t, t], color="black", lw=2.0)
          ax.text(x - 0.45, t * 1.05, f"target {t:g}×", va="bottom",
                  ha="left", fontsize=7.5, fontweight="bold")
          hi = max(hi, t)
    ax.set_yscale("log", base=2)
    ax.set_ylim(min(lo, 1.0) / 1.4, hi * 3.0)
    from matplotlib.ticker import FuncFormatter
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}×"))
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([_point_title(pts[p]).replace(" B", "\nB", 1)
                        for p in names], fontsize=8.5)
    ax.set_xlim(-0.6, len(names) - 0.1)
    ax.set_ylabel(f"{ref_name} time ÷ this time\n(> 1: faster)")
    ax.set_title(f"speedup over {ref_name}", fontsize=11)
    ax.grid(True, axis="y", alpha=0.3)
  order = [i for i in impls if i in handles]
  fig.legend([handles[i] for i in order], [deberta_name(i, md) for i in order],
             loc="upper center", ncol=len(order), frameon=False, fontsize=8.5,
             bbox_to_anchor=(0.5, 1 - 0.62 / fig_h))
  fig.suptitle("How much faster than what you use now? DeBERTa-v3-base "
               f"encoder ({device_label(md)})")
  _footer(fig, "Black bars: the acceptance targets (forward ≥ 3× HF eager "
               "at B4 L2048; training step ≥ 1.5× HF eager); dashed: 1×.\n"
          + provenance(md, list(sources)))
  fig.tight_layout(rect=(0, 0.5 / fig_h, 1, 1 - 0.85 / fig_h))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def deberta_train_figure(model: list[dict], md: dict, path: Path, *,
                         sources=()) -> Path | None:
  """Training step: time (left) and peak memory (right) per point."""
  pts = {p: v for p, v in deberta_points(model).items()
         if next(iter(v.values()))["mode"] == "train"}
  if not any(ok(r) for v in pts.values() for r in v.values()):
    return None
  plt = _plt()
  impls = _deberta_impls(pts)
  n = len(pts)
  fig_h = 1.5 + n * (0.9 + 0.45 * len(impls))
  fig, axes = plt.subplots(n, 2, figsize=(15.0, fig_h), squeeze=False)
  for row, (p, recs) in enumerate(pts.items()):
    ax_t, ax_m = axes[row]
    ys = list(range(len(impls)))[::-1]
    tmax = max([r["ms"] for r in recs.values() if ok(r)] or [1.0])
    mems = [r.get("peak_mem_bytes") for r in recs.values() if ok(r)
            and r.get("peak_mem_bytes")]
    unit, uname = _mem_scale(max(mems or [1]))
    mmax = max(mems or [1]) / unit
    df_mem = (recs.get("disentangled_flash") or {}).get("peak_mem_bytes")
    for y, impl in zip(ys, impls):
      r = recs.get(impl)
      col = DEBERTA_COLORS.get(impl, "#4c72b0")
      if not ok(r):
        for ax, top in ((ax_t, tmax), (ax_m, mmax)):
          ax.text(top * 0.015, y, _why(r), va="center", fontsize=8,
                  color="#777777", style="italic")
        continue
      ax_t.barh(y, r["ms"], height=0.66, color=col)
      txt = f"{fmt_ms(r['ms'])} ms"
      if r.get("speedup_vs_hf_eager"):
        txt += f"  ·  {r['speedup_vs_hf_eager']:.2f}× HF"
      ax_t.text(r["ms"] + tmax * 0.015, y, txt, va="center", fontsize=8)
      m = r.get("peak_mem_bytes")
      if m:
        g = m / unit
        ax_m.barh(y, g, height=0.66, color=col)
        lab = f"{g:.2f} {uname}"
        if df_mem and impl != "disentangled_flash":
          lab += f"  ({m / df_mem:.2f}× DF)"
        ax_m.text(g + mmax * 0.015, y, lab, va="center", fontsize=8)
      else:
        ax_m.text(mmax * 0.015, y, "not measured", va="center", fontsize=8,
                  color="#777777", style="italic")
    if df_mem:
      ax_m.axvline(df_mem / unit, color=DEBERTA_COLORS["disentangled_flash"],
                   ls="--", lw=1.2)
    ax_t.set_xlim(0, tmax * 1.6)
    ax_m.set_xlim(0, mmax * 1.6)
    for ax in (ax_t, ax_m):
      ax.set_ylim(-0.6, len(impls) - 0.4)
      ax.set_yticks(ys)
      ax.tick_params(axis="y", length=0)
      ax.grid(True, axis="x", alpha=0.3)
    ax_t.set_yticklabels([deberta_name(i, md) for i in impls], fontsize=8.5)
    for t, impl in zip(ax_t.get_yticklabels(), impls):
      if impl in DEBERTA_OURS:
        t.set_color(DEBERTA_COLORS[impl])
        t.set_fontweight("bold")
    ax_m.set_yticklabels([])
    title = _point_title(recs)
    ax_t.set_title(f"{title}: time per step", fontsize=10.5)
    ax_m.set_title(f"{title}: peak memory", fontsize=10.5)
    ax_t.set_xlabel("median time per training step (ms; lower is better)")
    ax_m.set_xlabel(f"parameters + peak a step allocates ({uname}; "
                    "dashed: disentangled-flash)")
  fig.suptitle("How fast and how big is a DeBERTa-v3-base training step? "
               f"({device_label(md)})")
  _footer(fig, _model_note(md) + "; bf16 parameters, dropout 0.1, loss = "
               "mean(h²), backward, SGD.\nMemory: torch max_memory_allocated "
               "(+ JAX-side bytes for the bridge); JAX: XLA buffer "
               "assignment.\n" + provenance(md, list(sources)))
  fig.tight_layout(rect=(0, 0.7 / fig_h, 1, 1 - 0.3 / fig_h))
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def deberta_table(suite: dict, md: dict) -> list[str]:
  model, _ = deberta_split(suite.get("records", []))
  if not model:
    return []
  pts = deberta_points(model)
  smd = suite.get("metadata") or {}
  impls = _deberta_impls(pts)
  L = ["\n### DeBERTa-v3-base encoder (whole model)\n"]
  if smd.get("config_note"):
    L.append(smd["config_note"] + ".")
  L.append("Speedups are time ratios from this run (> 1×: faster). "
           "Definitions: metadata.conventions of the JSON and "
           "benchmarks/deberta.py.")
  for mode, title in (("fwd", "fp16 forward: ms (× HF eager / × "
                       "disentangled-flash)"),
                      ("train", "bf16 training step: ms, peak memory (× HF "
                       "eager time; memory ÷ disentangled-flash's)")):
    names = [p for p, v in pts.items()
             if next(iter(v.values()))["mode"] == mode]
    if not names:
      continue
    L.append(f"\n**{title}**\n")
    L.append("| implementation | " + " | ".join(
        _point_short(pts[p]) for p in names) + " |")
    L.append("|---|" + "---:|" * len(names))
    for impl in impls:
      cells = []
      for p in names:
        r = pts[p].get(impl)
        if not r:
          cells.append("–")
          continue
        if not ok(r):
          cells.append(_why(r))
          continue
        c = f"{fmt_ms(r['ms'])}"
        if mode == "train" and r.get("peak_mem_bytes"):
          c += f", {r['peak_mem_bytes'] / 2**30:.2f} GiB"
        sh = r.get("speedup_vs_hf_eager")
        sd = r.get("speedup_vs_disentangled_flash")
        if mode == "fwd" and (sh or sd):
          c += (f" ({sh:.2f}×" if sh else " (–") + (
              f" / {sd:.2f}×)" if sd else " / –)")
        elif mode == "train":
          df = pts[p].get("disentangled_flash") or {}
          bits = []
          if sh:
            bits.append(f"{sh:.2f}×")
          if r.get("peak_mem_bytes") and df.get("peak_mem_bytes") and \
              impl != "disentangled_flash":
            bits.append(f"mem {r['peak_mem_bytes'] / df['peak_mem_bytes']:.2f}")
          if bits:
            c += " (" + "; ".join(bits) + ")"
        cells.append(c)
      name = deberta_name(impl, md)
      if impl in DEBERTA_OURS:
        name = f"**{name}**"
      L.append(f"| {name} | " + " | ".join(cells) + " |")
  ovh = [(p, r["fold_torch"]["hf_mask_relpos_ms"]) for p, r in pts.items()
         if (r.get("fold_torch") or {}).get("hf_mask_relpos_ms") is not None]
  if ovh:
    L.append("\nHF's encoder builds a [B, 1, L, L] mask and [1, L, L] "
             "relative positions on every forward, which fold_torch keeps "
             "(disentangled-flash replaces the encoder): " + "; ".join(
                 f"{_point_short(pts[p])} {fmt_ms(v)} ms"
                 for p, v in ovh) + ".")
  try:
    from benchmarks.deberta import evaluate_targets
    targets = evaluate_targets(model)
  except Exception:  # noqa: BLE001
    targets = smd.get("targets") or {}
  if targets:
    L.append("\n**Acceptance targets** (from this run's times)\n")
    word = {True: "met", False: "**not met**", None: "not measured"}
    present = {r.get("impl") for r in model}
    for issue, per in targets.items():
      for impl, s in per.items():
        if impl not in present:
          continue  # not part of this run at all (e.g. older files)
        L.append(f"- {issue.replace('_', ' ')}, {impl}: {word[s['met']]}")
        for cname, c in s["checks"].items():
          if c["met"] is None:
            detail = c.get("note", "")
          elif "speedup" in c:
            detail = (f"{c['speedup']:.2f}× (need {c['threshold']:g}×; "
                      f"{fmt_ms(c['ms'])} vs {fmt_ms(c['reference_ms'])} ms)")
          else:
            detail = (f"{c['value_gib']:.2f} vs {c['reference_gib']:.2f} "
                      f"GiB")
          L.append(f"  - {cname}: {word[c['met']]} — {detail}")
  errs = [(p, i, r["error"]) for p, v in pts.items() for i, r in v.items()
          if not ok(r) and r.get("error")]
  if errs:
    L.append("\nNot measured:\n")
    for p, i, e in errs:
      L.append(f"- {i} @ {p}: {str(e)[:200]}")
  return L


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------
def plot_all(paths: list[str], out_dir: str | os.PathLike | None = None,
             ) -> list[Path]:
  data = load(paths)
  out = Path(out_dir) if out_dir else REPO / "benchmarks" / "results" / \
      gpu_slug(data["metadata"])
  out.mkdir(parents=True, exist_ok=True)
  figs: list[Path] = []
  for name, suite in data["suites"].items():
    recs = suite.get("records", [])
    md = dict(data["metadata"])
    md.update({k: v for k, v in (suite.get("metadata") or {}).items()
               if k in ("versions",) and v})
    if not recs:
      continue
    if name == "deberta":
      model, recs = deberta_split(recs)
      dmd = dict(suite.get("metadata") or {})
      dmd.update(md)  # the run's provenance; config/smoke from the suite
      for fn, stem in ((deberta_forward_figure, "forward"),
                       (deberta_speedup_figure, "speedup_vs_hf"),
                       (deberta_train_figure, "train")):
        p = fn(model, dmd, out / f"deberta_{stem}.png",
               sources=data["sources"])
        if p:
          figs.append(p)
      if not recs:
        continue
    if name == "decode":
      p = decode_figure(recs, md, out / "decode_bandwidth.png",
                        sources=data["sources"])
      if p:
        figs.append(p)
    if name == "bridge":  # its own figure; the generic ones do not apply
      p = bridge_figure(recs, md, suite.get("metadata") or {},
                        out / "bridge_overhead.png", sources=data["sources"])
      if p:
        figs.append(p)
      continue
    for fn, stem in ((speedup_figure, "speedup"),
                     (seqlen_figure, "latency_vs_seqlen"),
                     (memory_figure, "memory")):
      p = fn(recs, md, out / f"{name}_{stem}.png", suite=name,
             sources=data["sources"])
      if p:
        figs.append(p)
  figs.append(write_table(data, out, figs))
  return figs


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.plot",
                               description=__doc__.split("\n\n")[0])
  ap.add_argument("json", nargs="+", help="benchmark JSON file(s)")
  ap.add_argument("--output-dir", "-o", default=None,
                  help="default: benchmarks/results/<gpu>/")
  args = ap.parse_args(argv)
  for p in plot_all(args.json, args.output_dir):
    print(p)
  return 0


if __name__ == "__main__":
  sys.exit(main())
