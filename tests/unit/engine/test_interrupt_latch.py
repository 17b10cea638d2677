"""Ctrl-C is never lost: a SIGINT that arrives while a destructor runs (where Python drops a KeyboardInterrupt and
prints its traceback) is latched and raised at the training loop's next check."""

from __future__ import annotations

import os
import signal

import pytest

from dynabatch.engine.errors import InterruptLatch


class _SignalsWhenDeleted:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # delivered while this destructor runs


def test_a_sigint_in_a_destructor_is_raised_at_the_next_check(capsys):
    with InterruptLatch() as latch:
        obj = _SignalsWhenDeleted()
        del obj
        assert latch.pending
        with pytest.raises(KeyboardInterrupt):
            latch.check()
    assert "Exception ignored" not in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # given back


def test_a_sigint_elsewhere_raises_at_once():
    with InterruptLatch() as latch:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            signal.pthread_sigmask(signal.SIG_BLOCK, [])  # a point where Python runs the handler
        assert latch.pending
