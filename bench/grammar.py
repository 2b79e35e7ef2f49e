"""What the grammar mask of structured output costs a decode step, in process.

For each batch size, the same prompts are decoded on the engine's `Scheduler` (greedy,
`--tokens` steps each) plain and with every row constrained to a JSON object by
`appliance.chat.grammar` (llguidance), in the order plain, constrained, constrained,
plain, and each averaged; a batch of 16 with one constrained
row shows what the other rows pay. The mask's own time (llguidance's bitmask plus
MLX's `where`) is timed around each processor call, after the logits are computed, in
CPU time of the calling thread (a loaded machine preempts a sub-millisecond call, and
wall time would count the wait), over the calls made while the JSON is still open (a
finished grammar allows only end-of-sequence, a trivial mask); the median is printed. Rows keep decoding to `--tokens`
(a finished grammar allows only end-of-sequence), so both runs do the same work.

    .venv/bin/python bench/grammar.py [--tokens 48] [--batches 1 16] [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import converted_model_dir  # noqa: E402

TOPICS = ["a cat", "the sea", "Paris", "a bicycle", "winter", "a library", "coffee", "the moon",
          "a river", "chess", "bread", "a violin", "rain", "a forest", "trains", "honey"]


class Timed:
    """A logits processor that records the CPU time of each of its calls in `times_s`."""

    def __init__(self, inner):
        self.inner, self.times_s = inner, []

    def __call__(self, tokens, logits):
        import mlx.core as mx

        mx.eval(tokens, logits)  # the forward pass is not the mask's time
        open_before = not self.inner.matcher.is_stopped()
        started = time.thread_time()
        out = self.inner(tokens, logits)
        mx.eval(out)
        if open_before and not self.inner.matcher.is_stopped():  # a finished grammar's mask is trivial
            self.times_s.append(time.thread_time() - started)
        return out


def decode(loaded, prompts: list[list[int]], *, constraint, constrained_rows: int, num_tokens: int):
    """Returns (ms per decode step after the first, the mask's median ms per row and token)."""
    from mlx_lm.generate import StopSequences

    from appliance.engine.sampling import GREEDY
    from appliance.engine.scheduler import Scheduler

    scheduler = Scheduler(loaded.model, chunk_tokens=4096)
    timers = []
    for i, prompt in enumerate(prompts):
        processors = []
        if i < constrained_rows:
            timers.append(Timed(constraint.processor()))
            processors = [timers[-1]]
        scheduler.insert(prompt, max_tokens=num_tokens, cache=None, cached_tokens=[], sampler=GREEDY,
                         processors=processors, stop=StopSequences([]))
    steps = []
    while len(scheduler):
        started = time.perf_counter()
        _, generated = scheduler.step()
        steps.append(time.perf_counter() - started)
        for g in generated:
            if g.finish_reason is not None:
                scheduler.remove(g.uid, keep_cache=False)
    step_ms = 1000 * sum(steps[1:]) / max(1, len(steps) - 1)  # the first step also prefills
    times = sorted(t for timer in timers for t in timer.times_s)
    return step_ms, 1000 * times[len(times) // 2] if times else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 16])
    parser.add_argument("--quick", action="store_true", help="16 tokens a row")
    args = parser.parse_args()
    if args.quick:
        args.tokens = 16
    from appliance.platform import ensure_process_env

    # As `omlx serve` runs: OpenBLAS preloaded and glibc's malloc tuned. Without the
    # tunables llguidance's consume_token costs about 2 ms (fresh heap pages after each
    # forward pass) instead of 0.07.
    ensure_process_env()
    from appliance.chat.grammar import compile_constraint, format_grammar
    from appliance.chat.prepare import prepare
    from appliance.chat.turn import Message, OutputFormat, Turn
    from appliance.models.loaded import load_model
    from appliance.spec import ModelSpec

    model_dir = converted_model_dir()
    loaded = load_model(ModelSpec(name="bench", source=str(model_dir), max_context_tokens=8192),
                        base_dir=model_dir, cache_dir=model_dir.parent)
    constraint = compile_constraint(loaded, format_grammar(OutputFormat("json_object")))
    prompts = [list(prepare(loaded, Turn((Message("user", f"Describe {t} as a JSON object."),))).prompt_tokens)
               for t in TOPICS]
    decode(loaded, prompts[:2], constraint=constraint, constrained_rows=2, num_tokens=4)  # warm-up
    print(f"{args.tokens} tokens a row, greedy, {loaded.dtype}\n")
    print("| batch | constrained rows | plain ms/step | constrained ms/step | ratio | mask CPU ms/row/token |")
    print("|---|---|---|---|---|---|")
    runs = [(n, n) for n in args.batches] + [(n, 1) for n in args.batches if n > 1]
    for batch, rows in runs:
        batch_prompts = (prompts * (batch // len(prompts) + 1))[:batch]
        runs_ms: dict[int, list[float]] = {0: [], rows: []}
        masks_ms = []
        for constrained in (0, rows, rows, 0):  # ABBA: the VM's drift hits both alike
            step_ms, mask_ms = decode(loaded, batch_prompts, constraint=constraint,
                                      constrained_rows=constrained, num_tokens=args.tokens)
            runs_ms[constrained].append(step_ms)
            masks_ms += [mask_ms] if mask_ms is not None else []
        plain, masked = (sum(runs_ms[k]) / 2 for k in (0, rows))
        mask_ms = sorted(masks_ms)[len(masks_ms) // 2]
        print(f"| {batch} | {rows} | {plain:.1f} | {masked:.1f} | {masked / plain:.2f} | {mask_ms:.2f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
