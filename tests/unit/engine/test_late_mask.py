"""HeldGraphs (engine/late_mask.py): a decode graph step held by a grammar fill asks for the
next step to be a host step, where a slow row can be found late; rarely, and never for free steps."""
from generation_service.engine.late_mask import HELD_FACTOR, PROBE_BURST, PROBE_EVERY, HeldGraphs

DECODE_S = 0.002
HELD_S = HELD_FACTOR * DECODE_S * 1.5


def test_a_grammar_graph_step_held_by_a_fill_asks_for_a_host_step():
    held = HeldGraphs(DECODE_S)
    held.graph_step(HELD_FACTOR * DECODE_S * 0.9, waited_for_masks=True)   # host-bound, not held
    assert not held.wants_host_step
    held.graph_step(HELD_S, waited_for_masks=False)                         # no mask to wait for
    assert not held.wants_host_step
    held.graph_step(HELD_S, waited_for_masks=True)
    assert held.wants_host_step
    held.host_step()
    assert not held.wants_host_step and held.num_probes == 1


def _spend_a_burst(held: HeldGraphs) -> None:
    for _ in range(PROBE_BURST):  # the first times the slow row's fill, the next finds it late
        held.graph_step(HELD_S, waited_for_masks=True)
        assert held.wants_host_step
        held.host_step()


def test_a_burst_of_host_steps_then_none_for_a_probe_interval():
    held = HeldGraphs(DECODE_S)
    held.host_step()  # a host step not asked for (a prefill) uses none of the burst
    _spend_a_burst(held)
    for _ in range(PROBE_EVERY - 2):  # free-speed steps, then a held one: too soon
        held.graph_step(DECODE_S, waited_for_masks=True)
    held.graph_step(HELD_S, waited_for_masks=True)
    assert not held.wants_host_step
    held.graph_step(HELD_S, waited_for_masks=True)
    assert held.wants_host_step and held.num_probes == PROBE_BURST


def test_steps_held_long_after_a_burst_ask_again_within_the_probe_intervals_time():
    """A burst spent before the slow row held anything (another request's stall, the prompts'
    host step) must not leave it holding PROBE_EVERY graph steps of its whole fill each: the
    steps after a burst count by their time too (gpu-tests-h200-slow-row-dda6414-1.log)."""
    held = HeldGraphs(DECODE_S)
    _spend_a_burst(held)
    fill_s = 10 * held.threshold_s  # a slow grammar's fill holds each graph step
    held.graph_step(fill_s, waited_for_masks=True)
    assert not held.wants_host_step  # 10 thresholds of time: not yet the interval's 16
    held.graph_step(fill_s, waited_for_masks=True)
    assert held.wants_host_step
    held.host_step()
    assert held.num_probes == PROBE_BURST + 1
