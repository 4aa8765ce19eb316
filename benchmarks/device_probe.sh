#!/usr/bin/env bash
# Diagnostics on the lent H200 (through the device tool), one stage per
# argument, each "SECONDS:command" run under `timeout`, output to $OUT/log.txt:
#
#   bash benchmarks/device_probe.sh \
#     "120:python3 -m benchmarks.kernel_probe --bwd-probe --out \$OUT/bwd_probe.json" \
#     "90:python3 -m benchmarks.bridge_calls --seq 128 4096 --phases"
#
# The carried wheels (.whl/) are installed into /tmp/site first, as in
# device_run.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/foldax_out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
main() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || echo "wheels: rc=$?"
  fi
  export PYTHONPATH="/tmp/site:$REPO:$REPO/benchmarks/xprof_stub${PYTHONPATH:+:$PYTHONPATH}"
  for stage in "$@"; do
    t=${stage%%:*}; cmd=${stage#*:}
    echo; echo "=== [$(date -u +%H:%M:%S) ${SECONDS}s] (timeout ${t}s) $cmd"
    timeout -k 10 "$t" bash -c "$cmd"; rc=$?
    [ $rc != 0 ] && echo "--- rc=$rc"
  done
  echo "done in ${SECONDS}s"
}
main "$@" 2>&1 | tee "$OUT/log.txt"
