"""Property-based fuzzing of every endpoint in /openapi.json against a real server: no 5xx,
no hang. Bounded for CI: a few examples per operation, tiny generation limits."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from appliance.server.openapi import schema as openapi_schema
from tests.conftest import Server, served

pytestmark = pytest.mark.slow

# The cache's clear, export and import write or delete files on the server's machine at
# paths the fuzzer would make up; they are tested with real paths in test_cache_api.py.
SCHEMA = schemathesis.openapi.from_dict(openapi_schema()).exclude(path_regex="^/admin/api/cache/")
LIMITS = """
[limits]
max_prompt_tokens = 96
max_tokens = 4
max_body_bytes = 65536
"""


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory):
    with served(tmp_path_factory, "fuzzed", extra=LIMITS) as srv:
        yield srv
    assert srv.stop() == 0  # stopped already: its exit status
    assert "Traceback" not in srv.output()


def test_the_schema_is_served(fuzzed: Server):
    served = httpx.get(f"{fuzzed.url}/openapi.json").json()
    assert served == openapi_schema()
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/health"} <= set(served["paths"])


def test_requests_naming_no_max_tokens_stay_within_the_limit(fuzzed: Server):
    messages = [{"role": "user", "content": "Write a long story about a dragon."}]
    chat = httpx.post(f"{fuzzed.url}/v1/chat/completions", json={"messages": messages}, timeout=120).json()
    assert chat["usage"]["completion_tokens"] <= 4
    anthropic = httpx.post(f"{fuzzed.url}/v1/messages", json={"messages": messages}, timeout=120).json()
    assert anthropic["usage"]["output_tokens"] <= 4


@SCHEMA.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_request_gets_a_5xx_or_hangs(case, fuzzed: Server):
    response = case.call(base_url=fuzzed.url, timeout=120)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text[:500]}"
