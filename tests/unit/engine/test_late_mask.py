"""HeldGraphs (engine/late_mask.py): a decode graph step held by a grammar fill asks for the
next step to be a host step, where a slow row can be found late; rarely, and never for free steps."""
from generation_service.engine.late_mask import HELD_FACTOR, PROBE_EVERY, HeldGraphs

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


def test_at_most_one_host_step_asked_for_per_probe_interval():
    held = HeldGraphs(DECODE_S)
    held.host_step()  # a host step not asked for (a prefill) does not delay the first one asked for
    held.graph_step(HELD_S, waited_for_masks=True)
    assert held.wants_host_step
    held.host_step()
    for _ in range(PROBE_EVERY - 1):
        held.graph_step(HELD_S, waited_for_masks=True)
        assert not held.wants_host_step
    held.graph_step(HELD_S, waited_for_masks=True)
    assert held.wants_host_step and held.num_probes == 1
