"""appliance/cli.py: `omlx check` run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from appliance.cli_connect import base_url
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
                    '\n[kernels]\nkv_quantize = "fast"\n')
    result = check(path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert "4 error(s)" in result.stderr
    for line in ["server.port: ", "server.prot: unknown key", "models[0].source: required key is missing",
                 "kernels.kv_quantize: "]:
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


def connect(config: Path, *args: str) -> subprocess.CompletedProcess:
    """Returns the finished `python -m appliance connect ARGS --config CONFIG`."""
    return subprocess.run(
        [sys.executable, "-m", "appliance", "connect", *args, "--config", str(config)],
        cwd=REPO, env=os.environ, capture_output=True, text=True, timeout=60,
    )


TWO_MODELS = """
[server]
port = 8123

[[models]]
name = "small"
source = "small.gguf"

[[models]]
name = "big"
source = "big.gguf"
default = true
max_context_tokens = 16384
"""


def test_connect_claude_prints_exports_for_the_default_model(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(TWO_MODELS)
    result = connect(path, "claude")
    assert result.returncode == 0, result.stderr
    exports = dict(line.removeprefix("export ").split("=", 1) for line in result.stdout.splitlines()
                   if line.startswith("export "))
    assert exports["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8123"
    assert exports["ANTHROPIC_AUTH_TOKEN"]
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_SMALL_FAST_MODEL"):
        assert exports[key] == "big"
    # The lines run as they are in a shell.
    shell = subprocess.run(["bash", "-c", f'eval "$({sys.executable} -m appliance connect claude '
                            f'--config {path} --model small)"; echo "$ANTHROPIC_MODEL $ANTHROPIC_BASE_URL"'],
                           cwd=REPO, capture_output=True, text=True, timeout=60)
    assert shell.stdout.strip() == "small http://127.0.0.1:8123"


def test_connect_codex_prints_a_profile_file_with_a_responses_provider(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(TWO_MODELS)
    result = connect(path, "codex")
    assert result.returncode == 0, result.stderr
    data = tomllib.loads(result.stdout)
    assert data["model_providers"]["omlx"] == {"name": "omlx", "base_url": "http://127.0.0.1:8123/v1",
                                               "wire_api": "responses"}
    assert (data["model"], data["model_provider"], data["model_context_window"]) == ("big", "omlx", 16384)
    assert "~/.codex/omlx.config.toml" in result.stdout


def test_connect_reaches_a_server_listening_everywhere_locally():
    assert base_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert base_url("::", 8000) == "http://127.0.0.1:8000"
    assert base_url("::1", 8000) == "http://[::1]:8000"
    assert base_url("omlx.local", 8000) == "http://omlx.local:8000"


def test_connect_hands_the_agents_an_api_key(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text('[server]\nport = 8123\n\n[[server.api_keys]]\nkey = "sk-first-0123456789abcdef"\n\n'
                    '[[server.api_keys]]\nkey = "sk-second-0123456789abcdef"\ntenant = "other"\n' + ONE_MODEL)
    claude = connect(path, "claude")
    assert claude.returncode == 0, claude.stderr
    assert "export ANTHROPIC_AUTH_TOKEN=sk-first-0123456789abcdef\n" in claude.stdout
    codex = connect(path, "codex")
    assert codex.returncode == 0, codex.stderr
    assert tomllib.loads(codex.stdout)["model_providers"]["omlx"]["env_key"] == "OMLX_API_KEY"
    assert "sk-" not in codex.stdout  # a file to save: the key stays in the environment


def test_connect_names_an_unknown_model(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_text(TWO_MODELS)
    result = connect(path, "codex", "--model", "nope")
    assert result.returncode == 1
    assert "no model 'nope'" in result.stderr and "small, big" in result.stderr
