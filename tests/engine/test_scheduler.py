"""The scheduler with the real model: batched starts, first tokens, timed chunks."""

from __future__ import annotations

import random
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import StopSequences
from mlx_lm.sample_utils import greedy_sampler

from appliance.engine import scheduler
from appliance.engine.sampling import GREEDY, GREEDY_WITH_LOGPROBS
from appliance.engine.scheduler import (
    ALONE_STEPS,
    LENGTH_FLOOR,
    LENGTH_RATIO,
    MIN_CHUNK_TOKENS,
    Scheduler,
    generation_for,
    generation_tokens,
    padded_length,
    row_groups,
    split_by_length,
)
from appliance.kernels.gate import GATE
from appliance.spec import BatchingSpec

pytestmark = pytest.mark.slow


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def insert(s: Scheduler, prompt: list[int]) -> int:
    return s.insert(prompt, max_tokens=4, cache=None, cached_tokens=[], sampler=GREEDY,
                    processors=[], stop=StopSequences())


def test_short_prompts_start_together_and_give_a_token_in_the_same_step(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    uids = [insert(s, tokens(40, seed)) for seed in range(3)]
    started, generated = s.step()
    assert sorted(started) == uids
    assert sorted(g.uid for g in generated) == uids  # the first tokens, not one step later


def test_a_started_prompt_reports_its_tokens_and_its_share_of_its_calls_seconds(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=128, step_s=None)
    long = insert(s, tokens(1000))  # chunked: its chunks come from advance()
    short = [insert(s, tokens(40, seed)) for seed in range(1, 4)]
    s.step()  # starts the three short ones in one call: their tokens but the last (a decode input)
    assert [call[:3] for call in s.last_calls] == [("start", 3, 39), ("pass", 3, generation_tokens(s._generations[0]))]
    s.advance()  # a chunk of the long one, in the same step's record
    assert s.last_calls[-1][:3] == ("advance", 1, s.last_advanced_tokens)
    assert sorted(s.last_prefilled) == short
    assert {n for n, _ in s.last_prefilled.values()} == {39}
    assert len({seconds for _, seconds in s.last_prefilled.values()}) == 1  # equal shares of one call
    while long not in s.last_prefilled:
        s.advance()
        s.step()
    computed, seconds = s.last_prefilled[long]
    assert computed == 999 and seconds > 0  # its chunks and the call that started it
    s.step()  # a step that starts nothing reports nothing
    assert s.last_prefilled == {}


def decode(s: Scheduler, samplers: list, lengths: tuple[int, ...] = (30, 55, 80)) -> dict[int, list]:
    """Runs prompts to 5 tokens each; returns every request's (token, logprobs) in order."""
    out: dict[int, list] = {}
    for seed, (n, sampler) in enumerate(zip(lengths, samplers)):
        out[s.insert(tokens(n, seed), max_tokens=5, cache=None, cached_tokens=[], sampler=sampler,
                     processors=[], stop=StopSequences())] = []
    while len(s):
        _, generated = s.step()
        for g in generated:
            out[g.uid].append((g.token, g.logprobs))
        s.advance()
    return out


class Waiting:
    """A waiting prompt as split_by_length sees it: how many tokens it has left to prefill."""

    def __init__(self, todo: int):
        self.todo = todo


def split(lengths: list[int], pass_tokens: float) -> list[list[int]]:
    return [[p.todo for p in part] for part in split_by_length([Waiting(n) for n in lengths], pass_tokens)]


def test_prompts_split_where_padding_costs_more_than_another_call():
    assert split([10, 11, 12, 200], pass_tokens=32) == [[10, 11, 12], [200]]
    assert split([50, 50, 50], pass_tokens=1) == [[50, 50, 50]]  # no padding: one call
    assert split([10, 20, 30], pass_tokens=1e9) == [[10, 20, 30]]  # calls dearer than any padding
    assert split([10, 20, 30], pass_tokens=0) == [[10], [20], [30]]
    assert split([], pass_tokens=32) == []


def test_on_a_gpu_the_split_counts_padded_shapes_and_a_call_per_power_of_two():
    def gpu_split(lengths: list[int], pass_tokens: float) -> list[list[int]]:
        parts = split_by_length([Waiting(n) for n in lengths], pass_tokens, shape_tokens=256)
        return [[p.todo for p in part] for part in parts]

    # 110-144 tokens pad to 128 and 256: the raw lengths' padding (34 tokens each) would
    # not pay for another call, the padded ones' (128 each) does.
    assert split([110] * 4 + [144] * 4, pass_tokens=150) == [[110] * 4 + [144] * 4]
    assert gpu_split([110] * 4 + [144] * 4, pass_tokens=150) == [[110] * 4, [144] * 4]
    # 7 prompts of one shape run as 4 + 2 + 1 calls; split 4 + 3, as 4 + (2 + 1): the same
    # calls, so nothing gained by cutting; at 3 calls' cost the DP keeps them in one part.
    assert gpu_split([100] * 7, pass_tokens=1e6) == [[100] * 7]
    # Cheap calls: 12 prompts as 8 + 4 (two calls) beat 12 one by one.
    assert gpu_split([100 + i for i in range(12)], pass_tokens=50) == [[100 + i for i in range(12)]]


def test_a_split_start_gives_every_prompt_its_first_token_in_the_same_step(loaded_model):
    model = CountingModel(loaded_model.model)
    s = Scheduler(model, chunk_tokens=512, step_s=None)
    uids = [insert(s, tokens(n, seed)) for seed, n in enumerate((20, 25, 400))]
    started, generated = s.step()
    assert sorted(started) == uids and sorted(g.uid for g in generated) == uids
    assert model.calls == 3  # [20, 25] padded to 25, then 400 alone (not 3 x 400), then one decode


def test_split_and_padded_starts_give_the_same_greedy_tokens(loaded_model):
    def run(one_call: bool) -> list[list[int]]:
        s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
        if one_call:  # another call priced above any padding
            s._pass_s, s._fastest_start_s_per_token = 1e9, 1.0
        return [[t for t, _ in row] for row in decode(s, [GREEDY] * 3, (15, 40, 300)).values()]

    assert run(one_call=False) == run(one_call=True)


def test_a_long_prompt_advances_in_chunks_sized_by_its_measured_speed(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=256, step_s=1e-6)  # any measured chunk is too slow
    insert(s, tokens(2000))  # longer than four idle budgets: chunked, never started at once
    long = s._prefills[0]
    s.step()
    s.advance()  # nothing measured yet: a whole chunk
    assert long.todo == 1999 - 256 and long.s_per_token is not None
    s.step()
    s.advance()  # now sized by time: the smallest chunk
    assert long.todo == 1999 - 256 - MIN_CHUNK_TOKENS


def test_a_prompt_prefilled_alone_gets_longer_time_slices(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    insert(s, tokens(3000))
    long = s._prefills[0]
    s.step()
    s.advance()  # measures its speed
    s.step_s = 100 * long.s_per_token  # a slice is 100 of its tokens
    assert abs(s._timed_chunk(long) - 100 * ALONE_STEPS) <= 1  # float rounding
    insert(s, tokens(3000, seed=1))  # another prompt is waiting too: no longer alone
    assert abs(s._timed_chunk(long) - 100) <= 1


def test_a_lone_prompts_slice_spans_several_chunks(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=128, step_s=None)
    insert(s, tokens(3000))
    long = s._prefills[0]
    s.step()
    s.advance()  # measures its speed: one chunk
    s.step_s = 200 * long.s_per_token / ALONE_STEPS  # an alone slice is 200 of its tokens (< 2 chunks)
    before = long.todo
    s.step()
    s.advance()
    assert abs((before - long.todo) - 200) <= 1 and s.last_advanced_tokens == before - long.todo
    s.step_s *= 10  # a slice of 3000 tokens: at most ALONE_STEPS chunks
    before = long.todo
    s.step()
    s.advance()
    assert before - long.todo == ALONE_STEPS * 128
    insert(s, tokens(3000, seed=1))  # no longer alone: one chunk at most
    before = long.todo
    s.step()
    s.advance()
    assert before - long.todo <= 128


def test_without_a_time_slice_chunks_are_sized_by_tokens(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=128, step_s=None)
    insert(s, tokens(700))  # more than four idle budgets of 128
    long = s._prefills[0]
    for _ in range(2):
        s.step()
        s.advance()
    assert long.todo == 699 - 2 * 128


def test_a_short_prompt_starts_ahead_of_a_long_one_being_chunked(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=256, step_s=None)
    long_uid = insert(s, tokens(2000))
    s.step()
    s.advance()
    short_uid = insert(s, tokens(30, seed=1))
    started, generated = s.step()
    assert started == [short_uid] and [g.uid for g in generated] == [short_uid]
    assert long_uid not in started


class CountingModel:
    """The real model, counting its forward passes."""

    def __init__(self, model):
        self.model, self.calls, self.shapes = model, 0, []

    def __call__(self, inputs, *args, **kwargs):
        self.calls += 1
        self.shapes.append(tuple(inputs.shape))
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_without_look_ahead_a_started_prompt_gets_its_first_token_from_one_forward_pass(loaded_model):
    model = CountingModel(loaded_model.model)
    s = Scheduler(model, chunk_tokens=512, step_s=None, lookahead=False)
    uid = insert(s, tokens(40))
    started, generated = s.step()
    assert started == [uid] and [g.uid for g in generated] == [uid]
    assert model.calls == 2  # the prompt but its last token, then that token: nothing sampled ahead


def test_eager_and_look_ahead_decoding_give_the_same_tokens(loaded_model):
    def run(lookahead: bool) -> dict[int, list[int]]:
        s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None, lookahead=lookahead)
        out: dict[int, list[int]] = {}
        for seed, n in enumerate((30, 55, 80)):
            out[s.insert(tokens(n, seed), max_tokens=6 + seed, cache=None, cached_tokens=[],
                         sampler=GREEDY, processors=[], stop=StopSequences())] = []
        finished: dict[int, list[int]] = {}
        while len(s):
            _, generated = s.step()
            for g in generated:
                out[g.uid].append(g.token)
                if g.finish_reason is not None:
                    assert len(g.tokens) == len(tokens(30 + 25 * g.uid)) + len(out[g.uid]) - (not lookahead)
                    finished[g.uid] = out[g.uid]
            s.advance()
        assert finished == out
        return out

    eager, ahead = run(False), run(True)
    assert eager == ahead
    assert [len(t) for t in eager.values()] == [6, 7, 8]


def test_with_look_ahead_a_joining_prompt_gets_no_pass_of_its_own_and_the_same_tokens(loaded_model):
    def run(lookahead: bool) -> tuple[dict[int, list[int]], int, list[int]]:
        model = CountingModel(loaded_model.model)
        s = Scheduler(model, chunk_tokens=512, step_s=None, lookahead=lookahead)
        args = {"cache": None, "cached_tokens": [], "sampler": GREEDY, "processors": [], "stop": StopSequences()}
        out = {s.insert(tokens(30, 0), max_tokens=8, **args): []}
        step, passes, handed = 0, 0, []
        while len(s):
            if step == 3:  # a prompt arrives while the first one decodes
                out[s.insert(tokens(50, 1), max_tokens=6, **args)] = []
                calls = model.calls
            _, generated = s.step()
            if step == 3:
                passes, handed = model.calls - calls, [g.uid for g in generated]
            for g in generated:
                out[g.uid].append(g.token)
            s.advance()
            step += 1
        return out, passes, handed

    eager, eager_passes, eager_handed = run(False)
    ahead, ahead_passes, ahead_handed = run(True)
    assert ahead == eager and [len(t) for t in ahead.values()] == [8, 6]
    # Its prefill, then one pass of the whole batch: no priming pass of its own ...
    assert ahead_passes == eager_passes == 2
    # ... so its first token, computed by that pass, is handed out one step later.
    assert ahead_handed == [0] and eager_handed == [0, 1]


def chunking(model, *, lookahead: bool):
    """Returns a scheduler prefilling a long prompt in chunks of 256 tokens, and that prompt."""
    s = Scheduler(model, chunk_tokens=256, step_s=None, lookahead=lookahead)
    insert(s, tokens(3000))
    s.step()
    s.advance()
    return s, s._prefills[0]


def test_with_look_ahead_a_chunk_waits_a_step_for_the_first_tokens_of_started_rows(loaded_model):
    s, long = chunking(loaded_model.model, lookahead=True)  # alone: chunks of it
    decoding = s.insert(tokens(30, seed=1), max_tokens=20, cache=None, cached_tokens=[], sampler=GREEDY,
                        processors=[], stop=StopSequences())
    s.step()  # starts it; its first token comes out of the next pass
    before = long.todo
    s.advance()
    assert long.todo == before and s.last_advanced_tokens == 0  # gave way
    _, generated = s.step()
    assert [g.uid for g in generated] == [decoding]  # the first token, no chunk run before it
    s.advance()
    assert long.todo == before - 256  # and then the long prompt goes on


def test_a_chunk_gives_way_to_started_rows_never_twice_running(loaded_model):
    s, long = chunking(loaded_model.model, lookahead=True)
    advanced = []
    for seed in range(1, 5):  # a new short prompt every step
        insert(s, tokens(20, seed=seed))
        before = long.todo
        started, _ = s.step()
        assert started
        s.advance()
        advanced.append(before - long.todo)
    assert advanced[0::2] == [0, 0] and all(advanced[1::2])  # what the starts left of the budget


def test_without_look_ahead_a_chunk_runs_in_the_step_that_started_rows(loaded_model):
    s, long = chunking(loaded_model.model, lookahead=False)
    insert(s, tokens(30, seed=1))
    _, generated = s.step()  # its first token is out already
    before = long.todo
    s.advance()
    assert len(generated) == 1 and long.todo < before  # what the start left of the budget


@pytest.mark.parametrize("lookahead", [False, True])
def test_greedy_rows_without_logprobs_skip_the_normalization_and_pick_the_same_tokens(loaded_model, lookahead):
    def tokens_of(samplers: list) -> list[list[int]]:
        s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None, lookahead=lookahead)
        return [[t for t, _ in row] for row in decode(s, samplers).values()]

    lean = tokens_of([GREEDY] * 3)
    assert lean == tokens_of([greedy_sampler] * 3)  # mlx-lm's own step: argmax of log-probabilities
    assert lean == tokens_of([GREEDY, GREEDY_WITH_LOGPROBS, GREEDY])


def test_a_row_that_reports_logprobs_gets_normalized_ones_beside_lean_rows(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    rows = list(decode(s, [GREEDY, GREEDY_WITH_LOGPROBS, GREEDY]).values())
    for token, logprobs in rows[1]:
        assert abs(mx.logsumexp(logprobs).item()) < 1e-4  # probabilities that sum to 1
        assert logprobs[token].item() == logprobs.max().item() <= 0


def test_cut_chunks_keep_to_whole_shapes_and_the_last_one_is_padded(loaded_model):
    s = Scheduler(loaded_model.model, chunk_tokens=200, step_s=None, shape_tokens=64)
    uid = insert(s, tokens(1000))
    sizes = []
    while uid not in s.step()[0]:
        before = s._prefills[0].todo
        s.advance()
        sizes.append(before - s._prefills[0].todo)
    assert sizes and all(n % 64 == 0 for n in sizes)  # 192 each: whole shapes under the 200 budget


def test_a_prompt_advanced_to_its_last_token_starts_without_a_call(loaded_model):
    """Under load a short prompt can be chunked, and a cut chunk keeps to whole shapes:
    one chunk takes all of it. It then starts beside the prompts waiting with it, but in
    no call of theirs (a row of nothing but padding), and decodes what it decodes alone."""
    def run(with_others: bool) -> tuple[list[int], list[tuple]]:
        s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=1e-6, shape_tokens=256)
        s._start_s_per_token = 1.0  # measured slow: a timed chunk is the smallest, so 199 tokens are chunked
        s._pass_s, s._fastest_start_s_per_token = 1e9, 1.0  # calls cost most: the split would group them all
        uid = s.insert(tokens(200), max_tokens=3, cache=None, cached_tokens=[], sampler=GREEDY, processors=[],
                       stop=StopSequences())
        s.step()
        s.advance()
        assert s._prefills[0].todo == 0  # one chunk of whole shapes took it all
        if with_others:
            for seed in range(1, 4):
                insert(s, tokens(40, seed))
        out, starts = [], []
        while len(s):
            _, generated = s.step()
            starts += [call[:3] for call in s.last_calls if call[0] == "start"]
            out += [g.token for g in generated if g.uid == uid]
        return out, starts

    alone, starts = run(with_others=False)
    assert starts == []
    beside, starts = run(with_others=True)
    assert sum(rows for _, rows, _ in starts) == 3 and beside == alone


def test_row_groups_are_powers_of_two_largest_first():
    assert row_groups(list(range(7))) == [[0, 1, 2, 3], [4, 5], [6]]
    assert row_groups(list(range(8))) == [list(range(8))]
    assert row_groups([]) == []


def test_batched_calls_are_padded_to_powers_of_two_then_to_whole_shapes():
    assert [padded_length(n, 256) for n in (1, 3, 33, 125, 128, 200, 256, 257)] == [32, 32, 64, 128, 128, 256, 256, 512]
    assert padded_length(125, 1) == 125  # a CPU: no padding
    assert padded_length(100, 96) == 192  # a shape that is no power of two caps the powers


def test_a_wave_on_a_gpu_meets_few_shapes_and_gets_the_same_greedy_tokens(loaded_model):
    """Seven prompts of seven lengths start in calls of powers of two prompts padded to
    bucketed lengths (1, 4 and 2: as few calls as 4, 2 and 1, with less padding), and
    decode the tokens they decode unpadded."""
    lengths = (15, 22, 40, 41, 60, 90, 130)

    def run(shape_tokens: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
        model = CountingModel(loaded_model.model)
        s = Scheduler(model, chunk_tokens=512, step_s=None, shape_tokens=shape_tokens)
        s._pass_s, s._fastest_start_s_per_token = 1e9, 1.0  # one sub-batch: the groups are the GPU's
        rows = [[t for t, _ in row] for row in decode(s, [GREEDY] * len(lengths), lengths).values()]
        return rows, [shape for shape in model.shapes if shape[1] > 1]  # the prefill calls

    bucketed, calls = run(shape_tokens=64)
    assert calls == [(1, 64), (4, 64), (2, 192)]  # the lone prompt: its chunk padded to whole shapes
    assert bucketed == run(shape_tokens=1)[0]


def test_prompts_wait_while_the_batch_they_would_join_does_not_fit_in_memory(loaded_model, monkeypatch):
    """One long request decodes; seven short ones arrive. The batch pads every row to the
    long one's length, and memory is stubbed to hold four such rows: three start, the
    others wait for rows to finish, and every request gets the tokens it gets unhindered."""
    from appliance.engine.call_budget import RESERVE_FRACTION

    def run(limit_rows: int | None, apart: bool = False) -> tuple[dict[int, list[int]], int]:
        s = Scheduler(loaded_model.model, chunk_tokens=2048, step_s=None, apart=apart)
        out: dict[int, list[int]] = {}

        def add(n: int, seed: int, max_tokens: int) -> None:
            out[s.insert(tokens(n, seed), max_tokens=max_tokens, cache=None, cached_tokens=[], sampler=GREEDY,
                         processors=[], stop=StopSequences())] = []

        def step() -> None:
            for g in s.step()[1]:
                out[g.uid].append(g.token)
            s.advance()

        add(1500, 0, max_tokens=12)
        step()  # the long one starts and decodes
        if limit_rows is not None:
            room = limit_rows * generation_tokens(s._generations[0]) * s._shape.kv_bytes_per_token
            s._free = lambda: int(room / (1 - RESERVE_FRACTION)) + 1
        for seed in range(1, 8):
            add(30 + seed, seed, max_tokens=4)
        most = 0
        while len(s):
            step()
            most = max(most, s.num_generating)
        return out, most

    limited, most = run(limit_rows=4)
    assert most == 4  # the long row and three short ones at a time
    free, most_free = run(limit_rows=None)
    assert most_free == 8
    assert limited == free
    assert all(len(t) == (12 if i == 0 else 4) for i, t in limited.items())
    # Apart, the short rows decode in a batch of their own, unpadded: all of them fit.
    monkeypatch.setattr(scheduler, "LENGTH_FLOOR", 16)
    apart, most_apart = run(limit_rows=4, apart=True)
    assert most_apart == 8 and apart == free


def test_a_batch_fits_when_its_padded_rows_fit_under_the_free_memory():
    from appliance.engine.call_budget import RESERVE_FRACTION, ModelShape, batch_fits

    shape = ModelShape(hidden=64, ffn=128, heads=4, vocab=100, kv_bytes_per_token=1000)
    free = int(8 * 1000 * 1000 / (1 - RESERVE_FRACTION))
    assert batch_fits(shape, rows=8, tokens=1000, free=free)
    assert not batch_fits(shape, rows=9, tokens=1000, free=free)
    assert batch_fits(None, rows=10**6, tokens=10**6, free=free)  # nothing to judge by
    assert batch_fits(shape, rows=10**6, tokens=10**6, free=None)


def test_rows_join_the_generation_batch_of_like_kv_lengths():
    assert generation_for([], 100) is None  # the first batch
    assert generation_for([300], 100) == 0  # both under the floor: padding is cheap
    assert generation_for([LENGTH_FLOOR * LENGTH_RATIO], 100) == 0  # at the ratio, counted from the floor
    assert generation_for([LENGTH_FLOOR * LENGTH_RATIO + 256], 100) is None  # past it: a batch of its own
    assert generation_for([300, 25_000], 24_000) == 1  # the nearest
    assert generation_for([300, 25_000], 4_000) == 0
    assert generation_for([300, 25_000], 100_000, most=2) == 1  # no room for another: the nearest


def test_apart_rows_of_unlike_lengths_decode_in_batches_of_their_own(loaded_model, monkeypatch):
    """A long row and short ones decode in two batches, a pass each a step, to the tokens
    they decode in one padded batch; requests leave either, and an emptied batch goes."""
    monkeypatch.setattr(scheduler, "LENGTH_FLOOR", 16)

    def run(apart: bool, lookahead: bool) -> tuple[dict[int, list[int]], int, int]:
        model = CountingModel(loaded_model.model)
        s = Scheduler(model, chunk_tokens=1024, step_s=None, lookahead=lookahead, apart=apart)
        args = {"cache": None, "cached_tokens": [], "sampler": GREEDY, "processors": [], "stop": StopSequences()}
        out = {s.insert(tokens(600, 0), max_tokens=10, **args): []}
        for g in s.step()[1]:
            out[g.uid].append(g.token)
        s.advance()
        for seed in (1, 2):
            out[s.insert(tokens(20 + seed, seed), max_tokens=4, **args)] = []
        most, passes = 0, 0
        while len(s):
            calls = model.calls
            started, generated = s.step()
            if not started:
                passes = max(passes, model.calls - calls)
            most = max(most, len(s._generations))
            for g in generated:
                out[g.uid].append(g.token)
            s.advance()
        assert s._generations == []
        return out, most, passes

    for lookahead in (False, True):
        together, one, one_pass = run(apart=False, lookahead=lookahead)
        apart, two, two_passes = run(apart=True, lookahead=lookahead)
        assert apart == together and [len(t) for t in apart.values()] == [10, 4, 4]
        assert (one, one_pass) == (1, 1) and (two, two_passes) == (2, 2)


def test_apart_a_request_is_found_and_removed_in_its_own_batch(loaded_model, monkeypatch):
    monkeypatch.setattr(scheduler, "LENGTH_FLOOR", 16)
    s = Scheduler(loaded_model.model, chunk_tokens=1024, step_s=None, apart=True)
    long = insert(s, tokens(600, 0))
    s.step()
    short = insert(s, tokens(20, 1))
    s.step()
    assert len(s._generations) == 2
    cache, held = s.extract(short)
    assert held is not None and cache[0].offset == len(held) == 20  # its own tokens, unpadded
    s.remove(long, keep_cache=False)
    assert len(s._generations) == 1 and s._generations[0].uids == [short]
    s.remove(short, keep_cache=False)
    assert s._generations == [] and len(s) == 0


def test_a_composed_wave_on_a_gpu_starts_in_one_call_with_the_same_greedy_tokens(loaded_model):
    """Where short calls compose their attention, a wave needs no power-of-two counts of
    rows: no attention graph is built per shape."""
    lengths = (15, 22, 40, 41, 60, 90, 130)
    model = CountingModel(loaded_model.model)
    s = Scheduler(model, chunk_tokens=512, step_s=None, shape_tokens=64, composing=True)
    s._pass_s, s._fastest_start_s_per_token = 1e9, 1.0  # one sub-batch
    rows = [[t for t, _ in row] for row in decode(s, [GREEDY] * len(lengths), lengths).values()]
    assert [shape for shape in model.shapes if shape[1] > 1] == [(7, 192)]
    unpadded = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    assert rows == [[t for t, _ in row] for row in decode(unpadded, [GREEDY] * len(lengths), lengths).values()]


def test_short_attention_follows_the_limits(loaded_model):
    s = Scheduler.for_device(loaded_model.model, BatchingSpec())
    assert not s.composing  # fused by default
    s.set_limits(BatchingSpec(short_attention="composed", prefill_chunk_tokens=256))
    assert s.composing and s.chunk_tokens == 256


def test_a_batched_start_call_is_priced_at_what_it_was_measured_to_cost(loaded_model):
    """One more start call costs its own overhead and its rows' merge into the batch (the
    pass after it), beyond its tokens: measured from the steps that start batched calls,
    the fewest seconds a call yet, and worth at least a decode pass."""
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    uids = [insert(s, tokens(40 + seed, seed)) for seed in range(3)]
    s.step()  # one batched call of three prompts, then their first pass
    assert s._call_s is not None and s._call_s > 0
    assert s._pass_tokens() == max(s._pass_s, s._call_s) / s._fastest_start_s_per_token
    for uid in uids:
        s.remove(uid, keep_cache=False)
    s._call_s, s._pass_s, s._fastest_start_s_per_token = None, 0.005, 1e-5
    # two calls of 1,000 padded tokens in all, then one pass
    s.last_calls = [("start", 2, 250, 40.0), ("start", 4, 125, 40.0), ("pass", 6, 256, 20.0)]
    s._measure_call(0.1)
    assert s._call_s == pytest.approx((0.1 - 1000 * 1e-5 - 0.005) / 2)
    assert s._pass_tokens() == pytest.approx(s._call_s / 1e-5)
    s._measure_call(0.2)  # a slower step (a new shape's compile) leaves the fewest
    assert s._call_s == pytest.approx(0.0425)
    insert(s, tokens(40))
    s.step()  # a lone prompt's call (the plain path) is not a batched one: not measured
    assert [c[:2] for c in s.last_calls if c[0] == "start"] == [("start", 1)] and s._call_s == pytest.approx(0.0425)


def test_a_scheduler_step_waits_while_work_holds_the_gate_alone(loaded_model):
    """Its model calls never run beside work that may synchronize the GPU (kernels/gate.py)."""
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    insert(s, tokens(40, 0))
    stepped = threading.Event()
    with GATE.alone():
        threading.Thread(target=lambda: (s.step(), stepped.set()), daemon=True).start()
        assert not stepped.wait(0.5)
    assert stepped.wait(30)
