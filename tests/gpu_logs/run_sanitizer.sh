#!/usr/bin/env bash
# Runs every kernel family of sanitize_kernels.py under compute-sanitizer's
# memcheck, racecheck and initcheck, one family per tool run, each under a
# timeout; one log per (tool, family) in the directory $1, and a summary
# (summary.txt: the sanitizer's verdict line or TIMEOUT / EXIT n).
#
#   bash tests/gpu_logs/run_sanitizer.sh tests/gpu_logs/sanitizer-$(date +%F)
#
# Budget: 3 tools x 6 families under T_RUN seconds each (default 22:
# about 7 minutes in all on an H100); TOOLS / FAMILIES override the lists.
set -u
out=${1:?usage: run_sanitizer.sh LOG_DIR}
mkdir -p "$out"
here=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
# The sanitizer cannot follow XLA's own allocator: let JAX allocate on demand.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Under the sanitizer the process crashed (EXIT 139) while XLA compiled
# dense_atomic, decode and deberta (H100, 2026-12-07), with or without the
# flags below: each family first runs once without the sanitizer, filling a
# persistent compilation cache, so that under it the executables are loaded,
# not compiled. The flags (no gemm autotuning, no command buffers, one
# compile thread) are part of the configuration that then ran every family;
# our kernels are what is checked, not XLA's gemm choice.
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer= --xla_gpu_force_compilation_parallelism=1"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$out/.jax_cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
T_RUN=${T_RUN:-22}
TOOLS=${TOOLS:-"memcheck racecheck initcheck"}
FAMILIES=${FAMILIES:-"dense_recompute dense_atomic decode deberta ring bridge"}
PY=${PY:-python3}
summary="$out/summary.txt"
: > "$summary"
for fam in $FAMILIES; do  # fill the compilation cache (see above)
  timeout "$T_RUN" "$PY" "$here/tests/gpu_logs/sanitize_kernels.py" "$fam" \
    > "$out/warm-$fam.log" 2>&1
done
for tool in $TOOLS; do
  extra=()
  [ "$tool" = memcheck ] && extra=(--leak-check no)
  for fam in $FAMILIES; do
    log="$out/$tool-$fam.log"
    start=$(date +%s)
    timeout --kill-after=5 "$T_RUN" compute-sanitizer --tool "$tool" \
      "${extra[@]}" --print-limit 50 --error-exitcode 9 \
      "$PY" "$here/tests/gpu_logs/sanitize_kernels.py" "$fam" > "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    case $rc in
      0) verdict=$(grep -m1 "ERROR SUMMARY\|RACECHECK SUMMARY" "$log" ||
                   echo "ok") ;;
      124|137) verdict="TIMEOUT after ${T_RUN}s" ;;
      9) verdict="ERRORS: $(grep -m1 "ERROR SUMMARY\|RACECHECK SUMMARY" "$log")" ;;
      *) verdict="EXIT $rc (see log)" ;;
    esac
    printf '%-10s %-16s %4ss  %s\n' "$tool" "$fam" "$took" "$verdict" |
      tee -a "$summary"
  done
done
