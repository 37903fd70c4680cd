"""GracefulStop: the first SIGTERM / SIGINT is recorded for the loop, a second one stops at once."""
import os
import signal

import pytest

from grpo.runtime.signals import GracefulStop


def test_first_signal_is_recorded_second_stops_and_handlers_come_back():
    before_calls = []
    # whatever was installed before comes back (SIGINT is ignored, not default, in a shell's background job)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    stop = GracefulStop(before=lambda: before_calls.append(1))
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and before_calls == [1]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert before_calls == [1, 1]
    finally:
        stop.restore()
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_peer_failure_raised_by_before_wins_over_the_stop():
    def peer_failed():
        raise RuntimeError("rank 1 failed")

    stop = GracefulStop(before=peer_failed)
    stop.install()
    try:
        with pytest.raises(RuntimeError, match="rank 1 failed"):
            os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested is None
    finally:
        stop.restore()
