"""One batch through an in-process Engine, timed as the engine benchmarks (decode.py's engine rows,
verify.py) time it: every prompt submitted at once, the window from every row's first token
(prefill done) to the last row's end. `run_batch` returns a `Run`: the outputs, finish reasons
and errors, and the `Counters` (engine and runner step and draft counts) over that window.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, fields

from generation_service.engine.engine import Engine
from generation_service.engine.params import GenerationRequest, SamplingParams, SpeculativeParams


@dataclass(frozen=True)
class Counters:
    """Engine and runner counters at one moment; `minus` gives a window's counts."""

    steps: int
    graph_steps: int
    verify_graph_steps: int
    chained_steps: int
    draft_proposed: int
    draft_accepted: int

    @classmethod
    def of(cls, engine: Engine) -> "Counters":
        stats, runner = engine.stats(), engine.runner
        return cls(stats.steps, runner.num_graph_steps, runner.num_verify_steps,
                   runner.num_chained_steps, stats.draft_proposed, stats.draft_accepted)

    def minus(self, earlier: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))


@dataclass
class Run:
    """One batch through the engine: outputs, and counters over the timed window."""

    outputs: list[list[int]]
    num_tokens_before: int  # tokens read before the window (each row's first, from prefill)
    finish_reasons: dict[str, int]
    errors: list[str]       # the first three
    window_s: float         # every row's first token -> the last row's end
    submit_to_end_s: float
    window: Counters

    @property
    def num_decoded(self) -> int:
        """Tokens received in the window."""
        return sum(len(out) for out in self.outputs) - self.num_tokens_before


def run_batch(engine: Engine, tag: str, prompts, sampling: SamplingParams,
              speculative: SpeculativeParams = SpeculativeParams(), grammar=None, timeout_s: float = 120) -> Run:
    """Submit every prompt at once (request ids `<tag>-<i>`, each with `grammar` if given); time
    from every row's first token to the last row's end. `timeout_s`: the longest wait for one event."""
    started = time.perf_counter()
    streams = [engine.submit(GenerationRequest(f"{tag}-{i}", prompt, sampling, grammar=grammar,
                                               speculative=speculative))
               for i, prompt in enumerate(prompts)]
    outputs, finals = [[] for _ in streams], [None] * len(streams)

    def drain(i: int, until_first: bool) -> None:
        while finals[i] is None and not (until_first and outputs[i]):
            event = streams[i].get(timeout=timeout_s)
            outputs[i] += event.token_ids
            finals[i] = event if event.is_final else None

    for i in range(len(streams)):
        drain(i, until_first=True)
    t0, before, num_before = time.perf_counter(), Counters.of(engine), sum(len(out) for out in outputs)
    for i in range(len(streams)):
        drain(i, until_first=False)
    end, window = time.perf_counter(), Counters.of(engine).minus(before)
    reasons: dict[str, int] = {}
    for final in finals:
        reasons[final.finish_reason.name] = reasons.get(final.finish_reason.name, 0) + 1
    errors = [repr(f.error) for f in finals if f.error is not None][:3]
    return Run(outputs, num_before, reasons, errors, end - t0, end - started, window)
