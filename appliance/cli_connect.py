"""`omlx connect claude|codex`: prints how to point a coding agent at this config's server.

Claude Code reads environment variables (printed as `export` lines, for `eval`); Codex reads
a profile file, `~/.codex/omlx.config.toml`, layered over its config by `--profile omlx`
(printed as TOML: a model provider on the Responses API and the model).
"""

from __future__ import annotations

import argparse
import shlex
import sys

from appliance.cli_config import load_or_report
from appliance.spec import Spec


def add_parser(sub: argparse._SubParsersAction) -> None:
    connect = sub.add_parser("connect", help="print the settings that point Claude Code or Codex at omlx")
    connect.add_argument("agent", choices=["claude", "codex"])
    connect.add_argument("--config", default="omlx.toml", help="path to omlx.toml")
    connect.add_argument("--model", help="the model the agent uses (default: the config's default model)")
    connect.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_or_report(args.config)
    if loaded is None:
        return 1
    spec = loaded.spec
    model = spec.model(args.model) if args.model else spec.default_model
    if model is None:
        names = ", ".join(m.name for m in spec.models)
        print(f"omlx connect: no model {args.model!r} in {args.config} (models: {names})", file=sys.stderr)
        return 1
    text = claude_settings(spec, model.name) if args.agent == "claude" else codex_settings(spec, model.name)
    sys.stdout.write(text)
    return 0


def base_url(host: str, port: int) -> str:
    """Returns the server's URL as a client on this machine reaches it."""
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: reach it locally
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def api_key(spec: Spec) -> str | None:
    keys = spec.server.api_keys
    return keys[0].secret if keys else None


def claude_settings(spec: Spec, model: str) -> str:
    """Returns `export` lines for Claude Code: every model tier is the omlx model."""
    url = base_url(spec.server.host, spec.server.port)
    env = {
        "ANTHROPIC_BASE_URL": url,  # Claude Code appends /v1/messages
        # The config's first API key; without keys omlx takes any token, and Claude Code needs one.
        "ANTHROPIC_AUTH_TOKEN": api_key(spec) or "omlx",
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,  # the older name of the haiku tier
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "600000",  # a local model's first long prompt can take minutes
    }
    lines = [f"# Claude Code -> omlx at {url}, model {model}. Use: eval \"$(omlx connect claude)\""]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    return "\n".join(lines) + "\n"


def codex_settings(spec: Spec, model: str) -> str:
    """Returns Codex's profile file: the model and an omlx provider on the Responses API.

    Codex 0.134 and later read profiles from `<name>.config.toml` files, no longer from
    `[profiles.<name>]` tables in config.toml (0.169 refuses to start with one).
    """
    url = base_url(spec.server.host, spec.server.port)
    context = spec.model(model).max_context_tokens
    window = f"model_context_window = {context}\n" if context else ""
    # The key stays out of the file: Codex reads it from the variable env_key names.
    key = f'env_key = "{CODEX_KEY_ENV}"\n' if spec.server.api_keys else ""
    note = f"\n# Set {CODEX_KEY_ENV} to one of the server's API keys." if key else ""
    return f"""# Codex -> omlx at {url}, model {model}.
# Save as ~/.codex/omlx.config.toml, then run `codex --profile omlx` (or `codex exec --profile omlx ...`).{note}
model = "{model}"
model_provider = "omlx"
{window}
[model_providers.omlx]
name = "omlx"
base_url = "{url}/v1"
wire_api = "responses"
{key}"""


CODEX_KEY_ENV = "OMLX_API_KEY"
