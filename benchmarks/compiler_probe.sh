#!/usr/bin/env bash
# Forward and backward tile candidates at one shape, each compiled both by
# XLA and by pip Triton (FOLDAX_KERNEL_COMPILER, see pallas_kernels/
# pip_triton.py), through benchmarks.kernel_probe. On the device, from the
# repository root:
#
#   SHAPE=4,2048,16,64 FWD='128,64,8,3;128,128,8,3' \
#     BWD='64,64,4,2/64,64,4,2;64,128,8,2/128,64,8,2' \
#     bash benchmarks/compiler_probe.sh
#
# Writes $OUT/probe-<compiler>-{fwd,bwd}.json and prints each ranking.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/foldax_out}
mkdir -p "$OUT"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
SHAPE=${SHAPE:-2,8192,16,128}
T=${T_PROBE:-90}
for c in ${COMPILERS:-xla triton}; do
  tag=$(echo "$SHAPE" | tr ',' 'x')
  if [ -n "${FWD:-}" ]; then
    echo "=== forward, compiled by $c, shape $SHAPE"
    FOLDAX_KERNEL_COMPILER=$c timeout "$T" python3 -m benchmarks.kernel_probe \
      --fwd-probe --fwd-shape "$SHAPE" --fwd-blocks "$FWD" \
      --out "$OUT/probe-$c-fwd-$tag.json" 2>&1 | grep -E "^(ours|jax_mha)" 
  fi
  if [ -n "${BWD:-}" ]; then
    echo "=== backward, compiled by $c, shape $SHAPE"
    FOLDAX_KERNEL_COMPILER=$c timeout "$T" python3 -m benchmarks.kernel_probe \
      --bwd-probe --fwd-shape "$SHAPE" --bwd-configs "$BWD" \
      --out "$OUT/probe-$c-bwd-$tag.json" 2>&1 | grep -E "^(forward|dkdv)"
  fi
done
