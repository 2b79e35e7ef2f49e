"""`omlx status`: what the config's server runs, as tables (like `ollama ps`), from its admin API."""

from __future__ import annotations

import argparse
import sys

from appliance.cli_config import load_or_report

TIMEOUT_S = 10.0
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


def add_parser(sub: argparse._SubParsersAction) -> None:
    status = sub.add_parser("status", help="print the running server's models and cache as tables")
    status.add_argument("--config", default="omlx.toml", help="path to omlx.toml")
    status.set_defaults(run=run)


def base_url(server) -> str:
    """Returns the URL a local client reaches the server at (a wildcard bind on loopback)."""
    host = WILDCARD_HOSTS.get(server.host, server.host)
    return f"http://[{host}]:{server.port}" if ":" in host else f"http://{host}:{server.port}"


def run(args: argparse.Namespace) -> int:
    import httpx  # here, not at the top: every `omlx serve` imports this module before its preload starts

    config = load_or_report(args.config)
    if config is None:
        return 1
    server = config.spec.server
    url = base_url(server)
    try:
        with httpx.Client(base_url=url, headers=server.admin_headers, timeout=TIMEOUT_S) as client:
            answers = {name: client.get(f"/admin/api/{name}") for name in ("status", "overview", "cache")}
    except httpx.HTTPError as e:
        print(f"omlx status: no omlx server answers on {url} ({e}); start one with "
              f"`omlx serve --config {args.config}`", file=sys.stderr)
        return 1
    for name, response in answers.items():
        if response.status_code != 200:  # 401: the config's admin_key is not the server's
            print(f"omlx status: {url}/admin/api/{name} answered {response.status_code}: {response.text}",
                  file=sys.stderr)
            return 1
    sys.stdout.write(render(answers["status"].json(), answers["overview"].json(), answers["cache"].json(), url))
    return 0


def render(status: dict, overview: dict, cache: dict, url: str) -> str:
    """Returns the report: a header line, the models' table and the cache tiers' table."""
    config = status["config"]
    lines = [f"omlx {status['version']} at {url}, up {duration(status['uptime_s'])}, {overview['backend']}, "
             f"config {config['hash']}"]
    if config["last_error"]:
        lines.append(f"config not applied: {config['last_error']['message']}")
    rows = {m["name"]: m for m in overview["models"]}
    models = [[m["name"] + (" *" if m["default"] else ""), m["state"],
               size(rows.get(m["name"], {}).get("weights_bytes")),
               str(m["context_tokens"] or "-"), f"{rows.get(m['name'], {}).get('running', 0)}/"
               f"{rows.get(m['name'], {}).get('queued', 0)}", str(rows.get(m["name"], {}).get("requests", 0)),
               ratio(cache.get("models", {}).get(m["name"], {}).get("hit_ratio"))]
              for m in status["models"]]
    lines += ["", *table(["MODEL", "STATE", "MEMORY", "CONTEXT", "RUNNING/QUEUED", "REQUESTS", "HIT RATE"], models)]
    prompt = overview.get("prompt_tokens") or 0
    restored = overview.get("cached_tokens_by_tier", {})
    tiers = [[name, size(t.get("bytes")), size(t.get("budget_bytes")), str(t.get("blocks", "-")),
              str(t.get("hits", "-")), ratio(restored.get(name, 0) / prompt if prompt else None)
              + (" (disabled)" if t.get("disabled") else "")]
             for name, t in cache.get("tiers", {}).items()]
    lines += ["", *table(["TIER", "USED", "BUDGET", "BLOCKS", "HITS", "HIT RATE"], tiers),
              "", "* default model; HIT RATE: share of prompt tokens restored (per tier: from that tier)"]
    return "\n".join(lines) + "\n"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
