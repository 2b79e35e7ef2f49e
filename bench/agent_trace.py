"""Agent-trace replay: a coding agent revisiting file contexts, against omlx and mlx_lm.server.

12 contexts of about 2K tokens (one ~310-token system prompt shared by all, then a different
real Python file of an installed package, trimmed to the context's token target), 40 turns
that revisit them with locality (a fixed seeded sequence: 12 first visits, 28 revisits, each
revisit after 1 to 11 other turns). A turn is its context plus a short question that differs
on every turn ("Turn 17: what does function X do?"), streamed one at a time with max_tokens
16, temperature 0. Both servers are restarted halfway (after turn 20).

With --model (a bf16 model directory from bench/gpu_model.py, tokenizer inside) it runs at
GPU scale: 32 contexts of about 8K tokens (8000 ± 7.5%), 107 turns (75 revisits, each after 1
to 29 other turns), restart after turn 53. --contexts and --context-tokens set the scale
(turns, restart and gaps grow with the number of contexts, in the same proportions). A source
file shorter than its context's target is passed over for the next in a longer list; the run
stops at once, saying so, when too few installed files are long enough.

Both servers serve the same model and run side by side: by default the converted float32
test model with OpenBLAS preloaded; with --model that directory, which omlx loads in its own
dtype ("auto") under --profile if given. Turns are interleaved (turn t on one, then on the
other, who goes first alternating), so drift in the machine's load hits both. mlx_lm.server
gets `--prefill-step-size` equal to omlx's prefill chunk (512, or the profile's
prefill_chunk_tokens), so that the comparison is about caching, not chunk size; its prompt
cache keeps its defaults (mlx_lm 0.32.2: at most 10 distinct KV caches, so at 32 contexts it
cannot hold them all). After each start a server gets one tiny unrelated request before
anything is timed.

Hits. omlx: a revisit is a hit when cached_tokens (usage.prompt_tokens_details) >= 90% of its
context's tokens. mlx_lm.server: a revisit is a hit when its TTFT <= 25% of that context's
first-visit TTFT on that server. Both rules are also counted for both servers (mlx_lm 0.32.2
does send prompt_tokens_details.cached_tokens), so the two can be compared.

Then omlx alone is restarted once more and the whole trace is replayed (identical prompts:
every turn should be a hit); its wall time is compared with mlx_lm.server's first replay.
Wall time is the sum of the turns' request times (client-side, send to last byte), without
restarts and warm-ups.

    # CPU, the converted test model (quick: 4 contexts of ~580 tokens, 10 turns):
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libopenblas.so.0 .venv/bin/python bench/agent_trace.py [--quick]
    # NVIDIA GPU, a bf16 model from bench/gpu_model.py, under a profile from profiles/:
    python3 bench/agent_trace.py --model /tmp/llama-8b --profile nvidia-h200   # 32 contexts of ~8K tokens

Writes bench/out/agent_trace.json (agent_trace-quick.json with --quick; with --model the model
directory's name is added, e.g. agent_trace-llama-8b.json) and prints markdown tables. Server
logs: bench/out/logs/agent_trace-<server>-<start>.log.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    REPO,
    ChatTokens,
    ForeignLoad,
    ServerProcess,
    Timing,
    client,
    converted_model_dir,
    fmt,
    get_json,
    log,
    longest_fit,
    mlx_lm_server,
    omlx_server,
    ratio,
    run_header,
    site_packages,
    stream_chat,
    wait_idle_work,
    wait_ssd_written,
    write_json,
)

MAX_TOKENS = 16
OMLX_HIT_SHARE = 0.90  # cached_tokens >= 90% of the context's tokens
MLX_LM_HIT_SHARE = 0.25  # TTFT <= 25% of the context's first-visit TTFT
TARGET_REVISIT_SHARE = 0.10  # omlx revisit TTFT <= 10% of the context's first visit
TARGET_REVISIT_SUM = 1 / 5  # omlx revisit TTFT sum <= 1/5 of mlx_lm.server's
TARGET_REPLAY_WALL = 1 / 3  # omlx second replay wall time <= 1/3 of mlx_lm.server's first
REQUEST_TIMEOUT_S = 600.0
OMLX_PREFILL_CHUNK = 512  # omlx's default prefill_chunk_tokens; a profile may set another
MLX_LM_ARGS = ["--prefill-step-size", str(OMLX_PREFILL_CHUNK)]
OMLX, MLX_LM = "omlx", "mlx_lm"
GPU_CONTEXTS = 32  # --model's defaults: the GPU issue's 32 contexts of 8K tokens
GPU_CONTEXT_TOKENS = 8000
CONTEXT_SPREAD = 0.075  # --context-tokens T: each context's target is drawn from T ± 7.5%

FILES = (
    "mlx_lm/sample_utils.py", "mlx_lm/models/cache.py", "mlx_lm/models/llama.py", "mlx_lm/generate.py",
    "mlx_lm/tokenizer_utils.py", "httpx/_client.py", "httpx/_models.py", "starlette/routing.py",
    "starlette/responses.py", "uvicorn/config.py", "watchfiles/main.py", "h11/_connection.py",
)
# Used, in this order, where FILES run out or a file of FILES is shorter than its context's
# target: larger files (40-300 KB, 10K-70K tokens) of packages omlx and its tokenizer depend on.
MORE_FILES = (
    "mlx_lm/server.py", "mlx_lm/utils.py", "jinja2/compiler.py", "jinja2/environment.py", "jinja2/filters.py",
    "jinja2/parser.py", "pydantic/main.py", "pydantic/fields.py", "pydantic/types.py", "pydantic/json_schema.py",
    "pydantic/_internal/_generate_schema.py", "pydantic/networks.py", "pydantic/config.py",
    "pydantic_settings/main.py", "huggingface_hub/file_download.py", "huggingface_hub/hf_file_system.py",
    "huggingface_hub/_commit_api.py", "huggingface_hub/utils/_http.py", "huggingface_hub/utils/_cache_manager.py",
    "numpy/_core/numeric.py", "numpy/_core/arrayprint.py", "numpy/_core/fromnumeric.py", "numpy/linalg/_linalg.py",
    "numpy/lib/_npyio_impl.py", "numpy/lib/_function_base_impl.py", "numpy/ma/core.py", "gguf/gguf_writer.py",
    "gguf/quants.py", "gguf/vocab.py", "transformers/configuration_utils.py", "transformers/cache_utils.py",
    "transformers/modeling_utils.py", "transformers/generation/utils.py", "transformers/tokenization_utils_base.py",
)

SYSTEM = """You are a coding agent working in a Python repository on behalf of a developer. You can read files, run tests and propose patches. Follow these rules on every turn:
1. Answer the developer's question about the file that is open below; quote function and class names exactly as they appear in the code.
2. Be brief: one or two sentences unless asked for more. Do not restate the question.
3. If the code does not answer the question, say so plainly instead of guessing, and name the file or symbol you would read next.
4. When you describe behaviour, mention the inputs, the outputs and any side effects (files, network, global state), and call out error handling and edge cases such as empty inputs, timeouts and cancellation.
5. Never invent APIs. If a name is imported from another module, say which module it comes from.
6. When you propose a change, show it as a minimal unified diff against the open file, keep the existing style (type hints, docstrings, naming), and explain in one line why the change is safe.
7. Treat the open file as read-only context: it may be truncated at the end, so do not assume that code after the cut does not exist.
The developer works on a local LLM server; performance and correctness both matter, so point out quadratic loops, blocking I/O on the event loop, and shared mutable state between threads when you see them."""


@dataclass(frozen=True)
class Plan:
    num_contexts: int
    num_turns: int
    restart_after: int  # turns; the servers restart between turn `restart_after` and the next
    min_context_tokens: int  # each context's target is drawn (seeded) from this range
    max_context_tokens: int
    max_gap: int  # a context comes back after 1 to max_gap other turns


FULL = Plan(num_contexts=12, num_turns=40, restart_after=20, min_context_tokens=1850, max_context_tokens=2150,
            max_gap=11)
QUICK = Plan(num_contexts=4, num_turns=10, restart_after=5, min_context_tokens=520, max_context_tokens=640,
             max_gap=3)
SEED = 20240601


def scaled(base: Plan, num_contexts: int | None, context_tokens: int | None) -> Plan:
    """Returns `base` with `num_contexts` contexts (turns and gaps in proportion, the restart
    halfway) of `context_tokens` ± 7.5% tokens; what is None stays as in `base`."""
    plan = base
    if num_contexts is not None and num_contexts != base.num_contexts:
        turns = round(base.num_turns * num_contexts / base.num_contexts)
        plan = Plan(num_contexts=num_contexts, num_turns=turns, restart_after=turns // 2,
                    min_context_tokens=base.min_context_tokens, max_context_tokens=base.max_context_tokens,
                    max_gap=max(1, round(base.max_gap * num_contexts / base.num_contexts)))
    if context_tokens is not None:
        spread = round(context_tokens * CONTEXT_SPREAD)
        plan = Plan(num_contexts=plan.num_contexts, num_turns=plan.num_turns, restart_after=plan.restart_after,
                    min_context_tokens=context_tokens - spread, max_context_tokens=context_tokens + spread,
                    max_gap=plan.max_gap)
    return plan


# --- the trace -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Context:
    name: str  # A, B, ...
    file: str
    system: str
    num_tokens: int  # the system message rendered by the chat template
    functions: tuple[str, ...]


@dataclass(frozen=True)
class Turn:
    index: int  # 1-based
    context: str
    first_visit: bool
    after_restart: bool  # a revisit whose previous visit was before the restart
    messages: list[dict] = field(repr=False)
    prompt_tokens: int = 0
    shared_prefix_tokens: int = 0  # tokens shared with the context's previous turn (or the context)


def sequence(plan: Plan, seed: int) -> list[int]:
    """Returns the context index of each turn: first visits spread over the first 3/4, revisits with locality.

    Rejection-sampled over seeds from `seed` on until every revisit comes after 1 to
    `max_gap` other turns and every context is visited 2 to 5 times; deterministic. A context
    seen once whose last chance for a revisit has come is revisited then (after the seeded
    draw, which is still made): without that, many contexts (--contexts 32) almost never all
    get their revisit. A trace the plain draws accept is unchanged by this.
    """
    for s in range(seed, seed + 10_000):
        rng = random.Random(s)
        last_new = max(plan.num_contexts, plan.num_turns * 3 // 4)
        firsts = {0, *rng.sample(range(1, last_new), plan.num_contexts - 1)}
        seq: list[int] = []
        last_seen: dict[int, int] = {}
        for t in range(plan.num_turns):
            due = [c for c, i in last_seen.items() if 1 <= t - i - 1 <= plan.max_gap]
            if (t in firsts or not due) and len(last_seen) < plan.num_contexts:
                c = len(last_seen)
            elif due:
                # Locality: recently used contexts come back more often, but any gap can occur.
                weights = [1.0 / (t - last_seen[c]) ** 0.5 for c in due]
                c = rng.choices(due, weights)[0]
                last_chance = [d for d in due if t - last_seen[d] - 1 == plan.max_gap and seq.count(d) < 2]
                if last_chance:
                    c = last_chance[0]
            else:
                break
            seq.append(c)
            last_seen[c] = t
        visits = [seq.count(c) for c in range(plan.num_contexts)]
        if len(seq) == plan.num_turns and min(visits, default=0) >= 2 and max(visits) <= 5:
            return seq
    raise RuntimeError(f"no valid trace found for {plan.num_contexts} contexts in {plan.num_turns} turns: "
                       "ask for fewer contexts (--contexts)")


def source_path(name: str) -> Path:
    """Returns where the installed file `name` ("package/module.py") lies: a venv, or a --target dir."""
    import importlib.util

    try:
        top = importlib.util.find_spec(name.split("/")[0])
    except (ImportError, ValueError):
        top = None
    return Path(top.origin).parent.parent / name if top and top.origin else site_packages() / name


class TooFewFiles(RuntimeError):
    pass


def build_contexts(tokens: ChatTokens, plan: Plan, rng: random.Random) -> list[Context]:
    """Returns the contexts, each trimmed (by whole lines) to its seeded token target.

    Each takes the next file of FILES, then MORE_FILES, that is installed and longer than its
    target; raises TooFewFiles when they run out.
    """
    contexts: list[Context] = []
    candidates = iter(dict.fromkeys(FILES + MORE_FILES))
    passed_over: list[str] = []
    for i in range(plan.num_contexts):
        target = rng.randint(plan.min_context_tokens, plan.max_context_tokens)
        for file in candidates:
            path = source_path(file)
            if not path.is_file():
                passed_over.append(f"{file} (not found)")
                continue
            lines = path.read_text(errors="replace").splitlines()

            def system(n: int, file: str = file, lines: list[str] = lines) -> str:
                return f"{SYSTEM}\n\n## Open file: {file}\n```python\n" + "\n".join(lines[:n]) + "\n```"

            def count(n: int, system=system) -> int:
                return len(tokens.prompt([{"role": "system", "content": system(n)}], generation_prompt=False))

            # Search only a prefix of the file (~8 characters a token at most) when that is already
            # over the target: the same fit as over the whole file, without tokenizing all of a 300 KB one.
            cap, chars = len(lines), 0
            for j, line in enumerate(lines):
                chars += len(line) + 1
                if chars > 8 * target:
                    cap = j + 1
                    break
            if cap < len(lines) and count(cap) <= target:
                cap = len(lines)
            if count(cap) <= target:
                passed_over.append(f"{file} ({count(cap)} tokens whole, target {target})")
                continue
            break
        else:
            raise TooFewFiles(
                f"only {i} of {plan.num_contexts} contexts found a source file longer than its target "
                f"({plan.min_context_tokens}-{plan.max_context_tokens} tokens) among FILES and MORE_FILES of "
                f"bench/agent_trace.py; passed over: {', '.join(passed_over) or 'none'}. Ask for fewer contexts "
                f"(--contexts) or fewer tokens (--context-tokens), or install the packages named there.")
        n = longest_fit(cap, lambda n: count(n) <= target)
        functions = tuple(dict.fromkeys(re.findall(r"^\s*(?:async\s+)?def (\w+)", "\n".join(lines[:n]), re.M)))
        contexts.append(Context(name=context_name(i), file=file, system=system(n), num_tokens=count(n),
                                functions=functions or ("this module",)))
    if passed_over:
        log("source files passed over: " + ", ".join(passed_over))
    return contexts


def context_name(i: int) -> str:
    """Returns A, B, ... Z, then AA, AB, ..."""
    letters = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        letters = chr(ord("A") + r) + letters
    return letters


def build_turns(tokens: ChatTokens, plan: Plan, contexts: list[Context], order: list[int],
                rng: random.Random) -> list[Turn]:
    turns: list[Turn] = []
    last: dict[str, Turn] = {}
    for t, c in enumerate(order, 1):
        ctx = contexts[c]
        function = rng.choice(ctx.functions)
        what = "the code" if function == "this module" else f"function {function}"
        messages = [{"role": "system", "content": ctx.system},
                    {"role": "user", "content": f"Turn {t}: what does {what} do?"}]
        ids = tokens.prompt(messages)
        previous = last.get(ctx.name)
        shared = ctx.num_tokens if previous is None else _common_prefix(ids, tokens.prompt(previous.messages))
        turn = Turn(index=t, context=ctx.name, first_visit=previous is None,
                    after_restart=previous is not None and previous.index <= plan.restart_after < t,
                    messages=messages, prompt_tokens=len(ids), shared_prefix_tokens=shared)
        turns.append(turn)
        last[ctx.name] = turn
    return turns


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# --- running it ----------------------------------------------------------------------------------


@dataclass
class TurnResult:
    server: str
    replay: int  # 1: the trace with a restart after `restart_after`; 2: omlx's replay after one more restart
    turn: int
    context: str
    first_visit: bool
    after_restart: bool
    timing: Timing
    served_by: dict | None = None  # omlx: the request's cached_by_tier
    foreign_cpu_share: float = 0.0
    hit: bool | None = None  # by this server's rule; None for first visits in replay 1
    hit_by_cached: bool | None = None  # cached_tokens >= 90% of the context, where the server reports it
    hit_by_ttft: bool | None = None  # TTFT <= 25% of the context's first visit
    ttft_share_of_first: float | None = None  # TTFT / the context's first-visit TTFT (replay 1)

    @property
    def ttft_s(self) -> float | None:
        return self.timing.ttft_s


@dataclass
class Side:
    """One server across its starts."""

    name: str
    make: object  # () -> ServerProcess, not started
    starts: int = 0
    server: ServerProcess | None = None
    exit_codes: list[int | None] = field(default_factory=list)
    warm_up_errors: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.starts += 1
        self.server = self.make(f"agent_trace-{self.name}-{self.starts}")
        log(f"starting {self.name} ({self.server.log_path.name})")
        self.server.start(ready_timeout_s=600)
        t = asyncio.run(one_request(self.server, [{"role": "user", "content": "Say hello."}], max_tokens=4))
        if not t.ok:
            self.warm_up_errors.append(f"{self.server.log_path.name}: {t.error or 'no content'}")
        if self.server.config is not None:  # omlx: its idle work would slow the other side's turns
            log(f"   {self.name}'s idle work ended {wait_idle_work(self.server.url)} s after its warm-up")

    def stop(self) -> None:
        if self.server is not None:
            if self.name == OMLX:
                try:
                    wait_ssd_written(self.server.url)
                except Exception as e:  # a dead server: its log says why
                    log(f"   {self.name}: could not wait for SSD writes: {e}")
            self.exit_codes.append(self.server.stop(grace_s=60))
            self.server = None


async def one_request(server: ServerProcess, messages: list[dict], *, max_tokens: int) -> Timing:
    async with client() as http:
        return await stream_chat(http, server.url, messages, max_tokens=max_tokens, timeout_s=REQUEST_TIMEOUT_S)


def run_turn(side: Side, turn: Turn, replay: int) -> TurnResult:
    server = side.server
    meter = ForeignLoad({server.group}).start()
    timing = asyncio.run(one_request(server, turn.messages, max_tokens=MAX_TOKENS))
    result = TurnResult(server=side.name, replay=replay, turn=turn.index, context=turn.context,
                        first_visit=turn.first_visit, after_restart=turn.after_restart, timing=timing,
                        foreign_cpu_share=meter.share())
    if side.name == OMLX:
        recent = get_json(server.url, "/admin/api/status")["models"][0]["recent_requests"]
        result.served_by = recent[-1].get("cached_by_tier") if recent else None
    log(f"   {side.name} r{replay} turn {turn.index:2d} {turn.context} {'first' if turn.first_visit else 'again'}: "
        f"TTFT {fmt(timing.ttft_s, '.2f')} s, total {timing.total_s:.2f} s, prompt {timing.prompt_tokens}, "
        f"cached {timing.cached_tokens} {result.served_by or ''} {timing.error or ''}")
    return result


def judge(results: list[TurnResult], contexts: dict[str, Context], firsts: dict[tuple[str, str], float | None]) -> None:
    """Sets each result's hit and TTFT share of its context's first visit (on the same server)."""
    for r in results:
        first = firsts.get((r.server, r.context))
        r.ttft_share_of_first = ratio(r.ttft_s, first)
        if r.replay == 1 and r.first_visit:
            continue
        cached = r.timing.cached_tokens
        if cached is not None:
            r.hit_by_cached = cached >= OMLX_HIT_SHARE * contexts[r.context].num_tokens
        r.hit_by_ttft = r.ttft_share_of_first is not None and r.ttft_share_of_first <= MLX_LM_HIT_SHARE
        r.hit = bool(r.hit_by_cached) if r.server == OMLX else r.hit_by_ttft


def replay(sides: list[Side], turns: list[Turn], plan: Plan, *, replay_no: int, restart: bool) -> list[TurnResult]:
    results = []
    for turn in turns:
        if restart and turn.index == plan.restart_after + 1:
            log(f"restarting after turn {plan.restart_after}")
            for side in sides:
                side.stop()
            for side in sides:
                side.start()
        order = sides if turn.index % 2 else sides[::-1]
        for side in order:
            results.append(run_turn(side, turn, replay_no))
    return results


# --- summary and tables ---------------------------------------------------------------------------


def summarize(results: list[TurnResult], server: str, replay_no: int) -> dict:
    mine = [r for r in results if r.server == server and r.replay == replay_no]
    revisits = [r for r in mine if not r.first_visit] if replay_no == 1 else mine
    firsts = [r for r in mine if r.first_visit] if replay_no == 1 else []
    ttft = [r.ttft_s for r in revisits if r.ttft_s is not None]
    return {
        "server": server, "replay": replay_no, "turns": len(mine),
        "errors": sum(not r.timing.ok for r in mine),
        "revisits": len(revisits), "revisit_hits": sum(bool(r.hit) for r in revisits),
        "revisit_hits_by_cached": sum(bool(r.hit_by_cached) for r in revisits),
        "revisit_hits_by_ttft": sum(bool(r.hit_by_ttft) for r in revisits),
        "revisit_cached_tokens": sum(r.timing.cached_tokens or 0 for r in revisits),
        "revisits_within_10pct_of_first": sum(r.ttft_share_of_first is not None
                                              and r.ttft_share_of_first <= TARGET_REVISIT_SHARE for r in revisits),
        "after_restart_revisits": sum(r.after_restart for r in revisits) if replay_no == 1 else None,
        "after_restart_hits": sum(bool(r.hit) for r in revisits if r.after_restart) if replay_no == 1 else None,
        "revisit_ttft_sum_s": sum(ttft) if len(ttft) == len(revisits) else None,
        "first_visit_ttft_sum_s": sum(r.ttft_s or 0 for r in firsts) if firsts else None,
        "wall_s": sum(r.timing.total_s for r in mine),
        "mean_foreign_cpu_share": sum(r.foreign_cpu_share for r in mine) / len(mine) if mine else None,
    }


def table_summary(summaries: list[dict]) -> str:
    rows = ["| server | replay | revisits | hits (server's rule) | hits by cached ≥ 90% / by TTFT ≤ 25% "
            "| revisits with TTFT ≤ 10% of first visit | hits right after restart "
            "| revisit TTFT sum (s) | first-visit TTFT sum (s) | wall (s) | errors | others' CPU |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summaries:
        after = "–" if s["after_restart_revisits"] is None else f"{s['after_restart_hits']}/{s['after_restart_revisits']}"
        rows.append(
            f"| {s['server']} | {s['replay']} | {s['revisits']} | {s['revisit_hits']} "
            f"| {s['revisit_hits_by_cached']} / {s['revisit_hits_by_ttft']} | {s['revisits_within_10pct_of_first']} "
            f"| {after} | {fmt(s['revisit_ttft_sum_s'], '.1f')} | {fmt(s['first_visit_ttft_sum_s'], '.1f')} "
            f"| {s['wall_s']:.1f} | {s['errors']} | {fmt(_pct(s['mean_foreign_cpu_share']), '.0f')}% |")
    return "\n".join(rows)


def table_targets(targets: list[dict]) -> str:
    rows = ["| target | measured | met |", "|---|---|---|"]
    rows += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in targets]
    return "\n".join(rows)


def table_turns(turns: list[Turn], results: list[TurnResult], contexts: dict[str, Context]) -> str:
    by = {(r.server, r.replay, r.turn): r for r in results}
    rows = ["| turn | ctx | visit | ctx tokens | shared prefix | omlx TTFT (s) | omlx cached | omlx hit | omlx TTFT/first "
            "| mlx_lm TTFT (s) | mlx_lm cached | mlx_lm hit | mlx_lm TTFT/first | omlx replay 2 TTFT (s) | replay 2 cached |",
            "|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for t in turns:
        o, m, o2 = by.get((OMLX, 1, t.index)), by.get((MLX_LM, 1, t.index)), by.get((OMLX, 2, t.index))
        visit = "first" if t.first_visit else ("again, after restart" if t.after_restart else "again")
        rows.append(
            f"| {t.index} | {t.context} | {visit} | {contexts[t.context].num_tokens} | {t.shared_prefix_tokens} "
            f"| {fmt(o and o.ttft_s)} | {o.timing.cached_tokens if o else '–'} | {_yes(o and o.hit)} "
            f"| {fmt(_pct(o and o.ttft_share_of_first), '.0f')}% | {fmt(m and m.ttft_s)} "
            f"| {m.timing.cached_tokens if m else '–'} | {_yes(m and m.hit)} "
            f"| {fmt(_pct(m and m.ttft_share_of_first), '.0f')}% | {fmt(o2 and o2.ttft_s)} "
            f"| {o2.timing.cached_tokens if o2 else '–'} |")
    return "\n".join(rows)


def targets_of(summaries: dict[tuple[str, int], dict]) -> list[dict]:
    o, m, o2 = summaries[(OMLX, 1)], summaries[(MLX_LM, 1)], summaries.get((OMLX, 2))
    sum_ratio = ratio(o["revisit_ttft_sum_s"], m["revisit_ttft_sum_s"])
    wall_ratio = ratio(o2["wall_s"], m["wall_s"]) if o2 else None
    every = o["revisits"]
    return [
        {"target": "every omlx revisit a hit (cached ≥ 90% of context)",
         "measured": f"{o['revisit_hits']}/{every}", "met": o["revisit_hits"] == every},
        {"target": "every omlx revisit TTFT ≤ 10% of its context's first visit",
         "measured": f"{o['revisits_within_10pct_of_first']}/{every}", "met": o["revisits_within_10pct_of_first"] == every},
        {"target": "omlx revisits right after the restart all hits",
         "measured": f"{o['after_restart_hits']}/{o['after_restart_revisits']}",
         "met": o["after_restart_hits"] == o["after_restart_revisits"]},
        {"target": "omlx revisit TTFT sum ≤ 1/5 of mlx_lm.server's",
         "measured": f"{fmt(o['revisit_ttft_sum_s'], '.1f')} s / {fmt(m['revisit_ttft_sum_s'], '.1f')} s = {fmt(sum_ratio, '.3f')}",
         "met": sum_ratio is not None and sum_ratio <= TARGET_REVISIT_SUM},
        {"target": "omlx second-replay wall ≤ 1/3 of mlx_lm.server's first-replay wall",
         "measured": f"{fmt(o2 and o2['wall_s'], '.1f')} s / {m['wall_s']:.1f} s = {fmt(wall_ratio, '.3f')}",
         "met": wall_ratio is not None and wall_ratio <= TARGET_REPLAY_WALL},
        {"target": "omlx second replay: every turn a hit",
         "measured": f"{o2['revisit_hits']}/{o2['revisits']}" if o2 else "–",
         "met": bool(o2) and o2["revisit_hits"] == o2["revisits"]},
    ]


def prefill_chunk(profile: str) -> int:
    """Returns omlx's prefill chunk under `profile` (profiles/<profile>.toml), as mlx_lm.server's prefill step."""
    path = REPO / "profiles" / f"{profile}.toml"
    if not path.is_file():
        return OMLX_PREFILL_CHUNK  # omlx itself will say that there is no such profile
    return tomllib.loads(path.read_text()).get("batching", {}).get("prefill_chunk_tokens", OMLX_PREFILL_CHUNK)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def _yes(value: bool | None) -> str:
    return "–" if value is None else ("hit" if value else "miss")


# --- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 contexts of ~580 tokens, 10 turns, restart after 5")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="serve this model directory (with a tokenizer; e.g. from bench/gpu_model.py) on both "
                             "servers, omlx in its own dtype, instead of the converted float32 test model; "
                             f"defaults to {GPU_CONTEXTS} contexts of {GPU_CONTEXT_TOKENS} tokens (unless --quick)")
    parser.add_argument("--profile", metavar="NAME", help="an omlx profile from profiles/ (e.g. nvidia-h200)")
    parser.add_argument("--contexts", type=int, metavar="N",
                        help=f"number of contexts (default {FULL.num_contexts}, --quick {QUICK.num_contexts}, "
                             f"--model {GPU_CONTEXTS}); turns, revisit gaps and the restart scale with it")
    parser.add_argument("--context-tokens", type=int, metavar="T",
                        help="each context's token target is drawn from T ± 7.5%% (default "
                             f"{FULL.min_context_tokens}-{FULL.max_context_tokens}, --quick "
                             f"{QUICK.min_context_tokens}-{QUICK.max_context_tokens}, --model {GPU_CONTEXT_TOKENS})")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="where omlx's cache dir goes (default: the temp dir)")
    args = parser.parse_args(argv)
    if args.contexts is not None and not 2 <= args.contexts <= 200:
        parser.error("--contexts: 2 to 200")
    if args.context_tokens is not None and args.context_tokens < 400:
        parser.error("--context-tokens: at least 400 (the shared system prompt alone is ~310)")
    gpu_scale = args.model is not None and not args.quick
    plan = scaled(QUICK if args.quick else FULL,
                  args.contexts if args.contexts is not None else GPU_CONTEXTS if gpu_scale else None,
                  args.context_tokens if args.context_tokens is not None else GPU_CONTEXT_TOKENS if gpu_scale else None)
    model_dir = args.model.resolve() if args.model else converted_model_dir()
    if not (model_dir / "config.json").is_file() or not (model_dir / "tokenizer.json").is_file():
        parser.error(f"{model_dir}: no config.json and tokenizer.json there")
    dtype = "auto" if args.model else "float32"
    mlx_lm_args = ["--prefill-step-size", str(prefill_chunk(args.profile))] if args.profile else MLX_LM_ARGS
    suffix = "".join([f"-{model_dir.name}" if args.model else "", "-quick" * args.quick,
                      f"-c{args.contexts}" if args.contexts is not None else "",
                      f"-t{args.context_tokens}" if args.context_tokens is not None else ""])
    out = args.out or OUT_DIR / f"agent_trace{suffix}.json"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    started = time.time()

    tokens = ChatTokens(model_dir)
    rng = random.Random(SEED)
    try:
        order = sequence(plan, SEED)
        contexts = build_contexts(tokens, plan, rng)
    except RuntimeError as e:  # no trace for this many contexts, or TooFewFiles
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    turns = build_turns(tokens, plan, contexts, order, rng)
    by_name = {c.name: c for c in contexts}
    log("trace: " + " ".join(contexts[c].name for c in order))
    log("contexts: " + ", ".join(f"{c.name}={c.file} ({c.num_tokens} tok)" for c in contexts))

    with tempfile.TemporaryDirectory(prefix="omlx-agent-trace-", dir=args.dir) as tmp:
        work_dir = Path(tmp)
        sides = [
            Side(OMLX, lambda name: omlx_server(model_dir, work_dir=work_dir, max_running=4, max_queued=8,
                                                log_name=name, profile=args.profile, dtype=dtype)),
            Side(MLX_LM, lambda name: mlx_lm_server(model_dir, extra_args=mlx_lm_args, log_name=name)),
        ]
        try:
            for side in sides:
                side.start()
            results = replay(sides, turns, plan, replay_no=1, restart=True)
            sides[1].stop()  # mlx_lm is done; omlx restarts once more and replays it all
            sides[0].stop()
            log("omlx: restart, then the whole trace again")
            sides[0].start()
            results += replay(sides[:1], turns, plan, replay_no=2, restart=False)
            omlx_cache = get_json(sides[0].server.url, "/admin/api/cache")
        finally:
            for side in sides:
                side.stop()

    firsts = {(r.server, r.context): r.ttft_s for r in results if r.replay == 1 and r.first_visit}
    judge(results, by_name, firsts)
    summaries = {(s, n): summarize(results, s, n) for s, n in ((OMLX, 1), (MLX_LM, 1), (OMLX, 2))}
    targets = targets_of(summaries)
    record = {
        **run_header(__file__, argv, started=started),
        "model_dir": str(model_dir),
        "omlx_dtype": dtype,
        "profile": args.profile,
        "plan": plan,
        "max_tokens": MAX_TOKENS,
        "mlx_lm_args": mlx_lm_args,
        "hit_rules": {OMLX: f"cached_tokens >= {OMLX_HIT_SHARE:.0%} of the context's tokens",
                      MLX_LM: f"TTFT <= {MLX_LM_HIT_SHARE:.0%} of the context's first-visit TTFT"},
        "wall": "sum of the turns' client-side request times; restarts and warm-ups excluded",
        "trace": [contexts[c].name for c in order],
        "contexts": [{"name": c.name, "file": c.file, "num_tokens": c.num_tokens} for c in contexts],
        "turns": [{"turn": t.index, "context": t.context, "first_visit": t.first_visit, "after_restart": t.after_restart,
                   "prompt_tokens": t.prompt_tokens, "shared_prefix_tokens": t.shared_prefix_tokens,
                   "question": t.messages[-1]["content"]} for t in turns],
        "summary": list(summaries.values()),
        "targets": targets,
        "results": results,
        "omlx_cache_at_end": omlx_cache,
        "exit_codes": {s.name: s.exit_codes for s in sides},
        "warm_up_errors": {s.name: s.warm_up_errors for s in sides},
    }
    path = write_json(out, record)
    print(f"## Agent trace: {plan.num_contexts} contexts of {plan.min_context_tokens}-{plan.max_context_tokens} "
          f"tokens, {plan.num_turns} turns ({plan.num_turns - plan.num_contexts} revisits), restart after turn "
          f"{plan.restart_after}\n")
    print(f"Model: {model_dir} (omlx dtype {dtype}{f', profile {args.profile}' if args.profile else ''})\n")
    print("Trace: " + " ".join(contexts[c].name for c in order) + "\n")
    print(table_summary(list(summaries.values())))
    print("\n" + table_targets(targets))
    print("\n" + table_turns(turns, results, by_name))
    print(f"\nHit rules: omlx cached_tokens ≥ {OMLX_HIT_SHARE:.0%} of the context's tokens; mlx_lm.server "
          f"TTFT ≤ {MLX_LM_HIT_SHARE:.0%} of the context's first-visit TTFT (both rules are also counted for both "
          f"servers where they apply: mlx_lm 0.32.2 does report cached_tokens). Replay 2 (omlx only, after "
          f"one more restart) counts all {plan.num_turns} turns. Wall: sum of request times, restarts excluded. "
          f"mlx_lm.server args: {' '.join(mlx_lm_args)}. Each server start was warmed up with one tiny unrelated "
          f"request.\nResults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
