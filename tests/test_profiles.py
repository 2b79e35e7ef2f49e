"""profiles/*.toml: every preset validates under a real omlx.toml, changes something,
and stays a plain layer (no models, no nested profile); the README lists each one."""

from __future__ import annotations

import re
import shutil
import tomllib
from pathlib import Path

import pytest

from appliance.config import load_spec, profile_dirs
from appliance.spec import Spec

PROFILES = Path(__file__).resolve().parents[1] / "profiles"
FILES = sorted(PROFILES.glob("*.toml"))
NAMES = [p.stem for p in FILES]
ALLOWED_SECTIONS = {"cache", "batching", "kernels", "server"}

MINIMAL = """
[[models]]
name = "tiny"
source = "tiny.gguf"
"""


def user_config(tmp_path: Path, profile: str) -> Path:
    """Writes a minimal omlx.toml naming `profile`, with the repo's profiles where it looks."""
    config = tmp_path / "omlx.toml"
    config.write_text(f'profile = "{profile}"\n{MINIMAL}')
    shutil.copytree(PROFILES, profile_dirs(config)[0])
    return config


def test_profiles_exist():
    expected = {"linux-cpu", "mac-16gb", "mac-36gb", "mac-64gb", "mac-128gb", "mac-192gb",
                "nvidia-h100", "nvidia-h200", "coding-agent"}
    assert expected <= set(NAMES)


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_validates_under_a_minimal_file(tmp_path, path):
    loaded = load_spec(user_config(tmp_path, path.stem))
    assert loaded.files[1].name == path.name
    assert loaded.spec.default_model.name == "tiny"


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_changes_a_default(tmp_path, path):
    layered = load_spec(user_config(tmp_path, path.stem)).spec
    plain = Spec(models=[{"name": "tiny", "source": "tiny.gguf"}])
    data, defaults = layered.to_data(), plain.to_data()
    changed = [f"{section}.{key}" for section in ALLOWED_SECTIONS
               for key, value in data[section].items() if value != defaults[section][key]]
    assert changed, f"{path.name} sets nothing the defaults don't already"


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_is_a_plain_layer(path):
    data = tomllib.loads(path.read_text())
    assert "models" not in data
    assert "profile" not in data
    assert set(data) <= ALLOWED_SECTIONS
    assert all(isinstance(table, dict) for table in data.values())


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_profile_explains_itself(path):
    assert path.read_text().startswith("#"), f"{path.name} needs a header comment"


@pytest.mark.parametrize("path", FILES, ids=NAMES)
def test_user_file_wins_over_profile(tmp_path, path):
    config = user_config(tmp_path, path.stem)
    config.write_text(config.read_text() + "\n[cache]\nssd_gb = 7.5\n")
    assert load_spec(config).spec.cache.ssd_gb == 7.5


def test_readme_table_lists_every_profile():
    readme = (PROFILES / "README.md").read_text()
    rows = re.findall(r"^\| `([^`]+)` \|", readme, flags=re.MULTILINE)
    assert sorted(rows) == sorted(NAMES)
