"""How every command reads the config: loaded, or each of its errors printed to stderr."""

from __future__ import annotations

import sys
from pathlib import Path

from appliance.config import ConfigError, LoadedConfig, load_spec


def print_errors(error: ConfigError, config: str | Path) -> None:
    print(f"omlx: {config}: {len(error.issues)} error(s)", file=sys.stderr)
    for issue in error.issues:
        print(f"  {issue}", file=sys.stderr)


def load_or_report(config: str | Path) -> LoadedConfig | None:
    """Returns the loaded config, or None after printing why it is not valid (exit 1)."""
    try:
        return load_spec(config)
    except ConfigError as e:
        print_errors(e, config)
        return None
