"""N short prompts at once, in process: omlx's Engine against mlx-lm's BatchGenerator
(what `batch_generate` runs), on one model, with the engine's phases timed.

Where throughput.py measures tok/s over HTTP, this splits one wave's time into its
parts: the time to the wave's first and last first token, the decode step (median and
mean), and the engine's host-side phases (start, prefill calls, decode steps). Each round
uses fresh prompts of new random lengths (new shapes); the same prompts are then sent
again (shapes already seen), so what compiling per shape costs shows as the difference.

    python bench/batch_steps.py --shape 8b --n 8,32 --out OUT.json        # on the GPU
    .venv/bin/python bench/batch_steps.py --shape tiny --n 4 --decode 8   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from bench.prefill_paths import generated_model, instrument, loaded_model, log, phase_summary, prompt_of  # noqa: E402


def wave_stats(first: list[float], times: list[list[float]], started_at: float = 0.0) -> dict:
    """Returns a wave's figures from each request's token arrival times (s from send)."""
    gaps = sorted(b - a for t in times for a, b in zip(t[1:], t[2:]))  # after each one's first gap
    tokens = sum(map(len, times))
    wall = max(t[-1] for t in times if t) - started_at
    return {"requests": len(times), "tokens": tokens, "wall_s": round(wall, 4), "tok_s": round(tokens / wall, 1),
            "first_token_min_s": round(min(first), 4), "first_token_max_s": round(max(first), 4),
            "first_token_p50_s": round(statistics.median(first), 4),
            "gap_median_ms": round(1000 * gaps[len(gaps) // 2], 2) if gaps else None,
            "gap_mean_ms": round(1000 * statistics.fmean(gaps), 2) if gaps else None}


def run_batch_generator(model, prompts: list[list[int]], *, decode: int, chunk: int) -> dict:
    """One wave through mlx-lm's BatchGenerator as batch_generate sets it up for N prompts."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=decode, stop_tokens=[], completion_batch_size=n,
                         prefill_batch_size=min(n, 8), prefill_step_size=chunk)
    mx.synchronize()
    started = time.perf_counter()
    uids = gen.insert(prompts, max_tokens=[decode] * n)
    times: dict[int, list[float]] = {u: [] for u in uids}
    done: set[int] = set()
    for _ in range(100 * (decode + 2)):  # bounded: a stuck generator must not hang the run
        for r in gen.next_generated():
            times[r.uid].append(time.perf_counter() - started)
            if r.finish_reason:
                done.add(r.uid)
        if len(done) == n:
            break
    gen.close()
    return wave_stats([t[0] for t in times.values()], list(times.values()))


def run_engine(engine, prompts: list[list[int]], *, decode: int) -> dict:
    from appliance.engine.request import GenerationRequest, SamplingParams

    async def one(started: float, prompt: list[int]) -> list[float]:
        times: list[float] = []
        handle = engine.submit(GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=decode,
                                                 sampling=SamplingParams(temperature=0)))
        async for event in handle:
            if getattr(event, "token_ids", None):
                times.extend([time.perf_counter() - started] * len(event.token_ids))
        return times

    async def go() -> list[list[float]]:
        started = time.perf_counter()
        return await asyncio.gather(*(one(started, p) for p in prompts))

    times = asyncio.run(go())
    return wave_stats([t[0] for t in times], times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--n", default="8,32", help="wave sizes")
    parser.add_argument("--prompt-tokens", default="100,150", help="min,max length of each prompt")
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="per N: fresh lengths, then the same again")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--memory-limit-gb", type=float, default=100.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from appliance.engine.engine import Engine
    from appliance.spec import BatchingSpec

    model, cfg, tokenizer_dir, model_s = generated_model(args.shape, tokenizer=args.tokenizer,
                                                         memory_limit_gb=args.memory_limit_gb)
    results: dict = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__,
                     "model_s": model_s, "decode": args.decode, "waves": []}
    log(f"model {args.shape} generated in {results['model_s']} s on {mx.default_device()}")
    lo, hi = map(int, args.prompt_tokens.split(","))
    rng = random.Random(0)
    instrument()
    engine = Engine(loaded_model(model, cfg, tokenizer_dir),
                    BatchingSpec(prefill_chunk_tokens=args.chunk, max_running=64)).start()

    def record(n: int, label: str, name: str, fn, prompts) -> None:
        phase_summary()
        wave = {"n": n, "label": label, "path": name, **fn(prompts), "phases": phase_summary()}
        results["waves"].append(wave)
        log(json.dumps({k: v for k, v in wave.items() if k != "phases"}))
        if name == "engine":
            log(f"  phases: {json.dumps(wave['phases'])}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    try:
        for n in map(int, args.n.split(",")):
            for r in range(args.rounds):
                prompts = [prompt_of(rng, rng.randint(lo, hi)) for _ in range(n)]
                for label in ("new lengths", "same again"):
                    record(n, f"round {r} {label}", "batch_generator",
                           lambda p: run_batch_generator(model, p, decode=args.decode, chunk=args.chunk), prompts)
                    record(n, f"round {r} {label}", "engine", lambda p: run_engine(engine, p, decode=args.decode),
                           prompts)
    finally:
        engine.stop(drain_s=0)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's stream threads abort at interpreter teardown after an engine ran
