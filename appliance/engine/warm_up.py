"""The warm-up: what a first chat request needs, run through a scheduler before a model
counts as ready (template, tokenizer, a prefill, decode steps greedy and sampled, the
detokenizer; on GPUs a prompt of two full prefill chunks, and a batch's changes: rows
started together, joining, leaving). MLX compiles GPU kernels per shape and per kind of
index, and MLX CUDA builds an attention graph per shape on each thread: a first request
would pay for them otherwise."""

from __future__ import annotations

from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.slot import Slot
from appliance.models.loaded import LoadedModel
from appliance.platform import device_kind
from appliance.spec import BatchingSpec

WARM_UP_CHAT = ({"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Say hello."})
WARM_UP_SAMPLING = (SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=0))
WARM_UP_TOKENS = 3


def warm_up(loaded: LoadedModel, scheduler: Scheduler, limits: BatchingSpec) -> None:
    """Runs the warm-up requests on `scheduler` (idle, on `loaded`'s model), one at a time;
    their KV is not kept."""
    prompt = tuple(loaded.encode_chat(list(WARM_UP_CHAT)))
    for sampling in WARM_UP_SAMPLING:
        run_alone(scheduler, Slot(GenerationRequest(prompt, WARM_UP_TOKENS, sampling), loaded))
    for n in gpu_warm_up_lengths(limits, loaded.context_tokens):  # long prompts' prefill shapes
        long = (prompt * (n // len(prompt) + 1))[:n]
        run_alone(scheduler, Slot(GenerationRequest(long, WARM_UP_TOKENS, WARM_UP_SAMPLING[0]), loaded))
    if device_kind() == "gpu":
        run_batch_changes(scheduler, loaded, prompt)


def run_batch_changes(scheduler: Scheduler, loaded: LoadedModel, prompt: tuple[int, ...]) -> list[list]:
    """Runs, on an idle scheduler, rows through each change a generation batch meets:
    two prompts of unlike lengths started in one call (padded), a third joining them a
    step later (`extend`), rows finishing apart (`filter`), the last emptying it. Each
    change indexes arrays of its own kinds (the rows' KV, their tokens and offsets), and
    MLX CUDA compiles the kernel of each kind the first time a machine meets it: on an
    H100 2.3-3.2 s each, which a machine's first requests paid in the middle of their
    decoding (BENCHMARKS.md, "What a batch's change costs"). Returns each step's calls
    (`Scheduler.last_calls`); nothing is kept."""
    def insert(tokens: tuple[int, ...], max_tokens: int) -> int:
        request = GenerationRequest(tokens, max_tokens, WARM_UP_SAMPLING[0])
        return scheduler.insert(**Slot(request, loaded).insert_args())

    running = {insert(prompt, 2), insert(prompt[:max(1, len(prompt) // 2)], WARM_UP_TOKENS + 2)}
    steps = []
    for step in range(8 * WARM_UP_TOKENS):  # bounded: each row ends by its max_tokens
        _, generated = scheduler.step()
        steps.append(list(scheduler.last_calls))
        if step == 0:
            running.add(insert(prompt[1:], WARM_UP_TOKENS))
        running -= {r.uid for r in generated if r.finish_reason is not None}
        if not running:
            break
    for uid in running:
        scheduler.remove(uid, keep_cache=False)
    return steps


def gpu_warm_up_lengths(limits: BatchingSpec, context_tokens: int) -> list[int]:
    """Returns, on GPUs, the length of one prompt of two full prefill chunks (a chat
    prompt has none of that size); none on CPUs. Longer warm-ups did not pay on an H200:
    one over every chunk offset to 32K and each padded chunk size took 11 s and left the
    first 25K TTFT as it was (BENCHMARKS.md, "GPU")."""
    if device_kind() != "gpu":
        return []
    return [min(2 * limits.prefill_chunk_tokens, context_tokens - 1) + 1]


def run_alone(scheduler: Scheduler, slot: Slot) -> None:
    """Generates `slot`'s request to its end on an idle scheduler, delivering nothing."""
    uid = scheduler.insert(**slot.insert_args())
    done = False
    while not done:
        _, generated = scheduler.step()
        for r in generated:
            done = slot.on_token(r.token, r.logprobs, r.finish_reason)[1] is not None or done
        scheduler.advance()
    scheduler.remove(uid, keep_cache=False)
