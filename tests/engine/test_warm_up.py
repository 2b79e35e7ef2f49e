"""The warm-up: a first request's work, run through an idle scheduler, leaving nothing behind."""

from __future__ import annotations

import pytest

from appliance.engine.scheduler import Scheduler
from appliance.engine.warm_up import gpu_warm_up_lengths, warm_up
from appliance.spec import BatchingSpec

pytestmark = pytest.mark.slow


def test_the_warm_up_leaves_the_scheduler_empty(loaded_model):
    limits = BatchingSpec(prefill_chunk_tokens=64)
    scheduler = Scheduler.for_device(loaded_model.model, limits)
    warm_up(loaded_model, scheduler, limits)
    assert len(scheduler) == 0
    assert scheduler.extract(0) == (None, None)  # the warm-up's KV is not kept


def test_long_prompts_warm_up_on_gpus_only(loaded_model):
    import mlx.core as mx

    lengths = gpu_warm_up_lengths(BatchingSpec(prefill_chunk_tokens=512), context_tokens=2048)
    assert lengths == ([1025] if mx.default_device() == mx.gpu else [])
    assert gpu_warm_up_lengths(BatchingSpec(prefill_chunk_tokens=4096), context_tokens=2048) in ([2048], [])
