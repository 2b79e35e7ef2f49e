"""The gate between the engines' model calls and work that may synchronize the GPU.

What it prevents (a capture invalidated, the process aborted) needs an NVIDIA GPU
(bench/capture_race.py); here its threads meet as the server's do.
"""

from __future__ import annotations

import threading
import time

from appliance.kernels.gate import Gate

WAIT_S = 30  # for what must happen; "not yet" is checked over a short wait


def in_thread(work) -> tuple[threading.Thread, threading.Event]:
    """Runs `work` on a thread; returns it and an event set once `work` returned."""
    done = threading.Event()

    def run():
        work()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, done


def passes(hold) -> None:
    """Takes the gate as `hold` (gate.shared or gate.alone) and gives it back."""
    with hold():
        pass


def test_engines_hold_the_gate_shared_at_once():
    gate, both = Gate(), threading.Barrier(2, timeout=WAIT_S)

    def engine():
        with gate.shared():
            both.wait()  # breaks (raises) unless the other is inside too

    threads = [in_thread(engine) for _ in range(2)]
    assert all(done.wait(WAIT_S) for _, done in threads)


def test_work_alone_waits_for_the_step_under_way_and_holds_the_next_one_up():
    gate = Gate()
    step_left, alone_in, alone_left = threading.Event(), threading.Event(), threading.Event()

    def step():
        with gate.shared():
            step_left.wait(WAIT_S)

    def pin():
        with gate.alone():
            alone_in.set()
            alone_left.wait(WAIT_S)

    _, step_done = in_thread(step)
    _, pin_done = in_thread(pin)
    assert not alone_in.wait(0.2)  # the step is under way
    _, next_done = in_thread(lambda: passes(gate.shared))  # the next step, come while pin waits
    assert not next_done.wait(0.2)
    step_left.set()
    assert step_done.wait(WAIT_S) and alone_in.wait(WAIT_S)
    assert not next_done.wait(0.2)  # pin runs: the next step waits for it
    alone_left.set()
    assert pin_done.wait(WAIT_S) and next_done.wait(WAIT_S)


def test_a_thread_takes_the_gate_again_inside_its_own_hold():
    gate = Gate()
    with gate.shared(), gate.shared(), gate.alone(), gate.alone(), gate.shared():
        pass
    with gate.alone(), gate.shared():
        pass
    _, done = in_thread(lambda: passes(gate.alone))  # nothing is left held
    assert done.wait(WAIT_S)


def test_a_sharer_that_asks_for_it_alone_gives_its_share_back_while_it_waits():
    """Two engines, each in a step, each pinning a slot: neither waits for the other forever."""
    gate, both_in = Gate(), threading.Barrier(2, timeout=WAIT_S)
    order = []

    def engine(name):
        with gate.shared():
            both_in.wait()
            with gate.alone():
                order.append(name)
            order.append(f"{name} shares again")

    threads = [in_thread(lambda n=n: engine(n)) for n in ("a", "b")]
    assert all(done.wait(WAIT_S) for _, done in threads)
    assert sorted(order) == ["a", "a shares again", "b", "b shares again"]


def test_outside_lets_the_others_in_for_a_while():
    gate = Gate()
    outside, back = threading.Event(), threading.Event()

    def compile_while_alone():
        with gate.alone():
            with gate.outside():
                outside.set()
                back.wait(WAIT_S)

    _, compiled = in_thread(compile_while_alone)
    assert outside.wait(WAIT_S)
    _, step_done = in_thread(lambda: passes(gate.shared))
    assert step_done.wait(WAIT_S)  # a step ran while the holder compiled
    back.set()
    assert compiled.wait(WAIT_S)



def test_steps_that_waited_for_a_piece_of_work_run_before_the_next_piece():
    """A thread pinning slot after slot must not keep an engine out."""
    gate, stop = Gate(), threading.Event()
    pieces, steps = [0], [0]
    in_piece = threading.Event()

    def pin_slots():
        while not stop.is_set():
            with gate.alone():
                in_piece.set()
                pieces[0] += 1
                time.sleep(0.001)

    during = []  # pieces of work that ran between an engine's steps

    def engine():
        while not stop.is_set() and steps[0] < 20:
            before = pieces[0]
            with gate.shared():
                during.append(pieces[0] - before)
                steps[0] += 1

    pinning, _ = in_thread(pin_slots)
    assert in_piece.wait(WAIT_S)
    _, engine_done = in_thread(engine)
    assert engine_done.wait(WAIT_S)
    stop.set()
    pinning.join(WAIT_S)
    assert steps[0] == 20 and max(during) <= 3, during  # one piece before each step (or so: threads switch)
