"""benchmarks.plot on the committed H200 JSON (into a tmp dir): every figure
and the Markdown table come out, readable numbers in the table, and the
committed figures/table in benchmarks/results/h200/ are the ones this JSON
gives. Also the merged `benchmarks.run` format, a decode suite and suites
recorded as not available. No JAX, no GPU: a few seconds."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
H200 = REPO / "benchmarks" / "results" / "h200"
H200_DENSE_DIR = H200 / "2026-12-02"   # the full dense grid of 2026-12-02
H200_JSON = H200_DENSE_DIR / "dense-2026-12-02.json"
# The latest run (all suites) and its table/figures at the folder's top.
H200_LATEST = [H200 / "all-2026-12-03.json", H200 / "deberta-2026-12-03.json"]
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
  d = H200_DENSE_DIR
  for name in ("dense_speedup.png", "dense_latency_vs_seqlen.png",
               "dense_memory.png", "table.md"):
    assert (d / name).exists(), f"regenerate: see {d / 'table.md'}"
  # same table up to the output-dir line (tmp path vs committed path)
  assert _strip((tmp_path / "table.md").read_text()) == _strip(
      (d / "table.md").read_text())


def _strip(s: str) -> str:
  return re.sub(r"--output-dir \S+|\]\([^)]*\.json\)|benchmarks/results/"
                r"h200/\S*\.json", "", s)


# The second run of 2026-12-03 (after the backward tiles and the DeBERTa
# training-memory changes; dense anchor, decode, three DeBERTa points).
H200_RERUN = H200 / "rerun-2026-12-03"


@pytest.mark.parametrize("jsons, folder", [
    (H200_LATEST, H200),
    ([H200_RERUN / "rerun-2026-12-03.json"], H200_RERUN)])
def test_committed_latest_table_matches_its_json(tmp_path, jsons, folder):
  from benchmarks import plot
  out = plot.plot_all(jsons, tmp_path)
  for p in out:
    assert (folder / p.name).exists(), f"regenerate: see {folder / 'table.md'}"
  assert _strip((tmp_path / "table.md").read_text()) == _strip(
      (folder / "table.md").read_text())


def test_cli_and_merged_run_format(tmp_path):
  src = json.loads(H200_JSON.read_text())
  dense = [r for r in src["records"]]
  # benchmarks.decode's record schema (eff_tbs: K+V bytes / time, T: context)
  decode = [dict(impl=impl, B=b, T=t, Hq=32, Hkv=8, D=128, page=256,
                 dtype="bf16", ms=2 * b * t * 8 * 128 * 2 / (bw * 1e9),
                 eff_tbs=bw, tokens_per_s=b / (2 * b * t * 8 * 128 * 2 /
                                               (bw * 1e12)),
                 error=None, bitwise_repeatable=True)
            for impl, bw in (("ours", 3.5), ("ours_fp8", 3.6),
                             ("torch_sdpa", 3.8))
            for b, t in ((8, 32768), (64, 4096))]
  decode.append(dict(impl="pallas_paged", B=8, T=32768, Hq=32, Hkv=8, D=128,
                     ms=None, eff_tbs=None, error="ValueError: boom"))
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
  assert "**B8 context 32k H32/KV8 D128 bf16**" in t
  assert re.search(r"\| \*\*foldax \(ours\)\*\* \| 0\.\d+ \| 3\.50 \| [\d,]+ \| – \|", t)
  assert re.search(r"\| torch SDPA \| 0\.\d+ \| 3\.80 \| [\d,]+ \| 0\.92× \|", t)
  assert "| JAX Pallas paged_attention | error |" in t


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


def test_run_merges_suites_into_one_json(tmp_path):
  """benchmarks.run on CPU: one process per suite, merged JSON with the run's
  metadata, every suite either measured or recorded with a status; the
  merged file plots. (The dense suite runs in notebooks/05_benchmarks and
  tests/test_benchmarks_smoke.py.)"""
  out = tmp_path / "r.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-m", "benchmarks.run", "--suite",
                      "bridge", "--output", str(out)], cwd=REPO, env=env,
                     capture_output=True, text=True, timeout=240)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  doc = json.loads(out.read_text())
  md = doc["metadata"]
  for k in ("command", "date", "git_commit", "versions", "suites", "smoke"):
    assert k in md, k
  assert md["smoke"] is True and md["suites"] == ["bridge"]
  assert md["command"].startswith("python -m benchmarks.run --suite bridge")
  s = doc["suites"]["bridge"]
  assert s["status"] in ("ok", "not available"), s
  if s["status"] == "ok":
    by = {(x["impl"], x["mode"]): x for x in s["records"]}
    assert by[("bridge", "fwd")]["ms"] > 0 and by[("jax_direct", "fwd")]["ms"] > 0
  else:
    assert s["note"] and s["records"] == []
  from benchmarks import plot
  assert (tmp_path / "f").exists() is False
  names = {p.name for p in plot.plot_all([out], tmp_path / "f")}
  assert "table.md" in names
