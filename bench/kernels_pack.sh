#!/usr/bin/env bash
# Builds the pack of MLX's kernels omlx ships for a GPU architecture (appliance/kernels/packs.py),
# here, without a GPU: NVRTC (the test extra's) compiles the manifest's modules from the CUDA
# wheel's libmlx and headers, with CUDA's runtime headers from the nvidia-cuda-runtime wheel.
# Run from the repository root after `make setup-test`:
#
#   bash bench/kernels_pack.sh [ARCH]  # default sm_90a (H100, H200); writes appliance/kernels/ahead/mlx-VERSION-ARCH.zip
set -euo pipefail
ARCH=${1:-sm_90a}
MLX=$(sed -n 's/^ *"mlx==\([^"]*\)",.*/\1/p' pyproject.toml)
RUNTIME=13.0.96  # CUDA 13.0's runtime headers, as the test extra's NVRTC is 13.0's
DIR=.cache/pack-inputs; rm -rf "$DIR"; mkdir -p "$DIR/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py \
  --platform manylinux_2_35_x86_64 --platform manylinux2014_x86_64 -d "$DIR/wheels" \
  "mlx-cuda-13==$MLX" "nvidia-cuda-runtime==$RUNTIME"
for wheel in "$DIR"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$DIR/site"; done  # the layout MLX finds
.venv/bin/python bench/kernels_ahead.py pack --library "$DIR/site/mlx/lib/libmlx.so" --arch "$ARCH"
