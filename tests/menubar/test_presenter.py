"""The menu bar's presenter against the real server, with a fake menu in place of rumps."""

from __future__ import annotations

import sys

import httpx
import pytest

from appliance.cli import main
from appliance.config import load_spec
from appliance.menubar.presenter import SEPARATOR, Item, MenuPresenter, launchctl
from tests.conftest import MODEL_NAME, Server, free_port

pytestmark = pytest.mark.slow


class FakeMenu:
    """Records what the presenter shows (the stand-in for rumps, which is macOS only)."""

    def __init__(self):
        self.title = ""
        self.items: list[Item] = []

    def show(self, title: str, items: list[Item]) -> None:
        self.title, self.items = title, items

    def item(self, prefix: str) -> Item:
        (found,) = [i for i in self.items if i.title.startswith(prefix)]
        return found


def presenter(menu: FakeMenu, server: Server, opened: list, ran: list) -> MenuPresenter:
    return MenuPresenter.for_config(menu, load_spec(server.config), open_url=opened.append, run=ran.append)


def test_menu_shows_status_models_and_hit_rate(server: Server):
    for _ in range(2):  # the same prompt twice: the second restores it from the cache
        httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is a menu bar?"}], "max_tokens": 4})
    menu, opened, ran = FakeMenu(), [], []
    presenter(menu, server, opened, ran).refresh()
    assert menu.title == "omlx ●"
    assert menu.item("Ready: 1 of 1 models serving").action is None
    model = menu.item(MODEL_NAME)
    assert model.checked and model.title == f"{MODEL_NAME} (ready)"
    rate = menu.item("Cache hit rate: ").title.removeprefix("Cache hit rate: ")
    assert rate.endswith("%") and float(rate[:-1]) > 0
    assert SEPARATOR in menu.items


def test_menu_items_act_through_the_admin_api_and_launchd(server: Server):
    menu, opened, ran = FakeMenu(), [], []
    p = presenter(menu, server, opened, ran)
    p.refresh()
    menu.item("Open dashboard").action()
    assert opened == [f"{server.url}/"]
    menu.item(MODEL_NAME).action()  # make default: the admin API answers, the menu refreshes
    assert menu.item(MODEL_NAME).checked
    assert not any(i.title.endswith("not made default") for i in menu.items)
    menu.item("Restart server").action()
    menu.item("Stop server").action()
    assert ran == [launchctl("restart"), launchctl("stop")]
    assert ran[0][:3] == ["launchctl", "kickstart", "-k"] and ran[0][3].endswith("/com.omlx.server")


def test_menu_says_when_no_server_answers(tmp_path):
    menu = FakeMenu()
    MenuPresenter(menu, f"http://127.0.0.1:{free_port()}", open_url=lambda url: None, run=lambda c: None).refresh()
    assert menu.title == "omlx ✕"
    assert menu.items[0].title.startswith("No server at http://127.0.0.1:")
    assert menu.item("Restart server").action is not None


@pytest.mark.skipif(sys.platform == "darwin", reason="on macOS the command opens the menu bar")
def test_omlx_menubar_elsewhere_says_it_is_macos_only(capsys: pytest.CaptureFixture):
    assert main(["menubar"]) == 1
    assert "macOS only" in capsys.readouterr().err
