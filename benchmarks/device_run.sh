#!/usr/bin/env bash
# The one script to run on the lent H200 (through the device tool), from the
# repository root, with `.whl` carried (fill it here first with
# `bash benchmarks/fetch_wheels.sh`):
#
#   bash benchmarks/device_run.sh --quick      # anchor shapes, ~3 min
#   bash benchmarks/device_run.sh              # full grid, <= ~9 min
#   FOLDAX_GIT_COMMIT=<sha> bash benchmarks/device_run.sh --quick
#       (the device copy has no .git: pass the commit to record it)
#
# Stages, each under its own `timeout` (override with T_PYTEST, T_DENSE, T_DET):
#   0. install the carried wheels into /tmp/site (no index, no deps)
#   1. nvidia-smi
#   2. python3 -m pytest -q -m gpu tests/      (exit 5, nothing selected, is ok)
#   3. python3 -m benchmarks.dense --output $OUT/dense.json "$@"
#   4. python3 -m benchmarks.dense --deterministic-cudnn (own process, with
#      XLA_FLAGS=--xla_gpu_deterministic_ops=true), merged into $OUT/dense.json
# Everything goes to $OUT/log.txt too. Arguments pass through to stages 3 and 4.
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
if [ $QUICK = 1 ]; then
  T_PYTEST=${T_PYTEST:-60}; T_DENSE=${T_DENSE:-200}; T_DET=${T_DET:-60}
else
  T_PYTEST=${T_PYTEST:-45}; T_DENSE=${T_DENSE:-400}; T_DET=${T_DET:-60}
fi
# dense.py stops starting new measurements at its budget; the timeout is the
# hard stop (the JSON is rewritten after every shape, so partial runs survive).
B_DENSE=$((T_DENSE - 40)); B_DET=$((T_DET - 25))

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

  stage "3. dense benchmark (timeout ${T_DENSE}s, budget ${B_DENSE}s)"
  timeout -k 10 "$T_DENSE" "$PY" -m benchmarks.dense --budget-s "$B_DENSE" \
    "$@" --output "$OUT/dense.json"
  rc=$?; [ $rc != 0 ] && echo "dense: rc=$rc (124 = timeout; the JSON keeps what finished)"

  stage "4. deterministic cuDNN, own process (timeout ${T_DET}s)"
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_deterministic_ops=true" \
    timeout -k 10 "$T_DET" "$PY" -m benchmarks.dense "$@" \
    --deterministic-cudnn --budget-s "$B_DET" --output "$OUT/dense_det.json"
  rc=$?; [ $rc != 0 ] && echo "dense det: rc=$rc"
  if [ -f "$OUT/dense_det.json" ]; then
    if [ -f "$OUT/dense.json" ]; then
      "$PY" -m benchmarks.dense --merge "$OUT/dense.json" "$OUT/dense_det.json" \
        --output "$OUT/dense.json" && rm -f "$OUT/dense_det.json"
    else
      mv "$OUT/dense_det.json" "$OUT/dense.json"
    fi
  fi

  stage "summary"
  [ -f "$OUT/dense.json" ] && "$PY" -m benchmarks.dense --table "$OUT/dense.json"
  echo "done in ${SECONDS}s; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
}

main "$@" 2>&1 | tee "$OUT/log.txt"
