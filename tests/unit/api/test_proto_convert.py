"""proto <-> domain at the gRPC edge (generation_service/proto_convert.py), no server."""
import grpc
import pytest

from generation_service.config import ServeConfig
from generation_service.engine.errors import InvalidRequestError, LimitExceededError, QueueFullError
from generation_service.engine.events import FinishReason, OutputEvent, Usage
from generation_service.interceptors import status_of
from generation_service.proto_convert import event_to_proto, to_generation_request, validation_to_proto
from grammar_contract.report import GuaranteeReport
from structgen.schema_validation import validate_output
from structgen.v1 import generation_pb2 as pb


class FakeTokenizer:
    vocab_size = 100

    def encode(self, text):
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        return [1] + [len(m["content"]) for m in messages]


CONFIG = ServeConfig(max_grammar_bytes=10, default_max_tokens=7, default_temperature=0.5)


def convert(request, config=CONFIG):
    return to_generation_request(request, FakeTokenizer(), config, time_remaining=None)


def test_unset_sampling_fields_take_server_defaults_and_set_ones_win():
    domain = convert(pb.GenerateRequest(prompt="hi"))
    assert domain.sampling.temperature == 0.5 and domain.sampling.max_new_tokens == 7
    assert domain.sampling.top_p == 1.0 and domain.sampling.seed is None
    explicit = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=0.0, seed=0))
    domain = convert(explicit)
    assert domain.sampling.temperature == 0.0 and domain.sampling.seed == 0


def test_inputs_become_token_ids():
    assert convert(pb.GenerateRequest(prompt="ab")).prompt_ids == (97, 98)
    assert convert(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))).prompt_ids == (5, 6)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="abc")])
    assert convert(pb.GenerateRequest(chat=chat)).prompt_ids == (1, 3)


@pytest.mark.parametrize("request_, message", [
    (pb.GenerateRequest(), "no input"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[100])), "vocabulary size 100"),
    (pb.GenerateRequest(chat=pb.ChatMessages()), "at least one message"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="wizard", content="x")])),
     r"chat.messages\[0\].role must be one of system, developer, user, assistant, tool; got 'wizard'"),
    (pb.GenerateRequest(prompt="x", json_schema="{nope"), "not valid JSON"),
    (pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")]),
                        tools=[pb.Tool(name="f")], tool_choice=pb.ToolChoice(mode=5)),
     r"tool_choice.mode 5 is not a known value"),
    (pb.GenerateRequest(prompt="x", reasoning=pb.ReasoningOptions(mode=3)), r"reasoning.mode 3 is not a known value"),
    (pb.GenerateRequest(prompt="x", reasoning=pb.ReasoningOptions(mode=pb.REASONING_MODE_ENABLED, max_tokens=1 << 31)),
     "reasoning max_tokens must be 0 to 2147483647"),
])
def test_bad_inputs_are_invalid_requests(request_, message):
    with pytest.raises(InvalidRequestError, match=message):
        convert(request_)


def test_grammar_over_the_byte_limit_names_the_limit_and_value():
    with pytest.raises(LimitExceededError, match=r"regex constraint is 11 bytes; the limit max_grammar_bytes is 10"):
        convert(pb.GenerateRequest(prompt="x", regex="a" * 11))
    with pytest.raises(LimitExceededError, match="choice"):
        convert(pb.GenerateRequest(prompt="x", choice=pb.Choice(choices=["abcdef", "ghijk"])))


def test_constraint_options_reach_the_grammar_spec():
    request = pb.GenerateRequest(prompt="x", json_object=pb.JsonObject(),
                                 constraint_options=pb.ConstraintOptions(
                                     compact=True, max_whitespace=0, strict=True,
                                     backend=pb.GRAMMAR_BACKEND_LLGUIDANCE))
    spec = convert(request).grammar
    assert (spec.kind, spec.any_whitespace, spec.max_whitespace, spec.strict, spec.backend) == \
        ("json_object", False, 0, True, "llguidance")


def test_final_event_carries_finish_usage_and_schema_validation():
    domain = convert(pb.GenerateRequest(prompt="x", json_schema="{}"))
    first = event_to_proto(OutputEvent(guarantee=GuaranteeReport("xgrammar", compile_ms=1.5)), domain)
    assert first.guarantee.backend == "xgrammar" and not first.HasField("validation")
    final = event_to_proto(OutputEvent(token_ids=(1,), text="a", finish_reason=FinishReason.GRAMMAR_COMPLETE,
                                       usage=Usage(1, 1)),
                           domain, validate_output('{"type": "object", "properties": {"a": {"type": "array", '
                                                   '"items": {"type": "string"}}}}', '{"a": [3]}'))
    assert final.finish_reason == pb.FINISH_REASON_GRAMMAR_COMPLETE and final.usage.completion_tokens == 1
    assert not final.validation.valid and final.validation.status == pb.VALIDATION_STATUS_INVALID
    assert final.validation.num_errors == 1
    assert (final.validation.errors[0].path, final.validation.errors[0].message) == \
        ("/a/0", "3 is not of type 'string' (schema /properties/a/items/type)")
    valid = event_to_proto(OutputEvent(finish_reason=FinishReason.GRAMMAR_COMPLETE), domain,
                           validate_output('{"type": "object"}', "{}"))
    assert valid.validation.valid and valid.validation.status == pb.VALIDATION_STATUS_VALID


def test_a_final_message_never_claims_valid_when_validation_did_not_run():
    domain = convert(pb.GenerateRequest(prompt="x", json_schema="{}"))
    final = event_to_proto(OutputEvent(finish_reason=FinishReason.STOP_TOKEN), domain)  # nothing validated
    assert final.validation.status == pb.VALIDATION_STATUS_NOT_RUN and not final.validation.valid
    unusable = validation_to_proto(validate_output('{"type": 12}', '"x"'))  # jsonschema cannot use it
    assert unusable.status == pb.VALIDATION_STATUS_NOT_RUN and not unusable.valid
    assert "cannot validate" in unusable.errors[0].message


def test_validation_messages_without_a_pointer_keep_their_text():
    result = validation_to_proto(validate_output('{"type": "object"}', '{"a": '))
    assert result.status == pb.VALIDATION_STATUS_INVALID
    assert result.errors[0].path == "" and result.errors[0].message.startswith("output is not valid JSON")


def test_status_mapping():
    assert status_of(QueueFullError("full")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert status_of(ValueError("bad")) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert status_of(KeyError("x"))[0] == grpc.StatusCode.INTERNAL


def test_logits_processing_fields_reach_the_domain_and_default_to_neutral():
    neutral = convert(pb.GenerateRequest(prompt="hi")).sampling
    assert not neutral.uses_logit_processing
    sampling = pb.SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0, repetition_penalty=1.2,
                                 min_p=0.1, min_tokens=3, logit_bias={7: -100.0, 3: 2.5})
    domain = convert(pb.GenerateRequest(prompt="hi", sampling=sampling)).sampling
    assert (domain.frequency_penalty, domain.presence_penalty, domain.min_tokens) == (0.5, -1.0, 3)
    assert domain.repetition_penalty == pytest.approx(1.2) and domain.min_p == pytest.approx(0.1)
    assert domain.logit_bias == ((3, 2.5), (7, -100.0))


@pytest.mark.parametrize("sampling, message", [
    (pb.SamplingParams(frequency_penalty=2.5), r"^sampling.frequency_penalty must be in \[-2, 2\]"),
    (pb.SamplingParams(presence_penalty=-2.5), r"^sampling.presence_penalty must be in \[-2, 2\]"),
    (pb.SamplingParams(repetition_penalty=0.0), r"^sampling.repetition_penalty must be in \(0, 10\]"),
    (pb.SamplingParams(min_p=1.5), r"^sampling.min_p must be in \[0, 1\]"),
    (pb.SamplingParams(logit_bias={5: 150.0}), r"^sampling.logit_bias\[5\] must be in \[-100, 100\]"),
    (pb.SamplingParams(logit_bias={100: 1.0}), r"token id 100 is not below the vocabulary size 100"),
    (pb.SamplingParams(min_tokens=8), r"min_tokens 8 exceeds the max_tokens in effect \(7\)"),
])
def test_out_of_range_logits_processing_is_invalid_argument_saying_what_to_fix(sampling, message):
    with pytest.raises(InvalidRequestError, match=message) as raised:
        convert(pb.GenerateRequest(prompt="hi", sampling=sampling))
    assert status_of(raised.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("proposer, name", [(pb.DRAFT_PROPOSER_UNSPECIFIED, "ngram"), (pb.DRAFT_PROPOSER_NGRAM, "ngram"),
                                            (pb.DRAFT_PROPOSER_GRAMMAR, "grammar"), (pb.DRAFT_PROPOSER_SELF, "self")])
def test_every_draft_proposer_reaches_the_domain_and_the_client_spells_it(proposer, name):
    from structgen_client import build_request

    request = pb.GenerateRequest(prompt="hi", speculative=pb.SpeculativeOptions(num_draft_tokens=3, proposer=proposer))
    assert convert(request).speculative.proposer == name
    if proposer != pb.DRAFT_PROPOSER_UNSPECIFIED:
        assert build_request("hi", num_draft_tokens=3, proposer=name).speculative.proposer == proposer
