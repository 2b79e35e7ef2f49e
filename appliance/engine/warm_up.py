"""The warm-up: what a first chat request needs, run through a scheduler before a model
counts as ready (template, tokenizer, a prefill, decode steps greedy and sampled, the
detokenizer; on GPUs a prompt of two full prefill chunks, and two prompts of unlike
lengths started together, too). MLX compiles GPU kernels per shape, and MLX CUDA builds
an attention graph per shape on each thread: a first request would pay for them
otherwise."""

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
    together = [Slot(GenerationRequest(p, WARM_UP_TOKENS, WARM_UP_SAMPLING[0]), loaded)
                for p in gpu_warm_up_batch(prompt)]
    if together:
        run_together(scheduler, together)


def gpu_warm_up_lengths(limits: BatchingSpec, context_tokens: int) -> list[int]:
    """Returns, on GPUs, the length of one prompt of two full prefill chunks (a chat
    prompt has none of that size); none on CPUs. Longer warm-ups did not pay on an H200:
    one over every chunk offset to 32K and each padded chunk size took 11 s and left the
    first 25K TTFT as it was (BENCHMARKS.md, "GPU")."""
    if device_kind() != "gpu":
        return []
    return [min(2 * limits.prefill_chunk_tokens, context_tokens - 1) + 1]


def gpu_warm_up_batch(prompt: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Returns, on GPUs, two prompts of unlike lengths to start together (the padded batch
    path: its left padding, array mask and batch caches); none on CPUs. On an H200 whose
    kernel cache was empty, the first such start took 5.2-5.9 s (BENCHMARKS.md, "GPU")."""
    if device_kind() != "gpu":
        return []
    return [prompt, prompt + prompt[-8:]]


def run_alone(scheduler: Scheduler, slot: Slot) -> None:
    """Generates `slot`'s request to its end on an idle scheduler, delivering nothing."""
    run_together(scheduler, [slot])


def run_together(scheduler: Scheduler, slots: list[Slot]) -> None:
    """Generates the requests of `slots`, submitted at once, to their ends on an idle
    scheduler, delivering nothing."""
    by_uid = {scheduler.insert(**slot.insert_args()): slot for slot in slots}
    left = set(by_uid)
    while left:
        _, generated = scheduler.step()
        for r in generated:
            if r.uid in left and by_uid[r.uid].on_token(r.token, r.logprobs, r.finish_reason)[1] is not None:
                left.discard(r.uid)
        scheduler.advance()
    for uid in by_uid:
        scheduler.remove(uid, keep_cache=False)
