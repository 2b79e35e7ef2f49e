"""appliance/cli.py: `omlx check` run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path


from appliance.spec import Spec

REPO = Path(__file__).resolve().parents[1]

ONE_MODEL = """
[[models]]
name = "tiny"
source = "tiny.gguf"
"""


def check(config: Path, **env: str) -> subprocess.CompletedProcess:
    """Returns the finished `python -m appliance check --config CONFIG`, with `env` added."""
    return subprocess.run(
        [sys.executable, "-m", "appliance", "check", "--config", str(config)],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=60,
    )


def test_repo_config_prints_resolved_toml():
    result = check(REPO / "omlx.toml")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    data = tomllib.loads(result.stdout)
    assert data["models"][0]["name"] == "smollm2-135m"
    assert data["server"]["drain_timeout_s"] == 10.0  # defaults are filled in


def test_stdout_is_the_resolved_spec(tmp_path):
    (tmp_path / "profiles").mkdir()
    (tmp_path / "profiles" / "big.toml").write_text("[cache]\nmemory_gb = 8.0\n")
    path = tmp_path / "omlx.toml"
    path.write_text('profile = "big"\n[server]\nport = 8001\n' + ONE_MODEL)
    result = check(path, OMLX_BATCHING__MAX_RUNNING="3")
    assert result.returncode == 0, result.stderr
    spec = Spec(**tomllib.loads(result.stdout))
    assert (spec.server.port, spec.cache.memory_gb, spec.batching.max_running) == (8001, 8.0, 3)
    assert spec.profile == "big"


def test_every_error_is_listed_with_its_path(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text('[server]\nport = 99999\nprot = 1\n\n[[models]]\nname = "tiny"\n'
                    '\n[kernels]\nattention = "fast"\n')
    result = check(path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "4 error(s)" in result.stderr
    for line in ["server.port: ", "server.prot: unknown key", "models[0].source: required key is missing",
                 "kernels.attention: "]:
        assert line in result.stderr


def test_model_level_error_has_a_path(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(ONE_MODEL + ONE_MODEL.replace("tiny", "small"))
    result = check(path)
    assert result.returncode == 1
    assert "models: exactly one model must have default = true" in result.stderr


def test_bad_env_value_is_reported_with_its_path(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(ONE_MODEL)
    result = check(path, OMLX_SERVER__PORT="abc")
    assert result.returncode == 1
    assert "server.port: " in result.stderr
    assert "'abc'" in result.stderr


def test_missing_file(tmp_path):
    result = check(tmp_path / "nope.toml")
    assert result.returncode == 1
    assert "no such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_syntax_error(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(ONE_MODEL + '[cache]\ndir = "unterminated\n')
    result = check(path)
    assert result.returncode == 1
    assert "TOML syntax error" in result.stderr
    assert "Traceback" not in result.stderr
