"""`python -m jax_api.selfcheck`: do the public attention functions work here?

For each function in `REGISTRY`, each backend ("interpret": the Pallas kernel
on CPU; "xla": the pure-JAX path; "pallas": the Triton kernel, when an NVIDIA
GPU of compute capability 8.0+ is present) and each small embedded case, it

  1. runs the function forward (out and lse) and backward (`jax.vjp` with a
     random cotangent on out and lse) under `jax.jit`;
  2. runs the float32 reference of `pallas_kernels.reference` the same way
     and reports, for the forward and for the gradients (q, k, v and sinks),
     the largest error relative to the reference's largest magnitude:
     max |got - ref| / max |ref|, worst over the arrays;
  3. runs forward + backward 3 times and checks every output and gradient is
     bitwise identical (the library promises a deterministic backward).

A row passes when both errors are under the case's tolerance (float32 inputs:
2e-5 forward, 1e-4 gradients) and the runs agree bitwise. It prints a table,
one verdict line, and exits 0 (all passed) or 1.

    python -m jax_api.selfcheck                    # every case, < 60 s on CPU
    python -m jax_api.selfcheck --quick            # one case per function
    python -m jax_api.selfcheck --backend xla      # one backend (repeatable)
    python -m jax_api.selfcheck --function fold_attn_varlen_func

Adding a function: one `Entry` in `REGISTRY` (its name in `jax_api`, and a
`cases(quick)` callable returning `Case`s). Entries whose function is not in
`jax_api` yet are skipped with a note.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
import zlib
from collections.abc import Callable, Sequence

import numpy as np

# --------------------------------------------------------------- the cases --


@dataclasses.dataclass(frozen=True)
class Case:
  """One input configuration of one function.

  inputs(rng) -> dict of the differentiable arrays (name -> jax.Array).
  run(fn, backend, **arrays) -> tuple of outputs of `fn` (e.g. (out, lse)).
  reference(**arrays) -> the same tuple from the float32 reference (it gets
    the arrays cast to float32).
  """

  name: str
  inputs: Callable
  run: Callable
  reference: Callable
  tol_out: float = 2e-5
  tol_grad: float = 1e-4


@dataclasses.dataclass(frozen=True)
class Entry:
  """A public function: `jax_api.<name>` and its cases (None: none yet)."""

  name: str
  cases: Callable[[bool], list[Case]] | None
  module: str = "jax_api"


# Default shapes: batch 2, 64 tokens, 4 query heads over 2 KV heads (GQA),
# head_dim 32. Small enough for the Pallas interpreter, large enough to cross
# several 16x16 interpret tiles (and window/causal tile skipping).
B, S, HQ, HKV, D = 2, 64, 4, 2, 32
BF16_TOL = dict(tol_out=2e-2, tol_grad=4e-2)


def _draw(rng, shape, dtype, scale=1.0):
  import jax.numpy as jnp
  return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, dtype)


def _dense_case(name, *, causal=False, window_size=(-1, -1), sinks=False,
                softcap=0.0, segments=False, dtype="float32", **tol) -> Case:
  import jax.numpy as jnp

  from pallas_kernels.reference import attention_reference

  seg_ids = None
  if segments:  # three segments per row, at different cut points per row
    cuts = np.array([[20, 41], [9, 50]])
    seg_ids = jnp.asarray((np.arange(S)[None, None] >= cuts[..., None])
                          .sum(1).astype(np.int32))

  def inputs(rng):
    x = dict(q=_draw(rng, (B, S, HQ, D), dtype),
             k=_draw(rng, (B, S, HKV, D), dtype),
             v=_draw(rng, (B, S, HKV, D), dtype))
    if sinks:
      x["sinks"] = _draw(rng, (HQ,), jnp.float32, 1.5)
    return x

  opts = dict(causal=causal, window_size=window_size, softcap=softcap)

  def run(fn, backend, q, k, v, sinks=None):
    return fn(q, k, v, sinks=sinks, segment_ids=seg_ids, return_lse=True,
              backend=backend, **opts)

  def reference(q, k, v, sinks=None):
    return attention_reference(q, k, v, sinks=sinks, segment_ids=seg_ids,
                               **opts)

  return Case(name, inputs, run, reference, **tol)


def _varlen_case(name, cu_q, cu_k=None, *, total_q=128, total_k=128,
                 pass_max_seqlen=False, causal=False, window_size=(-1, -1),
                 sinks=False, softcap=0.0, dtype="float32", **tol) -> Case:
  import jax.numpy as jnp

  from pallas_kernels.reference import varlen_attention_reference

  cu_q = jnp.asarray(cu_q, jnp.int32)
  cu_k = cu_q if cu_k is None else jnp.asarray(cu_k, jnp.int32)
  max_q = int(np.max(np.diff(np.asarray(cu_q)))) if pass_max_seqlen else None
  max_k = int(np.max(np.diff(np.asarray(cu_k)))) if pass_max_seqlen else None

  def inputs(rng):
    x = dict(q=_draw(rng, (total_q, HQ, D), dtype),
             k=_draw(rng, (total_k, HKV, D), dtype),
             v=_draw(rng, (total_k, HKV, D), dtype))
    if sinks:
      x["sinks"] = _draw(rng, (HQ,), jnp.float32, 1.5)
    return x

  opts = dict(causal=causal, window_size=window_size, softcap=softcap)

  def run(fn, backend, q, k, v, sinks=None):
    return fn(q, k, v, cu_q, cu_k, max_q, max_k, sinks=sinks,
              return_lse=True, backend=backend, **opts)

  def reference(q, k, v, sinks=None):
    return varlen_attention_reference(q, k, v, cu_q, cu_k, sinks=sinks,
                                      **opts)

  return Case(name, inputs, run, reference, **tol)


def dense_cases(quick: bool) -> list[Case]:
  cases = [
      _dense_case("causal+sinks", causal=True, sinks=True),
      _dense_case("window(16,8)+sinks", window_size=(16, 8), sinks=True),
      _dense_case("segments+causal+softcap3", segments=True, causal=True,
                  softcap=3.0),
      _dense_case("bf16 causal+sinks", causal=True, sinks=True,
                  dtype="bfloat16", **BF16_TOL),
  ]
  return cases[:1] if quick else cases


def varlen_cases(quick: bool) -> list[Case]:
  cases = [
      # Three sequences of 37, 27 and 64 tokens.
      _varlen_case("3 seqs causal+sinks", [0, 37, 64, 128], causal=True,
                   sinks=True),
      # Keys longer than queries per sequence (bottom-right alignment).
      _varlen_case("q!=k lens window+softcap", [0, 30, 45, 96],
                   [0, 50, 70, 128], total_q=96, window_size=(16, 0),
                   softcap=3.0, pass_max_seqlen=True),
      # 8 tokens past cu_seqlens[-1]: out 0; lse and its gradient follow the
      # fully-masked-row convention (lse = the sink when sinks are given).
      _varlen_case("8 pad tokens+sinks", [0, 37, 64, 120], causal=True,
                   sinks=True),
  ]
  return cases[:1] if quick else cases


# One entry per public function. Later functions get one entry each (with a
# `cases` callable like `dense_cases`); until their cases are written, an
# entry with cases=None reports the function as present but unchecked.
REGISTRY: list[Entry] = [
    Entry("fold_attn_func", dense_cases),
    Entry("fold_attn_varlen_func", varlen_cases),
    Entry("fold_attn_with_kvcache", None),
    Entry("disentangled_attention", None),
]

# ------------------------------------------------------------- the checker --


@dataclasses.dataclass
class Row:
  function: str
  backend: str
  case: str
  err_out: float = float("nan")
  err_grad: float = float("nan")
  deterministic: bool | None = None
  seconds: float = 0.0
  error: str | None = None
  passed: bool = False
  worst: tuple[str, str] = ("", "")  # arrays with the largest errors


def _rel_err(got, want) -> float:
  """max |got - want| / max |want| over finite entries; matching infinities
  (e.g. lse = -inf of a row that sees no key) count as exact, others as inf."""
  g = np.asarray(got, np.float64)
  w = np.asarray(want, np.float64)
  if g.shape != w.shape:
    return float("inf")
  fin = np.isfinite(w)
  if not np.array_equal(g[~fin], w[~fin]) or not np.all(np.isfinite(g[fin])):
    return float("inf")
  if not fin.any():
    return 0.0
  scale = max(float(np.max(np.abs(w[fin]))), 1e-30)
  return float(np.max(np.abs(g[fin] - w[fin]))) / scale


def _worst(gots, wants, names) -> tuple[float, str]:
  """(largest relative error, name of the array it came from)."""
  errs = [(_rel_err(g, w), n) for g, w, n in zip(gots, wants, names)]
  return max(errs, key=lambda e: e[0], default=(0.0, ""))


def _vjp_fn(fn):
  import jax

  def value_and_grads(arrays, cotangents):
    outs, pullback = jax.vjp(fn, *arrays)
    cts = tuple(c.astype(o.dtype) for c, o in zip(cotangents, outs))
    return outs, pullback(cts)

  return jax.jit(value_and_grads)


def _bits(tree) -> list[bytes]:
  import jax
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _seed(*parts: str) -> int:
  return zlib.crc32("/".join(parts).encode())


def _prepare(entry: Entry, case: Case):
  """Inputs, cotangents and the float32 reference (computed once per case)."""
  import jax
  import jax.numpy as jnp

  rng = np.random.default_rng(_seed(entry.name, case.name))
  arrays = case.inputs(rng)
  names = list(arrays)
  xs = tuple(arrays[n] for n in names)
  ref_fn = lambda *a: case.reference(**dict(zip(names, a)))
  x32 = tuple(jnp.asarray(x, jnp.float32) for x in xs)
  out_shapes = jax.eval_shape(ref_fn, *x32)
  cts = tuple(jnp.asarray(rng.standard_normal(o.shape, np.float32))
              for o in out_shapes)
  ref_outs, ref_grads = jax.device_get(_vjp_fn(ref_fn)(x32, cts))
  return names, xs, cts, ref_outs, ref_grads


def _check(fn, entry: Entry, case: Case, backend: str, prepared) -> Row:
  import jax

  names, xs, cts, ref_outs, ref_grads = prepared
  row = Row(entry.name, backend, case.name)
  t0 = time.perf_counter()
  try:
    run = _vjp_fn(lambda *a: tuple(case.run(fn, backend,
                                            **dict(zip(names, a)))))
    results = [jax.device_get(run(xs, cts)) for _ in range(3)]
    outs, grads = results[0]
    out_names = ("out", "lse", *(f"out{i}" for i in range(2, len(outs))))
    row.err_out, w_out = _worst(outs, ref_outs, out_names)
    row.err_grad, w_grad = _worst(grads, ref_grads, [f"d{n}" for n in names])
    row.worst = (w_out, w_grad)
    first = _bits(results[0])
    row.deterministic = all(_bits(r) == first for r in results[1:])
    row.passed = (row.err_out <= case.tol_out and
                  row.err_grad <= case.tol_grad and row.deterministic)
  except Exception as e:  # reported in the table, never raised
    row.error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
  row.seconds = time.perf_counter() - t0
  return row


def _available_backends() -> list[str]:
  from jax_api._backend import _gpu_capability
  cc = _gpu_capability()
  return ["interpret", "xla"] + (["pallas"] if cc and cc >= (8, 0) else [])


# ---------------------------------------------------------------- printing --

_COLS = ("function", "backend", "case", "rel err out", "rel err grads",
         "deterministic", "time")
_WIDTHS = (22, 9, 26, 11, 13, 13, 7)


def _line(cells) -> str:
  return "  ".join(str(c).ljust(w) for c, w in zip(cells, _WIDTHS)).rstrip()


def _fmt_err(e: float, tol: float) -> str:
  if e != e:
    return "-"
  return f"{e:.1e}" + ("" if e <= tol else " !")


def _print_row(row: Row, case: Case | None) -> None:
  if row.error is not None:
    print(_line((row.function, row.backend, row.case, "ERROR", "-", "-",
                 f"{row.seconds:.1f}s")))
    print(f"    {row.error}")
    return
  det = {True: "yes", False: "NO", None: "-"}[row.deterministic]
  print(_line((row.function, row.backend, row.case,
               _fmt_err(row.err_out, case.tol_out),
               _fmt_err(row.err_grad, case.tol_grad), det,
               f"{row.seconds:.1f}s")), flush=True)
  bad = []
  for err, tol, name in ((row.err_out, case.tol_out, row.worst[0]),
                         (row.err_grad, case.tol_grad, row.worst[1])):
    if err > tol:
      why = "non-finite mismatch" if err == float("inf") else f"{err:.1e}"
      bad.append(f"{name} ({why})")
  if bad:
    print(f"    worst: {'; '.join(bad)}", flush=True)


def _intro(backends, quick) -> str:
  return (
      "foldax selfcheck: runs each public attention function forward and "
      "backward\n"
      f"on small embedded cases ({'one' if quick else 'every'} case per "
      f"function; default shapes B{B} S{S} H{HQ}/KV{HKV} D{D})\n"
      f"on backends {', '.join(backends)}, and checks, per row:\n"
      "  rel err out   = max|out - ref| / max|ref| over out and lse, against "
      "the float32\n"
      "                  reference of pallas_kernels.reference;\n"
      "  rel err grads = the same over dq, dk, dv (and dsinks), from jax.vjp "
      "with a\n"
      "                  random cotangent on out and lse;\n"
      "  deterministic = 3 runs of forward+backward give bitwise-identical "
      "results.\n"
      "Tolerances: float32 2e-5 (out) / 1e-4 (grads); bfloat16 2e-2 / 4e-2. "
      "'!' marks an error over tolerance.\n")


# -------------------------------------------------------------------- main --


def _parse(argv):
  p = argparse.ArgumentParser(
      prog="python -m jax_api.selfcheck",
      description="Check every public attention function of jax_api against "
      "the float32 references: forward, gradients, bitwise determinism.")
  p.add_argument("--quick", action="store_true",
                 help="one case per function (a few seconds per backend)")
  p.add_argument("--backend", action="append",
                 choices=("interpret", "xla", "pallas", "auto"),
                 help="backend to check (repeatable); default: interpret and "
                 "xla, plus pallas on an NVIDIA GPU of compute capability 8.0+")
  p.add_argument("--function", action="append",
                 help="only this function (repeatable); default: all in the "
                 "registry")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = _parse(argv)
  t_start = time.perf_counter()
  import jax
  # Registers a trace-context config option that JAX otherwise registers
  # lazily inside the first Pallas interpret call, which would make that
  # first jitted function trace and compile twice.
  try:
    import jax.experimental.pallas.fuser  # noqa: F401
  except ImportError:
    pass

  backends = list(dict.fromkeys(args.backend or _available_backends()))
  entries = REGISTRY
  if args.function:
    unknown = set(args.function) - {e.name for e in REGISTRY}
    if unknown:
      print(f"unknown function(s) {sorted(unknown)}; the registry has "
            f"{[e.name for e in REGISTRY]}.")
      return 2
    entries = [e for e in REGISTRY if e.name in args.function]

  print(_intro(backends, args.quick))
  print(f"jax {jax.__version__}, default device: {jax.devices()[0]}")
  print()
  print(_line(_COLS))
  print(_line("-" * w for w in _WIDTHS), flush=True)

  rows: list[Row] = []
  notes: list[str] = []
  for entry in entries:
    try:
      module = importlib.import_module(entry.module)
      fn = getattr(module, entry.name)
    except (ImportError, AttributeError) as e:
      if isinstance(e, AttributeError) and module.__file__ is None:
        # A package without __init__.py on the path: typically an editable
        # install made before the package had one, run outside the checkout.
        notes.append(f"{entry.name}: {entry.module} resolved to a namespace "
                     f"package ({list(module.__path__)}); reinstall with "
                     "`pip install -e .` or run from the repository root.")
      else:
        notes.append(f"{entry.name}: not in {entry.module} yet; skipped.")
      continue
    if entry.cases is None:
      notes.append(f"{entry.name}: present, but has no selfcheck cases yet "
                   "(add them to its entry in jax_api.selfcheck.REGISTRY); "
                   "skipped.")
      continue
    for case in entry.cases(args.quick):
      try:
        prepared = _prepare(entry, case)
      except Exception as e:
        row = Row(entry.name, "reference", case.name,
                  error=f"{type(e).__name__}: {e}".splitlines()[0][:300])
        rows.append(row)
        _print_row(row, case)
        continue
      for backend in backends:
        row = _check(fn, entry, case, backend, prepared)
        rows.append(row)
        _print_row(row, case)

  print()
  for note in notes:
    print(f"note: {note}")
  passed = sum(r.passed for r in rows)
  elapsed = time.perf_counter() - t_start
  ok = bool(rows) and passed == len(rows)
  verdict = "PASS" if ok else "FAIL"
  n_fn = len({r.function for r in rows})
  print(f"{verdict}: {passed}/{len(rows)} checks passed ({n_fn} "
        f"function{'s' * (n_fn != 1)}; backends {', '.join(backends)}) in "
        f"{elapsed:.1f}s.")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
