"""N short prompts at once, in process: omlx's Engine against mlx-lm's BatchGenerator
(what `batch_generate` runs), on one model, with the engine's phases timed.

Where throughput.py measures tok/s over HTTP, this splits one wave's time into its
parts: the time to the wave's first and last first token, the decode step (median and
mean), and the engine's host-side phases (start, prefill calls, decode steps). Each round
uses fresh prompts of new random lengths (new shapes); the same prompts are then sent
again (shapes already seen), so what compiling per shape costs shows as the difference.

Paths (`--paths`): `batch_generator`; `engine` (no KV cache, all prompts submitted at
once); `engine_cache` (with the tiered KV cache `omlx serve` gives it under the
nvidia-h200 profile's budgets: saves at each finish, lookups at each admission);
`engine_stagger` (with that cache, the prompts submitted `--stagger-ms` apart, as HTTP
requests arrive); `engine_cache_nowrite` (that cache without the SSD write-through, whose
device-to-host copies run beside the decode steps). Each engine wave also records the engine's own time by phase
(`Engine.phase_s`). Over HTTP on an H200 a wave of 8 waited 0.38-0.63 s in the engine for
its first tokens, against 0.09-0.27 s here without a cache: these paths split the
difference. `--busy-share` adds a Python thread holding the GIL part of the time, as the
server's event loop does, to see what that costs the engine's host-bound calls;
`--shared-prefix` starts every prompt with the same tokens, as chat prompts share their
template's, so that the cached paths restore them before each start.

    python bench/batch_steps.py --shape 8b --n 8,32 --out OUT.json        # on the GPU
    .venv/bin/python bench/batch_steps.py --shape tiny --n 4 --decode 8 --rounds 1   # CPU dry run
"""

from __future__ import annotations

import argparse
import asyncio
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


def run_engine(engine, prompts: list[list[int]], *, decode: int, stagger_s: float = 0.0) -> dict:
    """One wave through omlx's Engine, the prompts submitted `stagger_s` apart; adds the
    engine's seconds by phase over the wave."""
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
        tasks = []
        for i, p in enumerate(prompts):
            if i and stagger_s:
                await asyncio.sleep(stagger_s)
            tasks.append(asyncio.create_task(one(started, p)))
        return await asyncio.gather(*tasks)

    before = dict(engine.phase_s)
    times = asyncio.run(go())
    phases = {k: round(v - before.get(k, 0.0), 4) for k, v in engine.phase_s.items()}
    return {**wave_stats([t[0] for t in times], times), "engine_phases_s": phases}


def cached_engine(loaded, limits, root: Path, *, write_through: bool = True):
    """Returns a started Engine with the tiered KV cache of `omlx serve` under the
    nvidia-h200 profile (its budgets and block size; the SSD tier in `root`); without
    `write_through`, saved blocks are not written through to the SSD (its writer takes
    none), which splits what the writes cost the engine from what the rest of the cache
    does."""
    from appliance.cache.kv import probe_layout
    from appliance.cache.model_cache import ModelCache
    from appliance.cache.store import KVStore
    from appliance.engine.engine import Engine
    from appliance.kernels.registry import apply
    from appliance.spec import KernelsSpec

    store = KVStore(root=root, memory_bytes=32 << 30, host_bytes=64 << 30, ssd_bytes=256 << 30)
    apply(KernelsSpec().model_dump(), store.use_native)  # [kernels] auto, as the server
    if not write_through:
        store.writer.max_pending_bytes = 0  # every block is dropped before it is copied
    layout = probe_layout(loaded.model)
    store.expect_layout(dtype=layout.dtype, k_dim=layout.k_head_dim, v_dim=layout.v_head_dim)
    cache = ModelCache(store, weights="bench-batch-steps", compute_dtype=str(loaded.dtype),
                       layout=layout, block_tokens=512)
    engine = Engine(loaded, limits, cache=cache).start_warm()
    store.wait_warm(30)
    return engine


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
    parser.add_argument("--paths", default="batch_generator,engine,engine_cache,engine_stagger")
    parser.add_argument("--stagger-ms", type=float, default=3.0, help="engine_stagger: between submissions")
    parser.add_argument("--busy-share", type=float, default=0.0,
                        help="a Python thread beside the engine holds the GIL this share of the time "
                             "(in 2 ms slices), as an event loop serving HTTP streams would")
    parser.add_argument("--shared-prefix", type=int, default=0, metavar="TOKENS",
                        help="every prompt starts with the same TOKENS tokens, as chat prompts share their "
                             "template's (~31 in bench/throughput.py): the cached paths restore them")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paths = args.paths.split(",")
    if args.busy_share > 0:
        busy_beside(args.busy_share)

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
    loaded = loaded_model(model, cfg, tokenizer_dir)
    limits = BatchingSpec(prefill_chunk_tokens=args.chunk, max_running=64)
    tmp = tempfile.TemporaryDirectory(prefix="omlx-batch-steps-")
    engines = {}
    if "engine" in paths:
        engines["engine"] = Engine(loaded, limits).start()
    if "engine_cache" in paths or "engine_stagger" in paths:
        cached = cached_engine(loaded, limits, Path(tmp.name) / "kv")
        engines.update({name: cached for name in ("engine_cache", "engine_stagger") if name in paths})
    if "engine_cache_nowrite" in paths:
        engines["engine_cache_nowrite"] = cached_engine(loaded, limits, Path(tmp.name) / "kv-nowrite",
                                                        write_through=False)

    def record(n: int, label: str, name: str, fn, prompts) -> None:
        phase_summary()
        wave = {"n": n, "label": label, "path": name, **fn(prompts), "phases": phase_summary()}
        results["waves"].append(wave)
        log(json.dumps({k: v for k, v in wave.items() if k != "phases"}))
        if name.startswith("engine"):
            log(f"  phases: {json.dumps(wave['phases'])}")
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    shared = prompt_of(random.Random(1), args.shared_prefix)  # every prompt's first tokens
    try:
        for n in map(int, args.n.split(",")):
            for r in range(args.rounds):
                prompts = [shared + prompt_of(rng, max(1, rng.randint(lo, hi) - len(shared))) for _ in range(n)]
                for label in ("new lengths", "same again"):
                    if "batch_generator" in paths:
                        record(n, f"round {r} {label}", "batch_generator",
                               lambda p: run_batch_generator(model, p, decode=args.decode, chunk=args.chunk),
                               prompts)
                    for name, engine in engines.items():
                        stagger = args.stagger_ms / 1000 if name == "engine_stagger" else 0.0
                        # A cached path's prompts are its own each time (a token of their own
                        # after the shared prefix): a prompt it saw would be a cache hit.
                        mark, k = 7 + len(name) + 40 * r + 20 * (label == "same again"), args.shared_prefix
                        own = prompts if name == "engine" else [[*p[:k], mark, *p[k + 1:]] for p in prompts]
                        record(n, f"round {r} {label}", name,
                               lambda p, e=engine, s=stagger: run_engine(e, p, decode=args.decode, stagger_s=s), own)
    finally:
        stop_engines(engines.values(), tmp)
    return 0


def busy_beside(share: float, *, slice_s: float = 0.002) -> None:
    """Starts a daemon thread that runs Python (holding the GIL) `share` of the time, in
    slices of `slice_s`, and sleeps the rest."""
    import threading

    def spin() -> None:
        work = {"choices": [{"delta": {"content": "x" * 16}, "index": i} for i in range(8)]}
        while True:
            until = time.perf_counter() + slice_s * share
            while time.perf_counter() < until:
                json.loads(json.dumps(work))
            time.sleep(slice_s * (1 - share))

    threading.Thread(target=spin, daemon=True, name="busy").start()


def stop_engines(engines, tmp: tempfile.TemporaryDirectory) -> None:
    """Stops each of `engines` once and closes its store, then removes `tmp`."""
    for engine in {id(e): e for e in engines}.values():
        engine.stop(drain_s=0)
        if engine.cache is not None:
            engine.cache.store.close()  # its SSD writer is done before the dir goes
    tmp.cleanup()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's stream threads abort at interpreter teardown after an engine ran
