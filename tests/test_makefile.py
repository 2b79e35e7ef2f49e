"""The Makefile picks the MLX backend: cuda where an NVIDIA GPU answers, else cpu; BACKEND overrides."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the backend choice is Linux's (macOS uses Metal)")


def fake_nvidia_smi(bin_dir: Path, *, answers: bool) -> Path:
    """A stand-in for nvidia-smi (the fault being injected: a GPU present or broken)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    tool = bin_dir / "nvidia-smi"
    body = 'echo "GPU 0: NVIDIA H200"' if answers else "exit 9"
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return bin_dir


def dry_run(tmp_path: Path, *args: str, path_prefix: Path | None = None) -> str:
    """Returns what `make -n setup` would run, with a venv in tmp_path (nothing is run)."""
    env = dict(os.environ)
    env.pop("BACKEND", None)
    if path_prefix is not None:
        env["PATH"] = f"{path_prefix}:{env['PATH']}"
    done = subprocess.run(["make", "-n", "setup", f"VENV={tmp_path / 'venv'}", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_an_answering_gpu_gets_the_cuda_extra(tmp_path):
    out = dry_run(tmp_path, path_prefix=fake_nvidia_smi(tmp_path / "bin", answers=True))
    assert 'pip install -q -e ".[cuda]"' in out
    assert "MLX backend: cuda" in out


def test_a_gpu_that_does_not_answer_gets_the_cpu_extra(tmp_path):
    out = dry_run(tmp_path, path_prefix=fake_nvidia_smi(tmp_path / "bin", answers=False))
    assert 'pip install -q -e ".[cpu]"' in out


def test_backend_overrides_the_detection(tmp_path):
    gpu = fake_nvidia_smi(tmp_path / "bin", answers=True)
    assert 'pip install -q -e ".[cpu]"' in dry_run(tmp_path, "BACKEND=cpu", path_prefix=gpu)
    assert 'pip install -q -e ".[cuda]"' in dry_run(tmp_path, "BACKEND=cuda")


def test_an_unknown_backend_is_refused(tmp_path):
    done = subprocess.run(["make", "-n", "setup", "BACKEND=gpu", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert 'BACKEND must be cpu or cuda, not "gpu"' in done.stderr


def test_venv_selects_where_serve_runs(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BACKEND"}
    done = subprocess.run(["make", "-n", "serve", "VENV=.venv-base", "BACKEND=cpu"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert ".venv-base/bin/omlx serve --config omlx.toml" in done.stdout
    assert 'test' not in done.stdout.split("pip install", 1)[1].split("\n", 1)[0]  # base install only
