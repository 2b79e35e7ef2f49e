"""Who may call what: keys compared for every route kind, tenants from keys."""

from __future__ import annotations

import pytest
from starlette.datastructures import Headers

from appliance.server.auth import ANONYMOUS, identify, presented_key, refusal, route_kind, tenant_of
from appliance.spec import ServerSpec

KEY_A, KEY_B, ADMIN = "a" * 24, "b" * 24, "admin-key-0123456789"
KEYED = ServerSpec(admin_key=ADMIN, api_keys=[{"key": KEY_A, "tenant": "team-a"}, {"key": KEY_B, "tenant": "team-b"}])
OPEN = ServerSpec()


@pytest.mark.parametrize("path, kind", [
    ("/v1/chat/completions", "api"), ("/chat/completions", "api"), ("/v1/messages", "api"),
    ("/messages/count_tokens", "api"), ("/v1/v1/messages", "api"), ("/responses", "api"), ("/models", "api"),
    ("/admin/api/status", "admin"), ("/metrics", "admin"),
    ("/health", "public"), ("/openapi.json", "public"), ("/", "public"), ("/nowhere", "public"),
])
def test_route_kinds(path, kind):
    assert route_kind(path) == kind


def test_keys_are_read_from_bearer_or_x_api_key():
    assert presented_key(Headers({"authorization": f"Bearer {KEY_A}"})) == KEY_A
    assert presented_key(Headers({"x-api-key": KEY_B})) == KEY_B
    assert presented_key(Headers({"authorization": "Basic xyz"})) is None
    assert presented_key(Headers({})) is None


def test_each_key_has_its_tenant_and_only_the_admin_key_is_admin():
    a, b, admin = identify(KEYED, KEY_A), identify(KEYED, KEY_B), identify(KEYED, ADMIN)
    assert (tenant_of(a), tenant_of(b), tenant_of(admin)) == ("team-a", "team-b", "default")
    assert not a.admin and not b.admin and admin.admin
    assert identify(KEYED, "c" * 24) is None
    assert identify(KEYED, None) is ANONYMOUS


def test_with_keys_every_api_and_admin_route_needs_the_right_key():
    a = identify(KEYED, KEY_A)
    assert refusal("api", a, KEYED) is None
    assert refusal("api", identify(KEYED, ADMIN), KEYED) is None
    assert refusal("api", None, KEYED) == "invalid API key"
    assert "required" in refusal("api", ANONYMOUS, KEYED)
    assert "admin key" in refusal("admin", a, KEYED)
    assert "admin key" in refusal("admin", ANONYMOUS, KEYED)
    assert refusal("admin", identify(KEYED, ADMIN), KEYED) is None
    assert refusal("public", None, KEYED) is None


def test_without_keys_anyone_on_loopback_may_call_even_with_a_placeholder_key():
    stray = identify(OPEN, "unused")
    assert stray is None and tenant_of(stray) == "default"
    assert refusal("api", stray, OPEN) is None
    assert refusal("admin", stray, OPEN) is None
    assert refusal("admin", ANONYMOUS, OPEN) is None
