"""Stopping cleanly on SIGTERM / SIGINT (preemption, Ctrl-C): the loop finishes its step, saves, and exits 0.

The handler only records the signal; the training loop asks ``requested()`` after each step. In a
multi-process run every process must stop at the same step (a checkpoint is written by all of them
together), so there the processes agree through one tiny all-gather per step: a signal that reached any
process stops all of them. A second Ctrl-C stops at once: ``Interrupted``, a ``KeyboardInterrupt`` (which no
``except Exception`` catches); the save in flight is abandoned (left as Orbax's temporary directory, which a
resume ignores) and ``python -m jodpo.train`` exits 130 without waiting for it.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import jax
import numpy as np


class Interrupted(KeyboardInterrupt):
    """A second Ctrl-C: the run stops at once, without waiting for (or finishing) the checkpoint being written."""


class StopSignals:
    def __init__(self):
        self.received: str | None = None
        self._previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # signals can only be caught there
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise Interrupted  # a second Ctrl-C: do not wait for the checkpoint
        self.received = signal.Signals(signum).name
        again = " (Ctrl-C again: stop at once, abandoning that save)" if signum == signal.SIGINT else ""
        _say(f"jodpo.train: {self.received}: stopping after this step, which is saved first{again}\n")

    def requested(self) -> str | None:
        """The signal to stop for (on every process alike), or None."""
        if jax.process_count() == 1:
            return self.received
        from jax.experimental import multihost_utils

        codes = multihost_utils.process_allgather(np.int32(0 if self.received is None else
                                                            int(signal.Signals[self.received])))
        code = int(np.max(codes))
        return signal.Signals(code).name if code else None


def _say(text: str) -> None:
    """Writes to standard error's file descriptor, not through ``sys.stderr``: a handler runs in the main thread at
    any bytecode, also inside a write to ``sys.stderr`` (the progress bar's, blocked on a full pipe), and Python's
    buffered stream refuses a write reentered from there (``RuntimeError: reentrant call``), which killed the run."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a stream without a descriptor (an embedding program's)
        fd = 2
    os.write(fd, text.encode(errors="replace"))
