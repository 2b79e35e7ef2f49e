"""`omlx service install|uninstall|status`: run `omlx serve` as a per-user service that
starts at login and restarts on failure: a systemd user unit on Linux, a launchd agent on
macOS. The file is generated here; the OS's own tool (systemctl, launchctl) runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import plistlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from appliance.cli_config import print_errors
from appliance.config import ConfigError, load_spec

NAME = "omlx"
LAUNCHD_LABEL = "com.omlx.server"  # the agent of the default name
RESTART_S = 5


@dataclass(frozen=True)
class ServiceFile:
    """A generated service definition: where it goes and what it says."""

    system: str  # "linux" (systemd) or "darwin" (launchd)
    name: str  # the systemd unit's or the launchd agent's label
    path: Path
    text: str


def serve_command(config: Path) -> list[str]:
    """Returns the command that serves `config`: this install's `omlx` script when it has
    one, else this interpreter running the package."""
    script = Path(sys.executable).parent / "omlx"
    head = [str(script)] if script.exists() else [sys.executable, "-m", "appliance"]
    return [*head, "serve", "--config", str(config)]


def launchd_label(name: str) -> str:
    return f"com.{name}.server"


def systemd_unit(config: Path, *, name: str, home: Path, stop_timeout_s: float) -> ServiceFile:
    """Returns the systemd user unit serving `config` (an absolute path)."""
    command = " ".join(f'"{a}"' if any(c in a for c in ' "\\') else a for a in serve_command(config))
    text = f"""[Unit]
Description=omlx inference server ({config})
After=network-online.target

[Service]
Type=simple
ExecStart={command}
WorkingDirectory={config.parent}
Restart=on-failure
RestartSec={RESTART_S}
KillSignal=SIGTERM
TimeoutStopSec={int(stop_timeout_s)}

[Install]
WantedBy=default.target
"""
    return ServiceFile("linux", f"{name}.service", home / ".config" / "systemd" / "user" / f"{name}.service", text)


def launchd_agent(config: Path, *, name: str, home: Path, stop_timeout_s: float) -> ServiceFile:
    """Returns the launchd agent serving `config`: started at login, restarted when it exits
    with a failure."""
    logs = home / "Library" / "Logs"
    plist = {
        "Label": launchd_label(name),
        "ProgramArguments": serve_command(config),
        "WorkingDirectory": str(config.parent),
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": RESTART_S,
        "ExitTimeOut": int(stop_timeout_s),
        "StandardOutPath": str(logs / f"{name}.log"),
        "StandardErrorPath": str(logs / f"{name}.log"),
    }
    path = home / "Library" / "LaunchAgents" / f"{launchd_label(name)}.plist"
    return ServiceFile("darwin", launchd_label(name), path,
                       plistlib.dumps(plist).decode())


def service_file(config: Path, *, name: str = NAME, system: str = sys.platform,
                 home: Path | None = None) -> ServiceFile:
    """Returns the service definition for this OS serving the config at `config`."""
    config = Path(config).resolve()
    stop_timeout_s = load_spec(config).spec.server.drain_timeout_s + 20  # the drain, then the flush
    home = home or Path.home()
    if system == "darwin":
        return launchd_agent(config, name=name, home=home, stop_timeout_s=stop_timeout_s)
    if system.startswith("linux"):
        return systemd_unit(config, name=name, home=home, stop_timeout_s=stop_timeout_s)
    raise ServiceError(f"omlx service supports Linux (systemd) and macOS (launchd), not {system}")


class ServiceError(Exception):
    pass


def manager_commands(unit: ServiceFile, verb: str) -> list[list[str]]:
    """Returns the systemctl or launchctl commands that start, stop or query the service."""
    if unit.system == "darwin":
        target = f"gui/{os.getuid()}"
        return {"start": [["launchctl", "bootstrap", target, str(unit.path)]],
                "stop": [["launchctl", "bootout", f"{target}/{unit.name}"]],
                "status": [["launchctl", "print", f"{target}/{unit.name}"]]}[verb]
    return {"start": [["systemctl", "--user", "daemon-reload"], ["systemctl", "--user", "enable", "--now", unit.name]],
            "stop": [["systemctl", "--user", "disable", "--now", unit.name]],
            "status": [["systemctl", "--user", "status", "--no-pager", unit.name]]}[verb]


def run_manager(unit: ServiceFile, verb: str) -> tuple[bool, str]:
    """Runs the service manager's commands for `verb`; returns whether all worked, and their output."""
    output = []
    for command in manager_commands(unit, verb):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"{' '.join(command)}: {e}"
        output.append((done.stdout + done.stderr).strip())
        if done.returncode != 0:
            return False, f"{' '.join(command)} exited {done.returncode}: {output[-1]}"
    return True, "\n".join(o for o in output if o)


def service_name(value: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", value):
        raise argparse.ArgumentTypeError("letters, digits, '.', '_' and '-' only")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    service = sub.add_parser("service", help="run omlx serve as a user service (systemd or launchd)")
    verbs = service.add_subparsers(dest="verb", required=True)
    install = verbs.add_parser("install", help="write the service file and start it")
    install.add_argument("--no-start", action="store_true", help="only write the file")
    uninstall = verbs.add_parser("uninstall", help="stop the service and remove its file")
    status = verbs.add_parser("status", help="print the service file's path and the manager's status")
    for verb in (install, uninstall, status):
        verb.add_argument("--config", default="omlx.toml", help="path to omlx.toml")
        verb.add_argument("--name", default=NAME, type=service_name, help="the service's name (default: omlx)")
    service.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        unit = service_file(Path(args.config), name=args.name)
    except ConfigError as e:
        print_errors(e, args.config)
        return 1
    except ServiceError as e:
        print(f"omlx service: {e}", file=sys.stderr)
        return 1
    return {"install": install, "uninstall": uninstall, "status": status}[args.verb](unit, args)


def install(unit: ServiceFile, args: argparse.Namespace) -> int:
    unit.path.parent.mkdir(parents=True, exist_ok=True)
    unit.path.write_text(unit.text)
    print(f"wrote {unit.path}")
    if args.no_start:
        return 0
    ok, output = run_manager(unit, "start")
    if not ok:
        print(f"omlx service: the service file is written but did not start: {output}", file=sys.stderr)
        return 1
    print(f"started; it starts at login and restarts on failure ({' '.join(manager_commands(unit, 'status')[0])})")
    return 0


def uninstall(unit: ServiceFile, args: argparse.Namespace) -> int:
    if not unit.path.exists():
        print(f"omlx service: {unit.path} is not installed", file=sys.stderr)
        return 1
    ok, output = run_manager(unit, "stop")
    if not ok:
        print(f"omlx service: could not stop it ({output}); removing the file anyway", file=sys.stderr)
    unit.path.unlink()
    if unit.system == "linux":  # forget the removed unit; nothing to do where systemd does not run
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["systemctl", "--user", "daemon-reload"], capture_output=True, timeout=60)
    print(f"removed {unit.path}")
    return 0


def status(unit: ServiceFile, args: argparse.Namespace) -> int:
    if not unit.path.exists():
        print(f"not installed ({unit.path} does not exist)")
        return 1
    print(f"installed: {unit.path}")
    ok, output = run_manager(unit, "status")
    print(output)
    return 0 if ok else 3
