"""appliance/server/turns.py: the heartbeat that keeps a long prefill's stream alive."""

from __future__ import annotations

import asyncio

from appliance.server.turns import with_heartbeat


def test_heartbeat_fills_the_silence_then_passes_the_events_on():
    async def main() -> list:
        go = asyncio.Event()

        async def source():
            await go.wait()
            yield "a"
            yield "b"

        seen = []
        async for item in with_heartbeat(source(), 0.01):
            seen.append(item)
            go.set()  # the first heartbeat lets the source go on
        return seen

    seen = asyncio.run(main())
    assert seen[0] is None and seen[-2:] == ["a", "b"]
    assert set(seen[:-2]) == {None}


def test_leaving_early_closes_the_source():
    async def main() -> list:
        closed = []

        async def source():
            try:
                yield "a"
                await asyncio.Event().wait()  # never comes: a prefill still running
                yield "b"
            finally:
                closed.append(True)

        beats = with_heartbeat(source(), 0.01)
        seen = [await anext(beats), await anext(beats)]
        await beats.aclose()  # the client left
        return seen + closed

    assert asyncio.run(main()) == ["a", None, True]
