"""What a change of a decoding batch's rows costs: the decode pass after rows join or leave.

Over HTTP on an H100 the first decode pass after rows joined a decoding batch (mlx-lm's
`GenerationBatch.extend`) or left it (`filter`) took 40-100 ms, against 9-15 ms for the
passes around it (BENCHMARKS.md, "Gathering a wave"). This runs omlx's Scheduler in
process, set up as `omlx serve` sets it up on this device, through a fixed script: N short
prompts start together, then one prompt joins, then four, then two rows finish, then one
joins, then the rest finish. Every step's calls are timed (the scheduler's `last_calls`).

Each script runs in two modes. `pipelined` is the engine as it runs. `split` drains the
device before each step (`mx.synchronize()`, timed: the device time of the step before,
which a pipelined pass waits for), evaluates the arrays a join or a leave leaves lazy
right where it happens (timed), and times the host's building of each pass's graph apart
(the model call), so that the pass after a change splits into the work of the change,
the graph, and the device. Each mode runs the script twice: shapes the first met are
warm in the second. Each step also lists the kernels MLX compiled in it (the files it
added to its kernel cache, `appliance.platform.default_kernel_dir()`; run with a fresh
TMPDIR to start from an empty cache, as a machine's first run does).

    TMPDIR=$(mktemp -d) python bench/batch_change.py --shape 8b --tokenizer .gpu/tok --out OUT.json  # GPU
    .venv/bin/python bench/batch_change.py --shape tiny --rows 4 --out /tmp/bc.json  # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from appliance.platform import default_kernel_dir  # noqa: E402
from bench.prefill_paths import generated_model, loaded_model, log, prompt_of  # noqa: E402

JOINS = {12: 1, 24: 4, 48: 1}  # step -> prompts that start then
LEAVE_2_AT, LEAVE_ALL_AT = 36, 64  # the decoded tokens after which two rows, then all, finish


class Split:
    """The `split` mode's probes: the model call's time (graph building, the device runs
    nothing until evaluated) and the evaluation of what a join or leave leaves lazy."""

    def __init__(self, model):
        self.on = False
        self.build_ms = 0.0
        self.change_ms = 0.0
        self._model_call = type(model).__call__
        split = self

        def call(self_, inputs, *args, **kwargs):
            started = time.perf_counter()
            out = split._model_call(self_, inputs, *args, **kwargs)
            if split.on and inputs.shape[1] == 1:  # a decode pass, not a start call
                split.build_ms += 1000 * (time.perf_counter() - started)
            return out

        type(model).__call__ = call
        from appliance.engine.mlxlm_seam import LeanGeneration
        for name in ("extend", "filter"):
            self._wrap(LeanGeneration, name)

    def _wrap(self, cls, name: str) -> None:
        original = getattr(cls, name)
        split = self

        def wrapped(self_, *args, **kwargs):
            result = original(self_, *args, **kwargs)
            if split.on:
                started = time.perf_counter()
                mx.eval([c.state for c in self_.prompt_cache], self_._next_tokens)
                split.change_ms += 1000 * (time.perf_counter() - started)
            return result

        setattr(cls, name, wrapped)

    def take(self) -> tuple[float, float]:
        taken = round(self.build_ms, 2), round(self.change_ms, 2)
        self.build_ms = self.change_ms = 0.0
        return taken


def kernel_files() -> list[str]:
    """Returns the names of the files in MLX's kernel cache (none on a CPU)."""
    root = default_kernel_dir()
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()] if root.is_dir() else []


def script(scheduler, rng: random.Random, rows: int, lengths: tuple[int, int], split: Split) -> list[dict]:
    """Runs the script once; returns one record per step."""
    from mlx_lm.generate import StopSequences

    from appliance.engine.sampling import GREEDY

    def insert(n: int, max_tokens: int) -> None:
        for _ in range(n):
            scheduler.insert(prompt_of(rng, rng.randint(*lengths)), max_tokens=max_tokens, cache=None,
                             cached_tokens=[], sampler=GREEDY, processors=[], stop=StopSequences([]))

    insert(2, LEAVE_2_AT)
    insert(rows - 2, LEAVE_ALL_AT)
    steps, step = [], 0
    kernels = set(kernel_files())
    while len(scheduler) and step < 4 * LEAVE_ALL_AT:
        insert(JOINS.get(step, 0), LEAVE_ALL_AT - step)
        drain_ms = 0.0
        if split.on:
            started = time.perf_counter()
            mx.synchronize()
            drain_ms = 1000 * (time.perf_counter() - started)
        before = scheduler.num_generating
        started = time.perf_counter()
        scheduler.step()
        step_ms = 1000 * (time.perf_counter() - started)
        build_ms, change_ms = split.take()
        passes = [c for c in scheduler.last_calls if c[0] == "pass"]
        now = set(kernel_files())
        new, kernels = sorted(now - kernels), now
        steps.append({"step": step, "rows_before": before, "rows": scheduler.num_generating,
                      "calls": scheduler.last_calls, "step_ms": round(step_ms, 2),
                      "drain_ms": round(drain_ms, 2), "build_ms": build_ms, "change_ms": change_ms,
                      "pass_ms": round(sum(c[3] for c in passes), 2), "new_kernels": new})
        step += 1
    mx.synchronize()
    return steps


def summary(steps: list[dict]) -> dict:
    """The passes right after the batch changed (a join or a leave in the step before)
    against the others."""
    changed, steady = [], []
    for before, s in zip(steps, steps[1:]):
        rows_of = [c[1] for c in before["calls"] if c[0] == "pass"]
        now = [c[1] for c in s["calls"] if c[0] == "pass"]
        if not now or not rows_of:
            continue
        (changed if now != rows_of else steady).append(s)

    keys = ("pass_ms", "drain_ms", "build_ms", "change_ms")

    def medians(items: list[dict]) -> dict:
        return {"passes": len(items),
                **{k: round(statistics.median(s[k] for s in items), 2) if items else None for k in keys}}

    return {"compiled": [(s["step"], s["rows"], s["step_ms"], len(s["new_kernels"]), s["new_kernels"][:4])
                         for s in steps if s["new_kernels"]],
            "changed": {**medians(changed), "each": [(s["step"], s["rows"], *(s[k] for k in keys)) for s in changed[:12]]},
            "steady": {**medians(steady), "each": None}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--rows", default="8,32", help="the script's starting rows, one run each")
    parser.add_argument("--prompt-tokens", default="100,200", help="min,max length of each prompt")
    parser.add_argument("--memory-limit-gb", type=float, default=60.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--warm-up", action="store_true",
                        help="first run the batch changes of omlx's warm-up (`run_batch_changes`), as a "
                             "server does before it is ready: the kernels they compile are not met again")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from appliance.engine.scheduler import Scheduler
    from appliance.spec import BatchingSpec

    model, cfg, tokenizer_dir, model_s = generated_model(args.shape, tokenizer=args.tokenizer,
                                                         memory_limit_gb=args.memory_limit_gb)
    results: dict = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__,
                     "model_s": model_s, "joins": JOINS, "leaves": [LEAVE_2_AT, LEAVE_ALL_AT], "runs": []}
    log(f"model {args.shape} generated in {model_s} s on {mx.default_device()}")
    if args.warm_up:
        from appliance.engine.warm_up import WARM_UP_CHAT, run_batch_changes

        loaded = loaded_model(model, cfg, tokenizer_dir)
        started, before = time.perf_counter(), set(kernel_files())
        calls = run_batch_changes(Scheduler.for_device(model, BatchingSpec()), loaded,
                                  tuple(loaded.encode_chat(list(WARM_UP_CHAT))))
        results["warm_up"] = {"s": round(time.perf_counter() - started, 2), "calls": calls,
                              "new_kernels": sorted(set(kernel_files()) - before)}
        log(f"warm-up's batch changes: {results['warm_up']['s']} s, {len(results['warm_up']['new_kernels'])} "
            "kernel files compiled")
    split = Split(model)
    lengths = tuple(map(int, args.prompt_tokens.split(",")))
    for rows in map(int, args.rows.split(",")):
        for mode in ("pipelined", "split"):
            split.on = mode == "split"
            for r in range(2):
                scheduler = Scheduler.for_device(model, BatchingSpec(max_running=64))
                steps = script(scheduler, random.Random(r), rows, lengths, split)
                run = {"rows": rows, "mode": mode, "round": r, "summary": summary(steps), "steps": steps}
                results["runs"].append(run)
                log(f"rows {rows} {mode} round {r}: {json.dumps(run['summary'])}")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
