"""Cold prefill of one lone prompt, in process, at several `[batching] prefill_step_ms`.

Time-sliced chunks keep other streams flowing, but each chunk pays a pass over the
weights; this measures what slicing costs a prompt that is prefilled alone. For each
value an `Engine` (prefill_chunk_tokens 512) gets a 300-token warm-up prompt, then a
`--tokens`-token prompt of random ids; the time to its first token is printed.

    .venv/bin/python bench/cold_prefill.py [--tokens 2000] [250 1000 0]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import converted_model_dir  # noqa: E402


async def ttft(engine, num_tokens: int, rng: random.Random) -> float:
    from appliance.engine.request import GenerationRequest, SamplingParams

    prompt = tuple(rng.randrange(100, 40000) for _ in range(num_tokens))
    started = time.perf_counter()
    async for _ in engine.submit(GenerationRequest(prompt_tokens=prompt, max_tokens=2,
                                                   sampling=SamplingParams(temperature=0))):
        return time.perf_counter() - started
    raise RuntimeError("no token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("step_ms", type=int, nargs="*", default=[250, 1000, 0])
    args = parser.parse_args()
    from appliance.engine.engine import Engine
    from appliance.models.loaded import load_model
    from appliance.spec import BatchingSpec, ModelSpec

    model_dir = converted_model_dir()
    loaded = load_model(ModelSpec(name="bench", source=str(model_dir), max_context_tokens=8192),
                        base_dir=model_dir, cache_dir=model_dir.parent)
    for step_ms in args.step_ms:
        rng = random.Random(0)
        engine = Engine(loaded, BatchingSpec(prefill_chunk_tokens=512, prefill_step_ms=step_ms)).start()

        async def run():
            await ttft(engine, 300, rng)
            return await ttft(engine, args.tokens, rng)

        print(f"prefill_step_ms={step_ms}: {args.tokens}-token cold TTFT {asyncio.run(run()):.2f} s", flush=True)
        engine.stop(drain_s=0)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # MLX's stream threads abort at interpreter teardown after an engine ran in-process
    # ("terminate called without an active exception"); the figures are already out.
    os._exit(code)
