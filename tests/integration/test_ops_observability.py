"""Traces, metrics and graceful drain of a real `structgen serve` (issues 7 and 22).

One server for the module, started with OTEL_* pointing at an in-test OTLP receiver and with
`--metrics-port`. The drain test runs last: it SIGTERMs that server while streams are open.
"""
from __future__ import annotations

import json
import pathlib
import secrets
import subprocess
import threading
import time
import urllib.error
import urllib.request

import grpc
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import structgen
from otlp_receiver import OtlpReceiver
from live_server import LIMITS, start_serve, stop_serve
from ports import free_port
from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc
from structgen_client import Client

ROOT = pathlib.Path(__file__).resolve().parents[2]

GENERATE = "structgen.v1.GenerationService/Generate"
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                      "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})
DRAIN_S = 60
MAX_TOKENS_LIMIT = 1024



@pytest.fixture(scope="module")
def receiver():
    with OtlpReceiver() as receiver:
        yield receiver


@pytest.fixture(scope="module")
def server(receiver, tmp_path_factory):
    metrics_port, health_port, grammar_metrics_port = free_port(), free_port(), free_port()
    limits = {**LIMITS, "max_new_tokens_limit": MAX_TOKENS_LIMIT}
    args = [f"--{name.replace('_', '-')}={value}" for name, value in limits.items()]
    args += [f"--metrics-port={metrics_port}", f"--drain-seconds={DRAIN_S}", f"--health-port={health_port}",
             f"--http-port={free_port()}"]
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true",
           "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_TRACES_SAMPLER": "parentbased_always_on",
           "STRUCTGEN_GRAMMAR_METRICS_PORT": str(grammar_metrics_port)}  # the grammar child's, as in the chart
    with pytest.MonkeyPatch.context() as patch:
        for name in ("OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED",
                     "OTEL_TRACES_EXPORTER"):
            patch.delenv(name, raising=False)
        for name, value in env.items():
            patch.setenv(name, value)
        live = start_serve(args, tmp_path_factory.mktemp("ops") / "serve.log")
    live.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    live.grammar_metrics_url = f"http://127.0.0.1:{grammar_metrics_port}/metrics"
    live.health_address = f"127.0.0.1:{health_port}"
    yield live
    if live.process.poll() is None:  # the drain test did not run
        assert stop_serve(live) == 0


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def model(stub) -> str:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30).model_name


@pytest.fixture(scope="module")
def api(server):
    with openai.OpenAI(base_url=server.http_url + "/v1", api_key="unused", max_retries=0, timeout=120) as api:
        yield api


def _spans_of(receiver, trace_id: str, names: set[str], timeout_s: float = 30) -> dict:
    spans = receiver.wait_for(
        lambda spans: names <= {s.name for s in spans if s.trace_id == trace_id}, timeout_s=timeout_s)
    ours = {s.name: s for s in spans if s.trace_id == trace_id}
    assert names <= set(ours), f"missing spans {names - set(ours)}; got {sorted(ours)}"
    return ours


def _generate(stub, metadata=(), **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=metadata, timeout=120))


def _scrape(url: str) -> dict[str, float]:
    """Every sample as {"name{label=value,...}": value}."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def _scrape_when(url: str, ready, timeout_s: float = 10) -> dict[str, float]:
    """A scrape where `ready(samples)` holds (or the last one after `timeout_s`): a request
    is counted once its answer is over, which the client may see a moment before."""
    deadline = time.monotonic() + timeout_s
    samples = _scrape(url)
    while not ready(samples) and time.monotonic() < deadline:
        time.sleep(0.1)
        samples = _scrape(url)
    return samples


def _total(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    wanted = [f"{k}={v}" for k, v in labels.items()]
    return sum(value for key, value in samples.items()
               if key.split("{", 1)[0] == name and all(w in key for w in wanted))


# ---- traces ------------------------------------------------------------------------------------
def test_constrained_request_is_one_trace_across_both_processes(stub, receiver, model):
    trace_id, caller_span_id = secrets.token_hex(16), secrets.token_hex(8)
    traceparent = f"00-{trace_id}-{caller_span_id}-01"
    responses = _generate(stub, metadata=(("traceparent", traceparent),), request_id="traced-1",
                          prompt="A person as JSON:", json_schema=SCHEMA,
                          sampling=pb.SamplingParams(temperature=0.5, top_p=0.9, seed=7),
                          stop=pb.StopConditions(max_tokens=48))
    assert responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    server_name = f"text_completion {model}"  # {gen_ai.operation.name} {gen_ai.request.model}
    ours = _spans_of(receiver, trace_id, {"structgen.queue", "structgen.prefill", "structgen.decode",
                                          "grammar.compile", server_name})

    server_span = ours[server_name]
    assert server_span.parent_span_id == caller_span_id  # joined the caller's trace
    assert server_span.service == "structgen"
    assert server_span.resource["service.version"] == structgen.__version__
    attributes = server_span.attributes
    assert attributes["rpc.grpc.status_code"] == 0 and attributes["rpc.method"] == "Generate"
    assert {k: attributes[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                                       "gen_ai.response.id", "gen_ai.request.max_tokens", "gen_ai.request.seed")} == {
        "gen_ai.operation.name": "text_completion", "gen_ai.provider.name": "structgen",
        "gen_ai.request.model": model, "gen_ai.response.id": "traced-1", "gen_ai.request.max_tokens": 48,
        "gen_ai.request.seed": 7}
    assert abs(attributes["gen_ai.request.temperature"] - 0.5) < 1e-6
    assert abs(attributes["gen_ai.request.top_p"] - 0.9) < 1e-6
    assert attributes["gen_ai.usage.output_tokens"] == responses[-1].usage.completion_tokens
    assert attributes["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens
    latency = {k: attributes[f"gen_ai.latency.{k}"] for k in (
        "time_in_queue", "time_to_first_token", "time_in_model_prefill", "time_in_model_decode", "e2e")}
    assert 0 <= latency["time_in_queue"] <= latency["time_to_first_token"] <= latency["e2e"]
    assert latency["e2e"] * 1e9 <= server_span.end_ns - server_span.start_ns
    for name in ("structgen.queue", "structgen.prefill", "structgen.decode"):
        assert ours[name].parent_span_id == server_span.span_id, name
        assert ours[name].service == "structgen"
        assert server_span.start_ns <= ours[name].start_ns <= ours[name].end_ns <= server_span.end_ns
    # queue -> prefill -> decode follow each other, and their lengths are the latencies above
    assert ours["structgen.queue"].end_ns <= ours["structgen.prefill"].start_ns + 1000
    assert ours["structgen.prefill"].end_ns <= ours["structgen.decode"].start_ns + 1000
    queue_ns = ours["structgen.queue"].end_ns - ours["structgen.queue"].start_ns
    assert abs(queue_ns / 1e9 - latency["time_in_queue"]) < 1e-3

    compile_span = ours["grammar.compile"]
    assert compile_span.service == "structgen-grammar"  # exported by the other process
    assert compile_span.parent_span_id == server_span.span_id
    assert len(compile_span.attributes["structgen.grammar.hash"]) == 64
    assert compile_span.attributes["structgen.grammar.backend"] in ("xgrammar", "llguidance")
    assert compile_span.attributes["structgen.grammar.compile_ms"] >= 0
    assert "grammar.cache_hit" in compile_span.attributes

    decode = ours["structgen.decode"].attributes
    assert decode["gen_ai.usage.output_tokens"] == responses[-1].usage.completion_tokens
    assert decode["gen_ai.response.finish_reasons"][0] in ("grammar_complete", "max_tokens", "stop_token")
    assert {"structgen.drafts.proposed", "structgen.drafts.accepted"} <= set(decode)
    assert "structgen.grammar.cache_hit" in ours["structgen.prefill"].attributes


def test_chat_spans_are_chat_and_the_python_client_sends_its_trace(server, receiver, model):
    """structgen_client sends the current OpenTelemetry span's traceparent by itself."""
    from opentelemetry.sdk.trace import TracerProvider
    tracer = TracerProvider().get_tracer("test-client")
    with Client(server.address, timeout=120) as client, tracer.start_as_current_span("caller") as caller:
        client.generate_text(messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    context = caller.get_span_context()
    name = f"chat {model}"
    span = _spans_of(receiver, format(context.trace_id, "032x"), {name})[name]
    assert span.parent_span_id == format(context.span_id, "016x")
    assert span.attributes["gen_ai.operation.name"] == "chat"


@pytest.mark.parametrize("one_token", [True, False], ids=["unadmitted", "admitted"])
def test_no_prefill_span_for_a_request_that_failed_before_its_first_token(stub, receiver, model, one_token):
    """A grammar that cannot compile fails the request before any token: a one-token prompt
    waits unadmitted for its grammar; a longer one may prefill all but its last token first."""
    trace_id = secrets.token_hex(16)
    ids = list(stub.Tokenize(pb.TokenizeRequest(text="Write a long answer about the sea"), timeout=30).token_ids)
    with pytest.raises(grpc.RpcError) as error:
        _generate(stub, metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),),
                  token_ids=pb.TokenIds(ids=ids[-1:] if one_token else ids), lark="start: (",
                  stop=pb.StopConditions(max_tokens=4))
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    ours = _spans_of(receiver, trace_id, {f"text_completion {model}", "structgen.queue", "grammar.compile"})
    time.sleep(1)  # the batch processor exports every 100 ms: a prefill span would be here by now
    names = {s.name for s in receiver.spans if s.trace_id == trace_id}
    assert "structgen.prefill" not in names and "structgen.decode" not in names
    if one_token:
        assert ours["structgen.queue"].attributes["structgen.admitted"] is False
    assert ours["grammar.compile"].status_code == 2
    assert ours[f"text_completion {model}"].status_code == 2


def test_failed_rpc_span_has_its_status(stub, receiver):
    trace_id = secrets.token_hex(16)
    with pytest.raises(grpc.RpcError) as error:
        _generate(stub, metadata=(("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),),
                  prompt="x", json_schema="{not json")
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    def server_span(spans):
        return next((x for x in spans if x.trace_id == trace_id and x.kind == 2), None)  # SERVER
    span = server_span(receiver.wait_for(server_span))
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert span.status_code == 2  # ERROR


HTTP_CASES = [("chat", False), ("chat", True), ("text_completion", False), ("text_completion", True)]


def _http_completion(api, model, operation, stream, traceparent, **options):
    """One request over the HTTP API; returns (its id, its usage, finish reasons)."""
    create = api.chat.completions.create if operation == "chat" else api.completions.create
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if operation == "chat" else {"prompt": "Hello"}
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    answer = create(model=model, extra_headers={"traceparent": traceparent}, **prompt, **extra, **options)
    if not stream:
        return answer.id, answer.usage, [c.finish_reason for c in answer.choices]
    chunks = list(answer)
    return chunks[0].id, chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices
                                             and c.choices[0].finish_reason]


@pytest.mark.parametrize("operation,stream", HTTP_CASES, ids=[f"{o}-{'stream' if s else 'whole'}" for o, s in HTTP_CASES])
def test_http_completion_gets_the_generate_span(api, receiver, model, operation, stream):
    """The HTTP port's server span is the gRPC Generate span: same name and gen_ai.*
    attributes, in the caller's trace, with the engine's spans as its children."""
    trace_id, caller_span_id = secrets.token_hex(16), secrets.token_hex(8)
    response_id, usage, reasons = _http_completion(
        api, model, operation, stream, f"00-{trace_id}-{caller_span_id}-01", max_tokens=6, temperature=0.5,
        top_p=0.9, seed=7, extra_body={"structgen": {"ignore_eos": True}})
    assert reasons == ["length"] and usage.completion_tokens == 6
    name = f"{operation} {model}"
    ours = _spans_of(receiver, trace_id, {name, "structgen.queue", "structgen.prefill", "structgen.decode"})
    span = ours[name]
    assert span.parent_span_id == caller_span_id and span.kind == 2  # SERVER
    assert span.service == "structgen" and span.status_code == 0
    attributes = span.attributes
    assert {k: attributes[k] for k in ("gen_ai.operation.name", "gen_ai.provider.name", "gen_ai.request.model",
                                       "gen_ai.response.model", "gen_ai.response.id", "gen_ai.request.max_tokens",
                                       "gen_ai.request.seed", "gen_ai.usage.input_tokens",
                                       "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons")} == {
        "gen_ai.operation.name": operation, "gen_ai.provider.name": "structgen", "gen_ai.request.model": model,
        "gen_ai.response.model": model, "gen_ai.response.id": response_id, "gen_ai.request.max_tokens": 6,
        "gen_ai.request.seed": 7, "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": 6, "gen_ai.response.finish_reasons": ["max_tokens"]}
    assert abs(attributes["gen_ai.request.temperature"] - 0.5) < 1e-6
    assert abs(attributes["gen_ai.request.top_p"] - 0.9) < 1e-6
    route = "/v1/chat/completions" if operation == "chat" else "/v1/completions"
    assert attributes["http.route"] == route and attributes["http.request.method"] == "POST"
    assert attributes["http.response.status_code"] == 200
    latency = {k: attributes[f"gen_ai.latency.{k}"] for k in ("time_in_queue", "time_to_first_token", "e2e")}
    assert 0 <= latency["time_in_queue"] <= latency["time_to_first_token"] <= latency["e2e"]
    for child in ("structgen.queue", "structgen.prefill", "structgen.decode"):
        assert ours[child].parent_span_id == span.span_id, child
        assert span.start_ns <= ours[child].start_ns <= ours[child].end_ns <= span.end_ns


def test_http_constrained_request_joins_the_compile_span_and_n_choices_add_up(api, receiver, model):
    trace_id = secrets.token_hex(16)
    schema = {"type": "object", "properties": {f"k{secrets.token_hex(3)}": {"type": "boolean"}},
              "additionalProperties": False}
    answer = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "JSON:"}], max_tokens=24, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "flag", "schema": schema}},
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
        extra_body={"structgen": {"max_whitespace": 1}})
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
    name = f"chat {model}"
    ours = _spans_of(receiver, trace_id, {name, "grammar.compile", "structgen.decode"})
    span = ours[name]
    assert ours["grammar.compile"].parent_span_id == span.span_id
    assert ours["grammar.compile"].service == "structgen-grammar"
    assert span.attributes["structgen.grammar.kind"] == "json_schema"
    assert span.attributes["gen_ai.usage.output_tokens"] == answer.usage.completion_tokens
    assert len(span.attributes["gen_ai.response.finish_reasons"]) == 2
    assert span.attributes["gen_ai.request.choice.count"] == 2
    assert span.attributes["gen_ai.usage.input_tokens"] == answer.usage.prompt_tokens
    decodes = [s for s in receiver.spans if s.trace_id == trace_id and s.name == "structgen.decode"]
    assert len(decodes) == 2 and {d.parent_span_id for d in decodes} == {span.span_id}


def test_failed_http_request_span_has_its_status(api, receiver, model):
    trace_id = secrets.token_hex(16)
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 5}}},
            extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    name = f"chat {model}"
    span = _spans_of(receiver, trace_id, {name})[name]
    assert span.attributes["http.response.status_code"] == 400
    assert span.status_code == 2  # ERROR, as the gRPC span of INVALID_ARGUMENT


# ---- metrics -----------------------------------------------------------------------------------
FAMILIES = (
    "structgen_time_to_first_token_seconds_bucket", "structgen_inter_token_latency_seconds_bucket",
    "structgen_request_duration_seconds_bucket", "structgen_generated_tokens_total",
    "structgen_request_queue_time_seconds_bucket", "structgen_request_prefill_time_seconds_bucket",
    "structgen_request_decode_time_seconds_bucket", "structgen_request_prompt_tokens_bucket",
    "structgen_request_generation_tokens_bucket", "structgen_model_info",
    "structgen_queue_depth", "structgen_running_requests", "structgen_kv_pages_used",
    "structgen_kv_pages_capacity", "structgen_kv_cache_usage_ratio",
    "structgen_request_grammar_compile_seconds_bucket",
    "structgen_constrained_requests_total", "structgen_grammar_mask_wait_seconds_total",
    "structgen_grammar_steps_total", "structgen_draft_tokens_proposed_total",
    "structgen_draft_tokens_accepted_total", "structgen_rpcs_total", "structgen_finished_requests_total",
    "structgen_kv_pages_cached", "structgen_prefix_cache_query_tokens_total",
    "structgen_prefix_cache_hit_tokens_total", "structgen_prefix_cache_hit_ratio",
    "structgen_prefix_cache_evictions_total", "structgen_http_requests_total",
    "structgen_output_validations_total",
)


def test_metrics_expose_the_families_and_move(server, stub, model):
    before = _scrape(server.metrics_url)
    # A constrained request with a fresh schema (a compile, not a cache hit), a speculative
    # free one, and one refused with OUT_OF_RANGE.
    schema = json.dumps({"type": "object", "properties": {f"k{secrets.token_hex(3)}": {"type": "boolean"}}})
    _generate(stub, prompt="JSON:", json_schema=schema, stop=pb.StopConditions(max_tokens=24))
    free = _generate(stub, prompt="one two three one two three one two", stop=pb.StopConditions(max_tokens=24, ignore_eos=True),
                     speculative=pb.SpeculativeOptions(num_draft_tokens=3))
    with pytest.raises(grpc.RpcError) as error:
        _generate(stub, prompt="x", stop=pb.StopConditions(max_tokens=MAX_TOKENS_LIMIT + 1))
    refused = error.value.code().name
    after = _scrape(server.metrics_url)

    missing = [f for f in FAMILIES if not any(key.startswith(f + "{") for key in after)]
    assert not missing, f"families missing from /metrics: {missing}"
    assert all(f"model_name={model}" in key for key in after if key.startswith("structgen_"))

    def moved(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert moved("structgen_time_to_first_token_seconds_count") == 2
    assert moved("structgen_time_to_first_token_seconds_count", constrained="true") == 1
    assert moved("structgen_inter_token_latency_seconds_count") > 0
    assert moved("structgen_generated_tokens_total", constrained="false") == 24
    assert moved("structgen_request_generation_tokens_sum", constrained="false") == 24
    assert moved("structgen_request_prompt_tokens_sum") == moved("structgen_prompt_tokens_total")
    assert moved("structgen_request_prompt_tokens_sum") > free[-1].usage.prompt_tokens
    # the engine's own stamps, recorded before each final message went out
    for name in ("queue_time", "prefill_time", "decode_time"):
        assert moved(f"structgen_request_{name}_seconds_count") == 2, name
    assert moved("structgen_request_grammar_compile_seconds_count") == 1
    assert moved("structgen_constrained_requests_total", cache="miss") == 1
    assert moved("structgen_output_validations_total", kind="json_schema") == 1  # valid, or truncated at 24
    assert moved("structgen_output_validations_total", kind="json_schema", status="invalid") == 0
    assert not [k for k in after if k.startswith("structgen_output_validations_total") and "backend=," in k]
    assert moved("structgen_grammar_steps_total") > 0
    assert moved("structgen_grammar_mask_wait_seconds_total") >= 0
    assert moved("structgen_draft_tokens_proposed_total") > 0
    assert moved("structgen_rpcs_total", method=f"/{GENERATE}", code="OK") == 2
    assert moved("structgen_rpcs_total", method=f"/{GENERATE}", code=refused) == 1
    assert _total(after, "structgen_kv_pages_capacity") > 0
    assert 0 <= _total(after, "structgen_kv_cache_usage_ratio") <= 1
    assert _total(after, "structgen_model_info", device="cpu") == 1


def test_http_requests_are_counted_and_timed(server, api, model):
    """The HTTP port's requests: by route and status, and in the per-request generation
    families (time to first token, tokens, engine times) as Generate's are."""
    before = _scrape(server.metrics_url)
    answer = api.completions.create(model=model, prompt="one two", max_tokens=5,
                                    extra_body={"structgen": {"ignore_eos": True}})
    chunks = list(api.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=3, stream=True, extra_body={"structgen": {"ignore_eos": True}}))
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                    temperature=-1)
    with pytest.raises(urllib.error.HTTPError) as unknown:  # one label for every unknown path
        urllib.request.urlopen(f"{server.http_url}/v1/no-such-route/{secrets.token_hex(4)}", timeout=30)
    assert unknown.value.code == 404
    after = _scrape_when(server.metrics_url, lambda after: _total(after, "structgen_http_requests_total")
                         - _total(before, "structgen_http_requests_total") >= 4)

    def moved(name, **labels):
        return _total(after, name, **labels) - _total(before, name, **labels)

    assert moved("structgen_http_requests_total", route="/v1/completions", code="200") == 1
    assert moved("structgen_http_requests_total", route="/v1/chat/completions", code="200") == 1
    assert moved("structgen_http_requests_total", route="/v1/chat/completions", code="400") == 1
    assert moved("structgen_http_requests_total", route="unmatched", code="404") == 1
    assert moved("structgen_http_requests_total") == 4
    assert chunks[-1].choices[0].finish_reason == "length" and answer.usage.completion_tokens == 5
    assert moved("structgen_time_to_first_token_seconds_count") == 2
    assert moved("structgen_generated_tokens_total", constrained="false") == 5 + 3
    assert moved("structgen_request_duration_seconds_count") == 2
    assert moved("structgen_request_queue_time_seconds_count") == 2
    assert moved("structgen_finished_requests_total", finish_reason="max_tokens") == 2
    assert moved("structgen_rpcs_total") == 0  # the gRPC count is the gRPC port's alone


def test_http_client_leaving_mid_stream_is_499_and_an_error_span(server, api, receiver, model):
    before = _scrape(server.metrics_url)
    trace_id = secrets.token_hex(16)
    stream = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count"}], max_tokens=MAX_TOKENS_LIMIT, stream=True,
        extra_body={"structgen": {"ignore_eos": True}},
        extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"})
    next(iter(stream))
    stream.close()
    name = f"chat {model}"
    span = _spans_of(receiver, trace_id, {name})[name]  # exported once the server saw the client leave
    assert span.status_code == 2

    def moved(samples, name, **labels):
        return _total(samples, name, **labels) - _total(before, name, **labels)

    # the engine frees the request on its next step
    after = _scrape_when(server.metrics_url, lambda after: moved(after, "structgen_finished_requests_total"))
    assert moved(after, "structgen_http_requests_total", route="/v1/chat/completions", code="499") == 1
    assert moved(after, "structgen_finished_requests_total", finish_reason="cancelled") == 1


def test_prefix_cache_metrics_count_the_cached_prompt_tokens(server, stub):
    prefix = f"[{secrets.token_hex(4)}] You extract fields from invoices and answer in JSON. " * 4
    _generate(stub, prompt=prefix + "first", stop=pb.StopConditions(max_tokens=2))
    before = _scrape(server.metrics_url)
    final = _generate(stub, prompt=prefix + "second", stop=pb.StopConditions(max_tokens=2))[-1]
    after = _scrape(server.metrics_url)
    hit = _total(after, "structgen_prefix_cache_hit_tokens_total") - _total(before, "structgen_prefix_cache_hit_tokens_total")
    queried = (_total(after, "structgen_prefix_cache_query_tokens_total")
               - _total(before, "structgen_prefix_cache_query_tokens_total"))
    assert hit == final.usage.cached_prompt_tokens > 0 and queried == final.usage.prompt_tokens
    assert 0 < _total(after, "structgen_prefix_cache_hit_ratio") <= 1
    assert _total(after, "structgen_kv_pages_cached") > 0 and _total(after, "structgen_kv_pages_used") == 0
    stats = stub.GetEngineStats(pb.GetEngineStatsRequest())
    assert stats.num_kv_pages_cached > 0 and stats.num_prefix_cache_hit_tokens >= hit
    assert stats.num_prefix_cache_query_tokens >= queried


def test_live_exposition_passes_promtool_and_matches_the_docs(server, stub):
    """What Prometheus would scrape: promtool's lint, no *_created, the documented families."""
    from generation_service.metrics import GenerationMetrics
    from prometheus_client import CollectorRegistry
    _generate(stub, prompt="hello", stop=pb.StopConditions(max_tokens=2))
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read()
    promtool = subprocess.run([str(ROOT / "tools" / "install_promtool.sh")], capture_output=True, text=True)
    assert promtool.returncode == 0, promtool.stderr
    check = subprocess.run([promtool.stdout.strip().splitlines()[-1], "check", "metrics"], input=text,
                           capture_output=True)
    assert check.returncode == 0, (check.stdout + check.stderr).decode()
    families = list(text_string_to_metric_families(text.decode()))
    assert not [f.name for f in families if f.name.endswith("_created")]
    scraped = {f.name + ("_total" if f.type == "counter" else "") for f in families if f.name.startswith("structgen_")}
    assert scraped == {f.name for f in GenerationMetrics(CollectorRegistry()).families()}


def test_invalid_outputs_are_counted_per_backend(server, stub):
    """A schema keyword the grammar does not enforce (uniqueItems) lets an invalid output through,
    which the final validation finds and the metric counts under the backend. (A document cut by
    max_tokens, status truncated, no longer comes from a JSON Schema the grammar can close: the
    budget closes it, or the request is refused up front.)"""
    unique = json.dumps({"type": "array", "items": {"const": 1}, "minItems": 2, "maxItems": 2, "uniqueItems": True})
    before = _scrape(server.metrics_url)
    messages = _generate(stub, prompt="x", json_schema=unique, stop=pb.StopConditions(max_tokens=16))
    backend = messages[0].guarantee.backend
    assert messages[-1].validation.status == pb.VALIDATION_STATUS_INVALID and backend
    after = _scrape(server.metrics_url)
    moved = _total(after, "structgen_output_validations_total", backend=backend, kind="json_schema",
                   status="invalid") - _total(before, "structgen_output_validations_total", backend=backend,
                                              kind="json_schema", status="invalid")
    assert moved == 1


def test_forced_tokens_rejected_drafts_and_mask_waits_are_counted(server, stub):
    """The grammar proposer's accepted forced drafts and the n-gram drafts the grammar refused:
    in the request's usage, per backend at the edge and engine-wide; each grammar step's mask
    wait in the engine's histogram."""
    forced_schema = json.dumps({"type": "object", "properties": {
        "shipping_status_description": {"enum": ["delivered_to_the_front_door", "returned_to_the_warehouse"]},
        "schema_version": {"const": "structgen.forced-drafts.v1"}},
        "required": ["shipping_status_description", "schema_version"], "additionalProperties": False})
    before = _scrape(server.metrics_url)
    forced = _generate(stub, prompt="The record as JSON:", json_schema=forced_schema,
                       constraint_options=pb.ConstraintOptions(compact=True),
                       stop=pb.StopConditions(max_tokens=64), speculative=pb.SpeculativeOptions(
                           num_draft_tokens=4, proposer=pb.DRAFT_PROPOSER_GRAMMAR))
    # after "x y", n-gram drafts copy the prompt's " x y ...", which the grammar refuses at " x"
    refused = _generate(stub, prompt="x y x y x y x y", regex="x y [0-9]{1,3}", stop=pb.StopConditions(max_tokens=12),
                        speculative=pb.SpeculativeOptions(num_draft_tokens=4, proposer=pb.DRAFT_PROPOSER_NGRAM))
    usage, backend = forced[-1].usage, forced[0].guarantee.backend
    assert 0 < usage.forced_tokens <= usage.draft_tokens_accepted, usage
    assert refused[-1].usage.grammar_rejected_draft_tokens > 0, refused[-1].usage
    rejected = usage.grammar_rejected_draft_tokens + refused[-1].usage.grammar_rejected_draft_tokens
    moved = lambda after, name, **labels: _total(after, name, **labels) - _total(before, name, **labels)  # noqa: E731
    after = _scrape_when(server.metrics_url, lambda s: moved(
        s, "structgen_request_grammar_rejected_draft_tokens_total") >= rejected)
    assert moved(after, "structgen_request_grammar_forced_tokens_total", backend=backend) == usage.forced_tokens
    assert moved(after, "structgen_grammar_forced_tokens_total") == usage.forced_tokens
    assert moved(after, "structgen_request_grammar_rejected_draft_tokens_total") == rejected
    assert moved(after, "structgen_grammar_rejected_draft_tokens_total") == rejected
    steps = moved(after, "structgen_grammar_steps_total")
    assert steps > 0 and moved(after, "structgen_grammar_step_wait_seconds_count") == steps
    assert moved(after, "structgen_grammar_step_wait_seconds_bucket", le="+Inf") == steps


def test_grammar_metrics_under_serve_and_a_standby_that_does_not_bind(server, stub):
    """STRUCTGEN_GRAMMAR_METRICS_PORT reaches the grammar child under `structgen serve`; its warm
    standby, spawned beside it, does not take the port (it became ready instead of exiting on
    'Address already in use' and being spawned again)."""
    deadline = time.monotonic() + 120
    while "is ready to take over" not in server.log_text() and time.monotonic() < deadline:
        assert server.process.poll() is None
        time.sleep(0.2)
    log = server.log_text()
    assert "is ready to take over" in log and "Address already in use" not in log
    assert "standby exited" not in log
    _generate(stub, prompt="x", json_schema=SCHEMA, stop=pb.StopConditions(max_tokens=32))
    text = urllib.request.urlopen(server.grammar_metrics_url, timeout=10).read()
    names = {f.name for f in text_string_to_metric_families(text.decode())}
    assert {"structgen_grammar_compile_requests", "structgen_grammar_step_seconds"} <= names, names
    promtool = subprocess.run([str(ROOT / "tools" / "install_promtool.sh")], capture_output=True, text=True)
    check = subprocess.run([promtool.stdout.strip().splitlines()[-1], "check", "metrics"], input=text,
                           capture_output=True)
    assert check.returncode == 0, (check.stdout + check.stderr).decode()


def test_engine_gauges_move_while_a_stream_runs(server, stub):
    stream = stub.Generate(pb.GenerateRequest(prompt="count:", stop=pb.StopConditions(
        max_tokens=MAX_TOKENS_LIMIT, ignore_eos=True)), timeout=120)
    next(stream)  # it is running now
    during = _scrape(server.metrics_url)
    stream.cancel()
    assert _total(during, "structgen_running_requests") >= 1
    assert _total(during, "structgen_kv_pages_used") >= 1
    deadline = time.monotonic() + 10
    while _total(_scrape(server.metrics_url), "structgen_running_requests") and time.monotonic() < deadline:
        time.sleep(0.1)
    after = _scrape(server.metrics_url)
    assert _total(after, "structgen_running_requests") == 0
    assert _total(after, "structgen_kv_pages_used") == 0
    assert _total(after, "structgen_rpcs_total", code="CANCELLED") >= 1


# ---- drain (last: it stops the server) ----------------------------------------------------------
def test_sigterm_drains_open_streams_refuses_new_calls_and_exits_0(server, stub, receiver):
    num_streams, max_tokens = 3, 160
    results: list[list[pb.GenerateResponse] | Exception] = [None] * num_streams
    ended_s = [0.0] * num_streams
    started = threading.Barrier(num_streams + 1)

    def consume(i: int) -> None:
        responses = []
        try:
            kwargs = {"json_schema": SCHEMA} if i == 0 else {"stop": pb.StopConditions(
                max_tokens=max_tokens, ignore_eos=True)}
            if i == 0:  # a constrained stream needs the grammar child until it ends
                kwargs["stop"] = pb.StopConditions(max_tokens=200)
            for response in stub.Generate(pb.GenerateRequest(prompt=f"stream {i}:", **kwargs), timeout=120):
                responses.append(response)
                if len(responses) == 1 + (i == 0):  # first tokens (after the guarantee)
                    started.wait(60)
            results[i] = responses
            ended_s[i] = time.monotonic()
        except Exception as error:  # noqa: BLE001 -- reported below
            results[i] = error
            started.abort()

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    started.wait(60)
    sigterm_s = time.monotonic()
    server.process.send_signal(15)
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, prompt="too late", stop=pb.StopConditions(max_tokens=4))
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(server.health_address) as channel:  # what the readiness probe sees
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    still_running = [t.is_alive() for t in threads]
    for thread in threads:
        thread.join(DRAIN_S + 10)
    code = server.process.wait(DRAIN_S + 10)
    exited_s = time.monotonic()
    for i, result in enumerate(results):
        assert not isinstance(result, Exception), f"stream {i} failed during the drain: {result!r}"
        assert result[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED, f"stream {i} did not finish"
    assert code == 0, server.log_text()[-3000:]
    assert exited_s - sigterm_s < DRAIN_S
    # Exit follows the last stream at once: no second grace period, no slow teardown.
    assert exited_s - max(ended_s) < 5, f"exit {exited_s - max(ended_s):.1f} s after the last stream ended"
    assert any(still_running), "every stream ended before the refused call: the drain was not tested"
    assert results[1][-1].usage.completion_tokens == max_tokens
    # The drained streams' spans were flushed on the way out.
    assert receiver.wait_for(lambda s: sum(x.attributes.get("rpc.method") == "Generate" for x in s) >= 5,
                             timeout_s=5)
