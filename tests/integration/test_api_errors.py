"""Every bad-input class gets its documented status and message; the server keeps serving."""
import grpc
import pytest

from structgen.v1 import generation_pb2 as pb
from structgen.v1 import generation_pb2_grpc as pb_grpc
from structgen_client import (InvalidArgumentError, OutOfRangeError, ResourceExhaustedError,
                              StructgenError)

LIMITED = {"type": "array", "uniqueItems": True}

# (id, request options, error class, words the message must contain)
BAD_REQUESTS = [
    ("negative-temperature", dict(prompt="hi", temperature=-1.0), InvalidArgumentError, ["temperature", "-1"]),
    ("top-p-above-1", dict(prompt="hi", top_p=1.5), InvalidArgumentError, ["top_p"]),
    ("too-many-logprobs", dict(prompt="hi", num_logprobs=50), InvalidArgumentError, ["num_logprobs", "50"]),
    ("empty-stop-string", dict(prompt="hi", stop=[""]), InvalidArgumentError, ["stop_strings"]),
    ("token-id-beyond-vocab", dict(token_ids=[10**6]), InvalidArgumentError, ["1000000", "vocabulary"]),
    ("empty-token-ids", dict(token_ids=[]), InvalidArgumentError, ["empty"]),
    ("empty-chat", dict(messages=[]), InvalidArgumentError, ["chat"]),
    ("schema-not-json", dict(prompt="hi", json_schema="{not json"), InvalidArgumentError, ["json_schema", "JSON"]),
    ("schema-bad-type", dict(prompt="hi", json_schema={"type": "foo"}), InvalidArgumentError, ["foo"]),
    ("regex-unbalanced", dict(prompt="hi", regex="(ab"), InvalidArgumentError, ["regex"]),
    ("lark-syntax", dict(prompt="hi", lark="start: ("), InvalidArgumentError, ["lark"]),
    ("empty-choice", dict(prompt="hi", choices=[]), InvalidArgumentError, ["choice"]),
    ("structural-tag-bad", dict(prompt="hi", structural_tag={"type": "bogus"}), InvalidArgumentError, ["structural"]),
    ("strict-unenforced", dict(prompt="hi", json_schema=LIMITED, strict=True), InvalidArgumentError, ["uniqueItems"]),
    ("max-tokens-over-limit", dict(prompt="hi", max_tokens=65), OutOfRangeError, ["max_tokens", "65", "max_new_tokens_limit", "64"]),
    ("prompt-over-limit", dict(prompt="word " * 600), OutOfRangeError, ["max_prompt_tokens", "512"]),
    ("grammar-over-limit", dict(prompt="hi", regex="a" * 70000), OutOfRangeError, ["max_grammar_bytes", "65536", "70000"]),
    ("schema-nested-too-deep", dict(prompt="hi", json_schema='{"items":' * 200 + "{}" + "}" * 200), OutOfRangeError,
     ["json_schema", "128", "max_json_depth"]),
    ("brackets-past-recursion", dict(prompt="hi", json_schema="[" * 50000), OutOfRangeError, ["json_schema", "128"]),
    ("lark-accepts-nothing", dict(prompt="hi", lark="start: a\na: a"), InvalidArgumentError, ["accepts no string"]),
    ("lark-dead-end", dict(prompt="hi", lark='start: "x" a | "y"\na: a'), InvalidArgumentError, ["never finish"]),
    ("top-k-beyond-vocab", dict(prompt="hi", top_k=2**32 - 1, temperature=1.0), InvalidArgumentError,
     ["top_k", "4294967295", "vocabulary"]),
    ("stop-id-beyond-vocab", dict(prompt="hi", stop_token_ids=[10**6]), InvalidArgumentError, ["stop_token_ids"]),
    ("drafts-over-limit", dict(prompt="hi", num_draft_tokens=2**32 - 1), OutOfRangeError,
     ["num_draft_tokens", "max_draft_tokens"]),
]


@pytest.mark.parametrize("options, error_class, words",
                         [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_its_status_and_a_clear_message(client, options, error_class, words):
    options = dict(options)
    prompt = options.pop("prompt", None)
    with pytest.raises(error_class) as caught:
        client.generate_text(prompt, max_tokens=options.pop("max_tokens", 4), **options)
    for word in words:
        assert word in caught.value.details, caught.value.details


def test_message_over_the_size_limit_is_resource_exhausted(client):
    with pytest.raises(ResourceExhaustedError):
        client.generate_text("x" * 300_000, max_tokens=2)


def test_request_without_input_is_invalid(live_server):
    with grpc.insecure_channel(live_server.address) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.Generate(pb.GenerateRequest(), timeout=30))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "no input" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            stub.Tokenize(pb.TokenizeRequest(), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _raw_generate(address: str, data: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream("/structgen.v1.GenerationService/Generate", request_serializer=None,
                                    response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as caught:
            list(call(data, timeout=30))
        return caught.value


@pytest.mark.parametrize("data", [b"\x12\x03a\xffb", b"\x12\x10short", b"\xff\xff\xff", b"\x1a\x02\xc3\x28"],
                         ids=["invalid-utf8-prompt", "truncated", "not-protobuf", "invalid-utf8-schema"])
def test_request_bytes_that_do_not_parse_are_invalid_argument(live_server, data):
    error = _raw_generate(live_server.address, data)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "not a valid protobuf message" in error.details()


@pytest.mark.parametrize("field, value", [("backend", 99), ("backend", -1), ("proposer", -1), ("proposer", 7),
                                          ("tool_choice", 5), ("reasoning", -1)])
def test_unknown_enum_values_are_invalid_argument(live_server, field, value):
    request = pb.GenerateRequest(prompt="hi", stop=pb.StopConditions(max_tokens=2))
    if field == "backend":
        request.json_object.SetInParent()
        request.constraint_options.backend = value
    elif field == "proposer":
        request.speculative.num_draft_tokens = 1
        request.speculative.proposer = value
    elif field == "tool_choice":
        request.chat.messages.add(role="user", content="hi")
        request.tools.add(name="f")
        request.tool_choice.mode = value
    else:
        request.reasoning.mode = value
    error = _raw_generate(live_server.address, request.SerializeToString())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(value) in error.details() and "not a known value" in error.details()


def test_duplicate_live_request_id_is_invalid(client, wait_idle):
    stream = client.generate("hi", max_tokens=64, ignore_eos=True, request_id="dup-1")
    first = iter(stream)
    next(first)
    with pytest.raises(InvalidArgumentError, match="dup-1"):
        client.generate_text("hi", max_tokens=2, request_id="dup-1")
    stream.cancel()
    wait_idle()


def test_server_keeps_serving_after_every_error(client, wait_idle):
    for _, options, _, _ in BAD_REQUESTS[:6]:
        options = dict(options)
        try:
            client.generate_text(options.pop("prompt", None), max_tokens=options.pop("max_tokens", 4), **options)
        except StructgenError:
            pass
    completion = client.generate_text("Still there?", choices=["yes", "no"], max_tokens=8)
    assert completion.text in ("yes", "no")
    assert client.health() == "SERVING"
    wait_idle()
