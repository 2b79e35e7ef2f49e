"""The `omlx` command: `check` validates a config, `serve` runs the appliance, `status`,
`service` and `menubar` watch and run it."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from appliance import cli_cache, cli_connect, cli_status, service
from appliance.cli_config import load_or_report
from appliance.config import dump_toml

DEFAULT_CONFIG = "omlx.toml"


def main(argv: list[str] | None = None) -> int:
    """Returns the process exit status of one `omlx` invocation."""
    args = parser().parse_args(argv)
    return args.run(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omlx", description="A declarative LLM inference appliance on MLX.")
    sub = p.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="validate a config and print the resolved spec as TOML")
    check.add_argument("--config", default=DEFAULT_CONFIG, help="path to omlx.toml")
    check.set_defaults(run=run_check)

    serve = sub.add_parser("serve", help="serve the models of a config over HTTP")
    serve.add_argument("--config", default=DEFAULT_CONFIG, help="path to omlx.toml")
    serve.set_defaults(run=run_serve)

    diff = sub.add_parser("diff", help="print what applying the config would change on the running server")
    diff.add_argument("--config", default=DEFAULT_CONFIG, help="path to omlx.toml")
    diff.set_defaults(run=run_diff)

    cli_cache.add_parser(sub)
    cli_connect.add_parser(sub)
    cli_status.add_parser(sub)
    service.add_parser(sub)

    menubar = sub.add_parser("menubar", help="a macOS menu-bar client of the config's server (the menubar extra)")
    menubar.add_argument("--config", default=DEFAULT_CONFIG, help="path to omlx.toml")
    menubar.set_defaults(run=run_menubar)
    return p


def run_check(args: argparse.Namespace) -> int:
    loaded = load_or_report(args.config)
    if loaded is None:
        return 1
    sys.stdout.write(dump_toml(loaded.spec))
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from appliance import platform

    platform.ensure_process_env()  # may re-exec this process (OpenBLAS, malloc tunables)
    loaded = load_or_report(args.config)
    if loaded is None:
        return 1
    from appliance.kernels import ahead
    from appliance.models import kinds, preload

    os.umask(0o077)  # before the threads below create files: the cache holds other people's prompts
    platform.configure_logging()  # the preload's lines too
    preload.start(loaded)  # the default model's weights, while the server's imports run (CUDA)
    default = loaded.spec.default_model  # MLX's kernels a machine lacks, for its weights, beside them (CUDA)
    ahead.start(loaded.spec.cache.path(loaded.base_dir),
                functools.partial(kinds.expected, default.source, dtype=default.dtype, base_dir=loaded.base_dir))
    from appliance.server.runner import serve

    status = serve(loaded)
    exit_now(status)
    return status  # not reached


def exit_now(status: int) -> None:
    """Ends a server process that has shut down (requests drained, SSD writes flushed, the
    store closed) without the interpreter's teardown: on MLX CUDA that teardown destroys
    the backend's threads in an order that aborts the process ("terminate called without
    an active exception", status -6 after a clean stop, seen on an H200)."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_diff(args: argparse.Namespace) -> int:
    """Prints the plan between the running server's applied spec and the file; applies nothing."""
    import httpx

    from appliance.reconcile.plan import plan
    from appliance.spec import Spec

    desired = load_or_report(args.config)
    if desired is None:
        return 1
    server = desired.spec.server
    try:
        response = httpx.get(f"http://{server.host}:{server.port}/admin/api/config", headers=server.admin_headers,
                             timeout=30)
    except httpx.HTTPError as e:
        print(f"omlx diff: no server answers on {server.host}:{server.port} ({e})", file=sys.stderr)
        return 1
    if response.status_code != 200:  # e.g. 401: the file's admin_key is not the server's
        print(f"omlx diff: the server answered {response.status_code}: {response.text}", file=sys.stderr)
        return 1
    applied = response.json()
    actions = plan(Spec(**applied["spec"]), desired.spec)
    print(f"applied {applied['hash']} -> file {desired.spec.hash}")
    for action in actions:
        print(f"  {action.describe()}")
    if not actions:
        print("  (no changes)")
    return 0


def run_menubar(args: argparse.Namespace) -> int:
    if sys.platform != "darwin":
        print("omlx menubar: the menu bar is macOS only; use `omlx status` or the dashboard at /", file=sys.stderr)
        return 1
    loaded = load_or_report(args.config)
    if loaded is None:
        return 1
    try:
        from appliance.menubar import app
    except ImportError:
        print("omlx menubar: rumps is missing; install the extra: pip install 'omlx[menubar]'", file=sys.stderr)
        return 1
    return app.run(loaded)


if __name__ == "__main__":
    sys.exit(main())
