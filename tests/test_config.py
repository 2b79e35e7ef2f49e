"""appliance/config.py: loading real TOML files, profiles, env overrides and error paths."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

import pytest

from appliance.config import ConfigError, ConfigIssue, dump_toml, load_spec
from appliance.spec import Spec

REPO_CONFIG = Path(__file__).resolve().parents[1] / "omlx.toml"

ONE_MODEL = """
[[models]]
name = "tiny"
source = "tiny.gguf"
"""

TWO_MODELS = """
[[models]]
name = "a"
source = "a.gguf"
default = true

[[models]]
name = "b"
source = "b.gguf"
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def config(tmp_path: Path, text: str) -> Path:
    return write(tmp_path / "omlx.toml", text)


def issues(path: Path) -> dict[str, str]:
    """Returns {toml path: message} of the ConfigError that loading `path` must raise."""
    with pytest.raises(ConfigError) as excinfo:
        load_spec(path)
    assert all(isinstance(i, ConfigIssue) for i in excinfo.value.issues)
    return {i.path: i.message for i in excinfo.value.issues}


# --- valid files -------------------------------------------------------------------------


def test_repo_config_validates():
    loaded = load_spec(REPO_CONFIG)
    assert loaded.path == REPO_CONFIG
    assert loaded.files == (REPO_CONFIG,)
    assert loaded.base_dir == REPO_CONFIG.parent
    assert loaded.spec.default_model.name == "smollm2-135m"
    assert loaded.spec.cache.memory_gb == 1.0


def test_minimal_file_gets_defaults(tmp_path):
    loaded = load_spec(config(tmp_path, ONE_MODEL))
    assert loaded.spec == Spec(models=[{"name": "tiny", "source": "tiny.gguf"}])
    assert loaded.spec.default_model.name == "tiny"
    assert loaded.base_dir == tmp_path.resolve()


def test_accepts_str_path(tmp_path):
    assert load_spec(str(config(tmp_path, ONE_MODEL))).spec.models[0].name == "tiny"


# --- errors with their TOML paths ----------------------------------------------------------


def test_unknown_key_in_section(tmp_path):
    assert issues(config(tmp_path, ONE_MODEL + "[server]\nprot = 8000\n")) == {"server.prot": "unknown key"}


def test_unknown_top_level_key(tmp_path):
    assert issues(config(tmp_path, "colour = 'blue'\n" + ONE_MODEL)) == {"colour": "unknown key"}


def test_unknown_top_level_section(tmp_path):
    assert issues(config(tmp_path, ONE_MODEL + "[sever]\nport = 1\n")) == {"sever": "unknown key"}


def test_unknown_key_in_second_model(tmp_path):
    text = TWO_MODELS.replace('source = "b.gguf"', 'sourc = "b.gguf"')
    found = issues(config(tmp_path, text))
    assert found["models[1].sourc"] == "unknown key"
    assert found["models[1].source"] == "required key is missing"


@pytest.mark.parametrize("key", ["_env_prefix", "_cli_parse_args", "__pydantic_self__"])
def test_underscore_keys_are_unknown_not_settings_options(tmp_path, key):
    # BaseSettings takes "_"-prefixed init options; a file must not reach them.
    assert issues(config(tmp_path, f'{key} = "X"\n' + ONE_MODEL)) == {key: "unknown key"}


@pytest.mark.parametrize(
    "section, line, path, fragment",
    [
        ("server", "port = 70000", "server.port", "less than or equal to 65535"),
        ("server", "port = 0", "server.port", "greater than or equal to 1"),
        ("cache", "memory_gb = -1.0", "cache.memory_gb", "greater than or equal to 0"),
        ("cache", 'block_tokens = "lots"', "cache.block_tokens", "valid integer"),
        ("cache", "block_tokens = 2.5", "cache.block_tokens", "valid integer"),
        ("kernels", 'kv_quantize = "fast"', "kernels.kv_quantize", "'auto', 'generic' or 'native'"),
        ("batching", "max_running = 0", "batching.max_running", "greater than or equal to 1"),
    ],
)
def test_bad_value_names_its_path(tmp_path, section, line, path, fragment):
    found = issues(config(tmp_path, f"{ONE_MODEL}\n[{section}]\n{line}\n"))
    assert list(found) == [path]
    assert fragment in found[path]
    assert "(got " in found[path]  # the offending value is shown


def test_bad_dtype_names_its_path(tmp_path):
    found = issues(config(tmp_path, ONE_MODEL + 'dtype = "float8"\n'))
    assert list(found) == ["models[0].dtype"]
    assert "'float8'" in found["models[0].dtype"]


def test_missing_source(tmp_path):
    assert issues(config(tmp_path, '[[models]]\nname = "tiny"\n')) == {
        "models[0].source": "required key is missing"}


def test_no_models_at_all(tmp_path):
    assert issues(config(tmp_path, "[server]\nport = 8000\n")) == {"models": "required key is missing"}


def test_empty_models_list(tmp_path):
    found = issues(config(tmp_path, "models = []\n"))
    assert list(found) == ["models"]
    assert "at least one" in found["models"]


def test_one_bad_model_reports_only_its_own_error(tmp_path):
    # No extra "models: at least 1 item" error for a list whose only item is invalid.
    assert issues(config(tmp_path, ONE_MODEL + "port = 1\n")) == {"models[0].port": "unknown key"}


def test_duplicate_model_names(tmp_path):
    text = TWO_MODELS.replace('name = "b"', 'name = "a"')
    found = issues(config(tmp_path, text))
    assert list(found) == ["models"]
    assert "repeated: a" in found["models"]


def test_several_models_without_default(tmp_path):
    found = issues(config(tmp_path, TWO_MODELS.replace("default = true\n", "")))
    assert list(found) == ["models"]
    assert "exactly one model must have default = true" in found["models"]
    assert "found: none" in found["models"]


def test_several_models_with_two_defaults(tmp_path):
    found = issues(config(tmp_path, TWO_MODELS + "default = true\n"))
    assert list(found) == ["models"]
    assert "found: a, b" in found["models"]


def test_every_error_is_reported_together(tmp_path):
    text = """
[server]
port = 0
prot = 1

[[models]]
name = "tiny"
dtype = "float8"

[cache]
memory_gb = -2

[kernels]
kv_dequantize = "fast"
"""
    found = issues(config(tmp_path, text))
    assert set(found) == {"server.port", "server.prot", "models[0].source", "models[0].dtype",
                          "cache.memory_gb", "kernels.kv_dequantize"}


def test_error_records_file_and_data(tmp_path):
    path = config(tmp_path, ONE_MODEL + "[server]\nport = 0\n")
    with pytest.raises(ConfigError) as excinfo:
        load_spec(path)
    data = excinfo.value.to_data()
    assert data["path"] == "server.port"
    assert data["file"] == str(path.resolve())
    assert data["issues"][0]["path"] == "server.port"
    assert str(excinfo.value).startswith("server.port: ")


# --- broken files ------------------------------------------------------------------------


def test_missing_file(tmp_path):
    found = issues(tmp_path / "nope.toml")
    assert list(found) == [""]
    assert "no such file" in found[""]


def test_directory_instead_of_file(tmp_path):
    (tmp_path / "omlx.toml").mkdir()
    found = issues(tmp_path / "omlx.toml")
    assert "cannot read" in found[""]


def test_toml_syntax_error(tmp_path):
    found = issues(config(tmp_path, ONE_MODEL + "[server\nport = 8000\n"))
    assert "TOML syntax error" in found[""]


def test_every_prefix_of_repo_config_loads_or_is_a_config_error(tmp_path):
    # A file caught mid-write by the watcher: any prefix (even mid-character, the header has
    # an em dash) gives a spec or a ConfigError, never another exception.
    text = REPO_CONFIG.read_bytes()
    path = tmp_path / "omlx.toml"
    num_errors = 0
    for end in range(len(text)):
        path.write_bytes(text[:end])
        try:
            load_spec(path)
        except ConfigError as e:
            assert e.issues
            num_errors += 1
    assert num_errors > len(text) // 2


@pytest.mark.parametrize("cut", ['[cach', '[cache]\ndir = "~/.om', '[[models]]\nname = "tin',
                                 "[server]\nport = ", '[[models]]\nname = """multi'])
def test_truncated_inside_table_or_string(tmp_path, cut):
    found = issues(config(tmp_path, ONE_MODEL + cut))
    assert "TOML syntax error" in found[""]


def test_truncated_inside_a_multibyte_character(tmp_path):
    path = tmp_path / "omlx.toml"
    path.write_bytes((ONE_MODEL + '[server]\nhost = "hôte"\n').encode()[:-5])  # cuts "ô" in half
    found = issues(path)
    assert "not UTF-8" in found[""]


# --- environment overrides ---------------------------------------------------------------


def test_env_overrides_single_keys(tmp_path, monkeypatch):
    path = config(tmp_path, ONE_MODEL + "[server]\nport = 8001\nhost = '127.0.0.2'\n[cache]\nmemory_gb = 1.0\n")
    monkeypatch.setenv("OMLX_SERVER__PORT", "9000")
    monkeypatch.setenv("OMLX_CACHE__MEMORY_GB", "3.5")
    monkeypatch.setenv("OMLX_BATCHING__MAX_RUNNING", "2")
    spec = load_spec(path).spec
    assert (spec.server.port, spec.cache.memory_gb, spec.batching.max_running) == (9000, 3.5, 2)
    assert spec.server.host == "127.0.0.2"  # untouched keys of the section stay
    assert spec.batching.max_queued == 64


def test_env_wins_over_file_and_profile(tmp_path, monkeypatch):
    write(tmp_path / "profiles" / "big.toml", "[server]\nport = 8002\n[batching]\nmax_running = 32\n")
    path = config(tmp_path, 'profile = "big"\n[server]\nport = 8001\n' + ONE_MODEL)
    assert load_spec(path).spec.server.port == 8001
    monkeypatch.setenv("OMLX_SERVER__PORT", "9000")
    monkeypatch.setenv("OMLX_BATCHING__MAX_RUNNING", "4")
    spec = load_spec(path).spec
    assert (spec.server.port, spec.batching.max_running) == (9000, 4)


@pytest.mark.parametrize(
    "name, value, path",
    [
        ("OMLX_SERVER__PORT", "abc", "server.port"),
        ("OMLX_SERVER__PORT", "70000", "server.port"),
        ("OMLX_CACHE__MEMORY_GB", "-1", "cache.memory_gb"),
        ("OMLX_BATCHING__MAX_RUNNING", "0", "batching.max_running"),
        ("OMLX_SERVER__PROT", "1", "server.prot"),
    ],
)
def test_bad_env_value_names_its_path(tmp_path, monkeypatch, name, value, path):
    monkeypatch.setenv(name, value)
    found = issues(config(tmp_path, ONE_MODEL))
    assert list(found) == [path]


def test_unparsable_env_section_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_SERVER", "{not json")
    found = issues(config(tmp_path, ONE_MODEL))
    assert list(found) == ["server"]
    assert "environment" in found["server"]


# --- profiles ----------------------------------------------------------------------------

PROFILE = """
[server]
host = "127.0.0.2"
port = 8100

[cache]
memory_gb = 8.0
ssd_gb = 100.0

[[models]]
name = "from-profile"
source = "profile.gguf"
"""


def test_profile_layers_underneath(tmp_path):
    profile = write(tmp_path / "profiles" / "big.toml", PROFILE)
    path = config(tmp_path, 'profile = "big"\n[cache]\nmemory_gb = 4.0\n')
    loaded = load_spec(path)
    spec = loaded.spec
    assert spec.profile == "big"
    assert loaded.files == (path.resolve(), profile.resolve())
    assert (spec.server.host, spec.server.port) == ("127.0.0.2", 8100)  # from the profile
    assert spec.cache.memory_gb == 4.0  # the file's own key wins
    assert spec.cache.ssd_gb == 100.0  # tables merge key by key
    assert spec.cache.host_gb == 4.0  # neither sets it: the default
    assert [m.name for m in spec.models] == ["from-profile"]


def test_file_models_replace_profile_models(tmp_path):
    write(tmp_path / "profiles" / "big.toml", PROFILE)
    spec = load_spec(config(tmp_path, 'profile = "big"\n' + TWO_MODELS)).spec
    assert [m.name for m in spec.models] == ["a", "b"]


def test_profile_from_home_dir(tmp_path):
    write(Path(os.environ["HOME"]) / ".omlx" / "profiles" / "home.toml", "[server]\nport = 8200\n")
    assert load_spec(config(tmp_path, 'profile = "home"\n' + ONE_MODEL)).spec.server.port == 8200


def test_config_dir_profile_wins_over_home(tmp_path):
    write(Path(os.environ["HOME"]) / ".omlx" / "profiles" / "p.toml", "[server]\nport = 8200\n")
    write(tmp_path / "profiles" / "p.toml", "[server]\nport = 8300\n")
    assert load_spec(config(tmp_path, 'profile = "p"\n' + ONE_MODEL)).spec.server.port == 8300


def test_unknown_profile_names_where_it_looked(tmp_path):
    found = issues(config(tmp_path, 'profile = "ghost"\n' + ONE_MODEL))
    message = found["profile"]
    assert "'ghost'" in message
    assert str(tmp_path.resolve() / "profiles") in message
    assert str(Path(os.environ["HOME"]) / ".omlx" / "profiles") in message


def test_profile_env_selects_a_profile(tmp_path, monkeypatch):
    write(tmp_path / "profiles" / "big.toml", PROFILE)
    write(tmp_path / "profiles" / "small.toml", "[cache]\nmemory_gb = 0.5\n")
    path = config(tmp_path, 'profile = "small"\n' + ONE_MODEL)
    monkeypatch.setenv("OMLX_PROFILE", "big")
    spec = load_spec(path).spec
    assert spec.profile == "big"
    assert spec.cache.memory_gb == 8.0
    assert spec.models[0].name == "tiny"


def test_profile_env_unknown_profile(tmp_path, monkeypatch):
    monkeypatch.setenv("OMLX_PROFILE", "ghost")
    assert "'ghost'" in issues(config(tmp_path, ONE_MODEL))["profile"]


def test_profile_cannot_name_a_profile(tmp_path):
    write(tmp_path / "profiles" / "a.toml", 'profile = "b"\n')
    write(tmp_path / "profiles" / "b.toml", "[server]\nport = 1234\n")
    message = issues(config(tmp_path, 'profile = "a"\n' + ONE_MODEL))["profile"]
    assert "cannot layer another profile" in message
    assert "a.toml" in message


def test_profile_errors_are_reported_with_paths(tmp_path):
    write(tmp_path / "profiles" / "bad.toml", "[server]\nprot = 1\n")
    assert issues(config(tmp_path, 'profile = "bad"\n' + ONE_MODEL)) == {"server.prot": "unknown key"}


def test_broken_profile_file(tmp_path):
    write(tmp_path / "profiles" / "bad.toml", "[server\n")
    found = issues(config(tmp_path, 'profile = "bad"\n' + ONE_MODEL))
    assert "bad.toml" in found[""]
    assert "TOML syntax error" in found[""]


# --- dump_toml ---------------------------------------------------------------------------


def test_dump_round_trips_repo_config(tmp_path):
    spec = load_spec(REPO_CONFIG).spec
    text = dump_toml(spec)
    again = Spec(**tomllib.loads(text))
    assert again == spec
    assert again.hash == spec.hash
    reloaded = load_spec(config(tmp_path, text)).spec
    assert reloaded == spec
    assert reloaded.hash == spec.hash


def test_dump_round_trips_a_profiled_spec(tmp_path):
    write(tmp_path / "profiles" / "big.toml", PROFILE)
    spec = load_spec(config(tmp_path, 'profile = "big"\n' + TWO_MODELS)).spec
    resolved = tmp_path / "resolved" / "omlx.toml"
    write(resolved.parent / "profiles" / "big.toml", PROFILE)
    reloaded = load_spec(write(resolved, dump_toml(spec))).spec
    assert reloaded == spec
    assert reloaded.hash == spec.hash


def test_dump_is_fully_resolved(tmp_path):
    data = tomllib.loads(dump_toml(load_spec(config(tmp_path, ONE_MODEL)).spec))
    assert set(data) == {"server", "models", "cache", "batching", "limits", "kernels"}
    assert data["batching"]["max_running"] == 8
    assert data["models"] == [{"name": "tiny", "source": "tiny.gguf", "default": False, "dtype": "auto",
                               "allow_beyond_trained_context": False, "default_max_tokens": 512,
                               "fuse_projections": "auto", "compile_blocks": "off"}]


def test_hash_changes_when_a_key_changes(tmp_path):
    base = load_spec(config(tmp_path, ONE_MODEL)).spec.hash
    changed = load_spec(config(tmp_path, ONE_MODEL + "[cache]\nblock_tokens = 128\n")).spec.hash
    same = load_spec(config(tmp_path, ONE_MODEL + "[cache]\nblock_tokens = 256\n")).spec.hash
    assert changed != base
    assert same == base  # writing out a default does not change the spec
