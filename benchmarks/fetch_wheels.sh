#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the wheels that the H200 image lacks
# for benchmarks/dense.py, into .whl/ at the repository root (git-ignored).
# benchmarks/device_run.sh installs them there with --no-index --no-deps.
#
#   bash benchmarks/fetch_wheels.sh          # idempotent; prints the total size
#
# Targets the device: CPython 3.12, manylinux x86-64; --no-deps, so every
# missing dependency is named below. The H200 image already has (KINDS.md):
# absl-py jax jaxlib jaxtyping numpy tqdm flax chex opt-einsum protobuf
# packaging typing-extensions torch triton.
#   tokamax 0.0.17 requires: absl-py einshape jax jaxlib jaxtyping pydantic
#     qwix tqdm immutabledict tensorboardx xprof  -> xprof is replaced by the
#     stand-in benchmarks/xprof_stub (the real wheel is large); qwix needs
#     flax, numpy, opt_einsum, absl-py (all on the image).
#   pydantic 2.14.4 needs pydantic-core==2.50.5, annotated-types,
#     typing-inspection, typing-extensions>=4.16 (carried too: the image's
#     version is not recorded, and an older one can break pydantic's import).
#   tensorboardx needs numpy, packaging, protobuf (on the image).
#   fastflash-attention 0.2.0 needs only torch and triton (on the image).
#   disentangled-flash 1.1.1 and flashdeberta 0.0.8 (DeBERTa peers) need
#   torch, triton, einops (on the image).
# Nothing here is the `dlpack` PyPI package nor jax-triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -x .venv/bin/python ]; then PY=${PYTHON:-.venv/bin/python}; fi

PKGS=(
  tokamax==0.0.17
  einshape==1.0
  immutabledict==4.3.1
  qwix==0.1.8
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  tensorboardx==2.6.5
  fastflash-attention==0.2.0
  disentangled-flash==1.1.1
  flashdeberta==0.0.8
)

mkdir -p .whl   # ignored by the repository's .gitignore (/.whl/)

"$PY" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 \
  -d .whl "${PKGS[@]}"

# Keep exactly one version of each distribution (two stop the whole install).
"$PY" - <<'EOF'
import collections, pathlib, re
files = sorted(pathlib.Path(".whl").glob("*.whl"))
by = collections.defaultdict(list)
for f in files:
    by[re.sub(r"[-_.]+", "_", f.name.split("-")[0]).lower()].append(f)
dups = {k: v for k, v in by.items() if len(v) > 1}
if dups:
    raise SystemExit(f"several versions in .whl/, remove the extra ones: {dups}")
EOF

ls -l .whl/*.whl
echo "total: $(du -ch .whl/*.whl | tail -1 | cut -f1) in $(ls .whl/*.whl | wc -l) wheels"
