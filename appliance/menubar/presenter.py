"""The menu bar's logic, apart from rumps: what the menu shows, read from the admin API, and
what each item does. A `Menu` is anything with `show(title, items)`: rumps on macOS, a
recording fake in the tests.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import httpx

from appliance.config import LoadedConfig
from appliance.service import LAUNCHD_LABEL

TIMEOUT_S = 5.0
REFRESH_S = 3.0


@dataclass(frozen=True)
class Item:
    """One menu entry: a label, whether it is ticked, and what a click does (None: a
    label that cannot be clicked)."""

    title: str
    action: Callable[[], None] | None = None
    checked: bool = False


SEPARATOR = Item("-")


class Menu(Protocol):
    def show(self, title: str, items: list[Item]) -> None: ...


def launchctl(verb: str) -> list[str]:
    """Returns the launchctl command that stops or restarts the `omlx service` agent."""
    import os

    target = f"gui/{os.getuid()}/{LAUNCHD_LABEL}"
    return {"stop": ["launchctl", "kill", "SIGTERM", target], "restart": ["launchctl", "kickstart", "-k", target]}[verb]


class MenuPresenter:
    """Turns the server's status into a menu and menu clicks into admin API calls."""

    def __init__(self, menu: Menu, base_url: str, *, headers: dict[str, str] | None = None,
                 open_url: Callable[[str], None], run: Callable[[list[str]], object] = subprocess.run):
        self.menu = menu
        self.base_url = base_url.rstrip("/")
        self.headers = headers or {}
        self.open_url = open_url
        self.run = run  # runs launchctl: the server runs as the `omlx service` agent
        self.message: str | None = None  # the last action's outcome, shown under the status

    @classmethod
    def for_config(cls, menu: Menu, config: LoadedConfig, **kwargs) -> MenuPresenter:
        from appliance.cli_status import base_url

        server = config.spec.server
        return cls(menu, base_url(server), headers=server.admin_headers, **kwargs)

    def refresh(self) -> None:
        """Reads the server's status and cache figures and shows them."""
        try:
            status = self._get("status")
            overview = self._get("overview")
        except (httpx.HTTPError, ValueError) as e:
            self.menu.show("omlx ✕", [Item(f"No server at {self.base_url}"), Item(f"({e})"), SEPARATOR,
                                      *self._control_items()])
            return
        self.menu.show(title(status), self.items(status, overview))

    def items(self, status: dict, overview: dict) -> list[Item]:
        models = status["models"]
        ready = sum(m["state"] == "ready" for m in models)
        items = [Item(f"{'Ready' if status['ready'] else 'Not ready'}: {ready} of {len(models)} models serving")]
        if status["config"]["last_error"]:
            items.append(Item(f"Config not applied: {status['config']['last_error']['message'][:80]}"))
        if self.message:
            items.append(Item(self.message))
        items += [SEPARATOR, Item("Default model")]
        items += [Item(f"{m['name']} ({m['state']})", self._make_default(m["name"]), checked=m["default"])
                  for m in models]
        items += [SEPARATOR, Item(f"Cache hit rate: {hit_rate(overview)}"), SEPARATOR,
                  Item("Open dashboard", lambda: self.open_url(self.base_url + "/")), *self._control_items()]
        return items

    def _control_items(self) -> list[Item]:
        return [Item("Restart server", lambda: self._service("restart")),
                Item("Stop server", lambda: self._service("stop"))]

    def _make_default(self, name: str) -> Callable[[], None]:
        def action() -> None:
            response = httpx.post(f"{self.base_url}/admin/api/models/{name}/default", headers=self.headers,
                                  timeout=60)
            self.message = None if response.status_code == 200 else \
                f"{name} not made default: {response.json().get('error', {}).get('message', response.status_code)}"
            self.refresh()
        return action

    def _service(self, verb: str) -> None:
        self.run(launchctl(verb))
        self.message = f"{verb} requested"
        self.refresh()

    def _get(self, name: str) -> dict:
        response = httpx.get(f"{self.base_url}/admin/api/{name}", headers=self.headers, timeout=TIMEOUT_S)
        if response.status_code != 200:
            raise ValueError(f"/admin/api/{name} answered {response.status_code}")
        return response.json()


def title(status: dict) -> str:
    """Returns the menu bar's title: ● serving, ◐ loading, ✕ a model failed."""
    states = {m["state"] for m in status["models"]}
    mark = "●" if status["ready"] else "✕" if "failed" in states else "◐"
    return f"omlx {mark}"


def hit_rate(overview: dict) -> str:
    """Returns the share of prompt tokens restored from the cache since the server started."""
    prompt = overview.get("prompt_tokens") or 0
    restored = sum((overview.get("cached_tokens_by_tier") or {}).values())
    return f"{100 * restored / prompt:.1f}%" if prompt else "–"
