"""Samplers: a seeded draw depends on its seed, its step and its own logits only."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from appliance.engine.request import SamplingParams
from appliance.engine.sampling import GREEDY, make_sampler

STEPS = 32


def logits_rows() -> mx.array:
    rng = np.random.default_rng(0)
    return mx.array(rng.normal(size=(STEPS, 1000)).astype(np.float32) * 3)


def draws(sampler, rows: mx.array, *, between=None) -> list[int]:
    out = []
    for i in range(STEPS):
        if between is not None:
            between(i)
        out.append(sampler(rows[i:i + 1]).item())
    return out


def test_a_seeded_draw_ignores_other_requests_and_the_global_random_state():
    rows = logits_rows()
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    alone = draws(make_sampler(params), rows)

    others = [make_sampler(SamplingParams(temperature=1.0)),
              make_sampler(SamplingParams(temperature=0.7, top_k=50, seed=99))]

    def busy_batch(i: int) -> None:  # other rows drawing around it, the global state reseeded
        mx.random.seed(1000 + i)
        for other in others:
            other(rows[(i + 1) % STEPS:(i + 1) % STEPS + 1])

    assert draws(make_sampler(params), rows, between=busy_batch) == alone


def test_seeds_draw_differently_and_unseeded_samplers_use_the_global_state():
    rows = logits_rows()
    first = draws(make_sampler(SamplingParams(temperature=1.0, seed=1)), rows)
    assert first != draws(make_sampler(SamplingParams(temperature=1.0, seed=2)), rows)
    mx.random.seed(5)
    unseeded = draws(make_sampler(SamplingParams(temperature=1.0)), rows)
    mx.random.seed(5)
    assert draws(make_sampler(SamplingParams(temperature=1.0)), rows) == unseeded


def test_greedy_is_the_argmax():
    rows = logits_rows()
    assert draws(GREEDY, rows) == np.argmax(np.array(rows), axis=-1).tolist()
