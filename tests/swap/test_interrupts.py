"""Ctrl-C inside deepoffload's bookkeeping (``swap/interrupts.deferred``): held back until the call ends, or
raised at once on a second Ctrl-C."""

import signal

import pytest

from deepoffload.swap.interrupts import deferred


def test_one_ctrl_c_is_raised_when_the_bookkeeping_ends():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("after the signal")  # still runs: the interrupt waits for the end
    assert done == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_raises_at_once():
    done = []
    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            done.append("first held back")
            signal.raise_signal(signal.SIGINT)
            done.append("never reached")
    assert done == ["first held back"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_program_handler_is_left_alone():
    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with deferred():
            signal.raise_signal(signal.SIGINT)
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_error_on_its_way_out_is_not_replaced_by_a_held_ctrl_c():
    with pytest.raises(OSError, match="disk gone"):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            raise OSError(5, "disk gone")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
