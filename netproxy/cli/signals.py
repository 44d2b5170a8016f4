"""SIGTERM and SIGINT for ``netproxy run``, answered outside the signal handler.

Python runs a signal handler in the main thread between two bytecodes, wherever that thread is:
also inside ``threading.Event.clear()`` or ``Event.wait()``, which hold the event's lock, which is
not reentrant.  A handler that sets that event (the runner's wake-up) then waits forever for a lock
its own thread holds (reproduced in a small script on Python 3.11; rare in a real ``run``: a CI run
saw one stop on SIGTERM hang until it was killed, ~3,700 stops under stress did not).  Logging from
a handler can likewise re-enter a stream mid-write.

So the handler only does what takes no lock: it notes the signal and writes one byte to a pipe.  A
thread of its own reads the pipe and does the real work (log, stop the proxy) as any thread would.
SIGUSR1 prints every thread's stack to stderr and goes on (Go's SIGQUIT dump, without the exit):
what an operator, or a test that found ``run`` stuck, needs to say where."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
from typing import Callable, List

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUMP_SIGNAL = signal.SIGUSR1


def on_stop_signals(stop: Callable[[int], None]) -> None:
    """Call ``stop(signum)`` from a daemon thread for each SIGTERM or SIGINT from now on; install
    the stack dump on SIGUSR1.  Call from the main thread (only it may install handlers)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # a flood of signals must never block the handler
    received: List[int] = []

    def handler(signum: int, _frame: object) -> None:
        received.append(signum)  # list.append takes no Python-level lock
        with contextlib.suppress(BlockingIOError):  # full: the reader has bytes to wake on already
            os.write(write_end, b"\0")

    def reader() -> None:
        while os.read(read_end, 1):
            while received:
                stop(received.pop(0))

    threading.Thread(target=reader, name="stop-signals", daemon=True).start()
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True)
