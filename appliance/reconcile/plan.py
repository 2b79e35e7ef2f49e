"""The plan: what must change to turn the applied spec into the desired one. Pure data.

Only what changed gets an action: a model is reloaded only when its own section changed
(the `default` flag aside), a budget change never touches a model, an unchanged spec
plans nothing at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.spec import BatchingSpec, CacheSpec, KernelsSpec, ModelSpec, Spec


@dataclass(frozen=True)
class ResizeCache:
    cache: CacheSpec

    def describe(self) -> str:
        c = self.cache
        return f"resize cache tiers: memory {c.memory_gb} GB, host {c.host_gb} GB, ssd {c.ssd_gb} GB"


@dataclass(frozen=True)
class ReopenCache:
    """The cache moved (`dir`) or changed its block size: a new store, new key spaces."""

    cache: CacheSpec

    def describe(self) -> str:
        return f"reopen the cache at {self.cache.dir} with {self.cache.block_tokens}-token blocks"


@dataclass(frozen=True)
class SetBatching:
    batching: BatchingSpec

    def describe(self) -> str:
        b = self.batching
        return (f"set batching limits: max_running {b.max_running}, max_queued {b.max_queued}, "
                f"prefill_chunk_tokens {b.prefill_chunk_tokens}, prefill_step_ms {b.prefill_step_ms}")


@dataclass(frozen=True)
class SelectKernels:
    kernels: KernelsSpec

    def describe(self) -> str:
        return "select kernels: " + ", ".join(f"{k}={v}" for k, v in self.kernels.model_dump().items())


@dataclass(frozen=True)
class UnloadModel:
    name: str

    def describe(self) -> str:
        return f"unload model {self.name}"


@dataclass(frozen=True)
class LoadModel:
    spec: ModelSpec
    replaces: bool = False  # a changed model: load the new one beside the old, then swap

    def describe(self) -> str:
        verb = "reload" if self.replaces else "load"
        return f"{verb} model {self.spec.name} from {self.spec.source}"


@dataclass(frozen=True)
class Rebind:
    host: str
    port: int

    def describe(self) -> str:
        return f"rebind the server to {self.host}:{self.port}"


Action = ResizeCache | ReopenCache | SetBatching | SelectKernels | UnloadModel | LoadModel | Rebind


def plan(applied: Spec, desired: Spec) -> tuple[Action, ...]:
    """Returns the ordered actions that turn `applied` into `desired` (empty when equal).

    Cheap, reversible steps come first, then unloads and loads (an unloaded model stops
    only at commit, so a failed apply can put it back), and the socket is rebound last,
    once everything else has worked.
    """
    actions: list[Action] = []
    old_cache, new_cache = applied.cache, desired.cache
    if (old_cache.dir, old_cache.block_tokens) != (new_cache.dir, new_cache.block_tokens):
        actions.append(ReopenCache(new_cache))
    elif old_cache != new_cache:
        actions.append(ResizeCache(new_cache))
    if applied.batching != desired.batching:
        actions.append(SetBatching(desired.batching))
    if applied.kernels != desired.kernels:
        actions.append(SelectKernels(desired.kernels))
    old_models = {m.name: m for m in applied.models}
    new_models = {m.name: m for m in desired.models}
    actions += [UnloadModel(name) for name in old_models if name not in new_models]
    for name, spec in new_models.items():
        old = old_models.get(name)
        if old is None:
            actions.append(LoadModel(spec))
        elif _loading_fields(old) != _loading_fields(spec):
            actions.append(LoadModel(spec, replaces=True))
    if (applied.server.host, applied.server.port) != (desired.server.host, desired.server.port):
        actions.append(Rebind(desired.server.host, desired.server.port))
    return tuple(actions)


def _loading_fields(spec: ModelSpec) -> dict:
    """Returns what a loaded model depends on: its section, less the `default` flag."""
    return spec.model_dump(exclude={"default"})
