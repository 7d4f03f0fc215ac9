"""Host work of a steady chained mixed step on CPU, per piece (the served 1B at high concurrency).

At high concurrency nearly every step of the served path is a mixed step: N decode rows beside
one prompt chunk, chained (engine/mixed_steps.py: step N+1 is scheduled and launched before
N's tokens are read). This drives the real `MixedSteps` over the real RequestTable, Scheduler
and PrefixCache, with stand-ins only for what needs CUDA:

- the runner (`HostRunner`) packs the batch (`pack_mixed`, what MixedForward does on the host
  before its uploads and launches) and runs no forward;
- the sampler (`HostSampler`) returns a SampleLaunch whose host copy of the tokens is there
  already (the real one copies the device's argmax behind an event); the tokens replay the
  tokenization of real text (engine_host.py's corpus), each request from its own offset;
- the engine (`HostEngine`) holds what MixedSteps reads (lock, table, scheduler, counters) and
  uses Engine's own apply_inbox, finish_step and deliver_deferred.

The load is serve.py's, greedy and ignore_eos, with clients that resubmit once their request
finished (between steps, untimed): requests of `--prompt` tokens are admitted one per step (the
prefill budget), each generates `--rows` + 1 tokens (its first in its prefill step), so a
steady step has `--rows` decode rows beside one prompt (serve.py's 128 outputs make 127
rows). One client more than that keeps a request waiting, so admission never waits for one.
Streams are read between steps (untimed).

Reported per piece, microseconds of the engine thread's CPU time (`thread_time`: what other
processes take is not counted) per chained step, median over the steps after the ramp, the
best of `--repeats` runs (the machine may be shared: the least disturbed run is the cost):
`step` (MixedSteps.step whole, stand-ins excluded), `chained_batch` (MixedSteps._chained_batch,
with `schedule`, Scheduler.schedule(0, continuing=...)), `pack_mixed`, `postprocess`
(RequestTable.postprocess, accept with defer=True) and `deliver` (RequestTable.deliver: text,
stream events). The digests of the batches scheduled and of the events streamed show that two
versions of the code behave the same.

    .venv/bin/python benchmarks/engine_host_mixed.py --out benchmarks/results/engine_host_mixed-ci-2core.json
"""
from __future__ import annotations

import argparse
import hashlib
import pathlib
import platform
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._harness import code_commit, command_line, tekken_dir, write_result  # noqa: E402
from benchmarks.engine_host import corpus_text  # noqa: E402
from generation_service.engine.config import EngineConfig  # noqa: E402
from generation_service.engine.engine import Engine  # noqa: E402
from generation_service.engine.kv_cache import PageAllocator  # noqa: E402
from generation_service.engine.lifecycle import RequestTable  # noqa: E402
from generation_service.engine.mixed_forward import pack_mixed  # noqa: E402
from generation_service.engine.mixed_steps import MixedSteps  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams  # noqa: E402
from generation_service.engine.prefix_cache import PrefixCache  # noqa: E402
from generation_service.engine.request import Request  # noqa: E402
from generation_service.engine.sampler import SampleLaunch  # noqa: E402
from generation_service.engine.scheduler import ScheduledBatch, Scheduler, SlotPool, TokenBudget  # noqa: E402
from generation_service.engine.stream import RequestStream  # noqa: E402

PAGE_SIZE = 16
PIECES = ("step", "chained_batch", "schedule", "pack_mixed", "postprocess", "deliver")


class Timer:
    """CPU seconds spent in each piece during the current step; `stand_in` is not host work."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)

    def wrap(self, owner, name: str, piece: str) -> None:
        """Time `owner.name` (an instance attribute shadows the method) as `piece`."""
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.step[piece] += time.thread_time() - start
        setattr(owner, name, timed)


class HostRunner:
    """The runner's host work before its uploads: the packed layout; no forward (no logits)."""

    def __init__(self, timer: Timer, vocab_size: int) -> None:
        self.timer, self.vocab_size = timer, vocab_size
        self.batch: ScheduledBatch | None = None  # the latest run (what HostSampler samples)

    def run(self, batch: ScheduledBatch, fed_back=None) -> None:
        start = time.thread_time()
        pack_mixed(batch.rows, PAGE_SIZE, self.vocab_size)
        self.timer.step["pack_mixed"] += time.thread_time() - start
        self.batch = batch


class HostSampler:
    """Greedy launches whose tokens are known at once: each request's next corpus token."""

    def __init__(self, timer: Timer, runner: HostRunner, corpus_ids: list[int], offsets: dict[str, int]) -> None:
        self.timer, self.runner, self.corpus_ids, self.offsets = timer, runner, corpus_ids, offsets

    def launch_greedy(self, logits) -> SampleLaunch:
        start = time.thread_time()
        corpus = self.corpus_ids
        tokens = [corpus[(self.offsets[row.request.request_id] + row.request.num_generated) % len(corpus)]
                  for row in self.runner.batch.sampling_rows if not row.request.is_finished]
        host = torch.tensor(tokens, dtype=torch.int64)
        launch = SampleLaunch(None, host, host, ReadyEvent())
        self.timer.step["stand_in"] += time.thread_time() - start
        return launch


class ReadyEvent:
    """A copy that is done: nothing to wait for."""

    def synchronize(self) -> None:
        pass


class HostEngine:
    """What MixedSteps drives of an Engine, without a model; Engine's own bookkeeping methods."""

    apply_inbox = Engine.apply_inbox
    deliver_deferred = Engine.deliver_deferred
    finish_step = Engine.finish_step

    def __init__(self, table: RequestTable, scheduler: Scheduler, runner: HostRunner, sampler: HostSampler) -> None:
        self.table, self.scheduler, self.runner, self.sampler = table, scheduler, runner, sampler
        self.config = EngineConfig(max_draft_tokens=0)
        self.lock = threading.Lock()
        self.link = None
        self._inbox: list[Request] = []
        self._cancels: list = []
        self.num_steps = self.num_mixed_steps = self.num_prefill_tokens = 0


class Clients:
    """`num` clients, each resubmitting a request of its own prompt once the previous finished."""

    def __init__(self, engine: HostEngine, corpus_ids: list[int], offsets: dict[str, int], num: int,
                 prompt_len: int, max_new: int) -> None:
        self.engine, self.corpus_ids, self.prompt_len, self.max_new = engine, corpus_ids, prompt_len, max_new
        self.tokenizer = engine.table.tokenizer
        self.offsets = offsets  # request id -> where its tokens start in the corpus (HostSampler's too)
        self.streams: dict[str, RequestStream] = {}
        self.num_submitted = 0
        self.events = hashlib.blake2b(digest_size=8)
        for _ in range(num):
            self.submit()

    def submit(self) -> None:
        k = self.num_submitted
        self.num_submitted += 1
        corpus, offset = self.corpus_ids, 7919 * k
        head = self.tokenizer.encode(f"Request {k}:", add_special_tokens=False)  # no prefix cache hit
        prompt = (head + [corpus[(offset + i) % len(corpus)] for i in range(self.prompt_len)])[:self.prompt_len]
        spec = GenerationRequest(f"r{k}", tuple(prompt), SamplingParams(max_new_tokens=self.max_new, ignore_eos=True))
        request = Request(spec, frozenset(), sample_seed=k)
        stream = RequestStream(spec.request_id, self.engine.table.cancel)
        self.engine.table.attach_stream(request, stream)
        self.engine._inbox.append(request)
        self.offsets[spec.request_id], self.streams[spec.request_id] = offset + self.prompt_len, stream

    def read(self) -> None:
        """Read every stream; a finished request's client submits the next."""
        for request_id, stream in list(self.streams.items()):
            while stream._events:
                event = stream.get()
                self.events.update(repr((request_id, event.token_ids, event.text, event.finish_reason,
                                         event.usage)).encode())
            if stream.is_finished:
                del self.streams[request_id]
                self.submit()


def run_once(tokenizer, corpus_ids: list[int], *, num_rows: int, prompt_len: int, num_steps: int) -> dict:
    num_clients = num_rows + 3  # the decode rows, the prompt, the one finishing, the one waiting
    timer = Timer()
    slots = SlotPool(2 * num_clients)
    scheduler = Scheduler(PrefixCache(PageAllocator(1 << 16), PAGE_SIZE), PAGE_SIZE, slots, max_batch=num_clients,
                          max_waiting=4 * num_clients, budget=TokenBudget.fixed(prompt_len))
    table = RequestTable(scheduler, slots, tokenizer, tokenizer.eos_token_ids)
    runner = HostRunner(timer, tokenizer.vocab_size)
    offsets: dict[str, int] = {}
    engine = HostEngine(table, scheduler, runner, HostSampler(timer, runner, corpus_ids, offsets))
    clients = Clients(engine, corpus_ids, offsets, num_clients, prompt_len, num_rows + 1)
    steps = MixedSteps(engine, chain=True)
    timer.wrap(steps, "_chained_batch", "chained_batch")
    timer.wrap(scheduler, "schedule", "schedule")
    timer.wrap(table, "postprocess", "postprocess")
    timer.wrap(table, "deliver", "deliver")
    batches = hashlib.blake2b(digest_size=8)
    launch = steps.launch

    def launched(batch: ScheduledBatch, *chained) -> None:
        batches.update(repr([(row.request.request_id, row.num_cached, len(row.input_ids), row.is_sampling)
                             for row in batch.rows]).encode())
        launch(batch, *chained)
    steps.launch = launched
    ramp = num_clients + 8  # the clients admitted one per step, then the first finishes
    per_step: dict[str, list[float]] = defaultdict(list)
    num_decode_rows, num_prefill_tokens = [], []
    for index in range(ramp + num_steps):
        timer.step.clear()
        num_chained = steps.num_chained
        start = time.thread_time()
        if steps.in_flight is None:  # Engine.step's pipelined path: schedule and launch
            with engine.lock:
                engine.apply_inbox()
                batch = scheduler.schedule(0)
            steps.launch(batch)
        else:
            steps.step()
        elapsed = time.thread_time() - start
        clients.read()
        if index >= ramp and steps.num_chained > num_chained:
            per_step["step"].append(elapsed - timer.step["stand_in"])
            for piece in PIECES[1:]:
                per_step[piece].append(timer.step[piece])
            rows = steps.in_flight.batch.rows
            num_decode_rows.append(sum(1 for row in rows if len(row.input_ids) == 1))
            num_prefill_tokens.append(sum(len(row.input_ids) for row in rows if len(row.input_ids) > 1))
    return {"us_per_step_median": {piece: round(1e6 * statistics.median(per_step[piece]), 1) for piece in PIECES},
            "num_chained_steps": len(per_step["step"]), "num_steps": num_steps,
            "decode_rows_median": statistics.median(num_decode_rows),
            "prefill_tokens_median": statistics.median(num_prefill_tokens),
            "num_finished": table.num_finished,
            "batches_digest": batches.hexdigest(), "events_digest": clients.events.hexdigest()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default=platform.node())
    parser.add_argument("--rows", type=int, default=128, help="decode rows of a steady step")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (one chunk a step)")
    parser.add_argument("--steps", type=int, default=150, help="timed steps after the ramp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokenizer", type=pathlib.Path, default=pathlib.Path(tekken_dir()),
                        help="a tokenizer folder (default: serve.py's, the byte-level Tekken 131k)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()

    from generation_service.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.tokenizer)
    corpus_ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    runs = [run_once(tokenizer, corpus_ids, num_rows=args.rows, prompt_len=args.prompt,
                     num_steps=args.steps) for _ in range(args.repeats)]
    assert len({(run["batches_digest"], run["events_digest"]) for run in runs}) == 1, "runs differ"
    best = {piece: min(run["us_per_step_median"][piece] for run in runs) for piece in PIECES}
    spread = {piece: statistics.median(run["us_per_step_median"][piece] for run in runs) for piece in PIECES}
    for piece in PIECES:
        print(f"{piece:14} {best[piece]:8.1f} us/step (median of repeats {spread[piece]:.1f})")
    run = runs[0]
    print(f"{run['num_chained_steps']} chained steps of {run['num_steps']}, {run['decode_rows_median']} decode rows "
          f"and {run['prefill_tokens_median']} prefill tokens a step; batches {run['batches_digest']}, "
          f"events {run['events_digest']}")
    if args.out is not None:
        result = {"benchmark": "engine_host_mixed", "machine": args.machine, "python": platform.python_version(),
                  "tokenizer": args.tokenizer.name, "rows": args.rows, "prompt": args.prompt,
                  "repeats": args.repeats,
                  "us_per_step_best": best, "us_per_step_median_of_repeats": spread,
                  "num_chained_steps": run["num_chained_steps"], "num_steps": run["num_steps"],
                  "decode_rows_median": run["decode_rows_median"],
                  "prefill_tokens_median": run["prefill_tokens_median"],
                  "batches_digest": run["batches_digest"], "events_digest": run["events_digest"],
                  "command": command_line(f".venv/bin/python {sys.argv[0]}"), "code_commit": code_commit()}
        write_result(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
