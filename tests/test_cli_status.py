"""`omlx status` against the real server, and with no server at the config's address."""

from __future__ import annotations

import httpx
import pytest

from appliance.cli import main
from tests.conftest import MODEL_NAME, Server, free_port, write_config

pytestmark = pytest.mark.slow


def test_status_prints_models_and_tiers(server: Server, capsys: pytest.CaptureFixture):
    httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Hello there."}], "max_tokens": 4})
    assert main(["status", "--config", str(server.config)]) == 0
    out = capsys.readouterr().out
    print(out)
    lines = out.splitlines()
    assert lines[0].startswith("omlx ") and f"127.0.0.1:{server.port}" in lines[0]
    header = next(line for line in lines if line.startswith("MODEL"))
    assert header.split()[:3] == ["MODEL", "STATE", "MEMORY"]
    (row,) = [line for line in lines if line.startswith(MODEL_NAME)]
    cells = row.split()
    assert cells[1] == "*" and cells[2] == "ready"  # the default model, serving
    assert cells[4] == "MiB" and float(cells[3]) > 50  # its weights (float32, 135M parameters)
    tiers = {line.split()[0]: line for line in lines if line.split()[:1] in (["memory"], ["host"], ["ssd"])}
    assert set(tiers) == {"memory", "host", "ssd"}
    assert "%" in tiers["memory"]  # requests have run: the tiers' hit rates are figures


def test_status_without_a_server_says_so(tmp_path, capsys: pytest.CaptureFixture):
    config = write_config(tmp_path / "omlx.toml", port=free_port())
    assert main(["status", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "no omlx server answers on http://127.0.0.1:" in err
    assert "omlx serve --config" in err
