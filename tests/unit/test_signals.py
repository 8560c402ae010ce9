"""`SigtermAsCtrlC`'s handlers: which signals it takes, and what it leaves as it found it."""

from __future__ import annotations

import signal

from trainer.control.signals import SigtermAsCtrlC


def test_it_takes_sigterm_and_the_signals_it_is_given_and_restores_them() -> None:
    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # as a training child's launcher leaves it
    try:
        before = signal.getsignal(signal.SIGTERM)
        with SigtermAsCtrlC(also=(signal.SIGHUP,)):
            assert callable(signal.getsignal(signal.SIGTERM))
            assert callable(signal.getsignal(signal.SIGHUP))
        assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)) == (before, signal.SIG_DFL)
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_a_signal_ignored_on_purpose_stays_ignored() -> None:
    """`nohup python -m trainer.learner` ignores SIGHUP so that a closed terminal does not stop the run; only a
    training child's own parent-death signal, which its launcher resets to the default, is taken."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with SigtermAsCtrlC(also=(signal.SIGHUP,)):
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
