"""appliance/reconcile/actions.py: every action says what it does and where in the TOML."""

from __future__ import annotations

import pytest

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
from appliance.reconcile.plan import plan
from appliance.spec import Spec

A = {"name": "a", "source": "a.gguf", "default": True}
B = {"name": "b", "source": "b.gguf"}
C = {"name": "c", "source": "c.gguf"}


def every_kind() -> tuple[Spec, tuple[Action, ...]]:
    """Returns a desired spec and actions of every kind (two plans: resize and reopen exclude
    each other)."""
    applied = Spec(models=[A, B])
    desired = Spec(models=[{**A, "source": "a2.gguf"}, C], cache={"block_tokens": 64},
                   batching={"max_running": 1}, kernels={"kv_quantize": "generic"}, server={"port": 9001})
    resized = Spec(models=[A, B], cache={"ssd_gb": 1.0})
    actions = plan(applied, desired) + plan(applied, resized)
    assert {type(a) for a in actions} == {ResizeCache, ReopenCache, SetBatching, SelectKernels,
                                          UnloadModel, LoadModel, Rebind}
    return desired, actions


def test_every_action_describes_itself():
    for action in every_kind()[1]:
        text = action.describe()
        assert isinstance(text, str) and text.strip(), action


@pytest.mark.parametrize("kind, path", [
    (ResizeCache, "cache"), (ReopenCache, "cache"), (SetBatching, "batching"),
    (SelectKernels, "kernels"), (UnloadModel, "models"), (Rebind, "server.port")])
def test_each_action_names_its_section(kind, path):
    desired, actions = every_kind()
    (action,) = [a for a in actions if type(a) is kind]
    assert action.path_in(desired) == path


def test_a_load_names_its_own_model_source():
    desired, actions = every_kind()
    paths = {a.spec.name: a.path_in(desired) for a in actions if isinstance(a, LoadModel)}
    assert paths == {"a": "models[0].source", "c": "models[1].source"}


def test_actions_are_plain_comparable_data():
    first, second = every_kind()[1], every_kind()[1]
    assert first == second and len({*first}) == len(first)  # frozen: equal and hashable
    assert LoadModel(Spec(models=[C]).model("c")) == LoadModel(Spec(models=[C]).model("c"), replaces=False)
