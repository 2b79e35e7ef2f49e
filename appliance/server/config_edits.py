"""Edits of omlx.toml through the admin API: load, unload and make a model the default, and
the file's text itself. Each edit is validated, written atomically and then reconciled,
exactly as a save in an editor would be: the file stays the source of truth.

An unloaded model's table leaves `[[models]]`; the server keeps it (in memory, until it
restarts) so that loading it again puts the same table back.
"""

from __future__ import annotations

import asyncio
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.config import MASK, ConfigError, ConfigIssue, load_spec_as, write_config
from appliance.reconcile.watch import reconcile_now
from appliance.server.errors import ApiError
from appliance.server.json import JSONResponse

_EDITS = asyncio.Lock()  # one read-modify-write of the file at a time


def file_data(path: Path, applied: dict) -> dict[str, Any]:
    """Returns the config file's own tables, with `models` from the applied spec when the
    file leaves them to its profile."""
    data = tomllib.loads(path.read_text())
    data.setdefault("models", applied["models"])
    return data


def unloaded(request: Request) -> dict[str, dict]:
    """Returns the tables of the models unloaded through this server, by name."""
    state = request.app.state
    if not hasattr(state, "unloaded_models"):
        state.unloaded_models = {}
    return state.unloaded_models


async def list_models(request: Request) -> Response:
    """The declared models with their state, then the unloaded ones (state `unloaded`)."""
    app = request.app.state.appliance
    declared = app.status()["models"]
    names = {m["name"] for m in declared}
    parked = [{"name": name, "state": "unloaded", "default": False, "source": table.get("source")}
              for name, table in unloaded(request).items() if name not in names]
    return JSONResponse({"models": [*declared, *parked]})


async def unload_model(request: Request) -> Response:
    name = request.path_params["name"]

    def edit(models: list[dict]) -> list[dict]:
        table = find(models, name)
        rest = [m for m in models if m is not table]
        if table.get("default") and rest:  # the default moves to the first model left
            rest[0] = {**rest[0], "default": True}
        unloaded(request)[name] = {k: v for k, v in table.items() if k != "default"}
        return rest

    return await edit_models(request, edit)


async def load_model(request: Request) -> Response:
    name = request.path_params["name"]
    table = unloaded(request).get(name)
    if table is None:
        raise ApiError(404, f"no unloaded model named {name!r}", code="model_not_found")

    def edit(models: list[dict]) -> list[dict]:
        if any(m.get("name") == name for m in models):
            return models
        return [*models, table]

    response = await edit_models(request, edit)
    if response.status_code < 400:
        unloaded(request).pop(name, None)
    return response


async def make_default(request: Request) -> Response:
    name = request.path_params["name"]

    def edit(models: list[dict]) -> list[dict]:
        find(models, name)
        return [{**m, "default": m.get("name") == name} for m in models]

    return await edit_models(request, edit)


def find(models: list[dict], name: str) -> dict:
    for table in models:
        if table.get("name") == name:
            return table
    raise ApiError(404, f"the config declares no model named {name!r}", code="model_not_found")


async def edit_models(request: Request, edit) -> Response:
    """Rewrites the file's `[[models]]` with `edit`, then applies it; answers as PUT
    /admin/api/config does."""
    app = request.app.state.appliance
    async with _EDITS:
        path = app.config.path
        try:
            data = file_data(path, app.spec.to_data())
        except tomllib.TOMLDecodeError as e:
            raise ApiError(409, f"{path} does not parse ({e}): fix it first", code="invalid_config") from None
        data["models"] = edit(list(data["models"]))
        try:
            await asyncio.to_thread(write_config, path, data)
        except ConfigError as e:
            return invalid(e)
        return await applied(request)


async def get_file(request: Request) -> Response:
    """The config file's text, as saved, with its keys masked (as GET /admin/api/config
    shows them)."""
    path = request.app.state.appliance.config.path
    return JSONResponse({"path": str(path), "text": mask_keys(await asyncio.to_thread(path.read_text))})


# `admin_key = "..."` and an API key's `key = "..."` (also inside inline tables).
KEY_VALUE = re.compile(r"""\b(admin_key|key)(\s*=\s*)(["'])(.*?)\3""")


def mask_keys(text: str) -> str:
    """Returns the file's text with every key's value replaced by MASK."""
    return KEY_VALUE.sub(lambda m: f"{m[1]}{m[2]}{m[3]}{MASK}{m[3]}", text)


def unmask_keys(text: str, saved: str) -> str:
    """Returns `text` with each masked key put back: the n-th masked `key` (or `admin_key`)
    takes the value of the n-th one in the saved file."""
    values: dict[str, list[str]] = {}
    for m in KEY_VALUE.finditer(saved):
        values.setdefault(m[1], []).append(m[4])
    seen: dict[str, int] = {}

    def restore(m: re.Match) -> str:
        n = seen[m[1]] = seen.get(m[1], -1) + 1
        old = values.get(m[1], [])
        if m[4] != MASK or n >= len(old):
            return m[0]
        return f"{m[1]}{m[2]}{m[3]}{old[n]}{m[3]}"

    return KEY_VALUE.sub(restore, text)


async def put_file(request: Request) -> Response:
    """Validates new text for the config file, writes it atomically (comments and layout
    kept), then applies it."""
    try:
        text = orjson.loads(await request.body())["text"]
        assert isinstance(text, str)
    except (orjson.JSONDecodeError, KeyError, TypeError, AssertionError):
        raise ApiError(400, 'the body must be {"text": "<the TOML file>"}', code="invalid_json") from None
    app = request.app.state.appliance
    async with _EDITS:
        path = app.config.path
        try:
            text = unmask_keys(text, await asyncio.to_thread(path.read_text))
            await asyncio.to_thread(write_text, path, text)
        except ConfigError as e:
            return invalid(e)
        return await applied(request)


def write_text(path: Path, text: str) -> None:
    """Writes `text` to `path` once it loads as a valid config there; raises ConfigError."""
    tmp = path.with_name(f".{path.name}.pending-{os.getpid()}")  # not *.toml: the watcher ignores it
    try:
        tmp.write_text(text)
        try:
            load_spec_as(tmp, path)
        except ConfigError as e:  # name the real file, not the temp one
            raise ConfigError([ConfigIssue(i.path, i.message.replace(str(tmp), str(path)))
                               for i in e.issues], file=path) from None
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def invalid(error: ConfigError) -> Response:
    return JSONResponse({"error": {"message": str(error), "type": "invalid_request_error", "param": None,
                                   "code": "invalid_config", "issues": error.to_data()["issues"]}},
                        status_code=400)


async def applied(request: Request) -> Response:
    app = request.app.state.appliance
    outcome = await reconcile_now(request.app.state.reconciler)
    ok = outcome is not None and outcome.applied
    body = {"applied": ok, "hash": app.spec.hash, "actions": list(outcome.actions) if outcome else [],
            "last_error": app.last_error}
    return JSONResponse(body, status_code=200 if ok else 409)


ROUTES = [
    Route("/admin/api/models", list_models, methods=["GET"]),
    Route("/admin/api/models/{name:path}/unload", unload_model, methods=["POST"]),
    Route("/admin/api/models/{name:path}/load", load_model, methods=["POST"]),
    Route("/admin/api/models/{name:path}/default", make_default, methods=["POST"]),
    Route("/admin/api/config/file", get_file, methods=["GET"]),
    Route("/admin/api/config/file", put_file, methods=["PUT"]),
]
