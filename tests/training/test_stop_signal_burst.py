"""A burst of SIGTERMs must not hang a worker: the job's handler (``job._stop_on_signals``) runs ``Event.set``,
whose lock is not reentrant; a second SIGTERM delivered while the first handler is inside ``set`` (the launcher's
death re-sends PR_SET_PDEATHSIG as its orphans pass between its threads) re-entered it and deadlocked for good
(seen on a fresh-clone suite: a worker left running 46 minutes after its test failed)."""

import subprocess
import sys

SCRIPT = r"""
import os, signal, threading
from v4launch.training.job import _stop_on_signals

class Bursting(threading.Event):
    def set(self):  # a second SIGTERM arrives while set() holds the event's lock
        with self._cond:
            os.kill(os.getpid(), signal.SIGTERM)
            self._flag = True
            self._cond.notify_all()

stop = Bursting()
with _stop_on_signals(stop):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # let both signals be handled
        pass
print("stopped" if stop.is_set() else "not set")
"""


def test_a_second_sigterm_inside_the_first_does_not_deadlock():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "stopped", (out.returncode, out.stdout, out.stderr[-2000:])
