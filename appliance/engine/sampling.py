"""Per-request samplers and logits processors, reproducible under a seed inside any batch."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

from appliance.engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]

# Penalties look back this many generated tokens (mlx-lm's default is 20; OpenAI's
# presence/frequency penalties are meant over the whole completion).
PENALTY_CONTEXT_TOKENS = 1024


class Greedy:
    """Picks the most likely token. Its argmax is the same over logits as over
    log-probabilities, so a batch of greedy rows needs no softmax normalization (a
    logsumexp over the whole vocabulary a row, 48 ms a step at batch 64 on a CPU) unless
    a row reports its log-probabilities (`logprobs`)."""

    def __init__(self, *, logprobs: bool):
        self.logprobs = logprobs

    def __call__(self, scores: mx.array) -> mx.array:
        return mx.argmax(scores, axis=-1)


GREEDY = Greedy(logprobs=False)
GREEDY_WITH_LOGPROBS = Greedy(logprobs=True)


def make_sampler(params: SamplingParams, *, logprobs: bool = False) -> Sampler:
    """Returns a sampler of log-probabilities for one request (`logprobs`: whether the
    request reports them).

    With a seed, step i draws with key(seed, i) from the request's own logits, and from
    nothing else: not MLX's global random state, not the other rows' draws. What that
    guarantees: the same seed and prompt, computed the same way (the same batch shapes
    and prefill chunks), give the same tokens. What it does not: when the logits are
    computed another way (other requests batched beside it, a prefix restored from the
    cache, other chunk sizes), they can differ in the last bits, and a draw that falls
    within that distance of a boundary between two tokens picks the other one.
    """
    if params.greedy:
        return GREEDY_WITH_LOGPROBS if logprobs else GREEDY
    filters = []
    if 0 < params.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, params.top_p))
    if params.min_p > 0:
        filters.append(lambda x: apply_min_p(x, params.min_p))
    if params.top_k > 0:
        filters.append(lambda x: apply_top_k(x, params.top_k))
    inverse_temp = 1.0 / params.temperature
    step = [0]

    def sample(logprobs: mx.array) -> mx.array:
        for f in filters:
            logprobs = f(logprobs)
        key = None
        if params.seed is not None:
            key = mx.random.key((params.seed * 1_000_003 + step[0]) % (1 << 62))
            step[0] += 1
        return mx.random.categorical(logprobs * inverse_temp, key=key)

    return sample


def make_processors(params: SamplingParams) -> list:
    """Returns mlx-lm logits processors for the request's penalties and logit bias."""
    return make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=PENALTY_CONTEXT_TOKENS,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=PENALTY_CONTEXT_TOKENS,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=PENALTY_CONTEXT_TOKENS,
    )
