"""An engine's choice between our small matmul and MLX's, from measured passes: the
choice alone with given pass times, and a scheduler and an engine with the real model
choosing."""

from __future__ import annotations

import threading

import pytest
from mlx_lm.generate import StopSequences

from appliance.engine import matmul_choice
from appliance.engine.engine import Engine
from appliance.engine.matmul_choice import EXPLOIT, FAR, SETTLE, WINDOW, WINDOWS, MatmulChoice
from appliance.engine.request import GenerationRequest, SamplingParams
from appliance.engine.sampling import GREEDY
from appliance.engine.scheduler import Scheduler
from appliance.kernels import small_matmul
from appliance.spec import BatchingSpec
from tests.conftest import run_to_end


@pytest.fixture
def measured():
    """The kernel on and `auto`, as the registry sets it once the self-test passed on CUDA."""
    small_matmul.ENABLED = small_matmul.MEASURED = True
    yield
    small_matmul.ENABLED = small_matmul.MEASURED = False
    small_matmul.use_here(True)


def run(choice: MatmulChoice, passes: int, seconds, *, rows: int = 8, measured: bool = True) -> list[bool]:
    """Runs `passes` passes of `rows` rows, each taking `seconds(native)`; returns whether
    each ran our kernel."""
    ran = []
    for _ in range(passes):
        choice.before(rows)
        ran.append(small_matmul.in_use())
        choice.after(rows, seconds(ran[-1]), measured=measured)
    return ran


def ours_slower(native: bool) -> float:
    return 0.0085 if native else 0.008


def ours_faster(native: bool) -> float:
    return 0.007 if native else 0.008


def stretches(ran: list[bool]) -> list[tuple[bool, int]]:
    """Returns `ran` as (native, passes in a row)."""
    out: list[tuple[bool, int]] = []
    for native in ran:
        if out and out[-1][0] == native:
            out[-1] = native, out[-1][1] + 1
        else:
            out.append((native, 1))
    return out


def test_it_probes_each_in_turn_then_runs_the_faster_and_probes_again(measured):
    choice = MatmulChoice()
    probe = 2 * WINDOWS * (WINDOW + SETTLE)
    ran = run(choice, probe + EXPLOIT + 2 * (WINDOW + SETTLE), ours_slower)
    # WINDOW measured passes each in turn (the first SETTLE after a switch measure nothing)
    assert stretches(ran[:probe]) == [(True, WINDOW + SETTLE), (False, WINDOW + SETTLE)] * WINDOWS
    assert choice.choices() == {8: "generic"}
    after = stretches(ran[probe:])
    assert after[:3] == [(False, EXPLOIT), (True, WINDOW + SETTLE), (False, WINDOW + SETTLE)]


def ours_far_faster(native: bool) -> float:
    return 0.006 if native else 0.008


def test_a_choice_that_lost_clearly_is_probed_less_often(measured):
    choice = MatmulChoice()
    probe = 2 * WINDOWS * (WINDOW + SETTLE)
    ran = run(choice, probe + FAR * EXPLOIT + 2 * (WINDOW + SETTLE), ours_far_faster)
    # the probes ended on MLX's: the switch back costs SETTLE passes more
    assert stretches(ran[probe:])[:2] == [(True, FAR * EXPLOIT + SETTLE), (False, WINDOW + SETTLE)]


def test_a_host_that_changes_is_followed(measured):
    choice = MatmulChoice()
    ran = run(choice, 3000, ours_slower)
    assert sum(ran[-1000:]) < 200  # MLX's mostly, ours probed
    ran = run(choice, 6000, ours_faster)
    assert sum(ran[-1000:]) > 800 and choice.choices() == {8: "native"}


def test_each_count_of_rows_chooses_for_itself(measured):
    choice = MatmulChoice()
    for _ in range(400):  # interleaved in stretches, as rows come and go
        run(choice, 16, ours_slower, rows=8)
        run(choice, 16, ours_faster, rows=4)
    assert choice.choices() == {4: "native", 8: "generic"}


def test_unmeasured_passes_and_passes_after_a_change_teach_nothing(measured):
    choice = MatmulChoice()
    assert run(choice, 5000, ours_slower, measured=False) == [True] * 5000  # still its first window
    run(choice, WINDOW + SETTLE, ours_slower)  # its first window, ours
    assert choice.choices() == {8: "generic"}  # the next window's
    # a change of rows in between: the next SETTLE passes of 8 rows measure nothing
    run(choice, 1, ours_slower, rows=3)
    assert run(choice, SETTLE, ours_slower) == [False] * SETTLE
    assert choice._rows[8].window == [] and not choice._rows[8].windows[False]


def test_a_pass_that_compiled_a_kernel_measures_nothing(measured):
    choice = MatmulChoice()
    passes = iter([0.007] * SETTLE + [1.0])  # ours' first measured pass: a new shape's compile

    def seconds(native: bool) -> float:
        return next(passes, 0.007) if native else 0.008

    run(choice, 2 * WINDOWS * (WINDOW + SETTLE), seconds)
    assert choice.choices() == {8: "native"}  # the 1 s pass left out: ours' windows are faster


def test_rows_it_does_not_choose_for_and_a_kernel_asked_for_run_ours(measured):
    choice = MatmulChoice()
    assert run(choice, 500, ours_faster, rows=1) == [True] * 500  # one row: MLX's matvec anyway
    assert run(choice, 500, ours_faster, rows=small_matmul.ROWS + 1) == [True] * 500
    small_matmul.MEASURED = False  # `native` asked for: ours always
    assert run(choice, 500, ours_slower) == [True] * 500
    assert choice.choices() == {}


def test_a_change_to_native_runs_ours_from_the_next_pass(measured):
    choice = MatmulChoice()
    run(choice, WINDOW + SETTLE + 1, ours_slower)  # into MLX's first window
    assert not small_matmul.in_use()
    small_matmul.MEASURED = False  # the spec now asks for `native`
    assert run(choice, 3, ours_slower) == [True] * 3


def test_the_choice_is_the_threads_own(measured):
    small_matmul.use_here(False)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(small_matmul.in_use()))
    thread.start()
    thread.join()
    assert seen == [True] and not small_matmul.in_use()
    small_matmul.ENABLED = False
    small_matmul.use_here(True)
    assert not small_matmul.in_use()  # off: off everywhere


@pytest.mark.slow
def test_a_scheduler_runs_the_choice_for_its_passes(loaded_model, measured, monkeypatch):
    monkeypatch.setattr(matmul_choice, "WINDOW", 2)
    monkeypatch.setattr(matmul_choice, "WINDOWS", 1)
    monkeypatch.setattr(matmul_choice, "EXPLOIT", 4)
    s = Scheduler(loaded_model.model, chunk_tokens=512, step_s=None)
    for seed in range(3):
        s.insert([100 + seed] * 20, max_tokens=40, cache=None, cached_tokens=[], sampler=GREEDY,
                 processors=[], stop=StopSequences())
    ran = []
    while len(s):
        s.step()
        ran.append(s.matmuls.last)
        s.advance()
    # each probed (on a CPU our kernel is not in the model: both run MLX's matmuls)
    assert {"native", "generic"} <= set(ran) and set(s.matmuls.choices()) == {3}


@pytest.mark.slow
def test_an_engine_shows_what_it_chose(loaded_model, measured, monkeypatch):
    monkeypatch.setattr(matmul_choice, "WINDOW", 2)
    monkeypatch.setattr(matmul_choice, "WINDOWS", 1)
    engine = Engine(loaded_model, BatchingSpec(max_running=4)).start()
    assert engine.matmul_choices == {}

    greedy = SamplingParams(temperature=0)
    run_to_end(engine, [GenerationRequest((1, 504 + i, 2114, 314), 30, greedy) for i in range(3)])
    assert set(engine.matmul_choices.values()) <= {"native", "generic"} and 3 in engine.matmul_choices
