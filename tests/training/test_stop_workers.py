"""Stopping a local run: the first signal asks the workers to finish their step and save; a second one kills them
(v4launch/launchers.py ``stop_workers``). Found by a user check: a step that never ended (a global batch of 16M
sequences on CPU) held the launcher and both workers for ten minutes after ``timeout``'s SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from v4launch.launchers import _sigterm_as_interrupt, stop_workers

STUCK = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: print('asked to stop', flush=True))\n"
         "print('ready', flush=True)\n"
         "while True: time.sleep(0.05)\n")  # a worker whose step never ends: it hears SIGTERM, never exits
POLITE = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
          "print('ready', flush=True)\n"
          "while True: time.sleep(0.05)\n")


def _workers(source: str, n: int) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    return procs


@pytest.fixture
def sigterm_interrupts():
    previous = _sigterm_as_interrupt()
    assert previous is not None, "pytest runs tests in the main thread"
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.mark.timeout(60)
def test_a_second_signal_kills_workers_whose_step_never_ends(sigterm_interrupts):
    procs = _workers(STUCK, 2)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM))  # the user's second `kill`
    timer.start()
    t0 = time.monotonic()
    try:
        codes = stop_workers(procs)
    finally:
        timer.cancel()
        for p in procs:
            p.kill()
    assert codes == [-signal.SIGKILL, -signal.SIGKILL]
    assert all(p.stdout.readline().strip() == "asked to stop" for p in procs)  # the first stop reached each
    assert 0.9 < time.monotonic() - t0 < 30


@pytest.mark.timeout(60)
def test_one_signal_lets_the_workers_finish(sigterm_interrupts):
    procs = _workers(POLITE, 2)
    try:
        assert stop_workers(procs) == [0, 0]
    finally:
        for p in procs:
            p.kill()
