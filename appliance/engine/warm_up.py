"""The warm-up: what a first chat request needs, run through a scheduler before a model
counts as ready (template, tokenizer, a prefill, decode steps greedy and sampled, the
detokenizer; on GPUs a prompt of two full prefill chunks too). MLX compiles GPU kernels
per shape, and MLX CUDA builds an attention graph per shape on each thread: a first
request would pay for them otherwise."""

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
