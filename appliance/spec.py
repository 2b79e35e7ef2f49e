"""The spec: what `omlx.toml` declares, frozen and validated.

Every section is a frozen pydantic model that forbids unknown keys; derived values are
properties, never written back. The loader (`appliance.config`) layers profiles and
environment variables underneath and on top before validation.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
from pathlib import Path
from typing import Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

GIB = 2**30
MIB = 2**20
# A tenant names whose KV a key's requests read and write; it becomes part of cache paths.
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
MIN_KEY_CHARS = 16

KernelChoice = Literal["auto", "generic", "native"]
KVBits = Literal[16, 8, 4]
DType = Literal["auto", "float32", "float16", "bfloat16"]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def secret_of(value: SecretStr | None, env: str | None) -> str | None:
    """Returns a key given inline or by the name of an environment variable."""
    if value is not None:
        return value.get_secret_value()
    return os.environ.get(env) if env else None


def check_secret(value: SecretStr | None, env: str | None, *, what: str, required: bool) -> None:
    if value is not None and env is not None:
        raise ValueError(f"give {what} inline or by environment variable ({what}_env), not both")
    if env is not None and not os.environ.get(env):
        raise ValueError(f"environment variable {env} (named by {what}_env) is not set")
    secret = secret_of(value, env)
    if secret is None:
        if required:
            raise ValueError(f"{what} or {what}_env is required")
        return
    if len(secret) < MIN_KEY_CHARS:
        raise ValueError(f"{what} must have at least {MIN_KEY_CHARS} characters")


class ApiKeySpec(Frozen):
    """One API key, and the tenant whose KV its requests read and write."""

    key: SecretStr | None = None
    key_env: str | None = Field(None, min_length=1)
    tenant: str = Field("default", pattern=TENANT_PATTERN)

    @model_validator(mode="after")
    def _one_secret(self) -> ApiKeySpec:
        check_secret(self.key, self.key_env, what="key", required=True)
        return self

    @property
    def secret(self) -> str:
        return secret_of(self.key, self.key_env) or ""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


class ServerSpec(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # Seconds a shutdown waits for running requests before cutting them off.
    drain_timeout_s: float = Field(10.0, ge=0)
    # The admin API and the dashboard need this key when it is set (never shown or logged).
    admin_key: SecretStr | None = None
    admin_key_env: str | None = Field(None, min_length=1)
    # With keys, every API request needs one; each key's tenant scopes its KV cache.
    api_keys: tuple[ApiKeySpec, ...] = ()
    # A non-loopback host without keys is refused unless this says so explicitly.
    allow_unauthenticated: bool = False
    # GPUs only: the most memory MLX may allocate, in GiB. None: 85% of the device's
    # memory (MLX CUDA's managed memory can hang the card when oversubscribed).
    mlx_memory_limit_gb: float | None = Field(None, gt=0)


    @model_validator(mode="after")
    def _keys(self) -> ServerSpec:
        check_secret(self.admin_key, self.admin_key_env, what="admin_key", required=False)
        secrets = [k.secret for k in self.api_keys] + ([self.admin_secret] if self.admin_secret else [])
        if len(set(secrets)) != len(secrets):
            raise ValueError("every key (api_keys and admin_key) must be different")
        if not is_loopback(self.host) and not self.allow_unauthenticated and not (self.api_keys and self.admin_secret):
            raise PydanticCustomError(
                "unauthenticated",
                "binding {host}, which is not a loopback address, needs api_keys and an admin_key "
                "(or allow_unauthenticated = true, to serve anyone who can reach the port)",
                {"host": self.host, "path": "server.host"})
        return self

    @property
    def admin_secret(self) -> str | None:
        return secret_of(self.admin_key, self.admin_key_env)

    @property
    def admin_headers(self) -> dict[str, str]:
        """The headers a local client (omlx cache, diff, status) sends to the admin API."""
        return {"Authorization": f"Bearer {self.admin_secret}"} if self.admin_secret else {}

    @property
    def open_to_the_network(self) -> bool:
        """True when a non-loopback bind serves without keys (allow_unauthenticated)."""
        return not is_loopback(self.host) and not (self.api_keys and self.admin_secret)


class LimitsSpec(Frozen):
    """Per-request and per-key limits; a request over one gets a 4xx in its API's shape."""

    max_body_bytes: int = Field(32 * MIB, ge=1024)  # agents send 50-500 KB; 32 MiB is ~8M tokens of text
    max_prompt_tokens: int | None = Field(None, ge=1)  # None: the model's context is the limit
    max_tokens: int = Field(65_536, ge=1)  # the most a request may ask for (clamped later to the room left)
    max_concurrent_per_key: int = Field(64, ge=1)  # in flight at once per key (or for all, without keys)
    max_queued_per_key: int = Field(256, ge=0)  # waiting for one of those beyond that: then 429


class ModelSpec(Frozen):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    source: str = Field(min_length=1)
    default: bool = False
    # "auto": float32 on CPU (fastest there with OpenBLAS), the checkpoint's own dtype on GPUs.
    dtype: DType = "auto"
    # None: the model's own limit (max_position_embeddings).
    max_context_tokens: int | None = Field(None, ge=16)
    # True: max_context_tokens may exceed the trained length (positions the model never
    # saw in training: quality may drop). Needed to serve agents' long prompts on small models.
    allow_beyond_trained_context: bool = False
    # Default for requests that name no max_tokens.
    default_max_tokens: int = Field(512, ge=1)
    # Default for requests that name no temperature (Codex sends none); None: the APIs' 1.0.
    default_temperature: float | None = Field(None, ge=0, le=2)
    # One matmul for each layer's q/k/v projections and one for gate/up (models/fuse.py):
    # less host work per decode pass. "auto": on CUDA, where a decode pass is host-bound.
    fuse_projections: Literal["auto", "on", "off"] = "auto"
    # Each Llama block's decode calls as two compiled functions (models/compiled_blocks.py):
    # less host work per decode pass. "auto": on CUDA. Off until measured over HTTP.
    compile_blocks: Literal["auto", "on", "off"] = "off"

    @model_validator(mode="after")
    def _beyond_needs_a_limit(self) -> ModelSpec:
        if self.allow_beyond_trained_context and self.max_context_tokens is None:
            raise ValueError("allow_beyond_trained_context = true needs max_context_tokens (how far beyond)")
        return self


class CacheSpec(Frozen):
    dir: str = "~/.omlx/cache"
    block_tokens: int = Field(256, ge=16, le=8192)
    memory_gb: float = Field(2.0, ge=0)
    host_gb: float = Field(4.0, ge=0)
    ssd_gb: float = Field(50.0, ge=0)
    # KV precision per tier: 16 keeps it as computed; 8 or 4 quantize it group-wise on its
    # way down (~1/2 or ~1/4 the bytes of 16-bit KV). bench/kv_quality.py measures the cost.
    host_kv_bits: KVBits = 16
    ssd_kv_bits: KVBits = 16

    @model_validator(mode="after")
    def _slower_tier_no_finer(self) -> CacheSpec:
        if self.ssd_kv_bits > self.host_kv_bits:
            raise PydanticCustomError(
                "kv_bits", "cache.ssd_kv_bits ({ssd}) may not be above cache.host_kv_bits ({host}): "
                "a block goes down to the SSD from the host tier", {"ssd": self.ssd_kv_bits, "host": self.host_kv_bits})
        return self

    def path(self, base_dir: Path) -> Path:
        """Returns the cache directory; a relative `dir` is relative to the config file."""
        return (base_dir / Path(self.dir).expanduser()).resolve()

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * GIB)

    @property
    def host_bytes(self) -> int:
        return int(self.host_gb * GIB)

    @property
    def ssd_bytes(self) -> int:
        return int(self.ssd_gb * GIB)


class BatchingSpec(Frozen):
    max_running: int = Field(8, ge=1, le=1024)
    max_queued: int = Field(64, ge=0, le=100_000)
    prefill_chunk_tokens: int = Field(512, ge=16, le=65536)
    prefill_step_ms: int = Field(250, ge=0, le=600_000)  # 0: chunks sized by tokens only
    # A one-layer stand-in of each model warms up its shapes while the model loads
    # (engine/stand_in.py); "auto": on CUDA, where kernels compile per shape.
    warm_up_beside_load: Literal["auto", "on", "off"] = "auto"
    # Short prefill calls (chat-sized prompts started together) may run attention composed
    # of plain MLX ops instead of the fused kernel, which on CUDA builds a cuDNN graph per
    # shape (engine/attention.py). On an H200 that made starts faster and decode slower.
    short_attention: Literal["fused", "composed"] = "fused"
    # An idle engine, woken by a request, waits until none has arrived for this long (at
    # most GATHER_ROUNDS times as long) before it starts them: requests sent together
    # (agents' parallel calls, a batch of clients) then start in one prefill call.
    gather_ms: float = Field(0.0, ge=0, le=1000)
    # Once ready, an idle engine runs short requests' call shapes, so that the first ones
    # build no attention graph (engine/warm_up.py, `idle_shapes`); a request arriving
    # meanwhile waits for the shape under way. "auto": on CUDA, where cuDNN builds them.
    idle_shapes: Literal["auto", "on", "off"] = "auto"

    @property
    def prefill_step_s(self) -> float | None:
        return self.prefill_step_ms / 1000 if self.prefill_step_ms else None


class KernelsSpec(Frozen):
    """One key per kernel of appliance/kernels/registry.py: `native` (CUDA/Metal),
    `generic` (plain MLX) or `auto` (native where the backend has it)."""

    kv_quantize: KernelChoice = "auto"
    kv_dequantize: KernelChoice = "auto"
    small_matmul: KernelChoice = "auto"

    @model_validator(mode="after")
    def _native_exists(self) -> KernelsSpec:
        from appliance.kernels.registry import refusal

        for name, asked in self.model_dump().items():
            if (why := refusal(name, asked)) is not None:
                raise PydanticCustomError("kernel", "kernels.{name} = native: {why}", {"name": name, "why": why})
        return self


class Spec(BaseSettings):
    """The whole appliance, as declared. Build it with `appliance.config.load_spec`."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix="OMLX_",
        env_nested_delimiter="__",
        nested_model_default_partial_update=True,
    )

    profile: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    server: ServerSpec = ServerSpec()
    models: tuple[ModelSpec, ...]
    cache: CacheSpec = CacheSpec()
    batching: BatchingSpec = BatchingSpec()
    limits: LimitsSpec = LimitsSpec()
    kernels: KernelsSpec = KernelsSpec()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, **_):
        # OMLX_<SECTION>__<KEY> wins over the file, which wins over its profile.
        return (env_settings, init_settings)

    @field_validator("models")
    @classmethod
    def _unique_names(cls, models: tuple[ModelSpec, ...]) -> tuple[ModelSpec, ...]:
        # Not Field(min_length=1): pydantic counts only the valid items, so one bad model
        # would also be reported as "models: should have at least 1 item, not 0".
        if not models:
            raise ValueError("at least one [[models]] table is required")
        names = [m.name for m in models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"model names must be unique; repeated: {', '.join(dupes)}")
        return models

    @model_validator(mode="after")
    def _one_default(self) -> Spec:
        defaults = [m.name for m in self.models if m.default]
        if len(self.models) > 1 and len(defaults) != 1:
            found = ", ".join(defaults) if defaults else "none"
            # A model-level error has no location of its own; ctx["path"] names it for TOML.
            raise PydanticCustomError(
                "one_default",
                "exactly one model must have default = true when there are several (found: {found})",
                {"found": found, "path": "models"},
            )
        return self

    @property
    def default_model(self) -> ModelSpec:
        return next((m for m in self.models if m.default), self.models[0])

    def model(self, name: str) -> ModelSpec | None:
        return next((m for m in self.models if m.name == name), None)

    def to_data(self) -> dict:
        """Returns the spec as plain TOML/JSON-ready data (None values dropped)."""
        return self.model_dump(mode="json", exclude_none=True)

    @property
    def hash(self) -> str:
        """Returns a digest of the spec; keys count by their own digest (the dump masks them)."""
        server = self.server
        secrets = [server.admin_secret or "", *(k.secret for k in server.api_keys)]
        data = orjson.dumps([self.to_data(), hashlib.sha256("\0".join(secrets).encode()).hexdigest()],
                            option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(data).hexdigest()[:16]
