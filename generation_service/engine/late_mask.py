"""LateMask: when a slow grammar's next mask is likely ready (docs/step_channel.md, "Late rows").

A row whose mask was late once (VALID_LATE: its grammar fills masks slower than the engine's
forward) would keep every step of its batch on the host path, which lets one row be late but
costs the decode graphs' speed to every other row. Instead it sits out of steps while its next
mask is likely still being filled: grammar_service starts that fill as soon as the row's matcher
advances (loop.py), and the engine schedules the row again in a step whose forward ends once
about the fill's time has passed since its last token (the masks are read then; joining only after
that time would cost a whole step where steps are long, as on a CPU). The other rows run as decode
graphs meanwhile; the late row joins a host step when due, and if its mask is still not ready then,
tries again a fraction of that time later. The fill time is learnt from the row itself, between its
last late step and the step that found the mask ready (measuring from its last token instead would
count the time it sat out, and the estimate would grow with every token). A mask ready at the first
look took at most the time since the row's last token: the estimate halves from there, and once it
is under a forward (the mask is done before any step reads it) the row is fast again and back in
decode graphs. So a row found late for a reason that passed (a fast grammar's fill queued once
behind a slow row's in grammar_service's slow filler) sits out for a few tokens, not for many at
the pace of the time it once waited (the GPU slow-row test saw the others at the slow row's
pace; docs/step_channel.md, "Late rows"). Until a first estimate its retries back off
exponentially, so the others' steps are not host steps while it learns.

Only on a runner whose graphed steps wait for every row's mask (ModelRunner.waits_for_every_mask:
the CUDA-graph runner). Where every step is a host step (the CPU) a late row costs the others
nothing, and it joins every step, so it is sampled in the first one that finds its mask ready.
"""
from __future__ import annotations

from dataclasses import dataclass

DUE_FRACTION = 0.9     # back in steps after this share of the learnt fill time since its last token
RETRY_FRACTION = 0.25  # late again: back after this share of it
FIRST_RETRY_S = 0.004  # late with nothing learnt yet: back after this, twice as long each time again
DECAY = 0.5            # the running estimate's weight on its past (a few tokens follow a change)
SHRINK = 0.5           # ready at the first look: the estimate becomes this share of what it took at most


@dataclass
class LateMask:
    """A late row's fill-time estimate and when it is next scheduled (times: time.monotonic)."""

    fill_s: float | None = None         # running estimate of its fill time; None: unknown yet
    start_s: float | None = None        # its fill began then at the latest: its last token, or its first late step
    late_after_s: float | None = None   # its fill was not done this long after start_s (its latest late step)
    retry_s: float = FIRST_RETRY_S
    due_s: float = 0.0                  # it sits out of steps until then

    def is_due(self, now: float) -> bool:
        return now >= self.due_s

    def late(self, now: float) -> None:
        """Its mask was late in a step."""
        if self.start_s is None:
            self.start_s = now
        self.late_after_s = now - self.start_s
        if self.fill_s is None:
            self.due_s, self.retry_s = now + self.retry_s, 2 * self.retry_s
        else:
            self.due_s = now + RETRY_FRACTION * self.fill_s

    def sampled(self, now: float, fast_s: float = 0.0) -> bool:
        """A token of it was sampled (its mask was ready): its next mask fills from now. Whether
        it still sits out: False once its fill is estimated under `fast_s` (the engine's forward)."""
        if self.start_s is not None:
            done_by = now - self.start_s
            if self.late_after_s is not None:  # the fill took between its latest late step and now
                seen = (self.late_after_s + done_by) / 2
                self.fill_s = seen if self.fill_s is None else DECAY * self.fill_s + (1 - DECAY) * seen
            else:  # ready at the first look: it took at most done_by, maybe far less
                self.fill_s = SHRINK * min(done_by, self.fill_s if self.fill_s is not None else done_by)
        self.start_s, self.late_after_s, self.retry_s = now, None, FIRST_RETRY_S
        self.due_s = now + DUE_FRACTION * (self.fill_s or 0.0)
        return self.fill_s is None or self.fill_s >= fast_s


HELD_FACTOR = 4.0   # a decode graph step this many times the free one of the largest batch was held by a fill
PROBE_BURST = 2     # host steps asked for in a row: the first may only time a slow row's fill, the second finds it late
PROBE_EVERY = 16    # after a burst, none until this many graph steps, or this many thresholds of their time, have passed


class HeldGraphs:
    """Only a host step can find a row late (its descriptor gives grammar_service the forward
    time; a decode graph waits for every mask). A slow row whose first fill fell in a decode
    graph (its last prompt token is one) would hold every graph after it. So a grammar graph
    step that took HELD_FACTOR x the free decode step of the largest batch (`decode_s`, measured
    at start) asks for the next step to be a host step. grammar_service times a row's first fill
    on a host step alone (it holds that step), and fills a row it knows is slow apart, late if not
    done by the forward's end: so up to PROBE_BURST such host steps, then the row is late and sits
    out (LateMask); then none for PROBE_EVERY graph steps, or fewer when they are held long: until
    they have taken PROBE_EVERY thresholds of time. A burst spent before the slow row held any
    step (on another request's stalled step, or the prompts' host step) would otherwise leave it
    holding PROBE_EVERY graph steps, each its whole fill, and a short request never sits out
    (the GPU slow-row test; docs/step_channel.md, "Late rows"). Between bursts the graph steps
    still run PROBE_EVERY steps or PROBE_EVERY x HELD_FACTOR decode steps' time."""

    def __init__(self, decode_s: float) -> None:
        self.threshold_s = HELD_FACTOR * decode_s
        self.wants_host_step = False
        self.num_probes = 0                      # host steps asked for
        self._left = PROBE_BURST                 # host steps that may be asked for now
        self._graph_steps = 0                    # graph steps since the last burst ended
        self._graph_s = 0.0                      # and their time

    def graph_step(self, seconds: float, waited_for_masks: bool, expected_s: float = 0.0) -> None:
        """A step that waited for masks where it ran (a decode graph step, or a mixed step in
        stream order, whose own cost `expected_s` may exceed the decode step's) took `seconds`
        of the loop (waited_for_masks: a grammar step)."""
        self._graph_steps += 1
        self._graph_s += seconds
        if not self._left and (self._graph_steps >= PROBE_EVERY or self._graph_s >= PROBE_EVERY * self.threshold_s):
            self._left = PROBE_BURST
        if waited_for_masks and seconds > max(self.threshold_s, HELD_FACTOR * expected_s) and self._left:
            self.wants_host_step = True

    def host_step(self) -> None:
        """A host step was scheduled: grammar_service can time or find late a slow row in it."""
        if self.wants_host_step:
            self.num_probes += 1
            self.wants_host_step, self._left = False, self._left - 1
            if not self._left:
                self._graph_steps, self._graph_s = 0, 0.0
