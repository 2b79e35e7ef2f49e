"""Loading `omlx.toml`: profile layering, env overrides, errors that name their TOML path."""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import ValidationError
from pydantic_settings import SettingsError

from appliance.spec import Spec

PROFILE_ENV = "OMLX_PROFILE"


@dataclass(frozen=True)
class ConfigIssue:
    path: str  # TOML path, e.g. "server.port" or "models[0].name"
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class ConfigError(Exception):
    """The config could not become a spec; `issues` lists every problem with its path."""

    def __init__(self, issues: list[ConfigIssue], *, file: Path | None = None):
        self.issues = tuple(issues)
        self.file = file
        super().__init__("\n".join(str(i) for i in self.issues))

    def to_data(self) -> dict:
        first = self.issues[0] if self.issues else ConfigIssue("", "invalid config")
        return {
            "message": str(self),
            "path": first.path or None,
            "file": str(self.file) if self.file else None,
            "issues": [{"path": i.path, "message": i.message} for i in self.issues],
        }


@dataclass(frozen=True)
class LoadedConfig:
    """A validated spec with where it came from."""

    spec: Spec
    path: Path
    files: tuple[Path, ...]  # the file and every profile it layered, for the watcher

    @property
    def base_dir(self) -> Path:
        return self.path.parent


def read_toml(path: Path) -> dict[str, Any]:
    """Returns the parsed TOML table of `path`; raises ConfigError naming the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError([ConfigIssue("", f"{path}: no such file")], file=path) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([ConfigIssue("", f"{path}: TOML syntax error: {e}")], file=path) from None
    except UnicodeDecodeError as e:
        # tomllib decodes before parsing; a file cut mid-character fails here, not as TOML.
        raise ConfigError([ConfigIssue("", f"{path}: not UTF-8 text: {e.reason} at byte {e.start}")],
                          file=path) from None
    except OSError as e:
        raise ConfigError([ConfigIssue("", f"{path}: cannot read: {e.strerror}")], file=path) from None


def profile_dirs(config_path: Path) -> tuple[Path, ...]:
    """Returns where `profile = "name"` is looked up, first match wins."""
    return (config_path.parent / "profiles", Path("~/.omlx/profiles").expanduser())


def find_profile(name: str, config_path: Path) -> Path:
    """Returns the path of profile `name`; raises ConfigError listing where it looked."""
    for d in profile_dirs(config_path):
        candidate = d / f"{name}.toml"
        if candidate.is_file():
            return candidate
    where = ", ".join(str(d) for d in profile_dirs(config_path))
    raise ConfigError([ConfigIssue("profile", f"no profile named {name!r} (looked in {where})")],
                      file=config_path)


def deep_merge(base: dict, top: dict) -> dict:
    """Returns `base` with `top` laid over it: tables merge, everything else is replaced."""
    merged = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_spec(path: Path | str) -> LoadedConfig:
    """Returns the validated spec of `path` with its profile and env overrides applied."""
    path = Path(path).resolve()
    data = read_toml(path)
    files = [path]
    name = os.environ.get(PROFILE_ENV) or data.get("profile")
    if isinstance(name, str) and name:
        profile_path = find_profile(name, path)
        layer = read_toml(profile_path)
        if "profile" in layer:
            raise ConfigError([ConfigIssue("profile", f"{profile_path}: a profile cannot layer another profile")],
                              file=profile_path)
        data = deep_merge(layer, data)
        files.append(profile_path)
    # Keys starting with "_" would reach BaseSettings' own init options, not the spec.
    hidden = [ConfigIssue(key, "unknown key") for key in data if key.startswith("_")]
    if hidden:
        raise ConfigError(hidden, file=path)
    try:
        spec = Spec(**data)
    except ValidationError as e:
        raise ConfigError(issues_of(e), file=path) from None
    except SettingsError as e:
        # A malformed OMLX_* value (OMLX_SERVER='{') fails while reading the environment.
        raise ConfigError([env_issue(e)], file=path) from None
    return LoadedConfig(spec=spec, path=path, files=tuple(files))


def issues_of(error: ValidationError) -> list[ConfigIssue]:
    """Returns one ConfigIssue per pydantic error, worded for people editing TOML."""
    issues = []
    for err in error.errors():
        # A model-level error has no location; its ctx carries the TOML path it is about.
        path = toml_path(err["loc"]) or err.get("ctx", {}).get("path", "")
        kind = err["type"]
        if kind == "extra_forbidden":
            message = "unknown key"
        elif kind == "missing":
            message = "required key is missing"
        else:
            message = err["msg"].removeprefix("Value error, ")
            if "input" in err and not isinstance(err["input"], dict | list | tuple):
                message += f" (got {err['input']!r})"
        issues.append(ConfigIssue(path, message))
    return issues


def env_issue(error: SettingsError) -> ConfigIssue:
    """Returns the ConfigIssue of an environment value pydantic-settings could not parse."""
    field = re.search(r'field "([^"]+)"', str(error))
    cause = error.__cause__ or error
    return ConfigIssue(field.group(1) if field else "", f"bad OMLX_ environment value: {cause}")


def toml_path(loc: tuple) -> str:
    """Returns pydantic's error location as a TOML path: ("models", 0, "name") -> models[0].name."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def dump_toml(spec: Spec) -> str:
    """Returns the fully resolved spec as TOML text."""
    return tomli_w.dumps(spec.to_data())


MASK = "**********"  # how the spec's keys are shown (pydantic's SecretStr)


def restore_secrets(data: dict[str, Any], applied: Spec) -> dict[str, Any]:
    """Returns `data` with masked keys (as GET /admin/api/config shows them) replaced by the
    applied spec's: the admin key, and each API key by its position."""
    server = data.get("server")
    if not isinstance(server, dict):
        return data
    server = dict(server)
    if server.get("admin_key") == MASK and applied.server.admin_key is not None:
        server["admin_key"] = applied.server.admin_key.get_secret_value()
    keys = server.get("api_keys")
    if isinstance(keys, list):
        old = applied.server.api_keys
        server["api_keys"] = [
            {**k, "key": old[i].key.get_secret_value()}
            if isinstance(k, dict) and k.get("key") == MASK and i < len(old) and old[i].key is not None else k
            for i, k in enumerate(keys)]
    return {**data, "server": server}


def write_config(path: Path, data: dict[str, Any]) -> LoadedConfig:
    """Validates `data` as the config at `path` (profiles and env included) and writes it
    atomically; returns the loaded result. Raises ConfigError and leaves the file as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.pending-{os.getpid()}")  # not *.toml: the watcher ignores it
    try:
        tmp.write_text(tomli_w.dumps(data))
        loaded = load_spec_as(tmp, path)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return loaded
    except (TypeError, ValueError) as e:
        raise ConfigError([ConfigIssue("", f"cannot be written as TOML: {e}")], file=path) from None
    finally:
        tmp.unlink(missing_ok=True)


def load_spec_as(candidate: Path, path: Path) -> LoadedConfig:
    """Returns `candidate` loaded as if it were the file at `path` (same profiles, same dir)."""
    loaded = load_spec(candidate)
    return LoadedConfig(spec=loaded.spec, path=Path(path).resolve(),
                        files=(Path(path).resolve(), *loaded.files[1:]))
