"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a real
server with two models. Screenshots go to .cache/test-artifacts/dashboard/."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_GGUF, MODEL_NAME, REPO, Server, served

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = REPO / ".cache" / "test-artifacts" / "dashboard"
SECOND = "smollm2-second"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 120_000


@pytest.fixture(scope="module")
def two_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    second = f'[[models]]\nname = "{SECOND}"\nsource = "{MODEL_GGUF}"\nmax_context_tokens = 2048\n'
    with served(tmp_path_factory, "dashboard", model_extra="default = true", extra=second) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser_context(tmp_path_factory: pytest.TempPathFactory):
    if not CHROMIUM.exists():
        pytest.fail("Debian's chromium is missing: `make setup-test` installs it (scripts/ensure-chromium.sh)")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots: {ARTIFACTS}")
    # The Node driver must not inherit the OpenBLAS preload the in-process MLX tests need
    # (its thread pool makes Node's pthread_create fail).
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        playwright = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=str(CHROMIUM), headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900})
        yield context
        context.close()
    finally:
        playwright.stop()


@pytest.fixture
def page(browser_context, two_models: Server):
    page = browser_context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(two_models.url + "/")
    yield page
    page.close()


def status(server: Server) -> dict:
    return httpx.get(f"{server.url}/admin/api/status", headers=admin_headers(server), timeout=30).json()


def admin_headers(server: Server) -> dict:
    key = getattr(server, "admin_key", None)
    return {"Authorization": f"Bearer {key}"} if key else {}


def model_states(server: Server) -> dict[str, str]:
    return {m["name"]: m["state"] for m in status(server)["models"]}


def wait_for(check, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def shot(page, name: str) -> Path:
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def test_page_loads_and_shows_the_models(page, two_models: Server):
    for _ in range(3):  # traffic for the charts and the TTFT figures
        httpx.post(f"{two_models.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 16})
    rows = page.locator("#overview-models tbody tr")
    rows.filter(has_text=MODEL_NAME).filter(has_text="ready").wait_for()
    rows.filter(has_text=SECOND).filter(has_text="ready").wait_for()
    assert "(default)" in rows.filter(has_text=MODEL_NAME).inner_text()
    page.locator("#ttft").filter(has_text="ms").wait_for()
    assert page.locator("#config-hash").inner_text() == status(two_models)["config"]["hash"]
    assert "MLX" in page.locator("#backend").inner_text()
    page.wait_for_timeout(2500)  # a few polls, so the charts have points
    print(f"screenshot: {shot(page, 'overview')}")
    # Keyboard: "3" opens the cache tab, whose tier table fills from the admin API.
    page.keyboard.press("3")
    page.locator("#tier-table tbody tr").filter(has_text="ssd").wait_for()
    memory = page.locator("#tier-table tbody tr").filter(has_text="memory")
    assert memory.locator("td").nth(5).inner_text().endswith("%")  # prompt tokens restored from it
    assert page.locator("#cache").is_visible() and not page.locator("#overview").is_visible()
    print(f"screenshot: {shot(page, 'cache')}")


def test_unload_and_load_through_the_page_change_the_server(page, two_models: Server):
    page.keyboard.press("2")
    row = page.locator(f'#model-table tr[data-model="{SECOND}"]')
    row.filter(has_text="ready").wait_for()
    row.get_by_role("button", name=f"Unload {SECOND}").click()
    row.filter(has_text="unloaded").wait_for()
    assert SECOND not in model_states(two_models)
    assert SECOND not in two_models.config.read_text()  # the file is the source of truth
    print(f"screenshot: {shot(page, 'models-unloaded')}")

    row.get_by_role("button", name=f"Load {SECOND}").click()
    row.filter(has_text="ready").wait_for()
    assert model_states(two_models)[SECOND] == "ready"
    assert SECOND in two_models.config.read_text()

    row.get_by_role("button", name=f"Make default {SECOND}").click()
    wait_for(lambda: next(m for m in status(two_models)["models"] if m["name"] == SECOND)["default"])
    page.locator(f'#model-table tr[data-model="{MODEL_NAME}"]').get_by_role(
        "button", name=f"Make default {MODEL_NAME}").click()
    wait_for(lambda: next(m for m in status(two_models)["models"] if m["name"] == MODEL_NAME)["default"])


def test_a_bad_config_on_disk_shows_its_error(page, two_models: Server):
    good = two_models.config.read_text()
    try:
        two_models.config.write_text(good.replace(f"port = {two_models.port}", "port = 70000"))
        banner = page.locator("#config-error")
        banner.filter(has_text="server.port").wait_for()
        assert "less than or equal to 65535" in banner.inner_text()
        print(f"screenshot: {shot(page, 'config-error')}")
    finally:
        two_models.config.write_text(good)
    page.locator("#config-error").wait_for(state="hidden")
    assert status(two_models)["config"]["last_error"] is None


def test_config_editor_shows_errors_inline_and_saves_live(page, two_models: Server):
    page.keyboard.press("4")
    editor = page.locator("#config-text")
    page.wait_for_function("document.getElementById('config-text').value.includes('[batching]')")
    original = editor.input_value()
    editor.fill(original.replace("max_running = 4", "max_running = 0"))
    page.keyboard.press("Control+s")
    issue = page.locator("#config-issues li").filter(has_text="batching.max_running")
    issue.wait_for()
    assert "greater than or equal to 1" in issue.inner_text()
    assert "max_running = 4" in two_models.config.read_text()  # an invalid edit never reaches the file
    print(f"screenshot: {shot(page, 'config-invalid')}")

    editor.fill("# saved from the dashboard\n" + original.replace("max_running = 4", "max_running = 3"))
    page.get_by_role("button", name="Save and apply").click()
    page.locator("#notice").filter(has_text="config applied").wait_for()
    limits = next(m for m in status(two_models)["models"] if m["name"] == MODEL_NAME)["limits"]
    assert limits["max_running"] == 3
    assert two_models.config.read_text().startswith("# saved from the dashboard\n")  # saved as typed
    editor.fill(original)
    page.get_by_role("button", name="Save and apply").click()
    wait_for(lambda: next(m for m in status(two_models)["models"] if m["name"] == MODEL_NAME)["limits"]
             ["max_running"] == 4)


def test_the_page_asks_for_the_admin_key(page, two_models: Server):
    good = two_models.config.read_text()
    key = "dashboard-test-admin-key"
    two_models.config.write_text(good.replace("[server]", f'[server]\nadmin_key = "{key}"'))
    try:
        wait_for(lambda: httpx.get(f"{two_models.url}/admin/api/status").status_code == 401)
        two_models.admin_key = key
        page.reload()
        page.locator("#key-dialog").wait_for(state="visible")
        print(f"screenshot: {shot(page, 'admin-key')}")
        page.locator("#key-input").fill(key)
        page.keyboard.press("Enter")
        page.locator("#overview-models tbody tr").filter(has_text=MODEL_NAME).wait_for()
        assert page.evaluate("sessionStorage.getItem('omlx.adminKey')") == key
    finally:
        two_models.config.write_text(good)
        wait_for(lambda: httpx.get(f"{two_models.url}/admin/api/status").status_code == 200)
        two_models.admin_key = None


def test_readme_screenshot_is_a_png():
    """docs/dashboard.png is the overview this module's first test took (copied there with
    UPDATE_DASHBOARD_PNG=1)."""
    docs = REPO / "docs" / "dashboard.png"
    if os.environ.get("UPDATE_DASHBOARD_PNG") == "1":
        shutil.copyfile(ARTIFACTS / "overview.png", docs)
    assert docs.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_page_loads_nothing_from_elsewhere(browser_context, two_models: Server):
    """Offline: the page and every asset and call it makes come from the server itself."""
    page = browser_context.new_page()
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    try:
        page.goto(two_models.url + "/")
        page.locator("#overview-models tbody tr").filter(has_text=MODEL_NAME).wait_for(timeout=WAIT_MS)
    finally:
        page.close()
    assert {u.split("/dashboard/")[-1] for u in requested if "/dashboard/" in u} == {"style.css", "app.js"}
    assert all(u.startswith(two_models.url + "/") for u in requested), requested
