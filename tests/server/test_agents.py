"""The real coding agents against omlx with the default model: Claude Code (`claude -p`)
and Codex (`codex exec`), installed from npm into the checkout's ignored .cache/, set up
with what `omlx connect` prints, each run twice; the second run reads its prompt from the
cache, as the agent itself reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, Server, served

pytestmark = pytest.mark.slow

AGENTS_DIR = REPO / ".cache" / "agents"  # installed once, reused by later runs
PACKAGES = ["@anthropic-ai/claude-code@2.1.328", "@openai/codex@0.169.0"]
MODULES = AGENTS_DIR / "node_modules"
CONTEXT_TOKENS = 16384  # Codex's whole first prompt is ~8,900 tokens: past the trained 8,192
AGENT_TIMEOUT_S = 900


@dataclass(frozen=True)
class Agents:
    claude: list[str]
    codex: list[str]


@pytest.fixture(scope="module")
def agents() -> Agents:
    """The two CLIs, installed from npm on the first run."""
    claude = MODULES / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"  # finds the platform binary
    codex = MODULES / ".bin" / "codex"
    if not (claude.exists() and codex.exists()):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(AGENTS_DIR), *PACKAGES],
                       check=True, timeout=900, capture_output=True)
    return Agents(claude=["node", str(claude)], codex=[str(codex)])


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Codex names no temperature, and takes an answer cut off by the context for a failure:
    # sampled at the APIs' 1.0, the tiny model sometimes rambled on until then. Greedy, it
    # answers the same way every run.
    with served(tmp_path_factory, "agents", context_tokens=CONTEXT_TOKENS,
                model_extra="allow_beyond_trained_context = true\ndefault_temperature = 0") as srv:
        yield srv


def connect(server: Server, agent: str) -> str:
    result = subprocess.run([sys.executable, "-m", "appliance", "connect", agent, "--config", str(server.config)],
                            cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout


def run(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=AGENT_TIMEOUT_S,
                          stdin=subprocess.DEVNULL)


def test_claude_code_runs_twice_and_reads_its_prompt_from_the_cache(agents: Agents, agent_server: Server,
                                                                   tmp_path: Path):
    exports = dict(line.removeprefix("export ").split("=", 1) for line in connect(agent_server, "claude").splitlines()
                   if line.startswith("export "))
    # Claude Code samples at temperature 1, and the tiny model may ramble: 64 tokens keep a
    # run short (Claude Code reports an answer cut there as its max_output_tokens error).
    env = {**os.environ, **exports, "HOME": str(tmp_path / "home"), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64"}
    # Claude Code's own request (billing header, betas, thinking, context_management, its
    # stream handling) with a short system prompt and no tools: its full 12.8K-token first
    # prompt takes this 2-core CPU most of ten minutes to prefill cold.
    cmd = [*agents.claude, "-p", "What is the capital of France?", "--output-format", "json", "--max-turns", "1",
           "--tools", "", "--system-prompt", "You are a helpful assistant. Answer with one word."]
    runs, firsts = [], []
    for _ in range(2):
        seen = len(recent_requests(agent_server))
        result = run(cmd, cwd=tmp_path, env=env)
        data = json.loads(result.stdout)
        assert data["type"] == "result" and data["api_error_status"] is None, result.stdout + result.stderr
        assert not data["is_error"] or data["api_error"] == "max_output_tokens", result.stdout
        assert data["modelUsage"].keys() == {"smollm2-135m"} and data["usage"]["output_tokens"] > 0
        runs.append(data)
        firsts.append(recent_requests(agent_server)[seen])  # the run's first request, as omlx saw it
    assert firsts[1]["prompt_tokens"] == firsts[0]["prompt_tokens"]  # the billing header changed, was dropped
    assert firsts[1]["cached_tokens"] == firsts[1]["prompt_tokens"] - 1
    # Claude Code's own figures: the second run read at least that prompt from the cache.
    assert runs[1]["usage"]["cache_read_input_tokens"] >= firsts[1]["prompt_tokens"] - 1


def recent_requests(server: Server) -> list[dict]:
    status = httpx.get(f"{server.url}/admin/api/status", timeout=30).json()
    return status["models"][0]["recent_requests"]

def test_codex_runs_twice_and_reads_its_prompt_from_the_cache(agents: Agents, agent_server: Server,
                                                             tmp_path: Path):
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "omlx.config.toml").write_text(connect(agent_server, "codex"))
    env = {**os.environ, "CODEX_HOME": str(home), "HOME": str(tmp_path / "home")}
    # Codex's own request and tools, with short base instructions (its default ones make a
    # ~8,900-token prompt, past the trained context); the answer has no limit Codex could
    # set, and the server samples it greedily (`default_temperature = 0`, above).
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a helpful assistant. Answer in one short sentence.\n")
    cmd = [*agents.codex, "exec", "--json", "--profile", "omlx", "--skip-git-repo-check",
           "-c", f"model_instructions_file={json.dumps(str(instructions))}",
           "What is the capital of France? Answer in one sentence."]
    turns = []
    for _ in range(2):
        result = run(cmd, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr + result.stdout
        events = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        turns.append(next(e for e in events if e["type"] == "turn.completed"))
    first, second = turns[0]["usage"], turns[1]["usage"]
    # Codex's own first prompt, whole (~5,100 tokens, most of them its tools), cold...
    assert first["input_tokens"] > 4096 and first["cached_input_tokens"] < first["input_tokens"] / 2
    # ...and again, from the cache (all but the last token of each request of the turn).
    assert second["cached_input_tokens"] >= second["input_tokens"] * 0.95
