"""CPU checks of the benchmark harness (benchmarks/): FLOP counting, shape
parsing, the determinism helper, lazy imports, and one tiny end-to-end
`python -m benchmarks.dense --smoke` run that must write valid JSON whether or
not `jax_api.fold_attn_func` exists yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _run(args, tmp_path=None, timeout=240):
  env = dict(os.environ)
  env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
  env.setdefault("JAX_PLATFORMS", "cpu")
  return subprocess.run([sys.executable, *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_flops_convention():
  from benchmarks._timing import attention_flops
  # anchors README: B2 H16 S8192 D128 causal fwd 0.93 ms = 592 TFLOP/s
  f = attention_flops(2, 16, 8192, 8192, 128, True)
  assert f == 4 * 2 * 16 * 8192 * 8192 * 128 / 2
  assert abs(f / 0.93e-3 / 1e12 - 592) < 1
  assert attention_flops(2, 16, 8192, 8192, 128, True, "fwd+bwd") == 3.5 * f
  assert attention_flops(1, 1, 4, 4, 2, False) == 128
  with pytest.raises(ValueError):
    attention_flops(1, 1, 1, 1, 1, False, "bwd")


def test_input_set_rotation():
  from benchmarks._timing import L2_BYTES, n_input_sets
  assert n_input_sets(4 * L2_BYTES) == 1
  assert n_input_sets(L2_BYTES) == 2
  assert n_input_sets(1) == 8  # capped


def test_shapes_and_grid():
  from benchmarks import dense
  s = dense.parse_shape("b2-h16-kv2-s8192-d128-causal")
  assert (s.B, s.Hq, s.Hkv, s.S, s.D, s.causal, s.dtype) == (
      2, 16, 2, 8192, 128, True, "bf16")
  s = dense.parse_shape("B4:H16:g8:S4096:D64:full:fp16")
  assert (s.Hkv, s.causal, s.dtype) == (2, False, "fp16")
  with pytest.raises(ValueError):
    dense.parse_shape("b2-h16-s128")  # no head dim
  grid = dense.default_grid()
  assert len(grid) == 40 and len(set(grid)) == 40
  assert grid[:2] == list(dense.QUICK_SHAPES)
  assert all(g.B * g.S == 16384 and g.Hq == 16 and g.Hkv in (16, 2)
             for g in grid)
  args = dense.build_parser().parse_args(
      ["--seqs", "4096", "--head-dims", "128", "--causal", "true"])
  sel = dense.select_shapes(args)
  assert [(x.S, x.D, x.causal) for x in sel] == [(4096, 128, True)] * 2
  args = dense.build_parser().parse_args(["--quick"])
  assert dense.select_shapes(args) == list(dense.QUICK_SHAPES)
  assert dense.select_impls(dense.build_parser().parse_args([])) == list(
      dense.DEFAULT_IMPLS)
  assert dense.select_impls(dense.build_parser().parse_args(
      ["--deterministic-cudnn"])) == ["jax_cudnn_det"]


def test_bitwise_repeatable():
  import jax.numpy as jnp
  from benchmarks._timing import bitwise_repeatable
  x = jnp.arange(8, dtype=jnp.bfloat16)
  assert bitwise_repeatable(lambda a: (a * 2, (a + 1,)), (x,), n=3)
  calls = []

  def drifting(a):
    calls.append(1)
    return a + len(calls)
  assert not bitwise_repeatable(drifting, (x,), n=3)


def test_imports_are_lazy():
  r = _run(["-c", "import sys, benchmarks.dense, benchmarks._timing; "
                  "assert 'jax' not in sys.modules, 'jax'; "
                  "assert 'torch' not in sys.modules, 'torch'; "
                  "assert 'tokamax' not in sys.modules"])
  assert r.returncode == 0, r.stderr


def test_scripts_parse():
  for sh in ("device_run.sh", "fetch_wheels.sh"):
    r = subprocess.run(["bash", "-n", str(REPO / "benchmarks" / sh)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
  from benchmarks.xprof_stub.xprof.cli import tools  # tokamax's stand-in
  assert tools.get_kernel_stats_tool is None


def test_smoke_run_writes_json(tmp_path):
  out = tmp_path / "smoke.json"
  r = _run(["-m", "benchmarks.dense", "--smoke", "--output", str(out)])
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  doc = json.loads(out.read_text())
  md = doc["metadata"]
  for k in ("command", "date", "versions", "git_commit", "jax_backend",
            "conventions", "elapsed_s"):
    assert k in md, k
  recs = doc["records"]
  need = {"impl", "B", "Hq", "Hkv", "S", "D", "causal", "dtype", "mode", "ms",
          "tflops", "error"}
  for rec in recs:
    assert need <= set(rec), rec
    assert rec["mode"] in ("fwd", "fwd+bwd", "check")
    if rec["mode"] == "check":  # an accuracy record: errors, no time
      assert rec["error"] or rec["rel_err_out"] < 2e-2, rec
    else:
      assert (rec["ms"] is not None) or rec["error"], rec
  by = {(x["impl"], x["mode"]): x for x in recs}
  for mode in ("fwd", "fwd+bwd"):
    x = by[("jax_xla", mode)]
    assert x["error"] is None and x["ms"] > 0 and x["tflops"] > 0
    assert x["peak_mem_bytes"] > 0
    assert ("ours", mode) in by  # measured, or an error string
  assert by[("jax_xla", "fwd+bwd")]["bitwise_repeatable"] is True
  chk = by[("ours", "check")]
  if by[("ours", "fwd")]["error"] is None and chk["error"] is None:
    assert chk["rel_err_out"] < 2e-2
  # the table re-prints from the JSON, and merging two files appends records
  t = _run(["-m", "benchmarks.dense", "--table", str(out)])
  assert t.returncode == 0 and "ms/TFLOP/s" in t.stdout, t.stderr
  merged = tmp_path / "merged.json"
  m = _run(["-m", "benchmarks.dense", "--merge", str(out), str(out),
            "--output", str(merged)])
  assert m.returncode == 0, m.stderr
  assert len(json.loads(merged.read_text())["records"]) == 2 * len(recs)


def test_bridge_suite_smoke(tmp_path):
  """benchmarks.bridge on CPU (extras skipped: budget 0): the acceptance
  records, the targets block and the Llama fold/sdpa records come out, and
  plot gives the bridge figure and table rows."""
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  out = tmp_path / "bridge.json"
  env_budget = dict(os.environ, FOLDAX_BRIDGE_BUDGET_S="0")
  env_budget["PYTHONPATH"] = str(REPO) + os.pathsep + env_budget.get(
      "PYTHONPATH", "")
  env_budget.setdefault("JAX_PLATFORMS", "cpu")
  r = subprocess.run([sys.executable, "-m", "benchmarks.bridge", "--smoke",
                      "--output", str(out)], cwd=REPO, env=env_budget,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  doc = json.loads(out.read_text())
  assert doc["status"] == "ok"
  md = doc["metadata"]
  for k in ("command", "date", "git_commit", "versions", "targets",
            "conventions", "smoke"):
    assert k in md, k
  assert md["smoke"] is True and md["versions"].get("transformers")
  t = md["targets"]
  assert set(t) == {"overhead_fwd", "overhead_fwd_bwd", "ratio_fwd",
                    "ratio_fwd_bwd", "llama_train_step",
                    "llama_fold_grads_bitwise"}, t
  for k in ("overhead_fwd", "overhead_fwd_bwd"):
    assert t[k]["value_us"] is not None and t[k]["limit_us"] == 25.0
    assert isinstance(t[k]["met"], bool)
  for k in ("ratio_fwd", "ratio_fwd_bwd"):
    assert t[k]["value"] > 0 and t[k]["limit"] == 1.03
  by = {(x["impl"], x["mode"], x["S"]): x for x in doc["records"]
        if x.get("S") is not None}
  for S in (64, 256):
    for mode in ("fwd", "fwd+bwd"):
      b, j = by[("bridge", mode, S)], by[("jax_direct", mode, S)]
      assert b["error"] is None and j["error"] is None, (b, j)
      assert b["ms"] > 0 and j["ms"] > 0 and b["ms_pipelined"] > 0
      assert abs(b["overhead_us"] - (b["ms"] - j["ms"]) * 1e3) < 1e-6
  llama = {x["impl"]: x for x in doc["records"] if x.get("model") == "llama"}
  assert set(llama) == {"fold", "sdpa"}
  for x in llama.values():
    assert x["error"] is None and x["ms"] > 0 and x["n_steps"] >= 2, x
  # the CPU XLA path is deterministic; fold matches sdpa closely
  assert llama["fold"]["grads_bitwise_repeatable"] is True
  assert t["llama_fold_grads_bitwise"]["met"] is True
  assert llama["fold"]["grad_rel_l2_vs_sdpa"] < 1e-4
  assert t["llama_train_step"]["value"] == pytest.approx(
      llama["fold"]["ms"] / llama["sdpa"]["ms"], rel=1e-3)
  pytest.importorskip("matplotlib")
  from benchmarks import plot
  names = {p.name for p in plot.plot_all([out], tmp_path / "fig")}
  assert names == {"bridge_overhead.png", "table.md"}, names
  tab = (tmp_path / "fig" / "table.md").read_text()
  assert "**Targets**" in tab and "overhead fwd ≤ 25 µs" in tab
  assert "**Llama training step**" in tab and "| fold |" in tab


# ----------------------------------------------------------------------------
# DeBERTa suite (benchmarks/deberta.py)
# ----------------------------------------------------------------------------
def _deberta_rec(point, impl, ms, mode="fwd", mem=None, **kw):
  r = dict(kind="model", point=point, mode=mode, impl=impl, B=1, L=512,
           label=point, ms=ms, error=None if ms else "boom")
  if mem is not None:
    r["peak_mem_bytes"] = mem
  r.update(kw)
  return r


def test_deberta_ratios_and_targets():
  from benchmarks import deberta as DB
  G = 2**30
  recs = [
      _deberta_rec("fwd-b4-l2048", "hf_eager", 69.0),
      _deberta_rec("fwd-b4-l2048", "disentangled_flash", 21.0),
      _deberta_rec("fwd-b4-l2048", "fold_jax", 20.0),
      _deberta_rec("fwd-b4-l2048", "fold_torch", 24.0),
      _deberta_rec("train-b8-l512", "hf_eager", 56.0, "train", 4.9 * G),
      _deberta_rec("train-b8-l512", "disentangled_flash", 74.0, "train",
                   2.7 * G),
      _deberta_rec("train-b8-l512", "fold_jax", 30.0, "train", 2.5 * G),
      _deberta_rec("train-b8-l512", "fold_torch", None, "train"),
      _deberta_rec("train-b8-l512", "fold_jax_ffn", 33.0, "train", 1.4 * G),
  ]
  for p in ("fwd-b4-l2048", "train-b8-l512"):
    DB.add_ratios({r["impl"]: r for r in recs if r["point"] == p})
  by = {(r["point"], r["impl"]): r for r in recs}
  assert by[("fwd-b4-l2048", "fold_jax")]["speedup_vs_hf_eager"] == 69 / 20
  assert by[("fwd-b4-l2048", "fold_torch")][
      "speedup_vs_disentangled_flash"] == 21 / 24
  assert abs(by[("train-b8-l512", "fold_jax")]["mem_vs_disentangled_flash"]
             - 2.5 / 2.7) < 1e-12
  t = DB.evaluate_targets(recs)
  fj = t["deberta_issue"]["fold_jax"]
  assert fj["met"] is True, fj
  c = fj["checks"]["fwd-b4-l2048 >= 3x hf_eager"]
  assert c["met"] and c["speedup"] == round(69 / 20, 3) and c["threshold"] == 3
  assert fj["checks"]["train-b8-l512 peak memory <= disentangled_flash"][
      "value_gib"] == 2.5
  # remat="ffn": its own training step, fold_jax's (same) forward.
  ff = t["deberta_issue"]["fold_jax_ffn"]
  assert ff["met"] is True, ff
  assert ff["checks"]["fwd-b4-l2048 >= 3x hf_eager (fold_jax's forward)"][
      "ms"] == 20.0
  assert ff["checks"]["train-b8-l512 peak memory <= disentangled_flash"][
      "value_gib"] == 1.4
  assert t["deberta_issue"]["fold_jax_remat"]["met"] is None  # not timed
  ft = t["deberta_issue"]["fold_torch"]
  assert ft["met"] is False  # slower than disentangled-flash at B4 L2048
  assert ft["checks"]["train-b8-l512 >= 1.5x hf_eager"]["met"] is None
  assert t["bridge_issue"]["fold_torch"]["met"] is False


def test_deberta_suite_smoke_run_and_plot(tmp_path):
  """`benchmarks.run --suite deberta` on the CPU: tiny configuration, every
  point and implementation recorded (the peers as "not installed" when they
  are missing), ratios, targets, and the suite's figures and table rows."""
  out = tmp_path / "deberta.json"
  r = _run(["-m", "benchmarks.run", "--suite", "deberta", "--output",
            str(out)], timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  s = json.loads(out.read_text())["suites"]["deberta"]
  assert s["status"] == "ok", s
  md = s["metadata"]
  for k in ("command", "date", "versions", "git_commit", "config", "points",
            "conventions", "targets", "anchors_h200"):
    assert k in md, k
  assert md["smoke"] is True and md["complete"] is True
  model = [x for x in s["records"] if x.get("kind") == "model"]
  points = {p["name"]: p for p in md["points"]}
  by = {(x["point"], x["impl"]): x for x in model}
  for name, p in points.items():
    for impl in ("fold_jax", "fold_torch", "hf_eager"):
      x = by[(name, impl)]
      assert x["error"] is None and x["ms"] > 0, x
      assert x["finite"] is True, x
    for impl in ("disentangled_flash", "flashdeberta"):
      if (name, impl) in by:
        x = by[(name, impl)]
        assert x["ms"] or x["error"], x
    assert by[(name, "fold_jax")]["speedup_vs_hf_eager"] > 0
    if p["mode"] == "train":
      assert by[(name, "fold_jax")]["peak_mem_bytes"] > 0
      assert by[(name, "fold_jax")]["loss"] > 0
  assert {"deberta_issue", "bridge_issue"} <= set(md["targets"])
  from benchmarks import plot
  names = {q.name for q in plot.plot_all([out], tmp_path / "f")}
  assert {"deberta_forward.png", "deberta_speedup_vs_hf.png",
          "deberta_train.png", "table.md"} <= names, names
  t = (tmp_path / "f" / "table.md").read_text()
  assert "DeBERTa-v3-base encoder (whole model)" in t
  assert "Acceptance targets" in t and "foldax JAX model" in t


def test_deberta_head_to_head_smoke(tmp_path, monkeypatch):
  """FOLDAX_DEBERTA_H2H on the CPU: every forward point timed for both
  implementations in rounds; the eager model is a copy that the fold swap
  does not touch."""
  import contextlib
  import torch_bridge
  from benchmarks import deberta as DB
  monkeypatch.setenv("FOLDAX_DEBERTA_POINTS", "fwd-b2-l64-ragged")
  args = DB.build_parser().parse_args(
      ["--smoke", "--output", str(tmp_path / "h2h.json")])
  s = DB.Suite(args, [])
  fold_cls = torch_bridge.deberta.FoldDisentangledSelfAttention
  with contextlib.ExitStack() as stack:
    models = s._h2h_models(("fold_torch", "hf_eager"), s.torch_dtype(
        s.points[0]), 64, stack)
    assert any(isinstance(m, fold_cls) for m in models["fold_torch"].modules())
    assert not any(isinstance(m, fold_cls)
                   for m in models["hf_eager"].modules())
  s.head_to_head(("fold_torch", "hf_eager"), rounds=2)
  recs = [r for r in s.records if r["kind"] == "h2h"]
  assert [r["impl"] for r in recs] == ["fold_torch", "hf_eager"]
  assert all(r["ms"] > 0 and len(r["ms_rounds"]) == 2 for r in recs)
  assert recs[0]["time_vs_first"] == 1.0
