"""GrammarServiceConfig's auto defaults: compile capacity from the CPUs, rpc threads from it."""
from __future__ import annotations

import os

import pytest

from grammar_service.config import NUM_OTHER_RPC_THREADS, GrammarServiceConfig, auto_compile_threads, usable_cpus
from grammar_service.server import build_parser
from grammar_service.settings import GRAMMAR_SETTINGS


@pytest.fixture
def cpus(monkeypatch):
    """Sets how many CPUs this process may use, as os.sched_getaffinity reports them."""
    def set_cpus(num_cpus: int) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(num_cpus)))
    return set_cpus


@pytest.mark.parametrize("num_cpus, expected", [(1, 2), (2, 2), (8, 2), (16, 4), (24, 6), (32, 8), (128, 8)])
def test_auto_compile_threads_are_a_quarter_of_the_cpus_from_2_to_8(num_cpus, expected):
    assert auto_compile_threads(num_cpus) == expected


@pytest.mark.parametrize("num_cpus, num_compile_threads", [(2, 2), (16, 4)])
def test_the_default_compile_capacity_follows_the_cpus_this_process_may_use(cpus, num_cpus, num_compile_threads):
    cpus(num_cpus)
    config = GrammarServiceConfig()
    assert (config.num_compile_threads, config.max_queued_compiles) == (num_compile_threads, 256)
    # every compile running or queued may hold an rpc thread, and health still finds one
    assert config.num_rpc_threads == num_compile_threads + 256 + NUM_OTHER_RPC_THREADS


def test_an_explicit_value_wins_and_auto_rpc_threads_follow_it(cpus):
    cpus(16)
    config = GrammarServiceConfig(num_compile_threads=1, max_queued_compiles=3, num_rpc_threads=5)
    assert (config.num_compile_threads, config.max_queued_compiles, config.num_rpc_threads) == (1, 3, 5)
    assert GrammarServiceConfig(max_queued_compiles=3).num_rpc_threads == 4 + 3 + NUM_OTHER_RPC_THREADS


def test_auto_is_a_word_of_the_flags_and_variables(cpus):
    cpus(16)
    args = build_parser().parse_args(["--num-compile-threads", "auto", "--num-rpc-threads", "6"])
    config = GRAMMAR_SETTINGS.resolve(args, {"STRUCTGEN_GRAMMAR_MAX_QUEUED_COMPILES": "10"})[GrammarServiceConfig]
    assert (config.num_compile_threads, config.max_queued_compiles, config.num_rpc_threads) == (4, 10, 6)
    environ = {"STRUCTGEN_GRAMMAR_NUM_COMPILE_THREADS": "3", "STRUCTGEN_GRAMMAR_NUM_RPC_THREADS": "auto"}
    config = GRAMMAR_SETTINGS.resolve(build_parser().parse_args([]), environ)[GrammarServiceConfig]
    assert (config.num_compile_threads, config.num_rpc_threads) == (3, 3 + 256 + NUM_OTHER_RPC_THREADS)


@pytest.mark.parametrize("cpu_max, expected", [("max 100000", 16), ("200000 100000", 2), ("250000 100000", 3),
                                               ("50000 100000", 1), ("garbage", 16), (None, 16)])
def test_usable_cpus_are_capped_by_a_containers_cpu_quota(cpus, tmp_path, cpu_max, expected):
    cpus(16)
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    assert usable_cpus(path) == expected
