"""Serving until stopped: a driver that deploys an app and then waits for Ctrl-C or SIGTERM
before it shuts Serve and Ray down (the examples' `serve_*.py`)."""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Collection
from types import FrameType
from typing import Any, TypeAlias

#: What stops a serving driver: Ctrl-C, and what `kill` and process managers send.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})

#: What `signal.signal` takes and returns.
_Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


def _noted(signum: int, frame: FrameType | None) -> None:
    """The Python-level handler while waiting: the wake-up byte carries the signal, not this."""


def wait_for_stop_signal(signals: Collection[signal.Signals] = STOP_SIGNALS) -> signal.Signals:
    """Block the main thread until one of `signals` arrives; return it. The handlers and the
    wake-up fd it replaces are restored before it returns, so a second Ctrl-C during the
    caller's shutdown interrupts it as usual.

    Not `signal.sigwait`: it takes only blocked signals, and blocking them in this thread leaves
    them unblocked in threads started earlier (Ray's), so a signal can land in one of those and
    be handled there (Python's SIGINT handler sets a flag the waiting thread never checks;
    SIGTERM's default ends the process before any shutdown) while the wait goes on. Whichever
    thread takes the signal, the C handler Python installs writes its number to the wake-up fd,
    and that is what this waits on."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "wait_for_stop_signal must be called from the main thread (Python runs signal handlers there)"
        )
    wanted = {int(signum) for signum in signals}
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    previous_handlers: dict[int, _Handler] = {}
    try:
        for signum in wanted:
            previous_handlers[signum] = signal.signal(signum, _noted)
        while True:
            for signum in reader.recv(64):  # other signals with handlers write here too
                if signum in wanted:
                    return signal.Signals(signum)
    finally:
        for signum, handler in previous_handlers.items():
            # None: a handler not installed from Python, which cannot be put back; the default is.
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()
