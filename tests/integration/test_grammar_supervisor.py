"""serve's grammar supervisor on its own, with the 131k Tekken tokenizer: every grammar child is
forked ready from the template within 2 s of being asked, whatever dies is replaced, and stop()
leaves nothing (structgen/supervisor.py, grammar_service/template.py)."""
from __future__ import annotations

import os
import pathlib
import signal
import time

import pytest

from grammar_kills import descendants, is_alive
from structgen.supervisor import GrammarSupervisor, wait_healthy

pytestmark = pytest.mark.slow
READY_S = 2.0


def _tree_of(pid: int) -> set[int]:
    return {pid} | descendants(pid)


def _within(condition, timeout_s: float) -> float:
    """Seconds until `condition()` held; fails past `timeout_s`."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - started


@pytest.fixture
def supervisor(tekken_131k_dir):
    supervisor = GrammarSupervisor(min_backoff_s=0.1)
    supervisor.spawn()
    supervisor.use_tokenizer(tekken_131k_dir, 131072)
    supervisor.wait_ready()
    yield supervisor
    supervisor.stop()


def test_a_standby_is_ready_within_2_s_after_start_and_after_each_takeover(supervisor):
    assert _within(lambda: supervisor.standby_pid is not None, READY_S) < READY_S
    for _ in range(2):  # the second kill right after the first takeover
        serving, standby = supervisor.pid, supervisor.standby_pid
        os.kill(serving, signal.SIGKILL)
        _within(lambda: supervisor.pid == standby, READY_S)
        assert wait_healthy(supervisor.address, READY_S)
        _within(lambda: supervisor.standby_pid is not None, READY_S)
    assert supervisor.num_takeovers == 2


def test_a_dead_standby_or_template_is_replaced_and_stop_leaves_nothing(supervisor):
    standby = _within(lambda: supervisor.standby_pid is not None, 60) and supervisor.standby_pid
    os.kill(standby, signal.SIGKILL)
    _within(lambda: supervisor.standby_pid not in (None, standby), READY_S)
    template = supervisor._template.process.pid
    processes = _tree_of(template)
    os.kill(template, signal.SIGKILL)  # the children do not depend on it
    assert wait_healthy(supervisor.address, 5) and is_alive(supervisor.standby_pid)
    _within(lambda: supervisor._template.process.pid != template, 10)
    serving, standby = supervisor.pid, supervisor.standby_pid
    os.kill(serving, signal.SIGKILL)  # the standby forked by the old template takes over
    _within(lambda: supervisor.pid == standby, READY_S)
    _within(lambda: supervisor.standby_pid is not None, 120)  # forked by the new template, once it is up
    processes |= _tree_of(supervisor._template.process.pid)
    folder = pathlib.Path(supervisor.socket_path).parent
    supervisor.stop()
    _within(lambda: not any(is_alive(pid) for pid in processes), 10)
    assert not folder.exists()
