#!/usr/bin/env bash
# MLX's Linux CPU wheel links a slow reference BLAS; Debian's OpenBLAS, preloaded by
# `omlx serve`, makes float32 matmuls ~30x faster with identical results.
set -euo pipefail
[ "$(uname -s)" = Linux ] || exit 0
for lib in /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0; do
    [ -e "$lib" ] && exit 0
done
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "installing Debian's libopenblas0-pthread (fast CPU matmuls for MLX)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && apt-get install -y -q libopenblas0-pthread >/dev/null; }
elif command -v apt-get >/dev/null; then
    echo "note: OpenBLAS is missing; for ~30x faster CPU inference run: sudo apt-get install libopenblas0-pthread"
else
    echo "note: OpenBLAS not found; install your distribution's OpenBLAS (pthread build) for fast CPU inference"
fi
