"""One long cold prompt through every prefill path, side by side on one model, with the
engine's host-side phases timed; then the decode right after it.

Paths, in the order `--paths` gives (each runs `--runs` times on fresh random prompts of
the same length, the last counts and the first compiles kernels; with `--new-lengths`
every run's prompt has a length no run before it had, as a user's next prompt does, and
MLX CUDA meets new attention shapes as a server would; the paths share one process, so
put the one that must not profit from the others' compiled graphs first):
- `generate_step`: mlx-lm's own single-request path (chunked prefill, then decode);
- `forward`: the bare chunked forward pass into KVCaches (the floor);
- `batch_generator`: mlx-lm's BatchGenerator (what mlx_lm.server runs);
- `engine_mlx_batch`: omlx's Engine with its prefill sent through mlx-lm's
  PromptProcessingBatch and mlx-lm's BatchKVCache (the prefill and masks before
  BENCHMARKS.md's GPU fix);
- `engine`: omlx's Engine as it is, no KV cache;
- `engine_cache`: omlx's Engine with the tiered KV cache: cold, then the same prompt again
  (a memory-tier hit).
Also: attention alone with the "causal" mask and with an array mask (what mlx-lm's batch
cache passes), and the peak memory of one prefill call by its size.

    python bench/prefill_paths.py --shape 8b --tokens 25417 --out OUT.json   # on the GPU
    .venv/bin/python bench/prefill_paths.py --shape tiny --tokens 3000 --chunk 512   # CPU dry run

The model is generated in process (bench/gpu_model.py); `--tokenizer` names a dir with
tokenizer.json (default: the converted test model's).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from bench.gpu_model import generate  # noqa: E402

PHASES: dict[str, list[float]] = defaultdict(list)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def timed(owner, name: str, label: str) -> None:
    """Wraps `owner.name` to record each call's host time under `label`."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            PHASES[label].append(time.perf_counter() - started)

    setattr(owner, name, wrapper)


def phase_summary() -> dict:
    out = {k: {"calls": len(v), "total_s": round(sum(v), 4), "max_s": round(max(v), 4)}
           for k, v in sorted(PHASES.items())}
    PHASES.clear()
    return out


def sync() -> None:
    mx.synchronize()


def prompt_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def decode_stats(times: list[float]) -> dict:
    """Returns TTFT and per-token decode figures from token arrival times (s from send)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    steady = sorted(gaps[1:])  # after the first gap, where a save of the prompt's blocks lands
    return {"ttft_s": round(times[0], 4), "tokens": len(times),
            "decode_median_ms": round(1000 * steady[len(steady) // 2], 2) if steady else None,
            "decode_ms": round(1000 * sum(gaps) / len(gaps), 2) if gaps else None,
            "decode_max_gap_ms": round(1000 * max(gaps), 2) if gaps else None,
            "decode_first5_ms": [round(1000 * g, 1) for g in gaps[:5]]}


# --- the paths --------------------------------------------------------------------------------


def run_generate_step(model, prompt, *, chunk: int, decode: int) -> dict:
    from mlx_lm.generate import generate_step

    sync()
    started = time.perf_counter()
    times = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=decode + 1, prefill_step_size=chunk):
        times.append(time.perf_counter() - started)
    return decode_stats(times)


def run_forward(model, prompt, *, chunk: int, clear: bool = False) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    ids = mx.array(prompt)[None]
    sync()
    started = time.perf_counter()
    for s in range(0, len(prompt), chunk):
        model(ids[:, s:s + chunk], cache=cache)
        mx.eval([c.state for c in cache])
        if clear:
            mx.clear_cache()
    return {"prefill_s": round(time.perf_counter() - started, 4)}


def run_batch_generator(model, prompt, *, chunk: int, decode: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=decode + 1, prefill_step_size=chunk, stop_tokens=[])
    sync()
    started = time.perf_counter()
    (uid,) = gen.insert([prompt], max_tokens=[decode + 1])
    times: list[float] = []
    for _ in range(100 * (decode + 2)):  # bounded: a stuck generator must not hang the run
        responses = gen.next_generated()
        now = time.perf_counter() - started
        times.extend(now for r in responses if r.uid == uid)
        if any(r.uid == uid and r.finish_reason for r in responses) or len(times) > decode:
            break
    gen.close()
    return decode_stats(times)


def run_engine(engine, prompt, *, decode: int) -> dict:
    from appliance.engine.request import GenerationRequest, SamplingParams

    async def go():
        times = []
        started = time.perf_counter()
        handle = engine.submit(GenerationRequest(prompt_tokens=tuple(prompt), max_tokens=decode + 1,
                                                 sampling=SamplingParams(temperature=0)))
        async for event in handle:
            if getattr(event, "token_ids", None):
                times.extend([time.perf_counter() - started] * len(event.token_ids))
        return times, handle.stats

    times, stats = asyncio.run(go())
    out = decode_stats(times)
    out["cached_tokens"] = stats.cached_tokens
    return out


# --- attention and memory probes ------------------------------------------------------------


def attention_probe(cfg: dict, *, q_tokens: int, kv_tokens: int) -> dict:
    """Times SDPA at one layer's shape with the "causal" mask and with a boolean array mask."""
    from mlx_lm.models.base import create_causal_mask

    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    q = mx.random.normal((1, heads, q_tokens, dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, kv_heads, kv_tokens, dim)).astype(mx.bfloat16)
    v = mx.random.normal((1, kv_heads, kv_tokens, dim)).astype(mx.bfloat16)
    array_mask = create_causal_mask(q_tokens, offset=kv_tokens - q_tokens, left_padding=mx.array([0]))
    mx.eval(q, k, v, array_mask)
    out = {}
    for name, mask in (("causal", "causal" if q_tokens > 1 else None), ("array", array_mask)):
        f = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5, mask=mask)  # noqa: E731
        mx.eval(f())
        sync()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        started = time.perf_counter()
        for _ in range(5):
            mx.eval(f())
        sync()
        out[name] = {"ms": round(200 * (time.perf_counter() - started), 3),
                     "peak_extra_gb": round((mx.get_peak_memory() - base) / 1e9, 3)}
    return out


def call_memory_probe(model, *, context: int, sizes: list[int]) -> dict:
    """Returns the peak memory above the cache of one prefill call of each size after
    `context` tokens (plain KVCaches, "causal" mask)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    rng = random.Random(7)
    cache = make_prompt_cache(model)
    ids = mx.array(prompt_of(rng, context))[None]
    for s in range(0, context, 2048):
        model(ids[:, s:s + 2048], cache=cache)
        mx.eval([c.state for c in cache])
    for n in sizes:
        for c in cache:
            c.offset = context  # trim back: every probe call starts at the same context
        extra = mx.array(prompt_of(rng, n))[None]
        mx.eval(extra)
        sync()
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        started = time.perf_counter()
        try:
            mx.eval(model(extra, cache=cache))
            sync()
            out[n] = {"s": round(time.perf_counter() - started, 4),
                      "peak_extra_gb": round((mx.get_peak_memory() - base) / 1e9, 3),
                      "per_token_mb": round((mx.get_peak_memory() - base) / n / 1e6, 3)}
        except Exception as e:  # an allocation failure is a result here
            out[n] = {"error": str(e)[:200]}
        log(f"call of {n} tokens at context {context}: {out[n]}")
    del cache
    mx.clear_cache()
    return out


# --- main ------------------------------------------------------------------------------------


def generated_model(shape: str, *, tokenizer: Path | None, memory_limit_gb: float):
    """Returns (model, config, tokenizer dir, seconds it took) of a generated model of
    `shape`, with MLX's memory limit set on a GPU; the tokenizer defaults to the converted
    test model's."""
    if mx.default_device() == mx.gpu:
        mx.set_memory_limit(int(memory_limit_gb * 2**30))
    if tokenizer is None:
        from bench.common import converted_model_dir
        tokenizer = converted_model_dir()
    started = time.perf_counter()
    model, cfg = generate(shape)
    return model, cfg, tokenizer, round(time.perf_counter() - started, 2)


def loaded_model(model, cfg, tokenizer_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from appliance.models.loaded import LoadedModel
    from appliance.spec import ModelSpec

    return LoadedModel(spec=ModelSpec(name="bench", source=str(tokenizer_dir)), path=tokenizer_dir,
                       model=model, tokenizer=load_tokenizer(tokenizer_dir), context_tokens=65536,
                       dtype="bfloat16", load_s=0.0)


def instrument() -> None:
    from appliance.cache import kv, model_cache, store
    from appliance.engine import engine, mlxlm_seam, scheduler

    timed(scheduler.Scheduler, "_prompt", "scheduler.prefill_call")
    timed(scheduler.Scheduler, "_decode", "scheduler.decode_step")
    timed(scheduler.Scheduler, "_start", "scheduler.start")
    timed(scheduler.Scheduler, "advance", "scheduler.advance")
    timed(scheduler.Scheduler, "extract", "scheduler.extract")
    timed(engine.Engine, "_prefilled", "engine.prefilled(save)")
    timed(engine.Engine, "_restore", "engine.restore")
    timed(engine.Engine, "_save", "engine.save")
    timed(model_cache, "cut_blocks", "kv.cut_blocks")
    timed(store.KVStore, "save", "store.save")
    timed(store, "to_bytes", "store.to_bytes")
    timed(model_cache, "build_batch_cache", "kv.build_batch_cache")
    # Inside scheduler.start, after its prefill calls: the started rows' own generation
    # batch (on GPUs mlx-lm's priming pass, a decode step of those rows alone) and its
    # merge into the running one.
    timed(mlxlm_seam.LeanGeneration, "__init__", "generation.new_rows")
    timed(mlxlm_seam.LeanGeneration, "extend", "generation.extend")
    _ = kv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--tokens", type=int, default=25417)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--step-ms", type=int, default=250)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="per path; the first compiles kernels")
    parser.add_argument("--memory-limit-gb", type=float, default=100.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--paths", default="probe,generate_step,forward,batch_generator,engine_mlx_batch,"
                                           "engine,engine_cache")
    parser.add_argument("--probe-sizes", default="2048,4096,8192,16384")
    parser.add_argument("--new-lengths", action="store_true",
                        help="every run a prompt length not seen before (MLX CUDA builds graphs per shape)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    paths = args.paths.split(",")

    from appliance.cache.kv import probe_layout
    from appliance.cache.model_cache import ModelCache
    from appliance.cache.store import KVStore
    from appliance.engine import scheduler
    from appliance.engine.engine import Engine
    from appliance.spec import BatchingSpec

    def write(data: dict) -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(data, indent=1, default=str))

    model, cfg, tokenizer_dir, model_s = generated_model(args.shape, tokenizer=args.tokenizer,
                                                         memory_limit_gb=args.memory_limit_gb)
    results: dict = {"shape": args.shape, "config": cfg, "tokens": args.tokens, "chunk": args.chunk,
                     "device": str(mx.default_device()), "mlx": mx.__version__,
                     "device_info": {k: v for k, v in mx.device_info().items() if isinstance(v, (int, str, float))},
                     "model_s": model_s, "paths": {}}
    log(f"model {args.shape} generated in {results['model_s']} s on {mx.default_device()}")
    loaded = loaded_model(model, cfg, tokenizer_dir)
    rng = random.Random(0)
    limits = BatchingSpec(prefill_chunk_tokens=args.chunk, prefill_step_ms=args.step_ms, max_running=32)

    lengths = iter(range(args.tokens, 0, -61))  # --new-lengths: every run a length not seen before

    def record(name: str, fn) -> None:
        runs = []
        mx.clear_cache()
        for i in range(args.runs):  # no clear_cache between runs: a server reuses its buffers too
            runs.append(fn(prompt_of(rng, next(lengths) if args.new_lengths else args.tokens)))
            runs[-1]["phases"] = phase_summary()
            log(f"{name} run {i}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'phases'})}")
            log(f"  phases: {json.dumps(runs[-1]['phases'])}")
        results["paths"][name] = runs
        write(results)
        mx.clear_cache()

    def generate_step_path() -> None:
        record("generate_step", lambda p: run_generate_step(model, p, chunk=args.chunk, decode=args.decode))

    def forward_path() -> None:
        record("forward", lambda p: run_forward(model, p, chunk=args.chunk))
        record("forward_clear_cache", lambda p: run_forward(model, p, chunk=args.chunk, clear=True))

    def batch_generator_path() -> None:
        record("batch_generator", lambda p: run_batch_generator(model, p, chunk=args.chunk, decode=args.decode))

    def engine_mlx_batch_path() -> None:  # the engine as it was: mlx-lm's prefill and masks
        from mlx_lm.models.cache import BatchKVCache

        own, own_cache = scheduler.Scheduler._prompt, scheduler.BatchCache
        scheduler.Scheduler._prompt = lambda self, batch, todo: batch.prompt(todo)
        scheduler.BatchCache = BatchKVCache
        engine = Engine(loaded, limits).start()
        record("engine_mlx_batch", lambda p: run_engine(engine, p, decode=args.decode))
        engine.stop(drain_s=0)
        scheduler.Scheduler._prompt, scheduler.BatchCache = own, own_cache

    def engine_path() -> None:
        engine = Engine(loaded, limits).start_warm()  # as a server: ready once warmed up
        record("engine", lambda p: run_engine(engine, p, decode=args.decode))
        engine.stop(drain_s=0)

    def engine_cache_path() -> None:
        with tempfile.TemporaryDirectory(prefix="omlx-bench-") as tmp:
            store = KVStore(root=Path(tmp) / "kv", memory_bytes=32 << 30, host_bytes=64 << 30,
                            ssd_bytes=256 << 30)
            cache = ModelCache(store, weights=f"bench-{args.shape}", compute_dtype="bfloat16",
                               layout=probe_layout(model), block_tokens=512)
            engine = Engine(loaded, limits, cache=cache).start_warm()
            record("engine_cache", lambda p: run_engine(engine, p, decode=args.decode))
            repeat = prompt_of(rng, next(lengths) if args.new_lengths else args.tokens)
            runs = []
            for label in ("cold", "memory_hit", "memory_hit_again"):
                runs.append({"label": label, **run_engine(engine, repeat, decode=args.decode)})
                runs[-1]["phases"] = phase_summary()
                log(f"engine_cache {label}: {json.dumps({k: v for k, v in runs[-1].items() if k != 'phases'})}")
                log(f"  phases: {json.dumps(runs[-1]['phases'])}")
            results["paths"]["engine_cache_repeat"] = runs
            results["store"] = store.stats()
            engine.stop(drain_s=0)
            store.close()

    runners = {"generate_step": generate_step_path, "forward": forward_path, "batch_generator": batch_generator_path,
               "engine_mlx_batch": engine_mlx_batch_path, "engine": engine_path, "engine_cache": engine_cache_path}
    instrumented = False
    for name in paths:  # in the order given: each path's first run meets the graphs those before it built
        if name.startswith("engine") and not instrumented:
            instrument()
            instrumented = True
        if name in runners:
            runners[name]()
    results["peak_memory_gb"] = round(mx.get_peak_memory() / 1e9, 2)
    summary(results)
    write(results)
    if "probe" in paths:  # last: a failed allocation must not cost the paths' results
        kv_tokens = args.tokens
        results["attention"] = {q: attention_probe(cfg, q_tokens=q, kv_tokens=kv_tokens)
                                for q in (1, args.chunk, 4 * args.chunk) if q <= kv_tokens}
        log(f"attention at context {kv_tokens}: {json.dumps(results['attention'])}")
        write(results)
        sizes = [int(s) for s in args.probe_sizes.split(",") if s]
        results["call_memory"] = call_memory_probe(model, context=max(args.tokens - max(sizes), 2048), sizes=sizes)
        write(results)
    return 0


def summary(results: dict) -> None:
    """Prints one line per path (last run) and the ratios against the bare forward pass."""
    paths = results["paths"]
    floor = paths.get("forward", [{}])[-1].get("prefill_s")
    log(f"--- {results['shape']}, {results['tokens']} tokens, chunk {results['chunk']}, {results['device']}")
    for name, runs in paths.items():
        r = runs[-1]
        first = r.get("ttft_s", r.get("prefill_s"))
        ratio = f"{first / floor:.2f}x forward" if floor and first else ""
        log(f"{name:24s} ttft/prefill {first} s {ratio}  decode {r.get('decode_ms')} ms/token, "
            f"median {r.get('decode_median_ms')} "
            f"(max gap {r.get('decode_max_gap_ms')} ms)")
    if results["paths"].get("engine_cache_repeat"):
        for r in results["paths"]["engine_cache_repeat"]:
            log(f"  engine_cache {r['label']:16s} ttft {r['ttft_s']} s decode {r['decode_ms']} ms/token "
                f"(median {r['decode_median_ms']}, first gap {r['decode_first5_ms'][:1]}) "
                f"cached {r['cached_tokens']}")


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # MLX's stream threads abort at interpreter teardown after an engine ran
