"""CallGate: data calls overlap; an alone-entry waits for them, holds new ones back, lets them
in when it leaves or gives up."""

from __future__ import annotations

import threading
import time

import pytest

from gdskv.call_gate import CallGate
from reliability_helpers import wait_for


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_alone_waits_for_the_last_data_call_and_holds_new_ones_back():
    gate, log = CallGate(), []
    gate.enter_shared()
    gate.enter_shared()  # two calls in flight
    alone = _in_thread(lambda: (gate.enter_alone(), log.append("alone"), time.sleep(0.2),
                                log.append("alone done"), gate.leave_alone()))
    wait_for(lambda: gate._waiting == 1, 5, "the alone-entry to wait")
    late = _in_thread(lambda: (gate.enter_shared(), log.append("late"), gate.leave_shared()))
    gate.leave_shared()
    time.sleep(0.1)
    assert log == []  # one call still in flight; the late call is held back
    gate.leave_shared()  # the last one out wakes the alone-entry
    alone.join(5)
    late.join(5)
    assert log == ["alone", "alone done", "late"]
    assert gate.enter_alone(blocking=False)  # nothing in flight: enters at once
    gate.leave_alone()


def test_an_interrupted_alone_entry_lets_the_held_back_calls_in():
    gate, entered, errors = CallGate(), threading.Event(), []
    gate.enter_shared()
    real_wait, alone_thread = gate._cond.wait, []

    def wait(timeout=None):
        if threading.get_ident() in alone_thread:
            # the alone-entry waits (the lock released: the late call comes in and waits
            # behind it), then is interrupted
            real_wait(0.3)
            raise KeyboardInterrupt
        return real_wait(timeout)
    gate._cond.wait = wait

    def alone() -> None:
        alone_thread.append(threading.get_ident())
        try:
            gate.enter_alone()
        except KeyboardInterrupt:
            errors.append("interrupted")
    a = _in_thread(alone)
    wait_for(lambda: gate._waiting == 1, 5, "the alone-entry to wait")
    late = _in_thread(lambda: (gate.enter_shared(), entered.set()))
    a.join(5)
    assert errors == ["interrupted"] and gate._waiting == 0
    assert entered.wait(5), "a data call stayed held back by an alone-entry that gave up"
    late.join(5)


@pytest.mark.parametrize("waiting", [False, True])
def test_the_last_data_call_out_notifies_only_a_waiting_alone_entry(waiting):
    gate, notified = CallGate(), []
    gate.enter_shared()
    real_notify = gate._cond.notify_all
    gate._cond.notify_all = lambda: (notified.append(1), real_notify())
    if waiting:
        a = _in_thread(lambda: (gate.enter_alone(), gate.leave_alone()))
        wait_for(lambda: gate._waiting == 1, 5, "the alone-entry to wait")
    gate.leave_shared()
    if waiting:
        a.join(5)
        assert not a.is_alive() and notified
    else:
        assert notified == []
