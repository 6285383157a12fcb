"""`kvray.serve.wait_for_stop_signal`, what a serving driver waits in: Ctrl-C (SIGINT) and SIGTERM
each end the wait and are returned, whether the main thread or another one (as Ray's threads
may) takes the signal, and the handlers it replaced are back afterwards. Each case runs in a
child process that signals itself."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest

pytest.importorskip("ray.serve", reason="kvray.serve needs the serve extra: pip install -e '.[serve]'")

from kvray.serve import wait_for_stop_signal

CHILD = textwrap.dedent(
    """
    import os, signal, threading, time
    from kvray.serve import wait_for_stop_signal

    # As a driver started from a terminal has it: a process started in the background by a
    # shell without job control (a CI script's `cmd &`) begins with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def send(signum):
        # Only once the wait has installed its handler: before that, SIGTERM would end the
        # process and SIGINT raise KeyboardInterrupt, as they should.
        before = signal.getsignal(signum)
        while signal.getsignal(signum) is before:
            time.sleep(0.01)
        os.kill(os.getpid(), signum)

    if {main_blocks}:
        # The main thread blocks the signals, so the sender's thread takes them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT, signal.SIGTERM}})
    for signum in (signal.{first}, signal.{second}):
        threading.Thread(target=send, args=(signum,), daemon=True).start()
        print(wait_for_stop_signal().name, flush=True)
    print(signal.getsignal(signal.SIGINT) is signal.default_int_handler,
          signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, signal.set_wakeup_fd(-1) == -1)
    """
)


@pytest.mark.parametrize(
    ("first", "second", "main_blocks"),
    [("SIGINT", "SIGTERM", False), ("SIGTERM", "SIGINT", True)],
    ids=["main-thread-takes-them", "another-thread-takes-them"],
)
def test_ctrl_c_and_sigterm_each_end_the_wait_and_the_handlers_come_back(
    first: str, second: str, main_blocks: bool
) -> None:
    script = CHILD.format(first=first, second=second, main_blocks=main_blocks)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert result.stdout.splitlines() == [first, second, "True True True"], result.stdout


def test_it_refuses_to_wait_outside_the_main_thread() -> None:
    raised: list[BaseException] = []

    def wait() -> None:
        try:
            wait_for_stop_signal({signal.SIGUSR1})
        except RuntimeError as error:
            raised.append(error)

    thread = threading.Thread(target=wait)
    thread.start()
    thread.join(timeout=10)
    assert raised and "main thread" in str(raised[0])
