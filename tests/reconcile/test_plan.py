"""appliance/reconcile/plan.py: only what changed gets an action, in a safe order."""

from __future__ import annotations

import os

import pytest

from appliance.reconcile.actions import (
    LoadModel,
    Rebind,
    ReopenCache,
    ResizeCache,
    SelectKernels,
    SetBatching,
    UnloadModel,
)
from appliance.reconcile.plan import plan
from appliance.spec import Spec

A = {"name": "a", "source": "a.gguf", "default": True}
B = {"name": "b", "source": "b.gguf"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Spec reads OMLX_* variables; none of the machine's may leak into these specs."""
    for key in list(os.environ):
        if key.upper().startswith("OMLX_"):
            monkeypatch.delenv(key)


def spec(*models: dict, **sections) -> Spec:
    return Spec(models=list(models or [A, B]), **sections)


def kinds(actions) -> list[type]:
    return [type(a) for a in actions]


def test_unchanged_spec_plans_nothing():
    assert plan(spec(), spec()) == ()


def test_budget_change_only_resizes_the_cache():
    desired = spec(cache={"memory_gb": 8.0, "host_gb": 1.0, "ssd_gb": 300.0})
    actions = plan(spec(), desired)
    assert actions == (ResizeCache(desired.cache),)


@pytest.mark.parametrize("change", [{"dir": "/elsewhere"}, {"block_tokens": 128}])
def test_cache_dir_or_block_size_reopens_the_cache(change):
    desired = spec(cache={**change, "memory_gb": 8.0})
    # A reopen carries the whole new section, budgets included: no separate resize.
    assert plan(spec(), desired) == (ReopenCache(desired.cache),)


def test_batching_change_sets_batching():
    desired = spec(batching={"max_running": 2, "prefill_chunk_tokens": 1024})
    assert plan(spec(), desired) == (SetBatching(desired.batching),)


def test_kernels_change_selects_kernels():
    desired = spec(kernels={"kv_quantize": "generic"})
    assert plan(spec(), desired) == (SelectKernels(desired.kernels),)


def test_removed_model_is_unloaded():
    assert plan(spec(), spec({**A})) == (UnloadModel("b"),)


def test_added_model_is_loaded_fresh():
    desired = spec(A, B, {"name": "c", "source": "c.gguf"})
    assert plan(spec(), desired) == (LoadModel(desired.model("c"), replaces=False),)


@pytest.mark.parametrize("change", [{"source": "b2.gguf"}, {"dtype": "float16"},
                                    {"max_context_tokens": 4096}])
def test_changed_model_is_replaced_alone(change):
    desired = spec(A, {**B, **change})
    actions = plan(spec(), desired)
    assert actions == (LoadModel(desired.model("b"), replaces=True),)
    assert all(getattr(a, "name", None) != "a" for a in actions)


def test_moving_default_plans_no_model_action():
    desired = spec({**A, "default": False}, {**B, "default": True})
    assert desired.default_model.name == "b"
    assert plan(spec(), desired) == ()


def test_host_or_port_change_rebinds_last():
    desired = spec(server={"port": 9001}, batching={"max_running": 2}, cache={"ssd_gb": 10.0})
    actions = plan(spec(), desired)
    assert actions[-1] == Rebind("127.0.0.1", 9001)
    assert plan(spec(), spec(server={"host": "127.0.0.2"})) == (Rebind("127.0.0.2", 8000),)


def test_drain_timeout_alone_plans_nothing_to_rebind():
    assert Rebind not in kinds(plan(spec(), spec(server={"drain_timeout_s": 60.0})))


def test_everything_changed_is_ordered_safely():
    applied = spec(A, B)
    desired = spec({**A, "dtype": "float16"}, {"name": "c", "source": "c.gguf"},
                   cache={"dir": "/elsewhere"}, batching={"max_queued": 4},
                   kernels={"kv_dequantize": "generic"}, server={"port": 9001})
    assert kinds(plan(applied, desired)) == [ReopenCache, SetBatching, SelectKernels, UnloadModel,
                                             LoadModel, LoadModel, Rebind]
    resized = spec({**A, "dtype": "float16"}, B, cache={"memory_gb": 9.0}, batching={"max_queued": 4})
    assert kinds(plan(applied, resized)) == [ResizeCache, SetBatching, LoadModel]


def test_unloads_come_before_loads():
    applied = spec({**A}, {**B}, {"name": "c", "source": "c.gguf"})
    desired = spec({**A, "source": "a2.gguf"}, {"name": "d", "source": "d.gguf"})
    actions = plan(applied, desired)
    last_unload = max(i for i, a in enumerate(actions) if isinstance(a, UnloadModel))
    first_load = min(i for i, a in enumerate(actions) if isinstance(a, LoadModel))
    assert last_unload < first_load
    assert {a.name for a in actions if isinstance(a, UnloadModel)} == {"b", "c"}
    assert {(a.spec.name, a.replaces) for a in actions if isinstance(a, LoadModel)} == {
        ("a", True), ("d", False)}



def test_a_tiers_precision_change_reopens_the_cache():
    desired = spec(cache={"ssd_kv_bits": 8})
    assert kinds(plan(spec(), desired)) == [ReopenCache]
