"""Host work per step of a steady decode on CPU: `RequestTable.postprocess` per row.

On the GPU the engine overlaps step N+1 with the host work of step N (engine.py
`_step_chained`); for a small model at a large batch that host work is the bound. This
times it alone: N running requests (default 128) with the tiny-random model's tokenizer (or
`--tokenizer DIR`, e.g. the serving benchmark's byte-level Tekken), each
step one ScheduledBatch of N decode rows with one sampled token each. The tokens replay the
tokenization of real text (prose, JSON documents, accents, CJK, emoji, byte-fallback runs),
each request from its own offset, so the detokenizer sees real pieces. Six cases:
with/without stop strings (they never match, but their prefixes are held back), times three
kinds of consumer: none (the benchmark reads the streams between steps, untimed), `drain`
(one thread per request iterating its stream) and `servicer` (one thread per request doing
what `server.Generate` does per message but the gRPC send: `metrics.observe` and
`proto_convert.event_to_proto`, on `stream.coalesced()` where the stream has it, so the
same script times older code too).
Reported: microseconds of postprocess per row, median over steps, the best of `--repeats`
runs, taken round robin over the cases (the machine may be shared: the least disturbed run
is the cost; the median of the runs shows the spread); wall time, and the
engine thread's CPU time (`thread_time`: what other processes take is not counted, nor the
GIL waits for consumers). Also per row, over the whole run until every consumer has read its
final event: wall time and the process's CPU time (all threads: what a token costs the
serving process), and for `servicer` consumers the tokens per message sent.

    .venv/bin/python benchmarks/engine_host.py --out benchmarks/results/engine_host-ci-2core.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._documents import DOCUMENTS  # noqa: E402
from benchmarks._harness import code_commit, command_line, write_result  # noqa: E402
from generation_service.engine.events import FinishReason  # noqa: E402
from generation_service.engine.kv_cache import PageAllocator  # noqa: E402
from generation_service.engine.lifecycle import RequestTable  # noqa: E402
from generation_service.engine.params import GenerationRequest, SamplingParams  # noqa: E402
from generation_service.engine.prefix_cache import PrefixCache  # noqa: E402
from generation_service.engine.request import Request, RequestStatus  # noqa: E402
from generation_service.engine.sampler import SampleResult  # noqa: E402
from generation_service.engine.scheduler import ScheduledBatch, ScheduledRow, Scheduler, SlotPool, TokenBudget  # noqa: E402
from generation_service.engine.stream import RequestStream  # noqa: E402
from generation_service import proto_convert  # noqa: E402
from generation_service.metrics import GenerationMetrics  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

PROSE = (
    "The engine overlaps the forward of one step with the bookkeeping of the previous one, "
    "so for a small model the host decides how fast tokens come out. Grüße aus Köln — ça va? "
    "Naïve café owners in Zürich charge 4,50 € for an espresso.\n\n"
    "日本語のテキストと中文の混合、そして한국어도 조금. "
    "emoji: 😀👍🏽🎉 family 👨‍👩‍👧, rare script: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ᚠᛇᚻ ꦲꦏ.\n"
    "def step(self):\n    batch = self.scheduler.schedule()\n    return self.runner.run(batch)\n"
)
# Stop strings absent from the text whose prefixes ("\n", "<", "Obs") occur: held back, never matched.
STOP_STRINGS = ("\nUser:", "</answer>", "Observation:")
SERVICER_METRICS = GenerationMetrics(CollectorRegistry())  # not the process's registry
PROMPT = "Answer the question in prose, then as JSON:"


def corpus_text() -> str:
    documents = "\n".join(json.dumps(document, ensure_ascii=False, indent=1) for _, document in DOCUMENTS)
    return (PROSE + documents) * 2


def make_requests(table: RequestTable, prompt_ids: list[int], num: int, max_new: int,
                  stop_strings: tuple[str, ...]) -> list[Request]:
    """`num` decoding requests (admitted, prefill done), each with a stream attached."""
    requests = []
    for i in range(num):
        spec = GenerationRequest(f"r{i}", tuple(prompt_ids),
                                 SamplingParams(max_new_tokens=max_new, stop_strings=stop_strings))
        request = Request(spec, frozenset(), sample_seed=i)
        request.status, request.slot = RequestStatus.RUNNING, table.slots.allocate()
        request.num_cached = request.num_tokens - 1
        request.pages = table.scheduler.cache.allocate(-(-(request.num_tokens + max_new) // 16))
        table.scheduler.running.append(request)
        table.attach_stream(request, RequestStream(request.request_id, table.cancel))
        requests.append(request)
    return requests


def decode_step(requests: list[Request], corpus_ids: list[int], step: int):
    """The batch the scheduler would build for `step` and one sampled token per row."""
    stride = len(corpus_ids) // len(requests) + 1
    rows, samples = [], []
    for i, request in enumerate(requests):
        rows.append(ScheduledRow(request, request.num_tokens - 1, [request.token_ids[-1]], is_sampling=True))
        samples.append(SampleResult([corpus_ids[(i * stride + step) % len(corpus_ids)]]))
    return ScheduledBatch(rows), samples


def drain(stream: RequestStream, spec) -> None:
    for _ in stream:
        pass


def serve(stream: RequestStream, spec) -> None:
    """server.Generate's loop without the transport (no grammar: no schema validation)."""
    events = stream.coalesced() if hasattr(stream, "coalesced") else stream
    num_messages = 0
    for event in SERVICER_METRICS.observe(events, spec):
        proto_convert.event_to_proto(event, spec)
        num_messages += 1
    NUM_MESSAGES.append(num_messages)  # (list.append is atomic under the GIL)


NUM_MESSAGES: list[int] = []  # per request of the last case with servicer consumers
CONSUMERS = {"none": None, "drain": drain, "servicer": serve}


def drain_now(streams: list[RequestStream]) -> None:
    """What consumers would have read by now (so events do not pile up in memory)."""
    for stream in streams:
        events = stream._events  # a deque, or a SimpleQueue (this script timing older code)
        while len(events) if not hasattr(events, "empty") else not events.empty():
            stream.get()


def run_case(tokenizer, corpus_ids: list[int], prompt_ids: list[int], *, num_requests: int,
             num_steps: int, stop_strings: tuple[str, ...], consumers: str) -> dict:
    slots = SlotPool(2 * num_requests)
    scheduler = Scheduler(PrefixCache(PageAllocator(1 << 16), 16), 16, slots, max_batch=num_requests,
                          max_waiting=num_requests, budget=TokenBudget.fixed(4096))
    table = RequestTable(scheduler, slots, tokenizer, tokenizer.eos_token_ids)
    requests = make_requests(table, prompt_ids, num_requests, num_steps + 1, stop_strings)
    streams = [table._streams[r.request_id] for r in requests]
    consume = CONSUMERS[consumers]
    NUM_MESSAGES.clear()
    threads = [threading.Thread(target=consume, args=(stream, request.spec), daemon=True)
               for stream, request in zip(streams, requests)] if consume is not None else []
    for thread in threads:
        thread.start()
    per_step_s, per_step_cpu_s = [], []
    run_start, run_start_cpu = time.perf_counter(), time.process_time()
    for step in range(num_steps):
        batch, samples = decode_step(requests, corpus_ids, step)
        start, start_cpu = time.perf_counter(), time.thread_time()
        table.postprocess(batch, samples, None, None, None)
        per_step_s.append(time.perf_counter() - start)
        per_step_cpu_s.append(time.thread_time() - start_cpu)
        if consume is None:
            drain_now(streams)
    num_finished = table.num_finished
    for request in requests:  # the final event ends each consumer
        table.finish(request, FinishReason.CANCELLED, None)
    for thread in threads:
        thread.join()
    num_rows = num_steps * num_requests
    run_us_per_row = 1e6 * (time.perf_counter() - run_start) / num_rows
    run_cpu_us_per_row = 1e6 * (time.process_time() - run_start_cpu) / num_rows
    assert num_finished == 0, f"{num_finished} requests finished early: a stop string matched the corpus?"
    num_messages = sum(NUM_MESSAGES) if consumers == "servicer" else None  # else one per event
    us_per_row = [1e6 * s / num_requests for s in per_step_s[num_steps // 10:]]  # skip warm-up steps
    cpu_us_per_row = [1e6 * s / num_requests for s in per_step_cpu_s[num_steps // 10:]]
    return {"stop_strings": bool(stop_strings), "consumers": consumers, "num_requests": num_requests,
            "num_steps": num_steps, "us_per_row_median": round(statistics.median(us_per_row), 2),
            "us_per_row_mean": round(statistics.fmean(us_per_row), 2),
            "cpu_us_per_row_median": round(statistics.median(cpu_us_per_row), 2),
            "ms_per_step_median": round(statistics.median(us_per_row) * num_requests / 1000, 3),
            "num_messages": num_messages, "num_tokens": num_rows,
            # the whole run until every consumer read its final event, all threads: what a
            # token costs the serving process (step building and the finishes included)
            "run_us_per_row": round(run_us_per_row, 2), "run_cpu_us_per_row": round(run_cpu_us_per_row, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", default=platform.node())
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--consumers", nargs="+", choices=list(CONSUMERS), default=list(CONSUMERS))
    parser.add_argument("--no-stop-strings", action="store_true", help="only the cases without")
    parser.add_argument("--tokenizer", type=pathlib.Path, default=None,
                        help="a tokenizer folder (default: the tiny-random model's, Mistral 32k SentencePiece)")
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()

    from generation_service.model.tiny_random_model import ensure_tiny_random_model
    from generation_service.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(args.tokenizer or ensure_tiny_random_model())
    corpus_ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    assert tokenizer.decodes_by_concatenation or any(i in tokenizer.byte_fallback_ids for i in corpus_ids)
    prompt_ids = (tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]) if tokenizer.chat_template
                  else tokenizer.encode(PROMPT))
    stop_cases = ((),) if args.no_stop_strings else ((), STOP_STRINGS)
    cases = [(stop_strings, consumers) for stop_strings in stop_cases for consumers in args.consumers]
    runs: dict[tuple, list[dict]] = {case: [] for case in cases}
    for _ in range(args.repeats):  # round robin: a busy spell of the machine spreads over the cases
        for stop_strings, consumers in cases:
            runs[stop_strings, consumers].append(run_case(
                tokenizer, corpus_ids, prompt_ids, num_requests=args.requests, num_steps=args.steps,
                stop_strings=stop_strings, consumers=consumers))
    rows = []
    for case in cases:
        row = min(runs[case], key=lambda run: run["us_per_row_median"])
        rows.append(row | {"repeats": args.repeats,
                           "us_per_row_median_of_repeats": round(statistics.median(
                               run["us_per_row_median"] for run in runs[case]), 2)})
        print(f"stop_strings={row['stop_strings']!s:5} consumers={row['consumers']:8} "
              f"{row['us_per_row_median']:7.2f} us/row (median of repeats {rows[-1]['us_per_row_median_of_repeats']:.2f}, "
              f"engine thread CPU {row['cpu_us_per_row_median']:.2f}), "
              f"{row['ms_per_step_median']:.3f} ms/step at {args.requests} rows; whole run "
              f"{row['run_us_per_row']:.2f} us/row, process CPU {row['run_cpu_us_per_row']:.2f}"
              + (f", {row['num_tokens'] / row['num_messages']:.2f} tokens/message" if row["num_messages"] else ""),
              flush=True)
    if args.out is not None:
        result = {"benchmark": "engine_host", "machine": args.machine, "python": platform.python_version(),
                  "tokenizer": str(args.tokenizer.name) if args.tokenizer else "tiny-random (Mistral 32k SentencePiece)",
                  "rows": rows,
                  "command": command_line(f".venv/bin/python {sys.argv[0]}"), "code_commit": code_commit()}
        write_result(args.out, result, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
