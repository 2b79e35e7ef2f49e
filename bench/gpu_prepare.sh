#!/usr/bin/env bash
# Fills .gpu/ (git-ignored: add `/.gpu/` to .git/info/exclude) with what bench/gpu_run.sh
# carries to the offline GPU machine: the wheels this project needs beyond the GPU image's
# own packages (../shared/gpu/prepare-wheels.sh, plus our other runtime dependencies) and
# the test model's tokenizer files (.gpu/tok), from which bench/gpu_model.py builds its
# models. Run from the repository root after `make setup-test` (which converts the model).
set -euo pipefail
bash ../shared/gpu/prepare-wheels.sh .gpu gguf==0.19.0 prometheus-client==0.26.0
# llguidance's wheel is tagged manylinux_2_31, a platform prepare-wheels.sh does not ask for.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 -d .gpu/wheels llguidance==1.9.1
# py-spy, for gpu_run.sh's profiling steps (which threads of the server hold the GIL): apart, in .gpu/spy,
# since with it the second call's carry (part-b, wheels, tok and the tree) passes the device's 64 MiB.
python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 -d .gpu/spy py-spy==0.4.3
# The tokenizer stack as this checkout tests it (transformers, pinned in pyproject.toml, with what it needs, at
# the venv's versions), apart in .gpu/hf: without it the servers there run the GPU image's own transformers, whose
# import took 2.2-2.9 s (0.4 s here); the second call's carry has no room for it, so a call of its own stages it.
# numpy and what .gpu/wheels holds stay out.
rm -rf .gpu/hf
.venv/bin/python -m pip freeze --exclude-editable > .gpu/constraints.txt
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -c .gpu/constraints.txt -d .gpu/hf $(grep -iE '^(transformers|huggingface[-_]hub|tokenizers)==' .gpu/constraints.txt)
rm -f .gpu/hf/numpy-*.whl
for wheel in .gpu/wheels/*.whl; do rm -f ".gpu/hf/${wheel##*/}"; done
model=$(ls -d .cache/test/models/*-float32 | head -1)
mkdir -p .gpu/tok
cp "$model"/tokenizer.json "$model"/tokenizer_config.json "$model"/special_tokens_map.json .gpu/tok/
ls .gpu/wheels .gpu/hf .gpu/tok
