"""The plan: what must change to turn the applied spec into the desired one. Pure data.

Only what changed gets an action: a model is reloaded only when its own section changed
(the `default` flag aside), a budget change never touches a model, an unchanged spec
plans nothing at all.
"""

from __future__ import annotations

from appliance.reconcile.actions import (
    Action,
    LoadModel,
    Rebind,
    ReopenCache,
    ResizeCache,
    SelectKernels,
    SetBatching,
    UnloadModel,
)
from appliance.spec import CacheSpec, ModelSpec, Spec


def reopens(cache: CacheSpec) -> tuple:
    """Returns what, changed, needs new key spaces (ReopenCache), not only new budgets."""
    return cache.dir, cache.block_tokens, cache.host_kv_bits, cache.ssd_kv_bits


def plan(applied: Spec, desired: Spec) -> tuple[Action, ...]:
    """Returns the ordered actions that turn `applied` into `desired` (empty when equal).

    Cheap, reversible steps come first, then unloads and loads (an unloaded model stops
    only at commit, so a failed apply can put it back), and the socket is rebound last,
    once everything else has worked.
    """
    actions: list[Action] = []
    old_cache, new_cache = applied.cache, desired.cache
    if reopens(old_cache) != reopens(new_cache):
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
