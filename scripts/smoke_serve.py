#!/usr/bin/env python3
"""The README's `make serve`, run as a new user would: from a venv with only the base install.

Starts `make serve VENV=<venv>` in this checkout, waits for GET /health to answer 200,
checks that /v1/models lists the model as ready, sends one chat completion, stops the
server with SIGTERM and checks that it exits cleanly (status 0, no traceback in its log).
Exits non-zero, with the server's log, when any step fails. Standard library only: it
runs before any venv exists. Used by .ci/run.

    python3 scripts/smoke_serve.py [--venv .venv-base] [--timeout 1200]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def get(url: str, *, timeout_s: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post(url: str, body: dict, *, timeout_s: float = 300.0) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def descendants(pid: int) -> list[int]:
    """Returns the pids below `pid` in the process tree (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def omlx_pid(make_pid: int) -> int | None:
    """Returns the pid of the `omlx serve` that `make serve` started."""
    for pid in descendants(make_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"omlx") for a in argv) and b"serve" in argv:
            return pid
    return None


class Failed(Exception):
    pass


def run(venv: str, timeout_s: float, log_path: Path) -> float:
    """Returns the seconds from `make serve` to /health 200; raises Failed."""
    config = tomllib.loads((REPO / "omlx.toml").read_text())
    port = int(os.environ.get("OMLX_SERVER__PORT", config["server"]["port"]))
    url = f"http://127.0.0.1:{port}"
    model = config["models"][0]["name"]
    started = time.monotonic()
    with open(log_path, "wb") as log:
        make = subprocess.Popen(["make", "serve", f"VENV={venv}"], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if make.poll() is not None:
                raise Failed(f"make serve exited with {make.returncode} before /health answered 200")
            if time.monotonic() - started > timeout_s:
                raise Failed(f"/health did not answer 200 within {timeout_s:.0f} s")
            try:
                if get(f"{url}/health", timeout_s=2)[0] == 200:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        print(f"smoke: ready after {ready_s:.1f} s")
        status, models = get(f"{url}/v1/models")
        states = {m["id"]: m.get("state") for m in models.get("data", [])}
        if status != 200 or states.get(model) != "ready":
            raise Failed(f"/v1/models answered {status}: {models}")
        status, reply = post(f"{url}/v1/chat/completions", {
            "model": model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        text = (reply.get("choices") or [{}])[0].get("message", {}).get("content")
        if status != 200 or not text:
            raise Failed(f"chat completion answered {status}: {reply}")
        print(f"smoke: chat completion answered: {text!r}")
        pid = omlx_pid(make.pid)
        if pid is None:
            raise Failed("could not find the omlx serve process under make")
        os.kill(pid, signal.SIGTERM)
        try:
            code = make.wait(timeout=120)
        except subprocess.TimeoutExpired:
            raise Failed("omlx serve did not exit within 120 s of SIGTERM") from None
        if code != 0:
            raise Failed(f"after SIGTERM, make serve exited with {code} (omlx serve did not exit cleanly)")
        if b"Traceback" in log_path.read_bytes():
            raise Failed("the server's log holds a traceback")
        print("smoke: SIGTERM: clean exit (status 0)")
        return ready_s
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", default=".venv-base", help="the venv make serve sets up and runs from")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds allowed until /health is 200")
    args = parser.parse_args()
    log_path = Path(tempfile.mkstemp(prefix="omlx-smoke-", suffix=".log")[1])
    try:
        run(args.venv, args.timeout, log_path)
    except Failed as e:
        print(f"smoke: FAILED: {e}\n--- make serve log ({log_path}) ---", file=sys.stderr)
        sys.stderr.write(log_path.read_text(errors="replace")[-20000:])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
