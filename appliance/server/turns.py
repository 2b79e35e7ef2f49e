"""A chat turn on the engine, for the APIs built on `Turn` (Anthropic Messages, OpenAI
Responses): prepared, checked against the context, submitted, and its output read as the
parser's events.

Each API keeps only its wire shapes: it converts its body into a `Turn`, calls
`submit_turn`, and maps the `TurnRun`'s events and stop reason to its own names.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from appliance.cache.model_cache import request_tenant
from appliance.chat.prepare import OutputParser, Prepared, PrepareError, prepare
from appliance.chat.turn import Event, ToolCallStart, Turn
from appliance.engine.engine import Engine, RequestHandle
from appliance.engine.request import Delta, Finished, GenerationRequest, RequestStats, SamplingParams
from appliance.models.loaded import LoadedModel
from appliance.server.errors import ApiError, bad_request
from appliance.server.limits import check_tokens, default_tokens
from appliance.server.openai import ENDED_BY_SERVER, cancel_on_disconnect, ended_by_server


class PromptTooLong(Exception):
    """The prompt leaves no room for one output token; each API words it its own way."""

    def __init__(self, prompt_tokens: int, context_tokens: int):
        super().__init__(f"prompt is too long: {prompt_tokens} tokens, context {context_tokens}")
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens

    @property
    def max_prompt_tokens(self) -> int:
        return self.context_tokens - 1


def prepare_turn(loaded: LoadedModel, turn: Turn, *, tenant: str) -> Prepared:
    """Returns the prepared turn for a request of KV tenant `tenant`; a template that
    rejects the conversation is a 400."""
    try:
        return prepare(loaded, turn, tenant=tenant)
    except PrepareError as e:
        raise bad_request(str(e), param=e.param) from None
    except Exception as e:  # roles, order, or content the template refuses
        raise bad_request(f"the chat template rejected these messages: {e}", param="messages") from None


def submit_turn(engine: Engine, turn: Turn, *, max_tokens: int | None, sampling: SamplingParams,
                stop: tuple[str, ...] = (), cache_salt: str | None = None,
                fill_context: bool = False) -> TurnRun:
    """Returns the running turn. `max_tokens` above the room the context leaves is clamped;
    None means the model's default_max_tokens, or all the room left with `fill_context`.
    Raises PromptTooLong when no room is left."""
    loaded = engine.loaded
    tenant = request_tenant(cache_salt)
    prepared = prepare_turn(loaded, turn, tenant=tenant)
    prompt = prepared.prompt_tokens
    if not prompt:
        raise bad_request("the prompt is empty", param="messages")
    check_tokens(prompt_tokens=len(prompt), max_tokens=max_tokens, param="messages")
    if len(prompt) >= loaded.context_tokens:
        raise PromptTooLong(len(prompt), loaded.context_tokens)
    room = loaded.context_tokens - len(prompt)
    default = default_tokens(room if fill_context else loaded.spec.default_max_tokens)
    request = GenerationRequest(
        prompt_tokens=tuple(prompt),
        max_tokens=min(max_tokens or default, room),
        sampling=sampling,
        stop=tuple(s for s in stop if s),
        tenant=tenant,
        constraint=prepared.constraint,
    )
    return TurnRun(loaded=loaded, request=request, handle=engine.submit(request), parser=prepared.parser())


# A silent stream looks at its request this often, and says something at least this often.
HEARTBEAT_S = 0.25
KEEPALIVE_S = 10.0


async def with_heartbeat(events: AsyncIterator[Event], every_s: float) -> AsyncIterator[Event | None]:
    """Yields the events, and None each time `every_s` passes without one: a long prefill
    sends nothing for minutes, and clients and proxies drop streams that stay silent."""
    it = aiter(events)
    pending = asyncio.ensure_future(anext(it))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield None
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                return
            yield event
            pending = asyncio.ensure_future(anext(it))
    finally:
        # Cancelling the pending step closes the events generator (which cancels the turn).
        pending.cancel()
        with contextlib.suppress(BaseException):
            await pending
        await it.aclose()


@dataclass
class TurnRun:
    """One submitted turn: iterate `events()`; afterwards `finished` and `stop_reason` say how it ended."""

    loaded: LoadedModel
    request: GenerationRequest
    handle: RequestHandle
    parser: OutputParser
    token_ids: list[int] = field(default_factory=list)
    finished: Finished | None = None
    num_tool_calls: int = 0

    @property
    def stats(self) -> RequestStats:
        return self.handle.stats

    @property
    def failed(self) -> ApiError | None:
        """The error to report when the server, not the model, ended the turn."""
        if self.finished is not None and self.finished.reason in ENDED_BY_SERVER:
            return ended_by_server(self.finished)
        return None

    async def events(self) -> AsyncIterator[Event]:
        """Yields the answer's events in order; closing the iterator (client gone) cancels the turn."""
        try:
            async for item in self.handle:
                if isinstance(item, Delta):
                    self.token_ids.extend(item.token_ids)
                    events = self.parser.feed(item.text) if item.text else []
                else:
                    self.finished = item
                    events = [] if item.reason in ENDED_BY_SERVER else self.parser.close()
                for event in events:
                    if isinstance(event, ToolCallStart):
                        self.num_tool_calls += 1
                    yield event
        finally:
            self.handle.cancel()

    async def collect(self, request) -> list[Event]:
        """Returns every event of the answer, cancelling the turn if the client leaves."""
        watcher = asyncio.create_task(cancel_on_disconnect(request, self.handle))
        try:
            return [event async for event in self.events()]
        finally:
            watcher.cancel()

    @property
    def stop_reason(self) -> str:
        """Returns "length", "tool_calls", "stop_sequence" or "stop" (the model ended its turn)."""
        assert self.finished is not None
        if self.finished.reason == "length":
            return "length"
        if self.num_tool_calls:
            return "tool_calls"
        return "stop_sequence" if self.stop_sequence is not None else "stop"

    @property
    def stop_sequence(self) -> str | None:
        """Returns the stop string that ended the answer, if one did."""
        if self.finished is None or self.finished.reason != "stop" or not self.request.stop:
            return None
        # EOS and stop token ids end on their own token, which is never text; a stop string
        # ends on an ordinary token, and the engine cut the text there.
        enders = self.loaded.eos_token_ids | set(self.request.stop_token_ids)
        if not self.token_ids or self.token_ids[-1] in enders:
            return None
        text = self.loaded.tokenizer.decode(self.token_ids)
        found = [(text.find(s), s) for s in self.request.stop if s in text]
        return min(found)[1] if found else None
