"""The warm-up: what a first chat request needs, run through a scheduler before a model
counts as ready (template, tokenizer, a prefill, decode steps greedy and sampled, the
detokenizer; on GPUs a prompt of two full prefill chunks, and a batch's changes: rows
started together, joining, leaving, a restored row starting beside a new one). MLX
compiles GPU kernels per shape and per kind of index, and MLX CUDA builds an attention
graph per shape on each thread: a first request would pay for them otherwise. Once the
model is ready, an idle engine runs the calls of short requests one shape at a time
(`idle_shapes`, `run_shape`): their cuDNN graphs are kept per process only."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from appliance.cache.kv import KVBlock, build_batch_cache
from appliance.cache.model_cache import Restored
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.engine.scheduler import GPU_SHAPE_TOKENS, MIN_SHAPE_TOKENS, Generated, Scheduler, start_budget
from appliance.engine.slot import Slot
from appliance.models import kinds
from appliance.models.loaded import LoadedModel
from appliance.platform import device_kind, kernel_dir, wanted_here
from appliance.spec import BatchingSpec

WARM_UP_CHAT = ({"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello."})
WARM_UP_SAMPLING = (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0))
WARM_UP_TOKENS = 3
IDLE_PIECE_S = 1.0  # an idle call shape's tokens take at most this long (`idle_shapes`)
DECODE_ACROSS = (256, 512)  # one row decodes across KV buffers of these lengths while idle (`call_shapes`)
DECODE_ACROSS_TOKENS = 6  # tokens it generates: the last of its prompt's buffer, then the next one's
BATCH_CHANGES_VERSION = 2  # one more with each change that `run_batch_changes` makes


def warm_up(loaded: LoadedModel, scheduler: Scheduler, limits: BatchingSpec) -> dict[str, float]:
    """Runs the warm-up requests on `scheduler` (idle, on `loaded`'s model), one at a time;
    their KV is not kept. Returns the seconds of each part that ran, for the log."""
    laps = Laps()
    prompt = tuple(loaded.encode_chat(list(WARM_UP_CHAT)))
    for name, sampling in zip(("greedy chat", "sampled chat"), WARM_UP_SAMPLING):
        run_alone(scheduler, Slot(GenerationRequest(prompt, WARM_UP_TOKENS, sampling), loaded))
        laps.lap(name)
    for n in gpu_warm_up_lengths(limits, loaded.context_tokens):  # long prompts' prefill shapes
        long = (prompt * (n // len(prompt) + 1))[:n]
        run_alone(scheduler, Slot(GenerationRequest(long, WARM_UP_TOKENS, WARM_UP_SAMPLING[0]), loaded))
        laps.lap("long prompt")
    mark = batch_changes_mark(loaded.model)
    if device_kind() == "gpu" and not (mark and mark.exists()):
        run_batch_changes(scheduler, loaded, prompt)
        laps.lap("batch changes")
        if mark:
            try:
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.touch()
            except OSError:
                pass  # they run again at the next start
    return laps.seconds


class Laps:
    """The seconds of named parts of some work, each from the end of the one before (the
    first from the Laps' making)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._since = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self._since = round(now - self._since, 2), now


def run_batch_changes(scheduler: Scheduler, loaded: LoadedModel, prompt: tuple[int, ...]) -> list[list]:
    """Runs, on an idle scheduler, rows through each change a generation batch meets:
    two prompts of unlike lengths started in one call (padded), a third joining them a
    step later (`extend`), rows finishing apart (`filter`), the last emptying it; then a
    row restored from a tier starting in one call beside a new one (the restored KV
    padded to theirs), both joining a row decoding. Each change indexes arrays of its own
    kinds (the rows' KV, their tokens and offsets), and MLX CUDA compiles the kernel of
    each kind the first time a machine meets it: on an H100 2.3-3.2 s each, which a
    machine's first requests paid in the middle of their decoding (BENCHMARKS.md, "What
    a batch's change costs"). Returns each step's calls (`Scheduler.last_calls`);
    nothing is kept."""
    steps: list[list] = []
    finished: list[Generated] = []

    def insert(tokens: tuple[int, ...], max_tokens: int, restored: Restored | None = None) -> int:
        request = GenerationRequest(tokens, max_tokens, WARM_UP_SAMPLING[0])
        return scheduler.insert(**Slot(request, loaded).insert_args(restored))

    def run(running: set[int], joining: Callable[[], list[int]]) -> None:
        """Steps until the `running` rows end, those `joining` returns inserted after the first."""
        for step in range(8 * WARM_UP_TOKENS):  # bounded: each row ends by its max_tokens
            _, generated = scheduler.step()
            steps.append(list(scheduler.last_calls))
            if step == 0:
                running.update(joining())
            ended = [r for r in generated if r.finish_reason is not None]
            finished.extend(ended)
            running -= {r.uid for r in ended}
            if not running:
                break
        for uid in running:
            scheduler.remove(uid, keep_cache=False)

    half = prompt[:max(1, len(prompt) // 2)]
    run({insert(prompt, 2), insert(half, WARM_UP_TOKENS + 2)}, lambda: [insert(prompt[1:], WARM_UP_TOKENS)])
    # Only plain KV is restored (a model of rotating or quantized caches bypasses the tiers).
    kept = next((r for r in finished if r.cache and all(type(c) is KVCache and c.keys is not None
                                                        for c in r.cache)), None)
    if kept is None:
        return steps
    restored = restored_from(kept)
    tokens = (*kept.tokens[:restored.num_tokens], *half)
    run({insert(prompt, WARM_UP_TOKENS + 2)},
        lambda: [insert(tokens, WARM_UP_TOKENS, restored), insert(half, WARM_UP_TOKENS)])
    return steps


def batch_changes_mark(model: nn.Module) -> Path | None:
    """Returns the file that, kept among MLX CUDA's compiled kernels, says those of the
    batch changes are there for a model of `model`'s kinds of weights; None off CUDA
    (Metal keeps no such cache). A start that finds it skips the batch changes: their
    kernels load from the cache, and they would build little else (an attention graph
    or two), yet on an H200 a later start's stand-in took 9.5 s with them against 6.8 s
    before them, 2.0 s past the load (BENCHMARKS.md, "start to ready"). Where the kernels
    go (a tmpfs /tmp at a reboot) the mark goes with them."""
    directory = kernel_dir()
    if directory is None:
        return None
    return directory / f"omlx-batch-changes-v{BATCH_CHANGES_VERSION}-{'-'.join(kinds.of_model(model))}"


def restored_from(row: Generated) -> Restored:
    """Returns the KV a finished row held as a tier's restore hands it to the engine."""
    n = row.cache[0].offset
    block = KVBlock(key=b"", parent=b"", dir="", tokens=tuple(row.tokens[:n]),
                    keys=mx.stack([c.keys[0, :, :n] for c in row.cache]),
                    values=mx.stack([c.values[0, :, :n] for c in row.cache]))
    return Restored(build_batch_cache([block], n), n, {})


def gpu_warm_up_lengths(limits: BatchingSpec, context_tokens: int) -> list[int]:
    """Returns, on GPUs, the length of one prompt of two full prefill chunks (a chat
    prompt has none of that size); none on CPUs. Longer warm-ups did not pay on an H200:
    one over every chunk offset to 32K and each padded chunk size took 11 s and left the
    first 25K TTFT as it was (BENCHMARKS.md, "GPU")."""
    if device_kind() != "gpu":
        return []
    return [min(2 * limits.prefill_chunk_tokens, context_tokens - 1) + 1]


def idle_shapes(limits: BatchingSpec, s_per_token: float | None) -> list[tuple[int, int]]:
    """Returns the call shapes an idle engine runs ahead of the requests that would meet
    them first (`call_shapes`) where `limits.idle_shapes` asks for them ("auto": on CUDA),
    those whose tokens take at most `IDLE_PIECE_S` at `s_per_token` (the model's prefill;
    None: unknown, all), since a request arriving waits for the shape under way. "auto"
    runs none elsewhere: cuDNN's graphs are CUDA's, and on a Mac a large model's calls of
    thousands of tokens would run for seconds each, for nothing."""
    if not wanted_here(limits.idle_shapes):
        return []
    return [(rows, length) for rows, length in call_shapes(limits)
            if s_per_token is None or rows * length * s_per_token <= IDLE_PIECE_S]


def prefill_s_per_token(parts: dict[str, float], limits: BatchingSpec, context_tokens: int,
                        prefill_tok_s: float | None) -> float | None:
    """Returns the seconds a prompt token takes to prefill: from the model's measured
    prefill speed where there is one (kept across restarts), else from the warm-up's long
    prompt (its time includes its first graphs: an upper bound), else None."""
    if prefill_tok_s:
        return 1.0 / prefill_tok_s
    lengths = gpu_warm_up_lengths(limits, context_tokens)
    if lengths and parts.get("long prompt"):
        return parts["long prompt"] / lengths[0]
    return None


def call_shapes(limits: BatchingSpec) -> list[tuple[int, int]]:
    """Returns (rows, length) call shapes of short requests, cheapest first (rows x length):

    - rows > 1: the batched start calls of short prompts, each power of two of rows from 2
      to `max_running` (the scheduler's row groups) by each power-of-two length up to a
      whole shape (`padded_length`), where rows padded to that length can start in one
      idle step. On an H100 the first wave of 8 requests over HTTP took 0.25-0.33 s of
      start calls against 0.12-0.14 s for the next, its shapes unseen (cuDNN builds a
      graph per shape, ~50 ms: BENCHMARKS.md).
    - rows = 1: one row decoding across a KV buffer of `length` tokens (`DECODE_ACROSS`).
      MLX CUDA's one-query attention runs through a cuDNN graph, per buffer length, once
      the keys reach 256 tokens: on an H100 a lone request's first two such passes took
      0.49-0.66 s each (kernels compiled, then kept) and ~50 ms in a later process."""
    budget = start_budget(limits.prefill_chunk_tokens, decoding=False)
    lengths = [n for n in (MIN_SHAPE_TOKENS << i for i in range(16)) if n <= GPU_SHAPE_TOKENS]
    rows = [r for r in (2 << i for i in range(16)) if r <= limits.max_running]
    shapes = [(1, n) for n in DECODE_ACROSS]
    shapes += [(r, n) for r in rows for n in lengths if r * shortest_padded_to(n) <= budget]
    return sorted(shapes, key=lambda shape: shape[0] * shape[1])


def shortest_padded_to(length: int) -> int:
    """Returns the fewest tokens a prompt padded to `length` (a power of two) holds."""
    return length // 2 + 1 if length > MIN_SHAPE_TOKENS else 1


def run_shape(scheduler: Scheduler, loaded: LoadedModel, prompt: tuple[int, ...], rows: int,
              length: int) -> list:
    """Runs one of `call_shapes` on an idle scheduler, made of `prompt`, and leaves nothing
    behind; returns the calls of the steps it took (`Scheduler.last_calls`). Rows > 1:
    prompts of unlike lengths padded to `length` tokens started in one call, as a wave of
    short prompts would be, and the decode pass after it. One row: a prompt decoding
    across `length` tokens."""
    repeated = prompt * (length // max(1, len(prompt)) + 2)
    if rows == 1:  # one token more than it computes: the first decode step's input
        return run_alone(scheduler, Slot(GenerationRequest(repeated[:length - 1], DECODE_ACROSS_TOKENS,
                                                           WARM_UP_SAMPLING[0]), loaded))
    longest = min(length, start_budget(scheduler.chunk_tokens, decoding=False) // rows)
    uids = []
    try:
        for i in range(rows):
            tokens = repeated[:max(shortest_padded_to(length), longest - i) + 1]
            request = GenerationRequest(tokens, WARM_UP_TOKENS, WARM_UP_SAMPLING[0])
            uids.append(scheduler.insert(**Slot(request, loaded).insert_args()))
        scheduler.step()
        return list(scheduler.last_calls)
    finally:
        for uid in uids:
            scheduler.remove(uid, keep_cache=False)


def run_alone(scheduler: Scheduler, slot: Slot) -> list:
    """Generates `slot`'s request to its end on an idle scheduler, delivering nothing;
    returns the calls of its steps (`Scheduler.last_calls`)."""
    uid = scheduler.insert(**slot.insert_args())
    calls, done = [], False
    try:
        while not done:
            _, generated = scheduler.step()
            calls += scheduler.last_calls
            for r in generated:
                done = slot.on_token(r.token, r.logprobs, r.finish_reason)[1] is not None or done
            scheduler.advance()
    finally:  # a failed call leaves no row behind for the requests after it
        scheduler.remove(uid, keep_cache=False)
    return calls


def described(parts: dict[str, float]) -> str:
    """Returns the warm-up's parts and their seconds as a log line shows them."""
    return ", ".join(f"{name} {seconds:.2f} s" for name, seconds in parts.items())
