"""Throughput and TTFT under concurrency: omlx against mlx_lm.server, side by side, one run.

Scenario A: N concurrent streaming clients (N in 1, 4, 16, 64; with --model 1, 8, 32, 64)
sending chat requests in sequence; aggregate output tok/s and client-side TTFT p50/p99 per N.
Each server runs each N twice with new prompts, in the order ABBA, and the two rounds are
pooled: one round of a few waves is too short to rise above a small machine's ±10% drift.
With --mlx-lm-batch, mlx_lm's own `batch_generate` (in this process, after the servers
have stopped) runs the same prompts and max_tokens per N as a third baseline; with
--mlx-lm-batch-beside its rounds take turns with the servers' instead (its model loaded
beside them), so that a stretch of a slow host meets all alike.
Scenario B: short streaming requests alone, and again while one ~4,000-token prompt is
being prefilled (with --model: a 25,000-token one); short-request TTFT p50/p99 and how
much p99 grows.

Both servers serve the same model (by default the converted float32 test model; with
--model a model directory such as bench/gpu_model.py makes, which omlx loads in its own
dtype) and run at the same time; one idles while the other is measured, and they take
turns going first, so slow drift in the machine's load hits both (with --one-at-a-time
each runs alone, one after the other, for a GPU too small to hold both). Every prompt is
unique past its first ~31 tokens (the chat template's system prompt and `[label #`), so no
prompt cache (omlx's tiers, mlx_lm's LRU) can serve more than that; both get the same
prompts. The servers get OpenBLAS preloaded where it is installed (for MLX on CPU).

    # CPU, the converted test model (OpenBLAS preloaded for --mlx-lm-batch, which runs in-process):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python bench/throughput.py [--quick]
    # NVIDIA GPU, a bf16 model from bench/gpu_model.py, under a profile from profiles/:
    .venv/bin/python bench/throughput.py --model /tmp/llama-8b --profile nvidia-h200 [--mlx-lm-batch]

Writes bench/out/throughput.json (after every measurement, so a killed run keeps what
it measured) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    ForeignLoad,
    ServerProcess,
    Timing,
    client,
    converted_model_dir,
    fmt,
    log,
    mlx_lm_server,
    omlx_server,
    percentile,
    ratio,
    run_header,
    stream_chat,
    wait_for_quiet,
    wait_idle_work,
    write_json,
)

# mlx_lm.server decodes at most 32 requests at once by default; omlx is given max_running = 64.
MLX_LM_ARGS = ["--decode-concurrency", "64"]
OMLX_MAX_RUNNING = 64
OMLX_MAX_QUEUED = 256
REQUEST_TIMEOUT_S = 300.0  # no request here should take this long; a hang must not stall the run
LONG_TIMEOUT_S = 600.0  # the ~4,000-token prefill on a busy 2-core CPU machine
# http.server's listen backlog is 5: a burst of 64 connects gets some dropped unanswered.
# Such a connection is retried; its TTFT still counts from the first attempt.
RETRIES = 3
QUIET_WAIT_S = 20.0  # at most this long waiting for other processes to leave the CPU
GPU_CONCURRENCY = (1, 8, 32, 64)  # scenario A's N with --model (the GPU issue's)
GPU_LONG_PROMPT_TOKENS = 25_000  # scenario B's long prompt with --model: a "32K" context


@dataclass(frozen=True)
class Plan:
    """How much one run measures."""

    concurrency: tuple[int, ...]
    min_requests: int  # per N and repeat: max(N, min_requests) requests in all, shared by the N clients
    repeats: int  # rounds per server at each N, in the order ABBA..., each with new prompts
    max_tokens: int
    short_clients: int
    short_requests_per_client: int
    short_max_tokens: int
    long_prompt_tokens: int
    long_delay_s: float  # the short requests start this long after the long one is sent

    def num_requests(self, n: int) -> int:
        return max(n, self.min_requests)


FULL = Plan(concurrency=(1, 4, 16, 64), min_requests=16, repeats=2, max_tokens=64, short_clients=8,
            short_requests_per_client=2, short_max_tokens=16, long_prompt_tokens=4000, long_delay_s=1.0)
QUICK = Plan(concurrency=(1, 4), min_requests=2, repeats=1, max_tokens=32, short_clients=4,
             short_requests_per_client=2, short_max_tokens=8, long_prompt_tokens=1500, long_delay_s=1.0)


# --- prompts: varied, unique, the same for both servers -------------------------------------

TOPICS = (
    "suspension bridges", "the printing press", "coral reefs", "the steam engine", "jazz music",
    "volcanoes", "the Roman road network", "honeybees", "lighthouses", "the periodic table",
    "glaciers", "medieval castles", "the telescope", "rainforests", "container shipping",
    "the human immune system", "windmills", "the Silk Road", "sourdough bread", "comets",
    "public libraries", "the bicycle", "deep-sea vents", "the violin", "desert cities",
    "railway timetables", "paper making", "the compass", "tea cultivation", "solar panels",
    "ancient aqueducts", "migratory birds", "the typewriter", "canal locks", "olive farming",
    "the postal service", "clock towers", "mountain glaciers", "wool weaving", "radio broadcasting",
)
AUDIENCES = ("a curious ten-year-old", "a university student", "a retired engineer", "a museum visitor",
             "a history teacher", "a travel writer", "a city planner", "a science journalist")
TASKS = (
    "Write a long, detailed essay about {topic} for {audience}. Cover its history, how it works "
    "today, and what may change in the next fifty years. Use several full paragraphs.",
    "Explain {topic} to {audience} in depth, step by step, with many concrete examples.",
    "Tell a long story in which {audience} discovers everything about {topic}.",
    "Describe {topic} thoroughly for {audience}: origins, key people, turning points, and everyday impact.",
)
NOTE_SUBJECTS = ("The archive", "A local guide", "An old survey", "The committee", "A field report",
                 "The museum catalogue", "A traveller's diary", "The harbour office")
NOTE_VERBS = ("records", "mentions", "claims", "estimates", "suggests", "notes")
NOTE_OBJECTS = ("{k} workers spent {y} years on it", "repairs cost {k} thousand coins in year {y}",
                "{k} visitors came in the spring of {y}", "the design changed {k} times before {y}",
                "it was moved {k} kilometres in {y}", "a flood damaged {k} sections in {y}")


def chat_prompt(rng: random.Random, *, max_notes: int) -> list[dict]:
    """Returns a one-message chat asking for long output, with 0..max_notes context notes."""
    topic, audience = rng.choice(TOPICS), rng.choice(AUDIENCES)
    notes = [note(rng) for _ in range(rng.randint(0, max_notes))]
    task = rng.choice(TASKS).format(topic=topic, audience=audience)
    text = (" ".join(["Background notes:", *notes, "\n"]) if notes else "") + task
    return [{"role": "user", "content": text}]


def note(rng: random.Random) -> str:
    obj = rng.choice(NOTE_OBJECTS).format(k=rng.randint(2, 900), y=rng.randint(1200, 2020))
    return f"{rng.choice(NOTE_SUBJECTS)} {rng.choice(NOTE_VERBS)} that {obj}."


def prompt_set(label: str, count: int, *, max_notes: int) -> list[list[dict]]:
    """Returns `count` distinct chats, the same for every server (seeded by `label`)."""
    rng = random.Random(label)
    chats = [chat_prompt(rng, max_notes=max_notes) for _ in range(count)]
    # A serial number makes every prompt unique, so no prompt cache can serve a whole prompt.
    for i, chat in enumerate(chats):
        chat[0]["content"] = f"[{label} #{i}] {chat[0]['content']}"
    return chats


def long_prompt(model_dir: Path, num_tokens: int, *, label: str) -> list[dict]:
    """Returns a chat whose content is about `num_tokens` tokens of varied notes, seeded by `label`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(label)
    ask = "\nSummarize the notes above in one paragraph."
    lines: list[str] = []
    while len(lines) < num_tokens // 10:  # ~20 tokens a note: more than enough, trimmed below
        lines.append(f"Note {len(lines) + 1}: {note(rng)}")
    budget = num_tokens - len(tokenizer.encode(ask).ids) - 30  # ~30: chat template and system prompt
    while len(tokenizer.encode("\n".join(lines)).ids) > budget:
        lines.pop()
    return [{"role": "user", "content": "\n".join(lines) + ask}]


async def request(http: httpx.AsyncClient, server: ServerProcess, chat: list[dict], *, max_tokens: int,
                  timeout_s: float = REQUEST_TIMEOUT_S) -> Timing:
    return await stream_chat(http, server.url, chat, max_tokens=max_tokens, timeout_s=timeout_s, retries=RETRIES)


async def clients_in_parallel(server: ServerProcess, chats: list[list[dict]], num_clients: int, *,
                              max_tokens: int) -> tuple[list[Timing], float]:
    """Returns every request's timing and the wall time; client c sends chats[c::num_clients] in turn."""
    async with client() as http:
        async def one_client(c: int) -> list[Timing]:
            return [await request(http, server, chat, max_tokens=max_tokens) for chat in chats[c::num_clients]]

        started = time.perf_counter()
        per_client = await asyncio.gather(*(one_client(c) for c in range(num_clients)))
        return [t for ts in per_client for t in ts], time.perf_counter() - started


def ttft_bounds(timings: list[Timing]) -> list[float]:
    """Returns every request's TTFT; a failed request counts with the time it failed after.

    A request that timed out waited at least that long, so dropping it would flatter the
    server; its figure is a lower bound, and tables mark percentiles that include one with ">=".
    """
    return [t.ttft_s if t.ok else t.total_s for t in timings]


def failures(timings: list[Timing]) -> tuple[str, ...]:
    """Returns up to five failure descriptions, each with when it happened."""
    return tuple(f"{t.error or 'no content'} (after {t.total_s:.1f} s)" for t in timings if not t.ok)[:5]


# --- scenario A ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One server at one concurrency."""

    server: str
    concurrency: int
    repeat: int
    num_requests: int
    num_errors: int
    num_retries: int  # connections dropped unanswered and retried
    completion_tokens: int  # counted from usage, successful requests only
    min_completion_tokens: int
    mean_prompt_tokens: float | None
    wall_s: float
    tok_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    ttfts_s: tuple[float, ...]  # every request's, as ttft_bounds gives them: repeats pool these
    foreign_cpu_share: float  # CPU used by other processes on the machine meanwhile (0..1)
    errors: tuple[str, ...]
    # omlx only, from its /metrics: means over the round of the engine's own figures, so that
    # what the HTTP side adds shows (submission is after the prompt is tokenized)
    # ttft_s (submission to first token), queue_s, gap_ms (between tokens); the engine thread's
    # seconds per phase of its steps over the round (phases_s), its steps and prefill calls, the
    # prompt tokens it restored from its KV cache (cached_tokens)
    engine: dict | None = None


SERVER_SERIES = {"ttft_s": "omlx_time_to_first_token_seconds", "queue_s": "omlx_queue_seconds",
                 "gap_ms": "omlx_inter_token_seconds"}
ENGINE_COUNTERS = ("omlx_engine_phase_seconds_total", "omlx_engine_steps_total", "omlx_engine_prefill_calls_total",
                   "omlx_cached_prompt_tokens_total")


def server_sums(server: ServerProcess) -> dict[str, float] | None:
    """Returns omlx's histogram sums and counts (SERVER_SERIES) and engine counters
    (ENGINE_COUNTERS, by phase), each summed over its models; None for another server."""
    if server.name != "omlx":
        return None
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    text = httpx.get(server.url + "/metrics", timeout=30).text
    for sample in (s for family in text_string_to_metric_families(text) for s in family.samples):
        phase = sample.labels.get("phase")
        key = f"{sample.name}:{phase}" if phase else sample.name
        sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def server_means(before: dict | None, after: dict | None) -> dict | None:
    """Returns the means of SERVER_SERIES and the engine counters' growth between two `server_sums`."""
    if before is None or after is None:
        return None

    def grew(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    means: dict = {}
    for key, name in SERVER_SERIES.items():
        count = grew(name + "_count")
        means[key] = round(grew(name + "_sum") / count * (1000 if key == "gap_ms" else 1), 4) if count else None
    phases = sorted({k.split(":", 1)[1] for k in after if k.startswith(ENGINE_COUNTERS[0] + ":")})
    means["phases_s"] = {phase: round(grew(f"{ENGINE_COUNTERS[0]}:{phase}"), 4) for phase in phases}
    means["steps"] = int(grew(ENGINE_COUNTERS[1]))
    means["prefill_calls"] = int(grew(ENGINE_COUNTERS[2]))
    means["cached_tokens"] = int(grew(ENGINE_COUNTERS[3]))  # restored from the KV cache, every tier
    return means


async def concurrency_round(server: ServerProcess, n: int, chats: list[list[dict]], *,
                            max_tokens: int, groups: set[int], repeat: int = 0) -> Round:
    """Returns the round of `n` clients sharing `chats`, each sending its share in sequence."""
    meter = ForeignLoad(groups).start()
    sums = await asyncio.to_thread(server_sums, server)
    timings, wall_s = await clients_in_parallel(server, chats, n, max_tokens=max_tokens)
    means = server_means(sums, await asyncio.to_thread(server_sums, server))
    ok = [t for t in timings if t.ok]
    ttfts = ttft_bounds(timings)
    prompts = [t.prompt_tokens for t in ok if t.prompt_tokens is not None]
    tokens = sum(t.completion_tokens for t in ok)
    return Round(
        server=server.name, concurrency=n, repeat=repeat, num_requests=len(timings), num_errors=len(timings) - len(ok),
        num_retries=sum(t.num_retries for t in timings), completion_tokens=tokens,
        min_completion_tokens=min((t.completion_tokens for t in ok), default=0),
        mean_prompt_tokens=sum(prompts) / len(prompts) if prompts else None,
        wall_s=wall_s, tok_s=tokens / wall_s, ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        ttfts_s=tuple(round(t, 4) for t in ttfts), foreign_cpu_share=meter.share(), errors=failures(timings),
        engine=means,
    )


def chats_a(plan: Plan, n: int, repeat: int) -> list[list[dict]]:
    """Scenario A's prompts at `n` and `repeat`: new each repeat (a repeated prompt would be
    a cache hit), the same for every server and baseline."""
    return prompt_set(f"A{n}" + (f"-{repeat}" if repeat else ""), plan.num_requests(n), max_notes=6)


async def scenario_a(servers: list[ServerProcess], plan: Plan, rounds: list[Round], save: Callable[[], None], *,
                     batch: BatchGenerate | None = None, batch_rounds: list[BatchRound] | None = None) -> None:
    """Runs each N's rounds on `servers`, and with `batch` a round of batch_generate among
    theirs, on the same prompts (it counts as beside each of `servers`)."""
    groups = {s.group for s in servers}
    for i, n in enumerate(plan.concurrency):
        for repeat in range(plan.repeats):
            chats = chats_a(plan, n, repeat)
            # Alternate who goes first (ABBA...), so drift in the machine's load does not favour one.
            turns: list = [*servers, batch] if batch is not None else list(servers)
            for turn in turns if (i + repeat) % 2 == 0 else turns[::-1]:
                await quiet(groups)
                if turn is batch:
                    batch_rounds.append(batch.round(n, repeat, chats, max_tokens=plan.max_tokens,
                                                    beside=",".join(s.name for s in servers)))
                    save()
                    continue
                server = turn
                log(f"A: {server.name} N={n} repeat {repeat + 1}/{plan.repeats} ({len(chats)} requests)")
                r = await concurrency_round(server, n, chats, max_tokens=plan.max_tokens, groups=groups,
                                            repeat=repeat)
                log(f"   {r.tok_s:.1f} tok/s, TTFT p50 {fmt(r.ttft_p50_s)} s p99 {fmt(r.ttft_p99_s)} s, "
                    f"{r.num_errors} errors, {r.num_retries} retries, wall {r.wall_s:.1f} s, "
                    f"others' CPU {r.foreign_cpu_share:.0%} {' '.join(r.errors[:1])}"
                    + (f"; in the engine: TTFT {fmt(r.engine['ttft_s'])} s, queue {fmt(r.engine['queue_s'])} s, "
                       f"token gap {fmt(r.engine['gap_ms'])} ms, {r.engine['steps']} steps, "
                       f"{r.engine['prefill_calls']} prefill calls, {r.engine['cached_tokens']} prompt tokens "
                       f"restored, seconds by phase {r.engine['phases_s']}"
                       if r.engine else ""))
                rounds.append(r)
                save()


# --- scenario B ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShortLoad:
    """Short requests' TTFT in one condition."""

    num_requests: int
    num_errors: int
    num_retries: int
    ttft_p50_s: float | None  # failed requests count with the time they failed after (a lower bound)
    ttft_p99_s: float | None
    total_p50_s: float | None  # send to last token: decode stalls show here, not in TTFT
    wall_s: float
    foreign_cpu_share: float
    errors: tuple[str, ...]


@dataclass(frozen=True)
class Interference:
    """One server: short requests alone and during a long prefill."""

    server: str
    alone: ShortLoad
    with_long: ShortLoad
    p50_growth: float | None
    p99_growth: float | None
    long_prompt_tokens: int | None
    long_ttft_s: float | None
    long_error: str | None
    num_short_before_long_first_token: int  # short requests sent while the long one was prefilling
    during_ttft_p50_s: float | None  # over those short requests only
    during_ttft_p99_s: float | None
    shorts: tuple[dict, ...]  # each short request during the long one: sent_s (after the long), ttft_s, total_s, error


async def short_load(server: ServerProcess, chats: list[list[dict]], plan: Plan, *,
                     groups: set[int]) -> tuple[ShortLoad, list[Timing]]:
    meter = ForeignLoad(groups).start()
    timings, wall_s = await clients_in_parallel(server, chats, plan.short_clients, max_tokens=plan.short_max_tokens)
    ttfts = ttft_bounds(timings)
    load = ShortLoad(num_requests=len(timings), num_errors=sum(not t.ok for t in timings),
                     num_retries=sum(t.num_retries for t in timings), ttft_p50_s=percentile(ttfts, 50),
                     ttft_p99_s=percentile(ttfts, 99),
                     total_p50_s=percentile([t.total_s for t in timings], 50),
                     wall_s=wall_s, foreign_cpu_share=meter.share(),
                     errors=failures(timings))
    return load, timings


async def interference(server: ServerProcess, plan: Plan, long_chat: list[dict], *,
                       groups: set[int]) -> Interference:
    """Returns short-request TTFT alone and while `long_chat` is being prefilled."""
    count = plan.short_clients * plan.short_requests_per_client
    await quiet(groups)
    log(f"B: {server.name} short requests alone ({count})")
    alone, _ = await short_load(server, prompt_set("B-alone", count, max_notes=1), plan, groups=groups)
    await quiet(groups)
    log(f"B: {server.name} short requests during a {plan.long_prompt_tokens}-token prefill")
    async with client() as http:
        long_task = asyncio.create_task(request(http, server, long_chat, max_tokens=4, timeout_s=LONG_TIMEOUT_S))
        await asyncio.sleep(plan.long_delay_s)
        with_long, timings = await short_load(server, prompt_set("B-long", count, max_notes=1), plan,
                                              groups=groups)
        long = await long_task
    long_first = long.started_s + long.ttft_s if long.ttft_s is not None else float("inf")
    during = [t for t in timings if t.started_s < long_first]
    result = Interference(
        server=server.name, alone=alone, with_long=with_long,
        p50_growth=ratio(with_long.ttft_p50_s, alone.ttft_p50_s),
        p99_growth=ratio(with_long.ttft_p99_s, alone.ttft_p99_s),
        long_prompt_tokens=long.prompt_tokens, long_ttft_s=long.ttft_s, long_error=long.error,
        num_short_before_long_first_token=len(during),
        during_ttft_p50_s=percentile(ttft_bounds(during), 50), during_ttft_p99_s=percentile(ttft_bounds(during), 99),
        shorts=tuple({"sent_s": round(t.started_s - long.started_s, 3), "ttft_s": t.ttft_s,
                      "total_s": round(t.total_s, 3), "error": t.error} for t in timings),
    )
    log(f"   alone p99 {fmt(alone.ttft_p99_s)} s, with long p99 {fmt(with_long.ttft_p99_s)} s "
        f"(x{fmt(result.p99_growth)}), long TTFT {fmt(long.ttft_s)} s {long.error or ''}, "
        f"others' CPU {alone.foreign_cpu_share:.0%} / {with_long.foreign_cpu_share:.0%}")
    return result


async def scenario_b(servers: list[ServerProcess], plan: Plan, long_chat: list[dict],
                     results: list[Interference], save: Callable[[], None]) -> None:
    groups = {s.group for s in servers}
    for server in servers:
        results.append(await interference(server, plan, long_chat, groups=groups))
        save()


async def quiet(groups: set[int]) -> None:
    """Waits (boundedly) for other processes on the machine to leave the CPU alone."""
    share = await wait_for_quiet(groups, max_wait_s=QUIET_WAIT_S)
    if share >= 0.2:
        log(f"   machine busy: others use {share:.0%} of the CPU; measuring anyway")


# --- mlx_lm's batch_generate: a third baseline for scenario A, in-process -------------------


@dataclass(frozen=True)
class BatchRound:
    """mlx_lm's batch_generate on scenario A's prompts of one N and repeat (at most N decoding at once)."""

    concurrency: int
    repeat: int
    num_requests: int
    completion_tokens: int  # generated tokens, an end-of-sequence token not counted
    mean_prompt_tokens: float
    wall_s: float  # prefill and decode of all requests
    tok_s: float
    generation_tps: float  # mlx_lm's own figure: decode tokens over decode time
    beside: str | None = None  # with --mlx-lm-batch-beside: the servers whose rounds it took turns with (a,b)


class BatchGenerate:
    """mlx_lm's batch_generate on scenario A's prompts, in this process (at most N decoding
    at once): its model loaded and warmed up once."""

    def __init__(self, model_dir: Path):
        import mlx_lm

        from appliance.platform import blas_preloaded, openblas_path

        if openblas_path() and not blas_preloaded():
            log("   OpenBLAS is installed but not preloaded here: on CPU, run with LD_PRELOAD (see the docstring)")
        log(f"mlx_lm batch_generate: loading {model_dir}")
        self.model, self.tokenizer = mlx_lm.load(str(model_dir))
        self._run(self._encode(prompt_set("warm-mlx_lm-batch", 4, max_notes=2)), 4, 8)

    def _encode(self, chats: list[list[dict]]) -> list[list[int]]:
        return [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True)) for c in chats]

    def _run(self, prompts: list[list[int]], n: int, max_tokens: int):
        from mlx_lm.generate import batch_generate

        started = time.perf_counter()
        done = batch_generate(self.model, self.tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True,
                              completion_batch_size=n, prefill_batch_size=min(n, 8))
        return done, time.perf_counter() - started

    def round(self, n: int, repeat: int, chats: list[list[dict]], *, max_tokens: int,
              beside: str | None = None) -> BatchRound:
        prompts = self._encode(chats)
        log(f"A: mlx_lm batch_generate N={n} repeat {repeat + 1} ({len(prompts)} requests)"
            + (f", in turn with {beside}" if beside else ""))
        done, wall_s = self._run(prompts, n, max_tokens)
        tokens = sum(len(ids) for ids in done.token_ids)
        r = BatchRound(concurrency=n, repeat=repeat, num_requests=len(prompts), completion_tokens=tokens,
                       mean_prompt_tokens=sum(map(len, prompts)) / len(prompts), wall_s=wall_s,
                       tok_s=tokens / wall_s, generation_tps=done.stats.generation_tps, beside=beside)
        log(f"   {r.tok_s:.1f} tok/s (decode alone {r.generation_tps:.1f}), wall {wall_s:.1f} s")
        return r


def scenario_a_batch(batch: BatchGenerate, plan: Plan, rounds: list[BatchRound], save: Callable[[], None]) -> None:
    """Runs scenario A's prompts through mlx_lm's batch_generate with completion_batch_size N."""
    for n in plan.concurrency:
        for repeat in range(plan.repeats):
            rounds.append(batch.round(n, repeat, chats_a(plan, n, repeat), max_tokens=plan.max_tokens))
            save()


def table_batch(batch: list[BatchRound], rounds: list[Round]) -> str:
    """Each server against batch_generate at each N: against its rounds in turn with that
    server where it ran so (--mlx-lm-batch-beside), else against all of its rounds."""
    rows = ["| N | requests | mlx_lm batch_generate tok/s | omlx tok/s | omlx / batch_generate | mlx_lm.server tok/s "
            "| mlx_lm.server / batch_generate |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({b.concurrency for b in batch}):
        bs = [b for b in batch if b.concurrency == n]
        cells = []
        for name in ("omlx", "mlx_lm"):
            beside = ([b for b in bs if b.beside and name in b.beside.split(",")]
                      or [b for b in bs if b.beside is None])
            tok_s = sum(b.completion_tokens for b in beside) / sum(b.wall_s for b in beside) if beside else None
            rs = [r for r in rounds if r.concurrency == n and r.server == name]
            served = pooled(rs).tok_s if rs else None
            cells.append((tok_s, served))
        batch_tok_s = " / ".join(dict.fromkeys(fmt(t, ".1f") for t, _ in cells if t is not None))
        rows.append(f"| {n} | {sum(b.num_requests for b in bs)} | {batch_tok_s} | {fmt(cells[0][1], '.1f')} "
                    f"| {fmt(ratio(cells[0][1], cells[0][0]))} | {fmt(cells[1][1], '.1f')} "
                    f"| {fmt(ratio(cells[1][1], cells[1][0]))} |")
    return "\n".join(rows)


# --- warm-up, reports, main ----------------------------------------------------------------


async def warm_up(server: ServerProcess, model_dir: Path) -> list[str]:
    """Runs first-use work (allocations, a full prefill chunk, a small batch); returns errors seen."""
    async with client() as http:
        timings = [await request(http, server, chat, max_tokens=8)
                   for chat in prompt_set(f"warm-{server.name}", 2, max_notes=2)]
        chat = long_prompt(model_dir, 600, label=f"warm-long-{server.name}")
        timings.append(await request(http, server, chat, max_tokens=4))
        timings += await asyncio.gather(*(request(http, server, c, max_tokens=8)
                                          for c in prompt_set(f"warm-batch-{server.name}", 4, max_notes=2)))
    errors = [f"warm-up request {i}: {e}" for i, e in enumerate(failures(timings))]
    for e in errors:
        log(f"   {server.name} {e}")
    return errors


def bound(value: float | None, censored: bool) -> str:
    """Returns `value` formatted, marked ">=" when it includes failed requests (a lower bound)."""
    return (">=" if censored and value is not None else "") + fmt(value)


@dataclass(frozen=True)
class Pooled:
    """One server's repeats at one concurrency, taken together."""

    num_requests: int
    num_errors: int
    num_retries: int
    tok_s: float  # all completion tokens over all wall time
    repeat_tok_s: tuple[float, ...]
    ttft_p50_s: float | None  # over every request of every repeat
    ttft_p99_s: float | None
    foreign_cpu_share: float  # the highest of the repeats'


def pooled(rounds: list[Round]) -> Pooled:
    rounds = sorted(rounds, key=lambda r: r.repeat)
    ttfts = [t for r in rounds for t in r.ttfts_s]
    return Pooled(
        num_requests=sum(r.num_requests for r in rounds), num_errors=sum(r.num_errors for r in rounds),
        num_retries=sum(r.num_retries for r in rounds),
        tok_s=sum(r.completion_tokens for r in rounds) / sum(r.wall_s for r in rounds),
        repeat_tok_s=tuple(r.tok_s for r in rounds),
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        foreign_cpu_share=max(r.foreign_cpu_share for r in rounds),
    )


def table_a(rounds: list[Round]) -> str:
    rows = ["| N | requests | omlx tok/s | mlx_lm tok/s | tok/s ratio | ratio per repeat | omlx TTFT p50 (s) "
            "| mlx_lm TTFT p50 (s) | p50 ratio | omlx TTFT p99 (s) | mlx_lm TTFT p99 (s) | p99 ratio "
            "| errors (omlx / mlx_lm) | retried connects (omlx / mlx_lm) | others' CPU (omlx / mlx_lm) |",
            "|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for n in sorted({r.concurrency for r in rounds}):
        of = [r for r in rounds if r.concurrency == n and r.server == "omlx"]
        mf = [r for r in rounds if r.concurrency == n and r.server == "mlx_lm"]
        if not of or not mf:
            continue
        o, m = pooled(of), pooled(mf)
        per_repeat = " / ".join(fmt(ratio(a, b)) for a, b in zip(o.repeat_tok_s, m.repeat_tok_s))
        oc, mc = o.num_errors > 0, m.num_errors > 0
        rows.append(
            f"| {n} | {o.num_requests} | {o.tok_s:.1f} | {m.tok_s:.1f} | {fmt(ratio(o.tok_s, m.tok_s))} | {per_repeat} "
            f"| {bound(o.ttft_p50_s, oc)} | {bound(m.ttft_p50_s, mc)} | {fmt(ratio(o.ttft_p50_s, m.ttft_p50_s))} "
            f"| {bound(o.ttft_p99_s, oc)} | {bound(m.ttft_p99_s, mc)} | {fmt(ratio(o.ttft_p99_s, m.ttft_p99_s))} "
            f"| {o.num_errors} / {m.num_errors} | {o.num_retries} / {m.num_retries} "
            f"| {o.foreign_cpu_share:.0%} / {m.foreign_cpu_share:.0%} |")
    return "\n".join(rows)


def table_b(results: list[Interference]) -> str:
    rows = ["| server | short TTFT p50 alone (s) | p99 alone (s) | p50 with long (s) | p99 with long (s) "
            "| p99 growth | p50 / p99 of shorts sent during the prefill (s) | short completion p50 alone / with long (s) "
            "| long prompt tokens | long TTFT (s) | errors | others' CPU (alone / with) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ac, wc = r.alone.num_errors > 0, r.with_long.num_errors > 0
        during_c = any(x["error"] for x in r.shorts if r.long_ttft_s is None or x["sent_s"] < r.long_ttft_s)
        growth = (">=" if wc and not ac else "") + fmt(r.p99_growth)
        rows.append(
            f"| {r.server} | {bound(r.alone.ttft_p50_s, ac)} | {bound(r.alone.ttft_p99_s, ac)} "
            f"| {bound(r.with_long.ttft_p50_s, wc)} | {bound(r.with_long.ttft_p99_s, wc)} | {growth}x "
            f"| {bound(r.during_ttft_p50_s, during_c)} / {bound(r.during_ttft_p99_s, during_c)} "
            f"(n={r.num_short_before_long_first_token}) "
            f"| {fmt(r.alone.total_p50_s)} / {bound(r.with_long.total_p50_s, wc)} | {r.long_prompt_tokens or '–'} "
            f"| {fmt(r.long_ttft_s, '.1f')}{' ' + r.long_error if r.long_error else ''} "
            f"| {r.alone.num_errors + r.with_long.num_errors + (r.long_error is not None)} "
            f"| {r.alone.foreign_cpu_share:.0%} / {r.with_long.foreign_cpu_share:.0%} |")
    return "\n".join(rows)


def report(record: dict, plan: Plan) -> str:
    """Returns the markdown tables of a (possibly partial) record."""
    parts = []
    if record["scenario_a"]:
        parts += [f"Scenario A: {plan.max_tokens}-token completions, N concurrent streaming clients "
                  f"(max(N, {plan.min_requests}) requests per N and repeat, {plan.repeats} repeat(s) a server, "
                  "each with new prompts, alternating which server goes first; tok/s: all tokens over all wall "
                  "time; TTFT percentiles over all requests)\n", table_a(record["scenario_a"]), ""]
    if record.get("scenario_a_mlx_lm_batch"):
        when = ("its rounds in turn with each server's (a \"a / b\" column: beside omlx / beside mlx_lm)"
                if any(b.beside for b in record["scenario_a_mlx_lm_batch"]) else "after the servers")
        parts += ["Scenario A, mlx_lm's batch_generate in-process on the same prompts and max_tokens (at most N "
                  f"decoding at once; {when}; tok/s: all tokens over all wall time, prefill included)\n",
                  table_batch(record["scenario_a_mlx_lm_batch"], record["scenario_a"]), ""]
    if record["scenario_b"]:
        parts += [f"Scenario B: {plan.short_clients} clients x {plan.short_requests_per_client} short requests "
                  f"(max_tokens {plan.short_max_tokens}), alone and during a {plan.long_prompt_tokens}-token "
                  "prefill\n", table_b(record["scenario_b"]), ""]
    parts.append("Ratios are omlx / mlx_lm (tok/s: above 1 favours omlx; TTFT: below 1 favours omlx). "
                 "\"others' CPU\": share of the machine used by processes other than the benchmark and its "
                 "servers while measuring. \">=\": includes requests that failed (timed out), counted with the "
                 "time they failed after.")
    return "\n".join(parts)


async def measure(servers: list[ServerProcess], plan: Plan, model_dir: Path, record: dict,
                  save: Callable[[], None], *, scenarios: str, batch: BatchGenerate | None = None) -> None:
    for server in servers:
        log(f"warming up {server.name}")
        record["warm_up_errors"][server.name] = await warm_up(server, model_dir)
    for server in servers:
        if server.config is not None:  # omlx: its idle work ends before anything is measured
            record["idle_work_wait_s"] = waited = await asyncio.to_thread(wait_idle_work, server.url)
            log(f"   {server.name}'s idle work ended {waited} s after the warm-ups")
    if "a" in scenarios:
        await scenario_a(servers, plan, record["scenario_a"], save, batch=batch,
                         batch_rounds=record["scenario_a_mlx_lm_batch"])
    if "b" in scenarios:
        long_chat = long_prompt(model_dir, plan.long_prompt_tokens, label="B-long-prompt")
        await scenario_b(servers, plan, long_chat, record["scenario_b"], save)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a reduced run (N in 1, 4; fewer requests)")
    parser.add_argument("--only", choices=("a", "b"), help="run one scenario only")
    parser.add_argument("--n", type=int, action="append", metavar="N",
                        help="scenario A at this concurrency only (repeat for several)")
    parser.add_argument("--repeats", type=int, default=None, metavar="R",
                        help="rounds per server at each N (default 2), in turn; more where a host's slow stretches "
                             "make two rounds disagree")
    parser.add_argument("--omlx-only", action="store_true",
                        help="skip mlx_lm.server (for iterating; published figures come from runs with both)")
    parser.add_argument("--one-at-a-time", action="store_true",
                        help="run the servers one after the other, each alone on the machine (for a GPU "
                             "too small to hold both: on an 80 GB H100, N = 64 beside each other ran out of memory)")
    parser.add_argument("--mlx-lm-arg", action="append", default=[], metavar="ARG",
                        help="an extra mlx_lm.server argument (repeat; e.g. --mlx-lm-arg=--prefill-step-size=512)")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="serve this model directory (with a tokenizer; e.g. from bench/gpu_model.py) in its "
                             f"own dtype, instead of the converted float32 test model; N defaults to {GPU_CONCURRENCY}")
    parser.add_argument("--profile", metavar="NAME", help="an omlx profile from profiles/ (e.g. nvidia-h200)")
    parser.add_argument("--omlx-batching", action="append", default=[], metavar="LINE",
                        help='one more [batching] line for omlx\'s config, e.g. \'short_attention = "fused"\'')
    parser.add_argument("--omlx-cache", action="append", default=[], metavar="LINE",
                        help="one more [cache] line for omlx's config, e.g. 'memory_gb = 0'")
    parser.add_argument("--omlx-model", action="append", default=[], metavar="LINE",
                        help='one more [[models]] line for omlx\'s model, e.g. \'compile_blocks = "on"\'')
    parser.add_argument("--omlx-server", action="append", default=[], metavar="LINE",
                        help="one more [server] line for omlx's config, e.g. 'mlx_memory_limit_gb = 44' (beside "
                             "--mlx-lm-batch-beside on an 80 GB card)")
    parser.add_argument("--omlx-kernels", action="append", default=[], metavar="LINE",
                        help="one more [kernels] line for omlx's config, e.g. 'small_matmul=\"native\"'")
    parser.add_argument("--omlx-code", type=Path, default=None, metavar="DIR",
                        help="run omlx from this checkout (e.g. a `git worktree` of an older commit), to A/B it")
    parser.add_argument("--mlx-lm-batch", action="store_true",
                        help="also run scenario A's prompts through mlx_lm's batch_generate, in-process, "
                             "after the servers have stopped")
    parser.add_argument("--mlx-lm-batch-beside", action="store_true",
                        help="run batch_generate's rounds in turn with the servers' (ABBA), its model loaded in "
                             "this process beside them, so that a stretch of a slow host meets both alike (on a "
                             "GPU, its memory beside the servers': 16 GB for an 8B model)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench/out/throughput*.json)")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.model and not args.quick:
        plan = replace(plan, concurrency=GPU_CONCURRENCY, long_prompt_tokens=GPU_LONG_PROMPT_TOKENS)
    if args.n:
        plan = replace(plan, concurrency=tuple(args.n))
    if args.repeats:
        plan = replace(plan, repeats=args.repeats)
    mlx_lm_args = [*MLX_LM_ARGS, *args.mlx_lm_arg]
    model_dir = args.model.resolve() if args.model else converted_model_dir()
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        parser.error(f"{model_dir}: no config.json and tokenizer.json there")
    dtype = "auto" if args.model else "float32"
    suffix = "".join([f"-{model_dir.name}" if args.model else "", "-quick" * args.quick, f"-{args.only}" if args.only else "",
                      "".join(f"-n{n}" for n in args.n or ()), "-variant" * bool(args.mlx_lm_arg),
                      "-omlx" * args.omlx_only, "-apart" * args.one_at_a_time])
    out = args.out or OUT_DIR / f"throughput{suffix}.json"
    # SIGTERM unwinds like Ctrl-C, so the servers below are stopped either way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    record: dict = {
        **run_header(__file__, argv),
        "complete": False,
        "model_dir": str(model_dir),
        "omlx_dtype": dtype,
        "profile": args.profile,
        "plan": plan,
        "mlx_lm_args": mlx_lm_args,
        "warm_up_errors": {},
        "scenario_a": [],
        "scenario_b": [],
        "scenario_a_mlx_lm_batch": [],
    }

    def save() -> None:
        record["duration_s"] = round(time.time() - started, 1)
        write_json(out, record)

    runs_a = (args.only or "a") == "a"
    batch = BatchGenerate(model_dir) if args.mlx_lm_batch_beside and runs_a else None
    with tempfile.TemporaryDirectory(prefix="omlx-bench-") as tmp:
        servers = [omlx_server(model_dir, work_dir=Path(tmp), max_running=OMLX_MAX_RUNNING,
                               max_queued=OMLX_MAX_QUEUED, log_name="throughput-omlx", profile=args.profile,
                               dtype=dtype, batching=tuple(args.omlx_batching),
                               cache=tuple(args.omlx_cache), model=tuple(args.omlx_model),
                               server=tuple(args.omlx_server), kernels=tuple(args.omlx_kernels),
                               **({"code": args.omlx_code.resolve()} if args.omlx_code else {}))]
        if not args.omlx_only:
            servers.append(mlx_lm_server(model_dir, extra_args=mlx_lm_args, log_name="throughput-mlx_lm"))
        record["servers"] = {s.name: s.argv for s in servers}
        record["omlx_config"] = (Path(tmp) / "omlx.toml").read_text()
        record["log_tails"] = {}
        for group in [[s] for s in servers] if args.one_at_a_time else [servers]:
            try:  # each group's servers stop here, whatever happens, before the next group starts
                for server in group:
                    log(f"starting {server.name}: {' '.join(server.argv)}")
                    server.start()
                asyncio.run(measure(group, plan, model_dir, record, save, scenarios=args.only or "ab", batch=batch))
            finally:
                for server in group:
                    server.stop()
                    record["log_tails"][server.name] = server.log_tail(60)
                save()
    # After the servers have stopped, so that their memory (on a GPU, most of the card) is free.
    if args.mlx_lm_batch and batch is None and runs_a:
        scenario_a_batch(BatchGenerate(model_dir), plan, record["scenario_a_mlx_lm_batch"], save)
    record["complete"] = True
    save()
    print(report(record, plan))
    print(f"\nResults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
