"""The OpenAI-compatible routes: models, chat completions, text completions."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from appliance.cache.model_cache import request_tenant
from appliance.chat.grammar import grammar_tokenizer
from appliance.chat.prepare import PrepareError, prepare
from appliance.engine.engine import Engine, RequestHandle
from appliance.engine.request import Delta, Finished, GenerationRequest
from appliance.runtime import Appliance
from appliance.server.errors import ApiError
from appliance.server.json import SSE_DONE, JSONResponse, sse
from appliance.server.params import (
    ChatParams,
    CommonParams,
    CompletionParams,
    completion_prompt,
    generation_request,
    parse_body,
)
from appliance.server.shapes import ChatShape, Shape, usage


def appliance_of(request: Request) -> Appliance:
    return request.app.state.appliance


async def list_models(request: Request) -> Response:
    """Every configured model with its state (`ready` once it serves; see /health)."""
    app = appliance_of(request)
    data = [{"id": name, "object": "model", "created": int(app.started_at), "owned_by": "omlx",
             "state": entry.state} for name, entry in app.models.items()]
    return JSONResponse({"object": "list", "data": data})


async def chat_completions(request: Request) -> Response:
    params: ChatParams = parse_body(await request.body(), ChatParams)
    engine = await appliance_of(request).engine(params.model)
    loaded = engine.loaded
    turn = params.turn()
    if turn.tools or turn.output_format.kind != "text":
        # A grammar may be needed: the model's first builds llguidance's view of the
        # tokenizer (about a second), off the event loop.
        await asyncio.to_thread(grammar_tokenizer, loaded)
    try:
        prepared = prepare(loaded, turn, tenant=request_tenant(params.cache_salt))
    except PrepareError as e:  # a template that rejects the conversation, a schema that won't compile
        raise ApiError(400, str(e), param=e.param) from None
    top = (params.top_logprobs or 0) if params.logprobs else None
    gen = generation_request(params, list(prepared.prompt_tokens), loaded, constraint=prepared.constraint,
                             max_tokens=params.max_completion_tokens or params.max_tokens, top_logprobs=top)
    shape = ChatShape(model=loaded.name, decode=decoder(engine), parser=prepared.parser())
    return await respond(request, engine, gen, params, shape)


async def completions(request: Request) -> Response:
    params: CompletionParams = parse_body(await request.body(), CompletionParams)
    engine = await appliance_of(request).engine(params.model)
    loaded = engine.loaded
    prompt = completion_prompt(params, loaded)
    gen = generation_request(params, prompt, loaded, max_tokens=params.max_tokens, top_logprobs=params.logprobs,
                             prompt_param="prompt", trim_leading_space=False)
    prefix = loaded.tokenizer.decode(prompt) if params.echo else ""
    return await respond(request, engine, gen, params, Shape(model=loaded.name, decode=decoder(engine)),
                         prefix=prefix)


# Finishes that are no completion: the client gets an error, not a finish_reason.
ENDED_BY_SERVER = ("error", "cancelled")


def ended_by_server(finished: Finished) -> ApiError:
    if finished.reason == "cancelled":
        return ApiError(503, "the request was cut off: the server is shutting down or the model was unloaded",
                        type="server_error", code="cancelled", headers={"Retry-After": "5"})
    return ApiError(500, finished.error or "generation failed", type="server_error")


def decoder(engine: Engine):
    tokenizer = engine.loaded.tokenizer
    return lambda token_id: tokenizer.decode([token_id])


async def respond(request: Request, engine: Engine, gen: GenerationRequest, params: CommonParams,
                  shape: Shape, *, prefix: str = "") -> Response:
    """Returns the whole completion, or a stream of it; the client leaving cancels the request."""
    handle = engine.submit(gen)
    if params.stream:
        return StreamingResponse(
            stream(handle, shape, include_usage=params.include_usage, prefix=prefix),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    deltas, finished = await collect(request, handle)
    if finished.reason in ENDED_BY_SERVER:
        raise ended_by_server(finished)
    return JSONResponse(shape.whole(deltas, finished.reason, finished.stats, prefix=prefix))


async def collect(request: Request, handle: RequestHandle) -> tuple[list[Delta], Finished]:
    """Returns every delta and the finish of a request, cancelling it if the client leaves."""
    watcher = asyncio.create_task(cancel_on_disconnect(request, handle))
    deltas: list[Delta] = []
    try:
        async for event in handle:
            if isinstance(event, Delta):
                deltas.append(event)
    finally:
        watcher.cancel()
        handle.cancel()
    assert handle.finished is not None
    return deltas, handle.finished


async def cancel_on_disconnect(request: Request, handle: RequestHandle) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def stream(handle: RequestHandle, shape: Shape, *, include_usage: bool,
                 prefix: str = "") -> AsyncIterator[bytes]:
    """Yields the SSE chunks of a request; closing the stream (client gone) cancels it."""
    try:
        first = shape.start_choices()
        if prefix:
            first = [shape.delta_choice(Delta(text=prefix, token_ids=()))]
        if first:
            yield sse(shape.chunk(first))
        async for event in handle:
            if isinstance(event, Delta):
                for choice in shape.delta_choices(event):
                    yield sse(shape.chunk([choice]))
            elif event.reason in ENDED_BY_SERVER:
                yield sse(ended_by_server(event).to_data())
            else:
                for choice in shape.finish_choices(event.reason):
                    yield sse(shape.chunk([choice]))
                if include_usage:
                    yield sse(shape.chunk([], usage=usage(event.stats)))
        yield SSE_DONE
    finally:
        handle.cancel()


ROUTES = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
