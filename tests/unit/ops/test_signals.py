"""StopSignals: a stop signal at any moment ends `wait()`, never hangs it (structgen/signals.py).

The race it replaces (`signal.signal(sig, lambda *_: event.set())` then `event.wait()`) hung
about once in 150 runs of a minimal copy; here a minimal process is signalled at random
moments, before, during and after it starts waiting, 150 times.
"""
from __future__ import annotations

import pathlib
import random
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]
CHILD = """
import sys, time
from structgen.signals import StopSignals
stop = StopSignals()
print("installed", flush=True)
for _ in range(int(sys.argv[1])):  # busy main thread: the signal lands between bytecodes
    pass
stop.wait()
print("stopped", stop.received, flush=True)
"""


def test_a_signal_at_any_moment_ends_the_wait():
    rng = random.Random(19)
    for run in range(150):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(rng.choice([0, 1000, 100_000]))], cwd=ROOT,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "installed"
        time.sleep(rng.uniform(0, 0.01))
        child.send_signal(rng.choice([signal.SIGTERM, signal.SIGINT]))
        try:
            out, _ = child.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            raise AssertionError(f"run {run}: wait() did not return after the signal")
        assert child.returncode == 0 and out.startswith("stopped"), (run, child.returncode, out)

