"""`omlx service`: the generated systemd unit and launchd agent, install and uninstall of the
file, and on Linux a real start and stop where `systemctl --user` works."""

from __future__ import annotations

import os
import plistlib
import pwd
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from appliance.cli import main
from appliance.service import service_file
from tests.conftest import free_port, write_config


def config_file(tmp_path: Path, port: int | None = None) -> Path:
    (tmp_path / "my config").mkdir()
    return write_config(tmp_path / "my config" / "omlx.toml", port=port or free_port(),
                        cache_dir=tmp_path / "cache")


def test_systemd_unit_serves_the_config_and_restarts_on_failure(tmp_path):
    config = config_file(tmp_path)
    unit = service_file(config, system="linux", home=tmp_path / "home")
    assert unit.path == tmp_path / "home" / ".config" / "systemd" / "user" / "omlx.service"
    lines = unit.text.splitlines()
    (exec_start,) = [line for line in lines if line.startswith("ExecStart=")]
    # The path has a space: quoted, so systemd passes it as one argument.
    assert exec_start.endswith(f'serve --config "{config.resolve()}"')
    assert "Restart=on-failure" in lines and "WantedBy=default.target" in lines
    assert f"WorkingDirectory={config.parent.resolve()}" in lines
    assert "TimeoutStopSec=25" in lines  # drain_timeout_s (5) plus the cache flush


def test_launchd_agent_serves_the_config_and_restarts_on_failure(tmp_path):
    config = config_file(tmp_path)
    agent = service_file(config, system="darwin", home=tmp_path / "home")
    assert agent.path == tmp_path / "home" / "Library" / "LaunchAgents" / "com.omlx.server.plist"
    plist = plistlib.loads(agent.text.encode())
    assert plist["Label"] == "com.omlx.server"
    assert plist["ProgramArguments"][-3:] == ["serve", "--config", str(config.resolve())]
    assert Path(plist["ProgramArguments"][0]).exists()
    assert plist["RunAtLoad"] is True and plist["KeepAlive"] == {"SuccessfulExit": False}


def test_install_writes_and_uninstall_removes_the_file(tmp_path, capsys):
    config = config_file(tmp_path)
    expected = service_file(config)
    assert main(["service", "install", "--no-start", "--config", str(config)]) == 0
    assert expected.path.read_text() == expected.text
    assert str(expected.path) in capsys.readouterr().out
    assert main(["service", "uninstall", "--config", str(config)]) == 0
    assert not expected.path.exists()
    assert main(["service", "status", "--config", str(config)]) == 1
    assert "not installed" in capsys.readouterr().out


def systemd_user_reason() -> str | None:
    """Returns why `systemctl --user` cannot run a unit here, or None when it can."""
    if sys.platform != "linux":
        return "not Linux"
    try:
        done = subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"systemctl --user: {e}"
    state = done.stdout.strip()
    if state not in ("running", "degraded"):
        init = Path("/proc/1/comm").read_text().strip() if Path("/proc/1/comm").exists() else "?"
        return (f"`systemctl --user is-system-running` says {state or '-'!r} {done.stderr.strip()}; "
                f"PID 1 is {init!r}, so no user manager runs units").replace("  ", " ")
    return None


@pytest.mark.slow
def test_the_unit_starts_and_stops_for_real(tmp_path, monkeypatch):
    reason = systemd_user_reason()
    if reason is not None:
        print(f"skipped: no systemd user manager here ({reason})")
        pytest.skip(f"no systemd user manager here: {reason}")
    monkeypatch.setenv("HOME", pwd.getpwuid(os.getuid()).pw_dir)  # where systemd looks for user units
    port = free_port()
    config = config_file(tmp_path, port)
    name = f"omlx-test-{os.getpid()}"
    assert main(["service", "install", "--name", name, "--config", str(config)]) == 0
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the service never became healthy"
            time.sleep(0.5)
        assert main(["service", "status", "--name", name, "--config", str(config)]) == 0
    finally:
        assert main(["service", "uninstall", "--name", name, "--config", str(config)]) == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
