"""Where a decode pass's time goes: the host's graph building, MLX's submission, the wait.

On an H100 the same 8-row decode pass of the 8B shape ran at 8-10 ms in some stretches
and 14-18 ms in others, over HTTP and in process alike (docs/GPU.md). This runs
mlx-lm's BatchGenerator (what `batch_generate` runs, and whose GenerationBatch omlx's
scheduler decodes with) through `--steps` decode passes and splits each pass, as it
runs pipelined, into the Python model call that builds its graph (`build`), MLX's
`async_eval` that encodes and launches it (`submit`), and the rest of the step, mostly
waiting for the pass before it (`wait`); `cpu` is the thread's CPU time in the step. A
host-bound pass has `wait` near 0 and `cpu` near the step.

Variants, each on the same prompts in one process: `padded` (rows of different lengths:
attention with an array mask, MLX CUDA's unfused path), `equal` (rows of one length,
which mlx-lm's BatchKVCache masks all the same), `fused` (padded, each layer's q/k/v
and gate/up projections one matmul each: appliance/models/fuse.py), `native` (fused,
and the Linear layers' matmuls of 2-8 rows run by our kernel: models/native_linear.py;
on CUDA only), `compiled` (native, and each block's decode call before and after its
attention two compiled functions: models/compiled_blocks.py), `nogc` (padded,
Python's collector off), `pinned` (padded, this thread held to one CPU), `busy`
(padded, a Python thread beside it holding the GIL in slices, as an event loop serving
streams would).

    python bench/decode_host.py --shape 8b --tokenizer .gpu/tok --out OUT.json   # GPU
    .venv/bin/python bench/decode_host.py --shape tiny --steps 16 --rows 2 --variants padded,equal  # CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from appliance.kernels import small_matmul  # noqa: E402
from appliance.models.compiled_blocks import CompiledBlock, compile_blocks  # noqa: E402
from appliance.models.native_linear import use_native_linear  # noqa: E402
from bench.batch_steps import busy_beside  # noqa: E402
from bench.prefill_paths import generated_model, log, prompt_of  # noqa: E402

VARIANTS = ("padded", "equal", "fused", "native", "compiled", "nogc", "pinned", "busy")


class Probe:
    """Times the model's decode calls and MLX's `async_eval` (both patched in place)."""

    def __init__(self, model):
        self.build_s = 0.0
        self.submit_s = 0.0
        probe, model_call, async_eval = self, type(model).__call__, mx.async_eval

        def call(self_, inputs, *args, **kwargs):
            started = time.perf_counter()
            try:
                return model_call(self_, inputs, *args, **kwargs)
            finally:
                if inputs.shape[1] == 1:
                    probe.build_s += time.perf_counter() - started

        def submit(*args):
            started = time.perf_counter()
            try:
                return async_eval(*args)
            finally:
                probe.submit_s += time.perf_counter() - started

        type(model).__call__ = call
        mx.async_eval = submit

    def reset(self) -> tuple[float, float]:
        out = self.build_s, self.submit_s
        self.build_s = self.submit_s = 0.0
        return out


def run(model, probe: Probe, prompts: list[list[int]], *, steps: int) -> dict:
    """Starts `prompts` in one BatchGenerator, then times `steps` decode passes."""
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    gen = BatchGenerator(model, max_tokens=steps + 8, stop_tokens=[], completion_batch_size=n,
                         prefill_batch_size=n, prefill_step_size=2048)
    gen.insert(prompts, max_tokens=[steps + 8] * n)
    started: set[int] = set()
    while len(started) < n:  # the starts: every row has its first token
        started.update(r.uid for r in gen.next_generated())
    rows = []
    probe.reset()
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        out = gen.next_generated()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        build, submit = probe.reset()
        rows.append({"wall": wall, "cpu": cpu, "build": build, "submit": submit,
                     "wait": wall - build - submit, "tokens": len(out)})
    gen.close()
    return summary(rows)


def summary(rows: list[dict]) -> dict:
    def q(key: str, p: float) -> float:
        values = sorted(r[key] for r in rows)
        return round(1000 * values[min(len(values) - 1, int(p * len(values)))], 2)

    walls = [r["wall"] for r in rows]
    floor = q("wall", 0.1) / 1000
    slow = [r for r in rows if r["wall"] > 1.3 * floor]
    fast = [r for r in rows if r["wall"] <= 1.3 * floor]

    def mean_ms(part: list[dict], key: str) -> float | None:
        return round(1000 * statistics.fmean(r[key] for r in part), 2) if part else None

    return {"steps": len(rows), "tok_s": round(sum(r["tokens"] for r in rows) / sum(walls), 1),
            **{f"wall_p{int(100 * p)}_ms": q("wall", p) for p in (0.1, 0.5, 0.9)},
            "wall_mean_ms": round(1000 * statistics.fmean(walls), 2),
            **{f"{k}_p50_ms": q(k, 0.5) for k in ("build", "submit", "wait", "cpu")},
            "slow_share": round(len(slow) / len(rows), 3),
            "slow": {k: mean_ms(slow, k) for k in ("wall", "build", "submit", "wait", "cpu")},
            "fast": {k: mean_ms(fast, k) for k in ("wall", "build", "submit", "wait", "cpu")},
            "walls_ms": [round(1000 * w, 2) for w in walls]}


class Fusion:
    """Switches `model` between its own projections and fused ones (both kept)."""

    def __init__(self, model):
        from appliance.models.fuse import GROUPS, fuse_projections

        self.model = model
        members = [m for group in GROUPS.values() for m in group]
        self._own = [(p, {m: p[m] for m in members if m in p}) for _, p in model.named_modules()]
        fuse_projections(model)
        self._fused = [(p, {k: p[k] for k in GROUPS if k in p}, {m: getattr(p, m) for m in own})
                       for p, own in self._own]
        self.on = True

    def set(self, on: bool) -> None:
        if on == self.on:
            return
        for (p, own), (_, groups, parts) in zip(self._own, self._fused, strict=True):
            for key in own if on else groups:
                del p[key]
            if on:
                dict.update(p, groups)  # Module.update takes only keys it has
                p.__dict__.update(parts)
            else:
                for key in parts:
                    del p.__dict__[key]
                dict.update(p, own)
        self.on = on


def in_variant(name: str, fusion: Fusion | None = None):
    """Sets this process up for variant `name`; returns what undoes it."""
    if name == "fused" and fusion is not None:
        fusion.set(True)
        return lambda: fusion.set(False)
    if name == "native" and fusion is not None:
        fusion.set(True)
        small_matmul.ENABLED = mx.cuda.is_available()  # elsewhere `native` is `fused`

        def undo() -> None:
            small_matmul.ENABLED = False
            fusion.set(False)

        return undo
    if name == "compiled" and fusion is not None:
        undo_native = in_variant("native", fusion)
        compile_blocks(fusion.model)

        def undo() -> None:
            for _, module in fusion.model.named_modules():
                if type(module) is CompiledBlock:
                    module.__class__ = llama.TransformerBlock
            undo_native()

        return undo
    if name == "nogc":
        gc.disable()
        return gc.enable
    if name == "pinned" and hasattr(os, "sched_setaffinity"):
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(before)})  # 0: this thread, on Linux

        def undo() -> None:
            os.sched_setaffinity(0, before)

        return undo
    return lambda: None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--rows", default="8", help="rows per batch, comma-separated")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--memory-limit-gb", type=float, default=60.0)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model, _, _, model_s = generated_model(args.shape, tokenizer=args.tokenizer, memory_limit_gb=args.memory_limit_gb)
    log(f"model {args.shape} generated in {model_s} s on {mx.default_device()}")
    probe = Probe(model)
    fusion = None
    if {"fused", "native", "compiled"} & set(args.variants.split(",")):
        fusion = Fusion(model)  # its weights beside the model's own: more device memory
        use_native_linear(model)  # the own and the fused Linear layers; off but in `native`
        fusion.set(False)
    rng = random.Random(0)
    results: dict = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__, "runs": []}
    busy = False
    for n in map(int, args.rows.split(",")):
        padded = [prompt_of(rng, rng.randint(100, 150)) for _ in range(n)]
        equal = [prompt_of(rng, 128) for _ in range(n)]
        run(model, probe, padded, steps=8)  # the shapes' kernels, once
        run(model, probe, equal, steps=8)
        for name in ("native", "compiled") if fusion is not None else ():
            undo = in_variant(name, fusion)
            run(model, probe, padded, steps=8)
            undo()
        for r in range(args.rounds):
            for name in args.variants.split(","):
                if name == "busy" and not busy:  # last: it stays on once started
                    busy_beside(0.25)
                    busy = True
                undo = in_variant(name, fusion)
                try:
                    out = run(model, probe, equal if name == "equal" else padded, steps=args.steps)
                finally:
                    undo()
                results["runs"].append({"rows": n, "round": r, "variant": name, **out})
                log(json.dumps({k: v for k, v in results["runs"][-1].items() if k != "walls_ms"}))
                if args.out:
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
