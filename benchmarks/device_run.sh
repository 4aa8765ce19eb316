#!/usr/bin/env bash
# The one script to run on the lent H200 (through the device tool), from the
# repository root, with `.whl` carried (fill it here first with
# `bash benchmarks/fetch_wheels.sh`):
#
#   bash benchmarks/device_run.sh --quick      # dense anchor shapes + other suites
#   bash benchmarks/device_run.sh              # full dense grid (+ other suites)
#   SUITES="dense" bash benchmarks/device_run.sh             # one suite
#   SUITES="decode deberta bridge" bash benchmarks/device_run.sh --quick
#   FOLDAX_GIT_COMMIT=<sha> bash benchmarks/device_run.sh --quick
#       (the device copy has no .git: pass the commit to record it)
#
# A device command may run 10 minutes: the full dense grid alone needs most
# of that, so run it as SUITES=dense and the others in a second call, then
# plot both files together (benchmarks.plot takes several JSON files).
#
# Stages, each under its own `timeout` (override with T_PYTEST, T_DENSE,
# T_SUITE, T_DET):
#   0. install the carried wheels into /tmp/site (no index, no deps)
#   1. nvidia-smi
#   2. python3 -m pytest -q -m gpu tests/      (exit 5, nothing selected, is ok)
#   3. python3 -m benchmarks.run --suite <each of $SUITES> --output
#      $OUT/results.json "$@" (one process per suite; dense also runs the
#      deterministic-cuDNN process with XLA_FLAGS=--xla_gpu_deterministic_ops
#      and merges it; arguments run.py does not know go to benchmarks.dense)
#   4. python3 -m benchmarks.plot $OUT/results.json --output-dir $OUT/figures
# Everything goes to $OUT/log.txt too.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/foldax_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PYTHON:-python3}

QUICK=0
for a in "$@"; do [ "$a" = "--quick" ] && QUICK=1; done
SUITES=${SUITES:-all}
if [ $QUICK = 1 ]; then
  T_PYTEST=${T_PYTEST:-60}; T_DENSE=${T_DENSE:-200}; T_DET=${T_DET:-60}
else
  T_PYTEST=${T_PYTEST:-45}; T_DENSE=${T_DENSE:-400}; T_DET=${T_DET:-60}
fi
T_SUITE=${T_SUITE:-$T_DENSE}   # per-suite hard stop inside benchmarks.run
# dense.py stops starting new measurements at its budget; the timeout is the
# hard stop (the JSON is rewritten after every shape, so partial runs survive).
B_DENSE=$((T_DENSE - 40)); B_DET=$((T_DET - 25))
SUITE_ARGS=()
for s in $SUITES; do SUITE_ARGS+=(--suite "$s"); done

stage() { echo; echo "=== $* ($(date -u +%H:%M:%S), ${SECONDS}s)"; }

main() {
  stage "0. wheels -> /tmp/site"
  if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "WARNING: wheel install failed (rc=$?); tokamax/fastflash will be recorded as missing"
  else
    echo "WARNING: no .whl/ carried; tokamax/fastflash will be recorded as missing"
  fi
  export PYTHONPATH="/tmp/site:$REPO:$REPO/benchmarks/xprof_stub${PYTHONPATH:+:$PYTHONPATH}"
  echo "PYTHONPATH=$PYTHONPATH"

  stage "1. nvidia-smi"
  timeout 30 nvidia-smi || echo "nvidia-smi failed (rc=$?)"
  timeout 30 "$PY" -c "import sys, jax, torch; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices(), 'torch', torch.__version__, torch.cuda.is_available())" \
    || echo "framework probe failed (rc=$?)"

  stage "2. pytest -m gpu (timeout ${T_PYTEST}s)"
  timeout -k 10 "$T_PYTEST" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/
  rc=$?
  if [ $rc = 5 ]; then echo "pytest: no GPU tests selected (rc=5): ok";
  elif [ $rc != 0 ]; then echo "pytest: rc=$rc"; fi

  stage "3. benchmarks.run: $SUITES (per-suite timeout ${T_SUITE}s, dense budget ${B_DENSE}s)"
  "$PY" -m benchmarks.run "${SUITE_ARGS[@]}" --output "$OUT/results.json" \
    --timeout-s "$T_SUITE" --det-budget-s "$B_DET" --budget-s "$B_DENSE" "$@"
  rc=$?; [ $rc != 0 ] && echo "benchmarks.run: rc=$rc (the JSON keeps what finished)"

  stage "4. plots and table"
  if [ -f "$OUT/results.json" ]; then
    timeout 120 "$PY" -m benchmarks.plot "$OUT/results.json" --output-dir "$OUT/figures" \
      || echo "plot failed (rc=$?; matplotlib missing?): plot results.json off the device"
  fi
  echo "done in ${SECONDS}s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main "$@" 2>&1 | tee "$OUT/log.txt"
