"""Every benchmark suite, one process each, merged into one JSON file.

    python -m benchmarks.run --suite all --output results.json
    python -m benchmarks.run --suite dense --suite decode --output r.json
    python -m benchmarks.run --suite dense --quick --output r.json \\
        --skip-impls jax_xla --shapes b2-h16-kv16-s8192-d128-causal
        (arguments run.py does not know go to the dense suite)
    python -m benchmarks.run --suite all --smoke --output r.json   (CPU)
    python -m benchmarks.plot r.json --output-dir benchmarks/results/<gpu>/

Suites (each in its own `python -m ...` process, so one crash or XLA flag
cannot touch another, with its own timeout):

  dense    `benchmarks.dense` (ours vs cuDNN, tokamax, Pallas mha, torch SDPA,
           fastflash, ... in one process), then on a GPU a second process
           for deterministic cuDNN (`--deterministic-cudnn`, which sets a
           global XLA flag), merged.
  decode   `benchmarks.decode` when that module exists (else recorded as
           "not available").
  deberta  `benchmarks.deberta`: the DeBERTa-v3-base encoder (fp16
           forward, bf16 training step) as the JAX model and through
           torch_bridge, against Hugging Face eager, disentangled-flash and
           flashdeberta; targets in the suite's metadata; the attention op
           alone against its XLA path when time is left.
  bridge   `benchmarks.bridge`: the torch bridge's per-call overhead
           against calling the same JAX functions directly (S128, S4096),
           and a Llama training step with attn_implementation="fold" vs
           "sdpa" (time, bitwise-repeatable gradients); targets in the
           suite's metadata.

Without an NVIDIA GPU (or with --smoke) every suite runs its small CPU smoke
configuration (seconds to a minute each), so this is testable in CI.

Output: {"metadata": {command, date, git commit, GPU name, compute
capability, driver, library versions, ...}, "suites": {name: {"status":
"ok" | "error" | "timeout" | "not available", "note", "returncode",
"elapsed_s", "metadata", "records": [...]}}}. The file is rewritten after
every suite, so a run cut short keeps what finished.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import dense as D

REPO = Path(__file__).resolve().parents[1]
SUITES = ("dense", "decode", "deberta", "bridge")


# ----------------------------------------------------------------------------
# Parent: run the suites
# ----------------------------------------------------------------------------
def _has_gpu() -> bool:
  """An NVIDIA GPU that JAX may use (nvidia-smi answers and JAX_PLATFORMS
  does not pin the CPU). Checked without importing JAX in this process."""
  plat = os.environ.get("JAX_PLATFORMS", "").lower()
  if plat and "cuda" not in plat and "gpu" not in plat:
    return False
  return bool(D._nvidia_smi().get("gpu_name"))


def _module_exists(mod: str) -> bool:
  try:
    return importlib.util.find_spec(mod) is not None
  except Exception:  # noqa: BLE001
    return False


def _run_streaming(cmd: list[str], timeout: float | None, prefix: str,
                   env: dict | None = None) -> tuple[int, str, bool]:
  """Runs cmd, echoing its merged stdout/stderr line by line (the progress of
  the suite), and returns (returncode, last 4000 chars, timed_out)."""
  env = dict(os.environ if env is None else env)
  env["PYTHONUNBUFFERED"] = "1"
  env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"]
                                   if env.get("PYTHONPATH") else "")
  proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1,
                          start_new_session=True)
  tail: list[str] = []

  def pump():
    for line in proc.stdout:
      tail.append(line)
      if len(tail) > 200:
        del tail[:100]
      sys.stdout.write(f"{prefix}{line}")
      sys.stdout.flush()
  th = threading.Thread(target=pump, daemon=True)
  th.start()
  timed_out = False
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    timed_out = True
    try:
      os.killpg(proc.pid, signal.SIGTERM)
      proc.wait(timeout=10)
    except Exception:  # noqa: BLE001
      os.killpg(proc.pid, signal.SIGKILL)
      proc.wait()
  th.join(timeout=5)
  return proc.returncode, "".join(tail)[-4000:], timed_out


def _read(path: Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except Exception:  # noqa: BLE001
    return None


def _suite_result(doc: dict | None, rc: int, tail: str, timed_out: bool,
                  elapsed: float) -> dict:
  res = dict(status="ok", returncode=rc, elapsed_s=round(elapsed, 1),
             metadata=(doc or {}).get("metadata", {}),
             records=(doc or {}).get("records", []))
  if doc and doc.get("status") and doc["status"] != "ok":
    res["status"] = doc["status"]
    res["note"] = doc.get("note", "")
  elif timed_out:
    res["status"] = "timeout"
    res["note"] = ("stopped at the suite's timeout; the records hold what "
                   "finished")
  elif rc != 0 or doc is None:
    res["status"] = "error"
    res["note"] = f"exit code {rc}" + ("" if doc else "; no JSON written")
    res["log_tail"] = tail[-2000:]
  return res


def _without(argv: list[str], opt: str) -> list[str]:
  """argv less `opt VALUE` / `opt=VALUE` (and less --smoke)."""
  out, skip = [], False
  for a in argv:
    if skip:
      skip = False
      continue
    if a == opt:
      skip = True
      continue
    if a.startswith(opt + "=") or a == "--smoke":
      continue
    out.append(a)
  return out


def run_dense(args, extra: list[str], gpu: bool, tmp: Path) -> dict:
  out = tmp / "dense.json"
  base = [sys.executable, "-m", "benchmarks.dense", "--output", str(out)]
  flags = []
  if not gpu or args.smoke:
    flags.append("--smoke")
  elif args.quick:
    flags.append("--quick")
  flags += extra
  t0 = time.time()
  rc, tail, to = _run_streaming(base + flags, args.timeout_s, "  [dense] ")
  doc = _read(out)
  if gpu and not args.smoke and not args.no_det_cudnn and doc is not None:
    det = tmp / "dense_det.json"
    rc2, tail2, to2 = _run_streaming(
        [sys.executable, "-m", "benchmarks.dense", *_without(flags, "--budget-s"),
         "--output", str(det), "--deterministic-cudnn", "--budget-s",
         str(args.det_budget_s)],
        args.det_budget_s + 60, "  [dense det] ")
    d2 = _read(det)
    if d2:
      doc["records"].extend(d2.get("records", []))
      doc.setdefault("merged_metadata", []).append(d2.get("metadata", {}))
    else:
      print(f"  [dense det] no JSON (rc={rc2}{', timeout' if to2 else ''})")
  return _suite_result(doc, rc, tail, to, time.time() - t0)


def run_decode(args, gpu: bool, tmp: Path) -> dict:
  if not _module_exists("benchmarks.decode"):
    return dict(status="not available", records=[],
                note="benchmarks/decode.py does not exist yet")
  out = tmp / "decode.json"
  base = [sys.executable, "-m", "benchmarks.decode", "--output", str(out)]
  flags = ["--smoke"] if (not gpu or args.smoke) else []  # no --quick there
  flags += shlex.split(args.decode_args or "")
  t0 = time.time()
  rc, tail, to = _run_streaming(base + flags, args.timeout_s, "  [decode] ")
  if rc == 2 and "unrecognized arguments" in tail and (
      "--smoke" in flags or "--quick" in flags):
    flags = [f for f in flags if f not in ("--smoke", "--quick")]
    print("  [decode] retrying without --smoke/--quick (not understood)")
    rc, tail, to = _run_streaming(base + flags, args.timeout_s, "  [decode] ")
  return _suite_result(_read(out), rc, tail, to, time.time() - t0)


def run_child(name: str, args, gpu: bool, tmp: Path) -> dict:
  out = tmp / f"{name}.json"
  cmd = [sys.executable, "-m", "benchmarks.run", "--child", name, "--output",
         str(out)]
  if not gpu or args.smoke:
    cmd.append("--smoke")
  elif args.quick:
    cmd.append("--quick")
  t0 = time.time()
  rc, tail, to = _run_streaming(cmd, args.timeout_s, f"  [{name}] ")
  return _suite_result(_read(out), rc, tail, to, time.time() - t0)


def run_metadata(argv: list[str], suites: list[str], gpu: bool) -> dict:
  md = D.metadata(argv, None)
  md["command"] = " ".join(["python", "-m", "benchmarks.run"] +
                           [shlex.quote(a) for a in argv])
  md["suites"] = suites
  md["smoke"] = not gpu
  return md


def main_parent(args, extra: list[str], argv: list[str]) -> int:
  suites: list[str] = []
  for s in args.suite or ["all"]:
    for x in (SUITES if s == "all" else [s]):
      if x not in suites:
        suites.append(x)
  gpu = _has_gpu()
  smoke = args.smoke or not gpu
  if smoke:
    args.smoke = True
  md = run_metadata(argv, suites, gpu)
  md["smoke"] = smoke
  doc = dict(metadata=md, suites={})
  t_start = time.time()
  print(f"benchmarks.run: suites {', '.join(suites)} on "
        f"{md.get('gpu_name') or 'CPU'}"
        f"{' (smoke configuration)' if smoke else ''} -> {args.output}",
        flush=True)
  with tempfile.TemporaryDirectory(prefix="foldax_bench_") as td:
    tmp = Path(td)
    for k, name in enumerate(suites):
      bar = "#" * k + "." * (len(suites) - k)
      print(f"[{bar}] {k + 1}/{len(suites)} {name} "
            f"(t={time.time() - t_start:.0f}s)", flush=True)
      try:
        if name == "dense":
          res = run_dense(args, extra, gpu, tmp)
        elif name == "decode":
          res = run_decode(args, gpu, tmp)
        else:
          res = run_child(name, args, gpu, tmp)
      except Exception as e:  # noqa: BLE001
        res = dict(status="error", note=D._err(e), records=[])
      doc["suites"][name] = res
      n = sum(1 for r in res.get("records", []) if r.get("ms") is not None)
      print(f"  -> {name}: {res['status']}, {n} timings"
            + (f" ({res['note']})" if res.get("note") else ""), flush=True)
      # Device facts the suite learned (JAX's view of the device).
      smd = res.get("metadata") or {}
      for key in ("jax_backend", "device_kind", "jax_compute_capability",
                  "torch_compute_capability", "torch_cuda", "torch_cudnn"):
        if smd.get(key) is not None and key not in md:
          md[key] = smd[key]
      md["elapsed_s"] = round(time.time() - t_start, 1)
      D.write_json(args.output, doc)
  print(f"[{'#' * len(suites)}] done in {time.time() - t_start:.0f}s -> "
        f"{args.output}", flush=True)
  for name, res in doc["suites"].items():
    print(f"  {name:8s} {res['status']}"
          + (f": {res['note']}" if res.get("note") else ""))
  if args.plot:
    from benchmarks import plot
    for p in plot.plot_all([args.output], args.plot):
      print(f"  wrote {p}")
  bad = [n for n, r in doc["suites"].items() if r["status"] in ("error",)]
  return 1 if bad and args.strict else 0


# ----------------------------------------------------------------------------
# Child suites (run as `python -m benchmarks.run --child NAME`)
# ----------------------------------------------------------------------------
def _rec(impl, B, H, Hkv, S, Dh, causal, dtype, mode, **kw) -> dict:
  r = dict(impl=impl, B=B, Hq=H, Hkv=Hkv, S=S, D=Dh, causal=causal,
           dtype=dtype, mode=mode, ms=None, tflops=None, error=None)
  r.update(kw)
  return r


def _child_metadata(name: str, argv: list[str]) -> dict:
  md = D.metadata(argv, None)
  md["command"] = " ".join(["python", "-m", "benchmarks.run"] + argv)
  md["suite"] = name
  import jax
  dev = jax.devices()[0]
  md.update(jax_backend=dev.platform, device_kind=dev.device_kind,
            jax_compute_capability=getattr(dev, "compute_capability", None))
  return md


def _time_jax_record(rec: dict, fn, args_, *, target_s: float, determinism:
                     bool, flops: float | None = None):
  from benchmarks import _timing as T
  t0 = time.time()
  try:
    compiled, _, csec = T.jax_compile(fn, args_)
    rec["compile_s"] = round(csec, 2)
    tm = T.time_jax(compiled, [args_], target_s=target_s, n_batches=5)
    rec.update(tm)
    if flops:
      rec["tflops"] = flops / (tm["ms"] * 1e-3) / 1e12
    rec.update(T.jax_memory_analysis(compiled))
    if determinism and rec["mode"] == "fwd+bwd":
      rec["bitwise_repeatable"] = T.bitwise_repeatable(compiled, args_, n=3)
  except Exception as e:  # noqa: BLE001
    rec["error"] = D._err(e)
  rec["wall_s"] = round(time.time() - t0, 2)
  _print(rec)


def _print(rec: dict):
  head = (f"  {rec['impl']:12s} {rec['mode']:8s} B{rec['B']} H{rec['Hq']} "
          f"S{rec['S']} D{rec['D']}: ")
  if rec.get("ms") is None:
    print(head + str(rec.get("error")), flush=True)
    return
  print(head + f"{rec['ms']:.3f} ms"
        + (f" {rec['tflops']:.1f} TFLOP/s" if rec.get("tflops") else "")
        + (f" repeatable={rec['bitwise_repeatable']}"
           if "bitwise_repeatable" in rec else ""), flush=True)


def child_deberta(args, argv) -> dict:
  """The DeBERTa suite: see benchmarks/deberta.py (whole DeBERTa-v3-base
  encoder against HF eager, disentangled-flash, flashdeberta; plus the
  attention op alone against its XLA path)."""
  from benchmarks import deberta
  return deberta.run(args, argv)


def child_bridge(args, argv) -> dict:
  """The torch-bridge suite: see benchmarks/bridge.py."""
  from benchmarks import bridge
  return bridge.run(args, argv)


def main_child(args, argv) -> int:
  t0 = time.time()
  fn = {"deberta": child_deberta, "bridge": child_bridge}[args.child]
  try:
    doc = fn(args, argv)
  except Exception as e:  # noqa: BLE001
    import traceback
    traceback.print_exc()
    doc = dict(status="error", note=D._err(e), records=[])
  doc.setdefault("metadata", {})["elapsed_s"] = round(time.time() - t0, 1)
  D.write_json(args.output, doc)
  if doc.get("status") != "ok":
    print(f"{args.child}: {doc.get('status')}: {doc.get('note', '')}",
          flush=True)
  return 0


# ----------------------------------------------------------------------------
def build_parser():
  ap = argparse.ArgumentParser(
      prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0],
      epilog="Unknown arguments are passed to the dense suite "
             "(see python -m benchmarks.dense --help).")
  ap.add_argument("--suite", action="append", choices=SUITES + ("all",),
                  help="repeatable; default all")
  ap.add_argument("--output", "-o", default="results.json")
  ap.add_argument("--smoke", action="store_true",
                  help="small CPU configuration (default without a GPU)")
  ap.add_argument("--quick", action="store_true",
                  help="fewer shapes on the GPU (anchor shapes)")
  ap.add_argument("--timeout-s", type=float, default=None,
                  help="wall-clock limit per suite process")
  ap.add_argument("--det-budget-s", type=float, default=55,
                  help="budget of the deterministic-cuDNN process (GPU)")
  ap.add_argument("--no-det-cudnn", action="store_true",
                  help="skip the deterministic-cuDNN process")
  ap.add_argument("--dense-args", default="",
                  help="extra arguments for benchmarks.dense (one string)")
  ap.add_argument("--decode-args", default="",
                  help="extra arguments for benchmarks.decode (one string)")
  ap.add_argument("--plot", metavar="DIR", default=None,
                  help="also run benchmarks.plot into DIR")
  ap.add_argument("--strict", action="store_true",
                  help="exit 1 when a suite ends in error")
  ap.add_argument("--child", choices=("deberta", "bridge"),
                  help=argparse.SUPPRESS)
  return ap


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  args, extra = build_parser().parse_known_args(argv)
  if args.child:
    if extra:
      raise SystemExit(f"unknown arguments for --child: {extra}")
    return main_child(args, argv)
  extra = shlex.split(args.dense_args or "") + extra
  return main_parent(args, extra, argv)


if __name__ == "__main__":
  sys.exit(main())
