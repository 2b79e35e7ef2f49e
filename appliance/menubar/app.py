"""The rumps layer of `omlx menubar` (macOS only): draws what MenuPresenter shows and
refreshes it on a timer. Everything it decides lives in presenter.py."""

from __future__ import annotations

import webbrowser

import rumps

from appliance.config import LoadedConfig
from appliance.menubar.presenter import REFRESH_S, SEPARATOR, Item, MenuPresenter


class RumpsMenu:
    """A `Menu` on a rumps.App."""

    def __init__(self, app: rumps.App):
        self.app = app

    def show(self, title: str, items: list[Item]) -> None:
        self.app.title = title
        self.app.menu.clear()
        for item in items:
            if item is SEPARATOR:
                self.app.menu.add(rumps.separator)
                continue
            entry = rumps.MenuItem(item.title, callback=(lambda _, a=item.action: a()) if item.action else None)
            entry.state = int(item.checked)
            self.app.menu.add(entry)
        self.app.menu.add(rumps.separator)
        self.app.menu.add(rumps.MenuItem("Quit", callback=rumps.quit_application))


def run(config: LoadedConfig) -> int:
    app = rumps.App("omlx", title="omlx", quit_button=None)
    presenter = MenuPresenter.for_config(RumpsMenu(app), config, open_url=webbrowser.open)
    rumps.Timer(lambda _: presenter.refresh(), REFRESH_S).start()
    presenter.refresh()
    app.run()
    return 0
