"""The step loop's own Python cost per row: StepLoop.run_step over a backend that does nothing.

grammar_service's step is advance + fill + bookkeeping (loop.py); with a real backend the
native matcher work hides how much the loop's per-row Python costs. Here every matcher call
returns at once, so what is timed is the loop alone: `--rows` constrained rows, one position
and one accepted token each (the decode case), run_step called in this thread (no channel
waits). Reported: run_step p50 and min, and the phases per step (StepLoop.phases).

    .venv/bin/python benchmarks/grammar_loop_overhead.py [--rows 128] [--steps 2000] [--out FILE]
"""
from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import VOCAB, command_line, write_result  # noqa: E402
from grammar_service.backends.base import GrammarBackend, Matcher  # noqa: E402
from grammar_service.loop import StepLoop  # noqa: E402
from step_channel import FLAG_CONSTRAINED, FLAG_FRESH, Geometry, StepChannel  # noqa: E402


class NullMatcher(Matcher):
    def accept(self, token_id: int) -> bool:
        return True

    def rollback(self, num_tokens: int) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def jump_forward_tokens(self) -> list[int]:
        return []


class NullBackend(GrammarBackend):
    """Every call returns at once: masks are left as they are, every token is accepted."""

    name = "null"
    stop_token_ids = frozenset([2])

    def __init__(self) -> None:  # no tokenizer
        pass

    def compile(self, spec):
        return None

    def new_matcher(self, compiled) -> NullMatcher:
        return NullMatcher()

    def batch_accept(self, matchers, token_ids) -> list[bool]:
        return [True] * len(matchers)

    def batch_fill(self, matchers, masks, indices) -> None:
        pass

    def batch_rollback(self, matchers, num_tokens) -> None:
        pass


def run(rows: int, steps: int, warmup: int) -> dict:
    backend = NullBackend()
    geometry = Geometry(max_batch=rows, max_positions=1, vocab_size=VOCAB, depth=4)
    with StepChannel.create(geometry) as channel:
        loop = StepLoop(channel, rows, 1, lambda grammar_id: (backend, None))
        times = []
        for step in range(1, warmup + steps + 1):
            entry = channel.entry(step)
            entry.desc_header[:] = (step, rows)
            flags = FLAG_CONSTRAINED | (FLAG_FRESH if step == 1 else 0)
            entry.desc_rows[:rows] = [(r, 1, flags, 1) for r in range(rows)]
            if step > 1:  # the previous step's accepted token of every row
                previous = channel.entry(step - 1)
                previous.out_counts[:rows] = 1
                previous.out_tokens[:rows, 0] = 7
            if step == warmup + 1:
                loop.phases.advance_ns = loop.phases.fill_ns = loop.phases.bookkeeping_ns = 0
            started = time.perf_counter_ns()
            loop.run_step(step)
            if step > warmup:
                times.append((time.perf_counter_ns() - started) / 1e3)
        assert (channel.entry(warmup + steps).valid_positions[:rows] == 1).all()
        phases = {name: getattr(loop.phases, f"{name}_ns") / steps / 1e3
                  for name in ("advance", "fill", "bookkeeping")}
    return {"rows": rows, "steps": steps, "step_us_p50": statistics.median(times), "step_us_min": min(times),
            "us_per_row_p50": statistics.median(times) / rows, "phases_us_per_step": phases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    runs = [run(args.rows, args.steps, args.warmup) for _ in range(args.repeats)]
    for r in runs:
        ph = r["phases_us_per_step"]
        print(f"run_step, {r['rows']} rows: p50 {r['step_us_p50']:.0f} us ({r['us_per_row_p50']:.2f} us a row), "
              f"min {r['step_us_min']:.0f} us; per step advance {ph['advance']:.0f}, fill {ph['fill']:.0f}, "
              f"bookkeeping {ph['bookkeeping']:.0f} us")
    if args.out:
        write_result(args.out, {"benchmark": "grammar_loop_overhead", "python": platform.python_version(),
                                "command": command_line(f"python {sys.argv[0]}"), "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
