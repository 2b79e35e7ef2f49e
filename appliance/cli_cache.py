"""`omlx cache stats|clear|export|import`: through the running server, else on the files.

A running server owns its SSD tier (it holds the directory's lock), so while it answers
on the config's address every command goes through its admin API; otherwise the command
opens the SSD tier itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from appliance.cli_config import load_or_report
from appliance.config import LoadedConfig

ADMIN_TIMEOUT_S = 600.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    cache = sub.add_parser("cache", help="inspect and manage the KV cache")
    cache.add_argument("--config", default="omlx.toml", help="path to omlx.toml")
    verbs = cache.add_subparsers(dest="verb", required=True)
    stats = verbs.add_parser("stats", help="print per-tier figures as JSON")
    clear = verbs.add_parser("clear", help="remove cached blocks (one model or all)")
    clear.add_argument("--model", help="only this model's blocks")
    export = verbs.add_parser("export", help="write a model's SSD blocks to a portable archive")
    export.add_argument("path", type=Path)
    export.add_argument("--model", help="the model (default: the config's default model)")
    export.add_argument("--tenant", default="default", help="whose blocks (an API key's tenant; default: default)")
    imp = verbs.add_parser("import", help="verify and add the blocks of an archive")
    imp.add_argument("path", type=Path)
    for verb in (stats, clear, export, imp):  # `--config` also after the verb
        verb.add_argument("--config", default=argparse.SUPPRESS, help="path to omlx.toml")
    cache.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load_or_report(args.config)
    if config is None:
        return 1
    try:
        result = via_server(config, args)
        if result is None:
            result = offline(config, args)
    except (CacheCommandError, ValueError, OSError) as e:
        print(f"omlx cache {args.verb}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


class CacheCommandError(Exception):
    pass


def via_server(config: LoadedConfig, args: argparse.Namespace) -> dict | None:
    """Returns the server's answer, or None when no server answers on the config's address."""
    import httpx  # here, not at the top: every `omlx serve` imports this module before its preload starts

    server = config.spec.server
    base = f"http://{server.host}:{server.port}/admin/api/cache"
    requests = {
        "stats": ("GET", base, None),
        "clear": ("POST", f"{base}/clear", {"model": args.model} if args.verb == "clear" and args.model else {}),
        "export": ("POST", f"{base}/export", {"path": str(getattr(args, "path", "")),
                                              "model": getattr(args, "model", None),
                                              "tenant": getattr(args, "tenant", "default")}),
        "import": ("POST", f"{base}/import", {"path": str(getattr(args, "path", ""))}),
    }
    method, url, body = requests[args.verb]
    if args.verb in ("export", "import"):
        body["path"] = str(Path(body["path"]).resolve())
    try:
        response = httpx.request(method, url, json=body, headers=server.admin_headers, timeout=ADMIN_TIMEOUT_S)
    except httpx.ConnectError:
        return None
    data = response.json()
    if response.status_code != 200:
        raise CacheCommandError(data.get("error", {}).get("message", response.text))
    return data


def offline(config: LoadedConfig, args: argparse.Namespace) -> dict:
    """Runs the command on the cache files directly (no server running)."""
    from appliance.cache.keys import model_dir, tenant_dir
    from appliance.cache.model_cache import kv_tenant
    from appliance.cache.ssd import SsdTier

    spec = config.spec
    root = spec.cache.path(config.base_dir) / "kv"
    if args.verb == "stats" and not root.exists():
        return {"ssd": {"blocks": 0, "bytes": 0, "budget_bytes": spec.cache.ssd_bytes}, "server": "not running"}
    with SsdTier(root, budget_bytes=spec.cache.ssd_bytes) as tier:
        if tier.stats().get("disabled"):
            raise CacheCommandError(f"cannot open {root}: {tier.stats().get('disabled_reason')}")
        if args.verb == "stats":
            return {"ssd": tier.stats(), "server": "not running"}
        if args.verb == "clear":
            prefix = model_dir(model_weights(config, args.model)) if args.model else None
            return {"removed_blocks": tier.clear(prefix), "model": args.model}
        if args.verb == "export":
            dir = tenant_dir(model_weights(config, args.model), kv_tenant(args.tenant))
            return {"exported_blocks": tier.export(dir, args.path), "path": str(args.path)}
        return {"imported_blocks": tier.import_archive(args.path), "path": str(args.path)}


def model_weights(config: LoadedConfig, name: str | None) -> str:
    """Returns the weights fingerprint of a configured model (its cache's identity)."""
    from appliance.models.fingerprint import weights_fingerprint
    from appliance.models.source import materialize
    from appliance.platform import resolve_dtype

    spec = config.spec.model(name) if name else config.spec.default_model
    if spec is None:
        raise CacheCommandError(f"no model named {name!r} in {config.path}")
    cache_dir = config.spec.cache.path(config.base_dir)
    path = materialize(spec.source, base_dir=config.base_dir, cache_dir=cache_dir,
                       dtype=resolve_dtype(spec.dtype) or "float32")
    return weights_fingerprint(path, memo_dir=cache_dir)
