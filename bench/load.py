"""Load: N concurrent clients over all three APIs for a fixed time, against a real `omlx serve`.

Each client loops over random requests: OpenAI chat, Anthropic messages or OpenAI
responses; streaming or not; a short or a long prompt from a fixed pool (so the caches
fill once, then should stay flat); some streaming clients leave after the first token.
Counts status codes (the target is zero 5xx), reports TTFT and output tokens/s, and
samples the server's RSS, open file descriptors and cache bytes per tier over the run
(they should stay flat once every prompt of the pool has been seen).

    .venv/bin/python bench/load.py [--clients 8] [--duration-s 60] [--url http://...  --pid PID]

Without --url it starts its own server on the converted test model (run the tests once).
Exits 1 when any request got a 5xx or no answer. Prints tables; writes nothing else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import converted_model_dir, omlx_server, percentile  # noqa: E402

MODEL = "bench"
APIS = ("chat", "messages", "responses")
LEAVE_EARLY = 0.15  # share of streaming requests whose client disconnects after the first token
TOPICS = ["rivers", "bridges", "compilers", "tea", "volcanoes", "chess", "bees", "glaciers", "typography",
          "lighthouses", "fermentation", "orbits"]
RULES = " ".join(f"Rule {i}: answer briefly, name your sources, keep lists short." for i in range(60))
SAMPLE_EVERY_S = 2.0
# Small budgets, so that a short run fills them: the cache must then stay at its budget.
CACHE_BUDGETS = "memory_gb = 0.125\nhost_gb = 0.0625\nssd_gb = 0.25\n"


def prompts() -> list[str]:
    """Returns the fixed pool: a short and a long (~700-token) prompt per topic."""
    short = [f"Tell me one fact about {t}." for t in TOPICS]
    long = [f"{RULES}\n\nWith those rules, explain how {t} work." for t in TOPICS]
    return short + long


@dataclass
class Outcome:
    api: str
    stream: bool
    status: int | None  # None: no HTTP answer (connection error, timeout)
    left_early: bool = False
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None


def request(api: str, prompt: str, *, stream: bool, max_tokens: int) -> tuple[str, dict]:
    """Returns (path, body) of one request in `api`'s shape (greedy: a repeated request
    repeats its answer, so the caches see nothing new)."""
    common = {"model": MODEL, "stream": stream, "temperature": 0}
    messages = [{"role": "user", "content": prompt}]
    if api == "chat":
        body = {**common, "messages": messages, "max_tokens": max_tokens}
        return "/v1/chat/completions", body | ({"stream_options": {"include_usage": True}} if stream else {})
    if api == "messages":
        return "/v1/messages", {**common, "messages": messages, "max_tokens": max_tokens}
    return "/v1/responses", {**common, "input": prompt, "max_output_tokens": max_tokens}


def tokens_of(api: str, data: dict) -> int:
    """Returns the output token count of a whole (non-streamed) answer."""
    usage = data.get("usage") or {}
    return int(usage.get("completion_tokens" if api == "chat" else "output_tokens") or 0)


def is_token_event(api: str, data: dict) -> bool:
    """Returns whether a streamed event carries generated text."""
    if api == "chat":
        return any(c.get("delta", {}).get("content") for c in data.get("choices") or [])
    if api == "messages":
        return data.get("type") == "content_block_delta"
    return data.get("type") == "response.output_text.delta"


async def send(client: httpx.AsyncClient, api: str, prompt: str, *, stream: bool, leave_early: bool,
               max_tokens: int) -> Outcome:
    path, body = request(api, prompt, stream=stream, max_tokens=max_tokens)
    out = Outcome(api, stream, None)
    started = time.perf_counter()
    try:
        if not stream:
            r = await client.post(path, json=body)
            out.status = r.status_code
            if r.status_code == 200:
                out.output_tokens = tokens_of(api, r.json())
            return out
        async with client.stream("POST", path, json=body) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if is_token_event(api, orjson.loads(line[6:])):
                    out.output_tokens += 1
                    if out.ttft_s is None:
                        out.ttft_s = time.perf_counter() - started
                    if leave_early:
                        out.left_early = True
                        return out  # closing the stream mid-answer: the server must cancel it
    except (httpx.HTTPError, orjson.JSONDecodeError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def client_loop(client: httpx.AsyncClient, rng: random.Random, pool: list[str], until: float,
                      outcomes: list[Outcome]) -> None:
    while time.perf_counter() < until:
        stream = rng.random() < 0.5
        outcomes.append(await send(client, rng.choice(APIS), rng.choice(pool), stream=stream,
                                   leave_early=stream and rng.random() < LEAVE_EARLY,
                                   max_tokens=rng.choice((8, 16, 32, 64))))


# --- the server's resources -------------------------------------------------------------


@dataclass
class Sample:
    t_s: float
    rss_bytes: int | None
    num_fds: int | None
    cache_bytes: dict[str, int] = field(default_factory=dict)  # per tier


def rss_and_fds(pid: int | None) -> tuple[int | None, int | None]:
    if pid is None:
        return None, None
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None, None


async def sample_loop(client: httpx.AsyncClient, pid: int | None, started: float, until: float,
                      samples: list[Sample]) -> None:
    while True:
        rss, fds = rss_and_fds(pid)
        tiers: dict[str, int] = {}
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            data = (await client.get("/admin/api/cache")).json()["tiers"]
            tiers = {name: int(t.get("bytes") or 0) for name, t in data.items()}
        samples.append(Sample(time.perf_counter() - started, rss, fds, tiers))
        if time.perf_counter() >= until:
            return
        await asyncio.sleep(min(SAMPLE_EVERY_S, max(until - time.perf_counter(), 0)))


# --- the run --------------------------------------------------------------------------------


async def run(url: str, pid: int | None, *, num_clients: int, duration_s: float, seed: int
              ) -> tuple[list[Outcome], list[Sample], float, dict[str, int]]:
    """Returns every request's outcome, the server's samples, the seconds run and the
    cache's budget per tier."""
    pool = prompts()
    limits = httpx.Limits(max_connections=num_clients + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=10), limits=limits) as client:
        # Every prompt once, so the sampled cache bytes start from a full pool.
        for prompt in pool:
            await send(client, "chat", prompt, stream=False, leave_early=False, max_tokens=1)
        outcomes: list[Outcome] = []
        samples: list[Sample] = []
        started = time.perf_counter()
        until = started + duration_s
        await asyncio.gather(
            sample_loop(client, pid, started, until, samples),
            *(client_loop(client, random.Random(seed + i), pool, until, outcomes) for i in range(num_clients)))
        elapsed = time.perf_counter() - started
        await asyncio.sleep(1.0)  # cancelled streams settle; then one last sample
        rss, fds = rss_and_fds(pid)
        data = (await client.get("/admin/api/cache")).json()["tiers"]
        budgets = {name: int(t.get("budget_bytes") or 0) for name, t in data.items()}
        samples.append(Sample(time.perf_counter() - started, rss, fds,
                              {name: int(t.get("bytes") or 0) for name, t in data.items()}))
        status = (await client.get("/admin/api/status")).json()
        live = sum(m["live_requests"] for m in status["models"])
    print(f"live requests on the server after the run: {live}")
    return outcomes, samples, elapsed, budgets


def print_requests(outcomes: list[Outcome], elapsed_s: float) -> None:
    print(f"\n{len(outcomes)} requests in {elapsed_s:.0f} s\n")
    print("| API | stream | requests | 2xx | 4xx | 5xx | no answer | left early | TTFT p50 s | TTFT p99 s "
          "| output tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple[str, bool], list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[(o.api, o.stream)].append(o)
    for (api, stream), group in sorted(groups.items()):
        codes = Counter((o.status or 0) // 100 for o in group)
        ttfts = [o.ttft_s for o in group if o.ttft_s is not None]
        p50 = f"{percentile(ttfts, 50):.2f}" if ttfts else "-"
        p99 = f"{percentile(ttfts, 99):.2f}" if ttfts else "-"
        tok_s = sum(o.output_tokens for o in group) / elapsed_s
        print(f"| {api} | {'yes' if stream else 'no'} | {len(group)} | {codes[2]} | {codes[4]} | {codes[5]} "
              f"| {codes[0]} | {sum(o.left_early for o in group)} | {p50} | {p99} | {tok_s:.1f} |")
    others = Counter(o.status for o in outcomes if o.status not in (200, None))
    if others:
        print(f"\nnon-200 statuses: {dict(others)}")
    for o in [o for o in outcomes if o.error][:5]:
        print(f"no answer: {o.api} stream={o.stream}: {o.error}")


def print_resources(samples: list[Sample], budgets: dict[str, int]) -> None:
    def mib(n: int | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f}"

    tiers = sorted({name for s in samples for name in s.cache_bytes})
    print("\n| t s | RSS MiB | open fds | " + " | ".join(f"{t} MiB" for t in tiers) + " |")
    print("|---|---|---|" + "---|" * len(tiers))
    for s in samples:
        cache = " | ".join(mib(s.cache_bytes.get(t)) for t in tiers)
        print(f"| {s.t_s:.0f} | {mib(s.rss_bytes)} | {s.num_fds if s.num_fds is not None else '-'} | {cache} |")
    if len(samples) >= 2:
        first, last = samples[0], samples[-1]
        changes = []
        if first.rss_bytes and last.rss_bytes:
            changes.append(f"RSS {100 * (last.rss_bytes / first.rss_bytes - 1):+.1f}%")
        if first.num_fds is not None and last.num_fds is not None:
            changes.append(f"fds {last.num_fds - first.num_fds:+d}")
        changes += [f"{t} {mib(last.cache_bytes.get(t, 0) - first.cache_bytes.get(t, 0))} MiB" for t in tiers]
        print("\nfirst to last sample: " + ", ".join(changes))
        # The first requests size the allocator's pools; a leak keeps growing after them.
        mid = samples[len(samples) // 2]
        if mid.rss_bytes and last.rss_bytes and mid.num_fds is not None and last.num_fds is not None:
            print(f"second half (from {mid.t_s:.0f} s): RSS {100 * (last.rss_bytes / mid.rss_bytes - 1):+.1f}%, "
                  f"fds {last.num_fds - mid.num_fds:+d}")
    over = [t for t in tiers if any(s.cache_bytes.get(t, 0) > budgets.get(t, 1 << 62) for s in samples)]
    print("cache budgets MiB: " + ", ".join(f"{t} {mib(b)}" for t, b in sorted(budgets.items()))
          + (f"; OVER BUDGET: {', '.join(over)}" if over else "; never exceeded"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--duration-s", type=float, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server (its model must be named 'bench')")
    parser.add_argument("--pid", type=int, help="that server's pid, to sample its RSS and fds")
    args = parser.parse_args()
    if args.url:
        outcomes, samples, elapsed, budgets = asyncio.run(run(args.url, args.pid, num_clients=args.clients,
                                                     duration_s=args.duration_s, seed=args.seed))
    else:
        with tempfile.TemporaryDirectory(prefix="omlx-load-") as tmp, \
                omlx_server(converted_model_dir(), work_dir=Path(tmp), max_running=4,
                            max_queued=4 * args.clients, log_name="load") as server:
            config = Path(tmp) / "omlx.toml"
            config.write_text(config.read_text().replace("[cache]\n", "[cache]\n" + CACHE_BUDGETS))
            server.start()
            print(f"omlx serving on {server.url} (pid {server.process.pid}), ready in {server.ready_s:.1f} s; "
                  f"{args.clients} clients for {args.duration_s:.0f} s")
            outcomes, samples, elapsed, budgets = asyncio.run(run(server.url, server.process.pid,
                                                         num_clients=args.clients,
                                                         duration_s=args.duration_s, seed=args.seed))
            print(f"server exit status after SIGTERM: {server.stop()}")
    print_requests(outcomes, elapsed)
    print_resources(samples, budgets)
    failed = sum(1 for o in outcomes if o.status is None or o.status >= 500)
    print(f"\n{'FAIL' if failed else 'OK'}: {failed} requests with a 5xx or no answer")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
