"""Limits per request and per key, each a `[limits]` key: a request over one gets a 4xx."""

from __future__ import annotations

import asyncio
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field

from appliance.server.errors import ApiError
from appliance.spec import LimitsSpec

# The applied [limits] for the request being served, set by the Guard middleware.
REQUEST_LIMITS: ContextVar[LimitsSpec] = ContextVar("omlx_request_limits", default=LimitsSpec())  # noqa: B039 (frozen)


class Refused(Exception):
    """The key has `max_concurrent_per_key` in flight and `max_queued_per_key` waiting."""


@dataclass
class _Key:
    running: int = 0
    waiting: deque[asyncio.Future] = field(default_factory=deque)


class KeyGate:
    """Lets each key have `max_concurrent_per_key` requests in flight; up to
    `max_queued_per_key` more wait, oldest first; beyond that they are refused. The
    limits are read at each admission, so a live change applies to the next request."""

    def __init__(self) -> None:
        self._keys: dict[str, _Key] = {}

    def in_flight(self, name: str) -> tuple[int, int]:
        """Returns (running, waiting) for a key."""
        k = self._keys.get(name)
        return (k.running, len(k.waiting)) if k else (0, 0)

    async def acquire(self, name: str, limits: LimitsSpec) -> None:
        """Returns once the key may run one more request; raises Refused."""
        k = self._keys.setdefault(name, _Key())
        if k.running < limits.max_concurrent_per_key and not k.waiting:
            k.running += 1
            return
        if len(k.waiting) >= limits.max_queued_per_key:
            raise Refused(f"too many requests for this key: {k.running} running and {len(k.waiting)} "
                          f"waiting (limits.max_concurrent_per_key {limits.max_concurrent_per_key}, "
                          f"max_queued_per_key {limits.max_queued_per_key})")
        turn = asyncio.get_running_loop().create_future()
        k.waiting.append(turn)
        try:
            await turn  # release() hands its slot over: `running` stays counted
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(name)  # granted, then cancelled: pass the slot on
            elif turn in k.waiting:
                k.waiting.remove(turn)
            raise

    def release(self, name: str) -> None:
        k = self._keys[name]
        while k.waiting:
            turn = k.waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        k.running -= 1
        if not k.running:
            del self._keys[name]


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than this server accepts ({limit} bytes: "
                         "limits.max_body_bytes)", code="request_too_large")


def default_tokens(default: int) -> int:
    """Returns the tokens a request that names no max_tokens gets: `default`, within the
    server's limits.max_tokens (a limit binds requests that leave it unsaid too)."""
    return min(default, REQUEST_LIMITS.get().max_tokens)


def check_tokens(*, prompt_tokens: int, max_tokens: int | None, param: str) -> None:
    """Raises a 400 when a prompt or a requested `max_tokens` is over the server's limits
    (`param`: where the prompt came from, e.g. `messages`)."""
    limits = REQUEST_LIMITS.get()
    if limits.max_prompt_tokens is not None and prompt_tokens > limits.max_prompt_tokens:
        raise ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {limits.max_prompt_tokens} "
                            "maximum (limits.max_prompt_tokens)", param=param, code="context_length_exceeded")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise ApiError(400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens} "
                            "(limits.max_tokens)", param="max_tokens", code="invalid_value")
