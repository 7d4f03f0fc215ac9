"""The load side of benchmarks/serve.py: gRPC (or HTTP) clients in several processes.

Each client process runs one asyncio loop with grpc.aio (one channel), or with httpx against
the OpenAI-compatible HTTP API (`transport="http"`: /v1/completions, streamed, the same token
ids, sampling and schema; one connection per user), and, for a closed-loop
workload, `concurrency / processes` users that send their next request as soon as the last one
ended; for an open-loop workload, Poisson arrivals at `rate / processes` per second, each request
its own task. Every request records its send time, the arrival time and token count of each
streamed message, and how it ended (finish reason, validation status, gRPC code; over gRPC an
invalid document whose violations the guarantee report names, such as xgrammar's raw control
characters in length-limited strings, counts as INVALID_REPORTED_GAP apart). Requests are
token ids (`prompts`: slices of real text tokenized with the server's tokenizer, exact lengths),
so the prompt length is the workload's and no server-side tokenization varies between runs.

The server caches KV pages of prompt prefixes: unless a workload shares prefixes on purpose,
a few tokens of every request (`Workload.unique_at`) spell a number unique to it in the run
(`run_workload`'s `salt` apart from other workloads), so no request finds a page of another in
the cache, whatever prompt it drew. A multi-turn workload (`turns`) holds one conversation per
user: each turn resends the conversation so far (prompt, answers, a new message of
`turn_tokens` tokens), as chat clients and agent loops do.

Requests that use issue 20's features: `tools` sends chat input (prompts as text, the
request's number in front) with those tools and `tool_choice`; `reasoning_budget` enables a
reasoning span with the markers REASONING_MARKERS given in the request (a model need not
have its own) and that budget, after which the end marker is forced. Each parsed call's
validation status is recorded. `run_workloads` runs several workloads in one window.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import random
import time
from dataclasses import dataclass, field

# imported with this module, before any window: jsonschema's import takes ~1 s of a client's loop
from structgen.schema_validation import unexplained_violations

CANCELLED_AT_END = "CANCELLED_AT_END"  # not an error: the client stopped it when the window closed
REASONING_MARKERS = ("<think>", "</think>")


@dataclass(frozen=True)
class BenchTool:
    """One tool of a request (GenerateRequest.tools)."""

    name: str
    description: str
    parameters: str                 # JSON Schema of the arguments, JSON text


@dataclass
class Workload:
    """What one workload sends. max_tokens_list: per request, cycled (matched lengths)."""

    name: str
    prompt_len: int
    max_tokens: int
    concurrency: int = 0            # closed loop: users; 0 = open loop
    rate: float = 0.0               # open loop: requests per second
    json_schema: str | None = None  # constrained (compact whitespace)
    json_schemas: tuple[str, ...] = ()  # constrained, each request by a schema drawn from these
    ignore_eos: bool = True
    max_tokens_list: list[int] = field(default_factory=list)
    duration_s: float = 10.0
    warmup_s: float = 3.0
    num_requests: int = 0           # > 0: exactly this many requests one after another (idle TTFT)
    transport: str = "grpc"         # "grpc" or "http" (the OpenAI-compatible API at `address`)
    unique_at: int | None = 0       # tokens from here spell the request's number; None: prompts as drawn
    turns: int = 0                  # > 0: conversations of this many turns, each resending the whole
    turn_tokens: int = 64           # tokens of each new message of a conversation
    tools: tuple[BenchTool, ...] = ()  # chat input (prompts are text) with these tools
    tool_choice: str = "auto"       # with tools: "none", "auto" or "required"
    reasoning_budget: int | None = None  # a reasoning span of at most this many tokens first
    num_draft_tokens: int = 0       # > 0: speculative decoding, drafts from `proposer`
    proposer: str = "ngram"         # "ngram" or "grammar" (DraftProposer)

    @property
    def is_chat(self) -> bool:
        return bool(self.tools)


@dataclass
class Record:
    """One request as its client saw it; times in seconds since the workload's start."""

    start: float
    message_times: list[float]
    message_tokens: list[int]
    end: float
    finish_reason: str = ""
    validation: str = ""
    code: str = "OK"
    prompt_len: int = 0
    cached_tokens: int = 0          # usage.cached_prompt_tokens (gRPC): prompt tokens the server found cached
    turn: int = 0                   # multi-turn: which turn of its conversation
    call_validation: list[str] = field(default_factory=list)  # per parsed tool call, its validation status
    reasoning_chars: int = 0        # reasoning text streamed (markers left out)
    compile_ms: float | None = None  # its grammar's compile, when it was not cached (the guarantee report)

    @property
    def num_tokens(self) -> int:
        return sum(self.message_tokens)

    @property
    def ttft(self) -> float | None:
        return self.message_times[0] - self.start if self.message_times else None


def make_prompts(tokenizer_json: str, lengths: set[int], count: int, seed: int) -> dict[int, list[list[int]]]:
    """`count` prompts per length: windows of the tokenized benchmark documents and prose at
    random offsets (repeated until long enough)."""
    import json as json_lib

    from tokenizers import Tokenizer

    from benchmarks._documents import DOCUMENTS

    text = "\n".join(json_lib.dumps(doc) + "\nDescribe the record above in one sentence. " for _, doc in DOCUMENTS)
    ids = Tokenizer.from_file(tokenizer_json).encode(text, add_special_tokens=False).ids
    rng = random.Random(seed)
    out = {}
    for length in lengths:
        source = ids * (length // len(ids) + 2)
        out[length] = [source[(o := rng.randrange(len(ids))):o + length] for _ in range(count)]
    return out


def _request(pb, workload: Workload, prompt: list[int] | str, max_tokens: int, seed: int):
    """The GenerateRequest: token ids, or (with tools) the prompt text as one user turn."""
    request = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, seed=seed),
                                 stop=pb.StopConditions(max_tokens=max_tokens, ignore_eos=workload.ignore_eos))
    if isinstance(prompt, str):
        request.chat.messages.add(role="user", content=prompt)
    else:
        request.token_ids.ids.extend(prompt)
    if workload.json_schema is not None or workload.json_schemas:
        schemas = workload.json_schemas
        request.json_schema = schemas[seed % len(schemas)] if schemas else workload.json_schema
        request.constraint_options.compact = True
    for tool in workload.tools:
        request.tools.add(name=tool.name, description=tool.description, parameters=tool.parameters)
    if workload.tools:
        request.tool_choice.mode = pb.ToolChoiceMode.Value(f"TOOL_CHOICE_MODE_{workload.tool_choice.upper()}")
    if workload.tools and workload.tool_choice != "none":  # bounded whitespace in the arguments, as compact
        request.constraint_options.max_whitespace = 1       # for a schema (calls take no compact)
    if workload.num_draft_tokens:
        request.speculative.num_draft_tokens = workload.num_draft_tokens
        request.speculative.proposer = pb.DraftProposer.Value(f"DRAFT_PROPOSER_{workload.proposer.upper()}")
    if workload.reasoning_budget is not None:
        request.reasoning.CopyFrom(pb.ReasoningOptions(
            mode=pb.REASONING_MODE_ENABLED, max_tokens=workload.reasoning_budget,
            begin_marker=REASONING_MARKERS[0], end_marker=REASONING_MARKERS[1]))
    return request


async def _one_request(stub, pb, workload: Workload, prompt: list[int] | str, max_tokens: int, t0: float,
                       records: list[Record], seed: int, turn: int = 0) -> list[int]:
    """Send one request and record it; returns its output token ids."""
    request = _request(pb, workload, prompt, max_tokens, seed)
    record = Record(time.perf_counter() - t0, [], [], 0.0, prompt_len=len(prompt), turn=turn)
    output: list[int] = []
    texts: list[str] = []
    unenforced: set[str] = set()
    try:
        async for message in stub.Generate(request):
            texts.append(message.text)
            if message.HasField("guarantee"):
                unenforced |= {u.keyword for u in message.guarantee.unenforced}
                if not message.guarantee.cache_hit:
                    record.compile_ms = message.guarantee.compile_ms
            if message.token_ids:
                record.message_times.append(time.perf_counter() - t0)
                record.message_tokens.append(len(message.token_ids))
                output += message.token_ids
            record.reasoning_chars += len(message.reasoning_text)
            record.call_validation += [pb.ValidationStatus.Name(c.validation.status) for c in message.tool_calls]
            if message.finish_reason:
                record.finish_reason = pb.FinishReason.Name(message.finish_reason)
                record.cached_tokens = message.usage.cached_prompt_tokens
                record.prompt_len = message.usage.prompt_tokens or record.prompt_len  # chat: as templated
                if message.HasField("validation"):
                    record.validation = pb.ValidationStatus.Name(message.validation.status)
                    if message.finish_reason in (pb.FINISH_REASON_GRAMMAR_COMPLETE,  # a document, not a cut one
                                                 pb.FINISH_REASON_BUDGET_CLOSED):
                        record.validation = _status(record.validation, request.json_schema, texts, unenforced)
    except asyncio.CancelledError:  # the window ended with this request streaming: its tokens count
        record.code = CANCELLED_AT_END
    except Exception as error:  # noqa: BLE001 -- a failed call is a result (its code), never a crash
        code = getattr(error, "code", None)
        record.code = code().name if callable(code) else type(error).__name__
    record.end = time.perf_counter() - t0
    records.append(record)
    return output


def _status(name: str, schema: str | None, texts: list[str], unenforced: set[str]) -> str:
    """`name`, or INVALID_REPORTED_GAP for an invalid document that the guarantee report
    explains (every violation a keyword it names as unenforced)."""
    if name == "VALIDATION_STATUS_INVALID" and schema and not unexplained_violations(schema, "".join(texts), unenforced):
        return "VALIDATION_STATUS_INVALID_REPORTED_GAP"
    return name


def unique_tokens(number: int, alphabet: list[int], num_digits: int) -> list[int]:
    """`number` in base len(alphabet), `num_digits` digits, as tokens of the alphabet."""
    k = len(alphabet)
    return [alphabet[number // k ** d % k] for d in range(num_digits)]


class HttpStub:
    """Generate over the OpenAI-compatible API: /v1/completions with stream true."""

    def __init__(self, client, model: str) -> None:
        self.client, self.model = client, model

    async def one_request(self, workload: Workload, prompt: list[int], max_tokens: int, t0: float,
                          record: Record, seed: int, output: list[int]) -> None:
        import json

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "seed": seed, "stream": True,
                "structgen": {"ignore_eos": workload.ignore_eos, "return_token_ids": True}}
        if workload.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "record", "schema": json.loads(workload.json_schema)}}
            body["structgen"]["compact"] = True
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                record.code = f"HTTP_{response.status_code}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.code = chunk["error"].get("code") or "ERROR"
                    return
                for choice in chunk["choices"]:
                    extension = choice.get("structgen") or {}
                    if extension.get("token_ids"):
                        record.message_times.append(time.perf_counter() - t0)
                        record.message_tokens.append(len(extension["token_ids"]))
                        output += extension["token_ids"]
                    if choice.get("finish_reason"):
                        record.finish_reason = "FINISH_REASON_" + extension.get("finish_reason", "").upper()
                        if "validation" in extension:
                            record.validation = "VALIDATION_STATUS_" + extension["validation"]["status"].upper()


async def _one_http_request(stub: HttpStub, workload: Workload, prompt: list[int], max_tokens: int, t0: float,
                            records: list[Record], seed: int, turn: int = 0) -> list[int]:
    record = Record(time.perf_counter() - t0, [], [], 0.0, prompt_len=len(prompt), turn=turn)
    output: list[int] = []
    try:
        await stub.one_request(workload, prompt, max_tokens, t0, record, seed, output)
    except asyncio.CancelledError:
        record.code = CANCELLED_AT_END
    except Exception as error:  # noqa: BLE001 -- a failed call is a result, never a crash
        record.code = type(error).__name__
    record.end = time.perf_counter() - t0
    records.append(record)
    return output


async def _drive(address: str, workload: Workload, prompts: list[list[int]] | list[str], share: float, seed: int,
                 start_at: float, proc: tuple[int, int] = (0, 1), salt: int = 0) -> list[Record]:
    """`proc`: (this process's index, processes): requests are numbered apart across processes,
    from `salt` on."""
    if workload.transport == "http":
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=address, timeout=600, limits=limits) as client:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            stub = HttpStub(client, model)
            return await _drive_with(lambda *a: _one_http_request(stub, *a), workload, prompts, share, seed,
                                     start_at, proc, salt)
    import grpc

    from structgen.v1 import generation_pb2 as pb
    from structgen.v1 import generation_pb2_grpc as pb_grpc

    options = [("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        await channel.channel_ready()
        return await _drive_with(lambda *a: _one_request(stub, pb, *a), workload, prompts, share, seed, start_at,
                                 proc, salt)


async def _drive_with(one_request, workload: Workload, prompts: list[list[int]] | list[str], share: float, seed: int,
                      start_at: float, proc: tuple[int, int], salt: int) -> list[Record]:
    """`one_request(workload, prompt, max_tokens, t0, records, seed[, turn])` -> output ids, under the
    workload's load."""
    rng = random.Random(seed)
    records: list[Record] = []
    counter = iter(range(1 << 30))
    alphabet = sorted({t for p in prompts for t in p})  # token ids the prompts use: valid ones
    num_digits = 2
    while len(alphabet) ** num_digits < 1 << 40:  # run-unique numbers below 2^40
        num_digits += 1

    def next_args() -> tuple[list[int] | str, int]:
        n = next(counter)
        lengths = workload.max_tokens_list
        prompt = prompts[rng.randrange(len(prompts))]
        at = workload.unique_at
        if isinstance(prompt, str):  # chat: the number in front of the user's text
            prompt = f"Request {salt + n * proc[1] + proc[0]}. {prompt}"
        elif at is not None and len(alphabet) > 1:  # this request's number in the run, as tokens
            unique = unique_tokens(salt + n * proc[1] + proc[0], alphabet, num_digits)
            prompt = prompt[:at] + unique + prompt[at + len(unique):]
        return prompt, lengths[(seed * 7919 + n) % len(lengths)] if lengths else workload.max_tokens

    def new_message() -> list[int]:
        source = prompts[rng.randrange(len(prompts))]
        start = rng.randrange(max(1, len(source) - workload.turn_tokens))
        return source[start:start + workload.turn_tokens]

    while time.time() < start_at:  # every process starts at once
        await asyncio.sleep(0.001)
    t0 = time.perf_counter()
    end = workload.warmup_s + workload.duration_s

    async def user() -> None:
        while time.perf_counter() - t0 < end:
            prompt, max_tokens = next_args()
            if not workload.turns:
                await one_request(workload, prompt, max_tokens, t0, records, rng.randrange(1 << 30))
                continue
            for turn in range(workload.turns):  # one conversation: each turn resends it all
                if time.perf_counter() - t0 >= end:
                    break
                answer = await one_request(workload, prompt, max_tokens, t0, records, rng.randrange(1 << 30), turn)
                prompt = prompt + answer + new_message()

    if workload.num_requests:
        for _ in range(workload.num_requests):
            prompt, max_tokens = next_args()
            await one_request(workload, prompt, max_tokens, t0, records, 0)
    elif workload.concurrency:
        users = round(workload.concurrency * share)
        tasks = [asyncio.create_task(user()) for _ in range(users)]
        await _wait_until(t0, end, tasks)
    else:
        tasks = []
        rate = workload.rate * share
        next_at = rng.expovariate(rate) if rate > 0 else end
        while next_at < end:
            now = time.perf_counter() - t0
            if now < next_at:
                await asyncio.sleep(min(next_at - now, 0.01))
                continue
            prompt, max_tokens = next_args()
            tasks.append(asyncio.create_task(one_request(workload, prompt, max_tokens, t0, records,
                                                         rng.randrange(1 << 30))))
            next_at += rng.expovariate(rate)
        await _wait_until(t0, end, tasks)
    return records


async def _wait_until(t0: float, end: float, tasks: list) -> None:
    """Let the window end, then cancel what is still streaming (its tokens so far count)."""
    while time.perf_counter() - t0 < end and not all(t.done() for t in tasks):
        await asyncio.sleep(0.05)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _process_main(address, workload, prompts, share, seed, start_at, queue, proc, salt, index) -> None:
    cpu_before = time.process_time()
    records = asyncio.run(_drive(address, workload, prompts, share, seed, start_at, proc, salt))
    # the client's own CPU over its run: near 1, it (not the server) may set the pace
    busy = (time.process_time() - cpu_before) / (time.time() - start_at) if time.time() > start_at + 0.1 else None
    queue.put((index, [(r.start, r.message_times, r.message_tokens, r.end, r.finish_reason, r.validation, r.code,
                        r.prompt_len, r.cached_tokens, r.turn, r.call_validation, r.reasoning_chars, r.compile_ms)
                       for r in records], busy))


def run_workload(address: str, workload: Workload, prompts: list[list[int]] | list[str], num_procs: int,
                 seed: int = 0, salt: int = 0, client_cpu: list[float] | None = None) -> list[Record]:
    """Run `workload` from `num_procs` client processes (one for a fixed request count). `salt`:
    the first request number (`Workload.unique_at`); workloads on one server take ranges apart."""
    return run_workloads(address, [(workload, prompts, num_procs)], seed, salt, client_cpu)[0]


def run_workloads(address: str, runs: list[tuple[Workload, list, int]], seed: int = 0,
                  salt: int = 0, client_cpu: list[float] | None = None) -> list[list[Record]]:
    """Several workloads in one window, each (workload, prompts, client processes): their
    processes start at once; the records of each. Request numbers of the i-th start at
    salt + i << 28 (apart from each other). `client_cpu` gets each client process's CPU
    seconds per second of its run (its channel's setup included)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    start_at = time.time() + 2.0 + 0.3 * sum(n for _, _, n in runs)  # spawn + imports + channel ready
    for index, (workload, prompts, num_procs) in enumerate(runs):
        num_procs = 1 if workload.num_requests else max(1, min(num_procs, workload.concurrency or num_procs))
        procs += [ctx.Process(target=_process_main, args=(
            address, workload, prompts, 1 / num_procs, seed + len(procs) + i, start_at, queue, (i, num_procs),
            salt + (index << 28), index), daemon=True) for i in range(num_procs)]
    for p in procs:
        p.start()
    records: list[list[Record]] = [[] for _ in runs]
    timeout = max(w.warmup_s + w.duration_s for w, _, _ in runs) + 600
    for _ in procs:
        index, fields, busy = queue.get(timeout=timeout)
        records[index] += [Record(*f) for f in fields]
        if client_cpu is not None and busy is not None:
            client_cpu.append(busy)
    for p in procs:
        p.join(timeout=30)
    return records
