"""Short requests while a long prompt prefills, in process, with every scheduler call traced.

throughput.py's scenario B measures this over HTTP (8 clients send short requests 1 s
after a 25K-token prompt); this runs the same load straight into omlx's Engine with the
tiered KV cache of `omlx serve` under the nvidia-h200 profile, and records each step of
the engine's scheduler: when it started prompts (rows, padded tokens), ran a decode pass
(rows), advanced the long prompt (tokens, context), and how long each took. So the
shorts' first tokens and the long prompt's own TTFT can be read off the steps that made
them.

Each round: the shorts alone, then the long prompt with the shorts sent `--delay-s`
after it, all new prompts (the first round also meets its shapes for the first time).

    python bench/long_and_shorts.py --shape 8b --tokenizer TOKENIZER_DIR --out OUT.json   # on the GPU
    .venv/bin/python bench/long_and_shorts.py --shape tiny --long-tokens 3000 --rounds 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from bench.batch_steps import cached_engine, stop_engines  # noqa: E402
from bench.prefill_paths import generated_model, loaded_model, log, prompt_of  # noqa: E402

TRACE: list[dict] = []  # one entry per traced scheduler call, in order
CLOCK = [0.0]  # the round's start: trace times are seconds after it


def traced(name: str, describe) -> None:
    """Wraps `Scheduler.name` to append (start, seconds, `describe(self, args, result)`) to TRACE."""
    from appliance.engine.scheduler import Scheduler

    original = getattr(Scheduler, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        started = time.perf_counter()
        result = original(self, *args, **kwargs)
        entry = {"at_s": round(started - CLOCK[0], 4), "call": name,
                 "s": round(time.perf_counter() - started, 4), **describe(self, args, result)}
        if entry.get("rows", 1) and entry.get("tokens", 1):  # not the steps that started or advanced nothing
            TRACE.append(entry)
        return result

    setattr(Scheduler, name, wrapper)


def trace_scheduler() -> None:
    traced("_start", lambda s, a, r: {"rows": len(r), "calls": s.last_prefill_calls})
    traced("_decode", lambda s, a, r: {"rows": s.num_generating, "batches": len(s._generations), "tokens_out": len(r)})
    traced("advance", lambda s, a, r: {"tokens": s.last_advanced_tokens,
                                       "left": sum(p.todo for p in s._prefills)})
    traced("_prompt", lambda s, a, r: {"rows": len(a[1]), "tokens": max(map(len, a[1])),
                                       "context": max(len(t) for t in a[0].tokens)})


def run_round(engine, shorts: list[list[int]], long: list[int] | None, *, delay_s: float,
              short_tokens: int) -> dict:
    """Sends `long` (if any), then after `delay_s` every one of `shorts`; returns their times."""
    from appliance.engine.request import GenerationRequest, SamplingParams

    async def one(prompt: list[int], max_tokens: int, sent_after: float) -> dict:
        await asyncio.sleep(sent_after)
        sent = time.perf_counter()
        handle = engine.submit(GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=max_tokens,
                                                 sampling=SamplingParams(temperature=0)))
        times = []
        async for event in handle:
            if getattr(event, "token_ids", None):
                times.extend([time.perf_counter() - sent] * len(event.token_ids))
        return {"sent_s": round(sent - CLOCK[0], 4), "ttft_s": round(times[0], 4) if times else None,
                "total_s": round(times[-1], 4) if times else None, "tokens": len(times),
                "cached_tokens": handle.stats.cached_tokens}

    async def go() -> list[dict]:
        CLOCK[0] = time.perf_counter()
        tasks = [one(p, short_tokens, delay_s if long else 0.0) for p in shorts]
        if long:
            tasks.insert(0, one(long, short_tokens, 0.0))
        return await asyncio.gather(*tasks)

    TRACE.clear()
    results = asyncio.run(go())
    out = {"long": results[0] if long else None, "shorts": results[1:] if long else results,
           "trace": list(TRACE)}
    ttfts = [r["ttft_s"] for r in out["shorts"] if r["ttft_s"] is not None]
    out["shorts_ttft_p50_s"] = round(statistics.median(ttfts), 4) if ttfts else None
    out["shorts_ttft_max_s"] = round(max(ttfts), 4) if ttfts else None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--long-tokens", type=int, default=25000)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--short-prompt-tokens", default="100,150", help="min,max length of each short prompt")
    parser.add_argument("--short-tokens", type=int, default=16, help="tokens each request generates")
    parser.add_argument("--delay-s", type=float, default=1.0, help="the shorts are sent this long after the long")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--memory-limit-gb", type=float, default=100.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from appliance.spec import BatchingSpec

    model, cfg, tokenizer_dir, model_s = generated_model(args.shape, tokenizer=args.tokenizer,
                                                         memory_limit_gb=args.memory_limit_gb)
    log(f"model {args.shape} generated in {model_s} s on {mx.default_device()}")
    trace_scheduler()
    loaded = loaded_model(model, cfg, tokenizer_dir)
    limits = BatchingSpec(prefill_chunk_tokens=args.chunk, max_running=64)
    results: dict = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__,
                     "long_tokens": args.long_tokens, "delay_s": args.delay_s,
                     "prefill_step_ms": limits.prefill_step_ms, "rounds": []}
    lo, hi = map(int, args.short_prompt_tokens.split(","))
    rng = random.Random(0)
    tmp = tempfile.TemporaryDirectory(prefix="omlx-long-and-shorts-")
    engine = cached_engine(loaded, limits, Path(tmp.name) / "kv")
    try:
        for r in range(args.rounds):
            for label, long in (("shorts alone", None), ("shorts during the long", prompt_of(rng, args.long_tokens))):
                shorts = [prompt_of(rng, rng.randint(lo, hi)) for _ in range(args.shorts)]
                out = {"round": r, "label": label, **run_round(engine, shorts, long, delay_s=args.delay_s,
                                                                short_tokens=args.short_tokens)}
                results["rounds"].append(out)
                log(json.dumps({k: v for k, v in out.items() if k not in ("trace", "shorts")}))
                for entry in out["trace"]:
                    log(f"  {json.dumps(entry)}")
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1))
    finally:
        stop_engines([engine], tmp)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's stream threads abort at interpreter teardown after an engine ran
