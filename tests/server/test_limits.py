"""Per-key admission and per-request limits."""

from __future__ import annotations

import asyncio

import pytest

from appliance.server.errors import ApiError
from appliance.server.limits import REQUEST_LIMITS, KeyGate, Refused, check_tokens, default_tokens
from appliance.spec import LimitsSpec

LIMITS = LimitsSpec(max_concurrent_per_key=2, max_queued_per_key=1)


def test_a_key_runs_its_limit_queues_the_next_and_refuses_beyond():
    async def main():
        gate = KeyGate()
        await gate.acquire("k", LIMITS)
        await gate.acquire("k", LIMITS)
        waiter = asyncio.create_task(gate.acquire("k", LIMITS))
        await asyncio.sleep(0)
        assert gate.in_flight("k") == (2, 1)
        with pytest.raises(Refused, match="max_queued_per_key 1"):
            await gate.acquire("k", LIMITS)
        await gate.acquire("other key", LIMITS)  # keys do not share
        gate.release("k")  # hands its slot to the waiter
        await asyncio.wait_for(waiter, 1)
        assert gate.in_flight("k") == (2, 0)
        gate.release("k")
        gate.release("k")
        assert gate.in_flight("k") == (0, 0)

    asyncio.run(main())


def test_a_waiter_that_gives_up_leaves_the_queue():
    async def main():
        gate = KeyGate()
        one = LimitsSpec(max_concurrent_per_key=1, max_queued_per_key=1)
        await gate.acquire("k", one)
        waiter = asyncio.create_task(gate.acquire("k", one))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.in_flight("k") == (1, 0)
        gate.release("k")  # nobody is waiting any more: the slot is free
        assert gate.in_flight("k") == (0, 0)
        await asyncio.wait_for(gate.acquire("k", one), 1)
        assert gate.in_flight("k") == (1, 0)

    asyncio.run(main())


def test_a_request_naming_no_max_tokens_gets_the_default_within_the_limit():
    token = REQUEST_LIMITS.set(LimitsSpec(max_tokens=50))
    try:
        assert default_tokens(512) == 50 and default_tokens(20) == 20
    finally:
        REQUEST_LIMITS.reset(token)


def test_token_limits_name_their_key():
    token = REQUEST_LIMITS.set(LimitsSpec(max_prompt_tokens=100, max_tokens=50))
    try:
        check_tokens(prompt_tokens=100, max_tokens=50, param="messages")
        with pytest.raises(ApiError, match=r"prompt is too long: 101 tokens > 100 maximum") as e:
            check_tokens(prompt_tokens=101, max_tokens=None, param="messages")
        assert (e.value.status, e.value.param) == (400, "messages")
        with pytest.raises(ApiError, match=r"limits.max_tokens") as e:
            check_tokens(prompt_tokens=10, max_tokens=51, param="messages")
        assert e.value.param == "max_tokens"
    finally:
        REQUEST_LIMITS.reset(token)
