"""appliance/spec.py: defaults, validators, frozen sections and derived properties."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from appliance.spec import GIB, BatchingSpec, CacheSpec, KernelsSpec, ServerSpec, Spec

ONE_MODEL = [{"name": "tiny", "source": "tiny.gguf"}]


def error_locs(excinfo: pytest.ExceptionInfo[ValidationError]) -> set[tuple]:
    return {tuple(e["loc"]) for e in excinfo.value.errors()}


def test_defaults_of_every_section():
    spec = Spec(models=ONE_MODEL)
    assert spec.profile is None
    assert spec.server == ServerSpec(host="127.0.0.1", port=8000, drain_timeout_s=10.0)
    assert spec.cache == CacheSpec(dir="~/.omlx/cache", block_tokens=256, memory_gb=2.0,
                                   host_gb=4.0, ssd_gb=50.0)
    assert spec.batching == BatchingSpec(max_running=8, max_queued=64, prefill_chunk_tokens=512)
    assert spec.kernels == KernelsSpec(kv_quantize="auto", kv_dequantize="auto", small_matmul="auto")
    model = spec.models[0]
    assert (model.default, model.dtype, model.max_context_tokens, model.default_max_tokens) == (
        False, "auto", None, 512)


def test_models_are_required():
    with pytest.raises(ValidationError) as excinfo:
        Spec()
    assert ("models",) in error_locs(excinfo)


def test_empty_model_list_is_rejected():
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=[])
    assert ("models",) in error_locs(excinfo)


def test_single_model_is_default_implicitly():
    spec = Spec(models=ONE_MODEL)
    assert spec.models[0].default is False
    assert spec.default_model.name == "tiny"


def test_explicit_default_among_several():
    spec = Spec(models=[{"name": "a", "source": "a"}, {"name": "b", "source": "b", "default": True}])
    assert spec.default_model.name == "b"
    assert spec.model("a").source == "a"
    assert spec.model("missing") is None


@pytest.mark.parametrize("defaults", [(False, False), (True, True)], ids=["none", "two"])
def test_several_models_need_exactly_one_default(defaults):
    models = [{"name": n, "source": n, "default": d} for n, d in zip("ab", defaults)]
    with pytest.raises(ValidationError, match="exactly one model must have default = true"):
        Spec(models=models)


def test_duplicate_model_names_are_named():
    models = [{"name": "a", "source": "1", "default": True}, {"name": "a", "source": "2"}]
    with pytest.raises(ValidationError, match="repeated: a") as excinfo:
        Spec(models=models)
    assert error_locs(excinfo) == {("models",)}


@pytest.mark.parametrize("name", ["", "-leading-dash", "has space", "x" * 129])
def test_bad_model_names(name):
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=[{"name": name, "source": "s"}])
    assert error_locs(excinfo) == {("models", 0, "name")}


@pytest.mark.parametrize("name", ["a", "org/model:q4", "Qwen2.5-0.5B_instruct"])
def test_good_model_names(name):
    assert Spec(models=[{"name": name, "source": "s"}]).models[0].name == name


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("server", "port", 0),
        ("server", "port", 65536),
        ("server", "drain_timeout_s", -1),
        ("server", "mlx_memory_limit_gb", 0),
        ("server", "mlx_memory_limit_gb", "lots"),
        ("cache", "memory_gb", -0.5),
        ("cache", "block_tokens", 8),
        ("cache", "block_tokens", "big"),
        ("batching", "max_running", 0),
        ("kernels", "kv_quantize", "fast"),
    ],
)
def test_bad_section_values(section, key, value):
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=ONE_MODEL, **{section: {key: value}})
    assert error_locs(excinfo) == {(section, key)}


def test_bad_dtype():
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=[{"name": "a", "source": "s", "dtype": "float8"}])
    assert error_locs(excinfo) == {("models", 0, "dtype")}


@pytest.mark.parametrize("section", [{"server": {"prot": 1}}, {"cache": {"memry_gb": 1}}, {"colour": 1}])
def test_unknown_keys_are_forbidden(section):
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=ONE_MODEL, **section)
    assert {e["type"] for e in excinfo.value.errors()} == {"extra_forbidden"}


def test_running_beyond_the_trained_context_needs_a_limit():
    with pytest.raises(ValidationError) as excinfo:
        Spec(models=[{"name": "tiny", "source": "tiny.gguf", "allow_beyond_trained_context": True}])
    assert ("models", 0) in error_locs(excinfo)
    assert "needs max_context_tokens" in str(excinfo.value)
    spec = Spec(models=[{"name": "tiny", "source": "tiny.gguf", "max_context_tokens": 16384,
                         "allow_beyond_trained_context": True}])
    assert spec.models[0].allow_beyond_trained_context


def test_spec_and_sections_are_frozen():
    spec = Spec(models=ONE_MODEL)
    with pytest.raises(ValidationError):
        spec.server = ServerSpec(port=1)
    with pytest.raises(ValidationError):
        spec.server.port = 1
    with pytest.raises(ValidationError):
        spec.models[0].name = "other"
    with pytest.raises(AttributeError):
        spec.models.append(spec.models[0])  # a tuple, not a list
    assert spec.server.port == 8000


def test_env_overrides_single_keys(monkeypatch):
    monkeypatch.setenv("OMLX_SERVER__PORT", "9000")
    monkeypatch.setenv("OMLX_CACHE__MEMORY_GB", "3.5")
    spec = Spec(models=ONE_MODEL, server={"host": "127.0.0.2", "port": 8001})
    assert spec.server.port == 9000
    assert spec.server.host == "127.0.0.2"  # the rest of the section stays as given
    assert spec.cache.memory_gb == 3.5
    assert spec.cache.block_tokens == 256


def test_bytes_properties():
    cache = CacheSpec(memory_gb=1.5, host_gb=0.25, ssd_gb=0)
    assert cache.memory_bytes == 3 * GIB // 2
    assert cache.host_bytes == GIB // 4
    assert cache.ssd_bytes == 0
    assert isinstance(cache.memory_bytes, int)


def test_cache_path_relative_to_config_dir(tmp_path):
    assert CacheSpec(dir="cache").path(tmp_path) == (tmp_path / "cache").resolve()
    assert CacheSpec(dir="../shared").path(tmp_path / "cfg") == (tmp_path / "shared").resolve()


def test_cache_path_absolute_ignores_config_dir(tmp_path):
    assert CacheSpec(dir=str(tmp_path / "abs")).path(Path("/elsewhere")) == (tmp_path / "abs").resolve()


def test_cache_path_expands_home(tmp_path):
    home = Path(os.environ["HOME"])
    assert CacheSpec(dir="~/.omlx/cache").path(tmp_path / "cfg") == (home / ".omlx/cache").resolve()


def test_to_data_drops_none_and_is_plain():
    data = Spec(models=ONE_MODEL).to_data()
    assert "profile" not in data
    assert "max_context_tokens" not in data["models"][0]
    assert isinstance(data["models"], list)


def test_hash_is_stable_and_tracks_every_key():
    base = Spec(models=ONE_MODEL)
    assert base.hash == Spec(models=ONE_MODEL).hash
    assert len(base.hash) == 16
    changed = [
        Spec(models=ONE_MODEL, server={"port": 8001}),
        Spec(models=ONE_MODEL, cache={"memory_gb": 2.5}),
        Spec(models=[{"name": "tiny", "source": "other.gguf"}]),
        Spec(models=[{"name": "tiny", "source": "tiny.gguf", "max_context_tokens": 1024}]),
        Spec(models=ONE_MODEL, kernels={"kv_dequantize": "generic"}),
    ]
    hashes = {s.hash for s in changed}
    assert base.hash not in hashes
    assert len(hashes) == len(changed)


def test_the_mlx_memory_limit_is_unset_by_default_and_takes_gib():
    assert Spec(models=ONE_MODEL).server.mlx_memory_limit_gb is None
    assert Spec(models=ONE_MODEL, server={"mlx_memory_limit_gb": 100}).server.mlx_memory_limit_gb == 100.0


# --- keys and limits ([server] auth, [limits]) -------------------------------------------------

KEY = "k" * 20


def test_api_keys_carry_tenants_and_come_inline_or_from_the_environment(monkeypatch):
    monkeypatch.setenv("TEST_SPEC_KEY", "e" * 20)
    spec = Spec(models=ONE_MODEL, server={"admin_key": "a" * 20, "api_keys": [
        {"key": KEY, "tenant": "team-a"}, {"key_env": "TEST_SPEC_KEY"}]})
    a, b = spec.server.api_keys
    assert (a.secret, a.tenant, b.secret, b.tenant) == (KEY, "team-a", "e" * 20, "default")
    assert spec.server.admin_secret == "a" * 20


@pytest.mark.parametrize("server, message", [
    ({"api_keys": [{"key": KEY, "key_env": "X"}]}, "not both"),
    ({"api_keys": [{"key_env": "TEST_SPEC_UNSET_KEY"}]}, "TEST_SPEC_UNSET_KEY (named by key_env) is not set"),
    ({"api_keys": [{}]}, "key or key_env is required"),
    ({"api_keys": [{"key": "short"}]}, "at least 16 characters"),
    ({"api_keys": [{"key": KEY}, {"key": KEY}]}, "must be different"),
    ({"api_keys": [{"key": KEY}], "admin_key": KEY}, "must be different"),
    ({"api_keys": [{"key": KEY, "tenant": "../etc"}]}, "should match pattern"),
    ({"host": "0.0.0.0"}, "needs api_keys and an admin_key"),
    ({"host": "192.168.1.5", "api_keys": [{"key": KEY}]}, "needs api_keys and an admin_key"),
])
def test_bad_keys_and_open_binds_are_refused(server, message):
    with pytest.raises(ValidationError, match=re.escape(message)):
        Spec(models=ONE_MODEL, server=server)


def test_a_non_loopback_bind_needs_keys_or_an_explicit_choice():
    keyed = Spec(models=ONE_MODEL, server={"host": "0.0.0.0", "admin_key": "a" * 20, "api_keys": [{"key": KEY}]})
    assert not keyed.server.open_to_the_network
    open_ = Spec(models=ONE_MODEL, server={"host": "0.0.0.0", "allow_unauthenticated": True})
    assert open_.server.open_to_the_network
    assert not Spec(models=ONE_MODEL, server={"host": "::1"}).server.open_to_the_network


def test_keys_are_masked_in_the_dump_and_still_change_the_hash():
    one = Spec(models=ONE_MODEL, server={"api_keys": [{"key": KEY}]})
    other = Spec(models=ONE_MODEL, server={"api_keys": [{"key": "o" * 20}]})
    assert one.to_data()["server"]["api_keys"] == [{"key": "**********", "tenant": "default"}]
    assert KEY not in str(one.to_data())
    assert one.hash != other.hash


def test_limits_have_defaults_and_bounds():
    limits = Spec(models=ONE_MODEL).limits
    assert (limits.max_body_bytes, limits.max_prompt_tokens, limits.max_tokens) == (32 * 2**20, None, 65_536)
    with pytest.raises(ValidationError, match="limits.max_concurrent_per_key|max_concurrent_per_key"):
        Spec(models=ONE_MODEL, limits={"max_concurrent_per_key": 0})


def test_a_native_kernel_the_backend_lacks_is_refused_naming_its_key():
    with pytest.raises(ValidationError, match=r"kernels.kv_dequantize = native: no native kv_dequantize kernel "
                                              r"for the cpu backend; use auto or generic"):
        Spec(models=ONE_MODEL, kernels={"kv_dequantize": "native"})


def test_the_ssd_keeps_kv_at_no_more_bits_than_the_host():
    assert Spec(models=ONE_MODEL, cache={"host_kv_bits": 8, "ssd_kv_bits": 4}).cache.ssd_kv_bits == 4
    with pytest.raises(ValidationError, match=r"cache.ssd_kv_bits \(8\) may not be above cache.host_kv_bits \(4\)"):
        Spec(models=ONE_MODEL, cache={"host_kv_bits": 4, "ssd_kv_bits": 8})
    with pytest.raises(ValidationError, match="host_kv_bits"):
        Spec(models=ONE_MODEL, cache={"host_kv_bits": 6})
