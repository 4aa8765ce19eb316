"""benchmarks.plot on the committed H200 JSON (into a tmp dir): every figure
and the Markdown table come out, readable numbers in the table, and the
committed figures/table in benchmarks/results/h200/ are the ones this JSON
gives. Also the merged `benchmarks.run` format, a decode suite and suites
recorded as not available. No JAX, no GPU: a few seconds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks" / "results" / "h200"
H200_JSON = H200 / "dense-2026-12-02.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(p: Path) -> tuple[int, int]:
  b = p.read_bytes()
  assert b[:8] == PNG_MAGIC, p
  return int.from_bytes(b[16:20], "big"), int.from_bytes(b[20:24], "big")


@pytest.fixture(scope="module")
def h200_out(tmp_path_factory):
  from benchmarks import plot
  d = tmp_path_factory.mktemp("h200")
  return d, plot.plot_all([H200_JSON], d)


def test_h200_json_gives_figures_and_table(h200_out):
  tmp_path, out = h200_out
  names = sorted(p.name for p in out)
  assert names == ["dense_latency_vs_seqlen.png", "dense_memory.png",
                   "dense_speedup.png", "table.md"], names
  for p in out:
    if p.suffix == ".png":
      w, h = _png_size(p)
      assert 800 < w < 4000 and 300 < h < 3000, (p.name, w, h)
  t = (tmp_path / "table.md").read_text()
  assert "NVIDIA H200" in t and "dense-2026-12-02.json" in t
  # the README's anchor numbers: ours 6.59 ms fwd+bwd at B2 H16 S8192 D128
  # causal, 1.48x over deterministic FA2, 206 MB vs 405 MB for cuDNN.
  assert "| **foldax (ours)** | 1.77 (311) | 6.59 (292) |" in t
  assert re.search(r"torch SDPA flash, deterministic \| – \| 9\.75 \(197\) "
                   r"\| – / 1\.48×", t)
  assert "206 MB" in t and "405 MB" in t
  assert t.count("| implementation |") == 4  # one table per shape
  for p in out:  # every figure is linked from the table
    if p.suffix == ".png":
      assert f"({p.name})" in t


def test_committed_results_match_the_json(h200_out):
  """The committed table is what the committed JSON gives (figures too:
  same files exist; pixels may differ across matplotlib versions)."""
  tmp_path, _ = h200_out
  for name in ("dense_speedup.png", "dense_latency_vs_seqlen.png",
               "dense_memory.png", "table.md"):
    assert (H200 / name).exists(), f"regenerate: see {H200 / 'table.md'}"
  # same table up to the output-dir line (tmp path vs committed path)
  strip = lambda s: re.sub(r"--output-dir \S+|\]\([^)]*\.json\)", "", s)
  assert strip((tmp_path / "table.md").read_text()) == strip(
      (H200 / "table.md").read_text())


def test_cli_and_merged_run_format(tmp_path):
  src = json.loads(H200_JSON.read_text())
  dense = [r for r in src["records"]]
  decode = [dict(impl=impl, B=1, Hq=32, Hkv=8, D=128, context=ctx,
                 mode="decode", ms=0.05, tbps=bw * (1 - 256 / ctx),
                 error=None)
            for impl, bw in (("ours", 4.0), ("jax_xla", 2.0))
            for ctx in (1024, 8192, 65536)]
  doc = dict(metadata=dict(src["metadata"], command="python -m "
                           "benchmarks.run --suite all"),
             suites=dict(
                 dense=dict(status="ok", metadata=src["metadata"],
                            records=dense),
                 decode=dict(status="ok", records=decode),
                 deberta=dict(status="not available", records=[],
                              note="jax_api.deberta missing"),
                 bridge=dict(status="error", records=[], note="exit 1")))
  f = tmp_path / "results.json"
  f.write_text(json.dumps(doc))
  out = tmp_path / "figs"
  r = subprocess.run([sys.executable, "-m", "benchmarks.plot", str(f),
                      "--output-dir", str(out)], cwd=REPO,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert {p.name for p in out.iterdir()} == {
      "decode_bandwidth.png", "dense_speedup.png", "dense_memory.png",
      "dense_latency_vs_seqlen.png", "table.md"}
  t = (out / "table.md").read_text()
  assert "## deberta" in t and "not available" in t
  assert "## bridge" in t and "status: error" in t
  assert "| foldax (ours) | B1 H32/KV8 D128 | 65,536 | 3.98 |" in t


def test_smoke_shaped_input(tmp_path):
  """A CPU smoke record set (one shape, no GPU name) still plots."""
  from benchmarks import plot
  recs = []
  for impl, ms in (("ours", 2.0), ("jax_xla", 1.0)):
    for mode in ("fwd", "fwd+bwd"):
      recs.append(dict(impl=impl, B=1, Hq=4, Hkv=2, S=128, D=32, causal=True,
                       dtype="bf16", mode=mode, ms=ms, tflops=0.01,
                       peak_mem_bytes=100_000, bitwise_repeatable=True,
                       error=None))
  recs.append(dict(impl="pallas_mha", B=1, Hq=4, Hkv=2, S=128, D=32,
                   causal=True, dtype="bf16", mode="fwd", ms=None,
                   tflops=None, error="skipped: no GPU"))
  f = tmp_path / "smoke.json"
  f.write_text(json.dumps(dict(metadata=dict(
      command="python3 -m benchmarks.dense --smoke", jax_backend="cpu",
      device_kind="cpu"), records=recs)))
  out = plot.plot_all([f], tmp_path / "o")
  assert {p.name for p in out} == {"dense_speedup.png", "dense_memory.png",
                                   "table.md"}
  t = (tmp_path / "o" / "table.md").read_text()
  assert "smoke run" in t and "0.50× / 0.50×" in t and "skipped" in t
