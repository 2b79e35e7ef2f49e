"""The warm-up: a first request's work, run through an idle scheduler, leaving nothing behind."""

from __future__ import annotations

import pytest

from appliance.engine.scheduler import Scheduler, padded_length
from appliance.engine.warm_up import (
    DECODE_ACROSS,
    call_shapes,
    gpu_warm_up_lengths,
    idle_shapes,
    prefill_s_per_token,
    run_batch_changes,
    run_shape,
    warm_up,
)
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


@pytest.mark.parametrize("as_on_gpus", [False, True])
def test_the_batch_changes_start_rows_together_join_and_leave(loaded_model, as_on_gpus):
    if as_on_gpus:  # pipelined rows, shapes in whole multiples, batches by length
        scheduler = Scheduler(loaded_model.model, chunk_tokens=2048, lookahead=True, shape_tokens=256, apart=True)
    else:
        scheduler = Scheduler.for_device(loaded_model.model, BatchingSpec(prefill_chunk_tokens=64))
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Say hello."}]))
    steps = run_batch_changes(scheduler, loaded_model, prompt)
    starts = [[c[1:3] for c in calls if c[0] == "start"] for calls in steps]
    assert [rows for rows, _ in starts[0]] == [2]  # two unlike prompts, one call
    assert starts[1] == [(1, len(prompt) - 2)]  # the third, joining them
    second = next(i for i, calls in enumerate(starts) if i > 1 and calls)  # the second part's first row
    passes = [c[1] for calls in steps[:second] for c in calls if c[0] == "pass"]
    assert 3 in passes  # the third joined the two decoding
    assert passes.index(3) < len(passes) - 1 and passes[-1] < 3  # and rows left one by one
    # A restored row and a new one, half the prompt each to compute, start in one call and
    # join the row decoding.
    half = len(prompt) // 2 - 1
    assert starts[second + 1] == [(2, padded_length(half, scheduler.shape_tokens))]
    assert 3 in [c[1] for calls in steps[second:] for c in calls if c[0] == "pass"]
    assert len(scheduler) == 0


def test_the_batch_changes_run_until_their_kernels_are_kept(loaded_model, tmp_path, monkeypatch):
    """As on CUDA: the first warm-up runs the batch changes and marks them done among the
    compiled kernels; a later one skips them, until the mark goes."""
    from appliance.engine import warm_up as module

    monkeypatch.setattr(module, "device_kind", lambda: "gpu")
    monkeypatch.setattr(module, "kernel_dir", lambda: tmp_path / "ptx")
    limits = BatchingSpec(prefill_chunk_tokens=64)

    def parts() -> dict[str, float]:
        return warm_up(loaded_model, Scheduler.for_device(loaded_model.model, limits), limits)

    assert "batch changes" in parts()
    mark = module.batch_changes_mark(loaded_model.model)
    assert mark.exists() and mark.parent == tmp_path / "ptx" and "float32" in mark.name
    assert list(parts()) == ["greedy chat", "sampled chat", "long prompt"]
    mark.unlink()  # the kernels gone with it, as a reboot empties /tmp
    assert "batch changes" in parts()


def test_off_cuda_there_is_no_mark(loaded_model):
    from appliance.engine.warm_up import batch_changes_mark

    assert batch_changes_mark(loaded_model.model) is None  # CPU here; Metal keeps no kernels either


def test_the_call_shapes_are_a_lone_decode_and_the_starts_of_a_wave_in_one_idle_step():
    shapes = call_shapes(BatchingSpec(prefill_chunk_tokens=2048, max_running=32))
    starts = [(rows, length) for rows, length in shapes if rows > 1]
    assert {rows for rows, _ in starts} == {2, 4, 8, 16, 32}  # the scheduler's row groups
    assert {length for _, length in starts} == {32, 64, 128, 256}  # padded lengths up to a whole shape
    assert starts[0] == (2, 32) and (32, 256) in starts  # 32 prompts of 129 tokens start at once
    assert [(1, n) for n in DECODE_ACROSS] == [shape for shape in shapes if shape[0] == 1]
    assert [r * n for r, n in shapes] == sorted(r * n for r, n in shapes)  # cheapest first
    # A budget of 4 x 64 tokens starts 8 prompts of up to 32 tokens, 4 of up to 64, 2 of up to 128.
    assert call_shapes(BatchingSpec(prefill_chunk_tokens=64, max_running=8)) == [
        (2, 32), (2, 64), (4, 32), (1, 256), (2, 128), (4, 64), (8, 32), (1, 512)]
    assert idle_shapes(BatchingSpec(), None) == []  # CPU here: no graph per shape to build


def test_idle_shapes_are_cuda_s_and_short_enough_to_wait_for(monkeypatch):
    import mlx.core as mx

    from appliance.engine import warm_up as module

    limits = BatchingSpec(prefill_chunk_tokens=2048, max_running=32)
    monkeypatch.setattr(module, "device_kind", lambda: "gpu")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert idle_shapes(limits, None) == []  # a Mac: no cuDNN graphs, and long calls for nothing
    assert idle_shapes(limits.model_copy(update={"idle_shapes": "on"}), None) == call_shapes(limits)  # asked for
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert idle_shapes(limits, None) == call_shapes(limits)
    assert idle_shapes(limits.model_copy(update={"idle_shapes": "off"}), None) == []
    assert idle_shapes(limits, 1e-4) == [(r, n) for r, n in call_shapes(limits) if r * n <= 10_000]  # 1 s at most
    assert idle_shapes(limits, 1e-2) == [(2, 32)]  # a large model: only what takes a second


def test_the_prefill_rate_comes_from_the_measured_speed_else_the_long_prompt():
    limits = BatchingSpec(prefill_chunk_tokens=512)
    assert prefill_s_per_token({"long prompt": 2.0}, limits, 4096, 20_000.0) == 1 / 20_000
    lengths = gpu_warm_up_lengths(limits, 4096)  # on GPUs [1025]; none here
    want = 2.0 / lengths[0] if lengths else None
    assert prefill_s_per_token({"long prompt": 2.0}, limits, 4096, None) == want
    assert prefill_s_per_token({}, limits, 4096, None) is None


@pytest.mark.parametrize("chunk_tokens, rows, length", [(2048, 4, 64), (2048, 2, 256), (2048, 8, 32), (64, 2, 128)])
def test_a_start_shape_starts_its_rows_in_one_padded_call(loaded_model, chunk_tokens, rows, length):
    """As on GPUs: pipelined rows, shapes in whole multiples, batches by length."""
    scheduler = Scheduler(loaded_model.model, chunk_tokens=chunk_tokens, lookahead=True, shape_tokens=256, apart=True)
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Say hello."}]))
    calls = run_shape(scheduler, loaded_model, prompt, rows, length)
    assert [c[:3] for c in calls] == [("start", rows, length), ("pass", rows, calls[1][2])]
    assert len(scheduler) == 0 and scheduler.extract(0) == (None, None)  # nothing is kept


@pytest.mark.parametrize("length", DECODE_ACROSS)
def test_a_lone_decode_shape_decodes_across_its_buffer_length(loaded_model, length):
    scheduler = Scheduler(loaded_model.model, chunk_tokens=2048, lookahead=True, shape_tokens=256, apart=True)
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Say hello."}]))
    calls = run_shape(scheduler, loaded_model, prompt, 1, length)
    assert [c[:3] for c in calls if c[0] == "start"] == [("start", 1, length - 2)]
    buffers = [c[2] for c in calls if c[0] == "pass"]
    assert all(c[1] == 1 for c in calls) and buffers[0] == length < buffers[-1]  # a buffer full, then grown
    assert len(scheduler) == 0


def test_a_failed_shape_leaves_no_row_behind(loaded_model, monkeypatch):
    scheduler = Scheduler(loaded_model.model, chunk_tokens=2048, lookahead=True, shape_tokens=256, apart=True)
    prompt = tuple(loaded_model.encode_chat([{"role": "user", "content": "Say hello."}]))

    def fail():
        raise RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    monkeypatch.setattr(scheduler, "step", fail)
    for rows, length in ((1, 256), (4, 64)):
        with pytest.raises(RuntimeError):
            run_shape(scheduler, loaded_model, prompt, rows, length)
        assert len(scheduler) == 0
