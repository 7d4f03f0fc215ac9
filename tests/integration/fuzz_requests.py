"""Adversarial GenerateRequests for tests/integration/test_fuzz.py, as raw request bytes.

Two sources: hand-written families (`families()`: `$ref` expansion, nesting, huge
enums/choices, catastrophic regexes, Lark pathologies, invalid UTF-8, truncated bytes, every
numeric field at its extremes) and hypothesis strategies (`requests()`: any field, any value).
Each case is (name, bytes): bytes so that malformed protobuf travels as it is.
"""
from __future__ import annotations

import json
import random
from typing import Iterator

from hypothesis import strategies as st

from structgen.v1 import generation_pb2 as pb

U32, U64 = (1 << 32) - 1, (1 << 64) - 1
FLOATS = (0.0, -0.0, 1e-45, 0.5, 1.0, 100.0, 100.0001, 1e38, -1.0, float("inf"), float("-inf"), float("nan"))


def _request(**constraint) -> pb.GenerateRequest:
    request = pb.GenerateRequest(prompt="Answer:", stop=pb.StopConditions(max_tokens=4))
    for field, value in constraint.items():
        if field == "choice":
            request.choice.choices.extend(value)
        elif field == "json_object":
            request.json_object.SetInParent()
        else:
            setattr(request, field, value)
    return request


def _ref_chains() -> Iterator[tuple[str, pb.GenerateRequest]]:
    for n in (10, 200, 2000):
        for form in ("items", "anyOf", "prefixItems"):
            key = {"items": "items", "anyOf": "anyOf", "prefixItems": "prefixItems"}[form]
            defs = {f"d{i}": ({"type": "array", key: [{"$ref": f"#/$defs/d{i + 1}"}] * 2} if form != "anyOf"
                              else {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2}) for i in range(n)}
            defs[f"d{n}"] = {"type": "integer"}
            schema = json.dumps({"$defs": defs, "$ref": "#/$defs/d0"})
            for backend in (pb.GRAMMAR_BACKEND_UNSPECIFIED, pb.GRAMMAR_BACKEND_LLGUIDANCE):
                request = _request(json_schema=schema)
                request.constraint_options.backend = backend
                yield f"ref-chain-{form}-{n}-{backend}", request
    yield "ref-self", _request(json_schema='{"$ref": "#"}')
    yield "ref-loop", _request(json_schema='{"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}')
    yield "ref-missing", _request(json_schema='{"$ref": "#/$defs/nope"}')
    yield "ref-remote", _request(json_schema='{"$ref": "https://example.com/schema.json"}')


def _nesting() -> Iterator[tuple[str, pb.GenerateRequest]]:
    for depth in (50, 128, 129, 1000, 5000):
        yield f"objects-{depth}", _request(json_schema='{"type":"object","properties":{"a":' * depth
                                           + '{"type":"integer"}' + "}}" * depth)
        yield f"anyof-{depth}", _request(json_schema='{"anyOf":[' * depth + '{"type":"integer"}'
                                         + ',{"type":"null"}]}' * depth)
    for depth in (1000, 100_000):
        yield f"brackets-{depth}", _request(json_schema="[" * depth)
        yield f"structural-tag-{depth}", _request(structural_tag="[" * depth + "]" * depth)
    yield "regex-parens-5000", _request(regex="(" * 5000 + "a" + ")" * 5000)
    yield "lark-parens-3000", _request(lark="start: " + "(" * 3000 + '"a"' + ")" * 3000)


def _huge() -> Iterator[tuple[str, pb.GenerateRequest]]:
    yield "enum-90k", _request(json_schema=json.dumps({"enum": [f"v{i}" for i in range(90_000)]}))
    yield "enum-8k", _request(json_schema=json.dumps({"enum": [f"value-{i}" for i in range(8_000)]}))
    yield "choice-50k", _request(choice=[f"c{i}" for i in range(50_000)])
    yield "choice-5k", _request(choice=[f"choice number {i}" for i in range(5_000)])
    yield "choice-empty-string", _request(choice=[""])
    yield "choice-dupes", _request(choice=["a"] * 1000)
    yield "regex-1mib", _request(regex="a" * (1 << 20))
    yield "regex-over-limit", _request(regex="a" * ((1 << 20) + 10))
    yield "properties-3000", _request(json_schema=json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)},
         "required": [f"p{i}" for i in range(3000)]}))
    yield "prompt-100k", pb.GenerateRequest(prompt="word " * 100_000)
    yield "token-ids-200k", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 200_000))


def _regexes() -> Iterator[tuple[str, pb.GenerateRequest]]:
    patterns = ["(a+)+b", "(a|a)*c", "(a*)*$", "((a{1,10}){1,10}){1,10}", "a{100000}", "a{0,1000000}",
                "(x+x+)+y", "[^]", "[", "(", ")", "\\", "a**", "(?=a)b", "(?<=a)b", r"\p{L}+", r"\1(a)",
                "[\U0010FFFF-\U0010FFFF]", "[z-a]", "(?i)abc", ".*" * 200, "(" + "|".join(map(str, range(5000))) + ")",
                "\x00", "", "^$", "[\\d\\D]{5}", "(a|b|c|d|e|f|g){50}"]
    for i, pattern in enumerate(patterns):
        for backend in (pb.GRAMMAR_BACKEND_UNSPECIFIED, pb.GRAMMAR_BACKEND_LLGUIDANCE):
            request = _request(regex=pattern) if pattern else pb.GenerateRequest(prompt="x")
            if not pattern:
                request.regex = ""
            request.constraint_options.backend = backend
            yield f"regex-{i}-{backend}", request


def _lark() -> Iterator[tuple[str, pb.GenerateRequest]]:
    grammars = ["start: a\na: a", 'start: "x" a\na: a', "start: start", 'start: start "a" | "a"',
                'start: "a" start | ""', "start:", "start: b", 'start: "a"\nstart: "b"', 'start: /a*/',
                'start: /(a+)+b/', "%import common.WORD\nstart: WORD", "start: " + " | ".join(f'"t{i}"' for i in range(5000)),
                "\n".join(f'r{i}: r{i + 1} "x"' for i in range(3000)) + '\nr3000: "y"\nstart: r0',
                'start: "\U0001F600"+', "start: \x00", "garbage ::= ", '%ignore " "\nstart: "a"',
                'start: x{1000}\nx: "a"', "start: " + "(" * 200 + '"a"' + ")*" * 200]
    for i, grammar in enumerate(grammars):
        for backend in (pb.GRAMMAR_BACKEND_UNSPECIFIED, pb.GRAMMAR_BACKEND_LLGUIDANCE):
            request = _request(lark=grammar)
            request.constraint_options.backend = backend
            yield f"lark-{i}-{backend}", request


def _numeric_extremes() -> Iterator[tuple[str, pb.GenerateRequest]]:
    for value in FLOATS:
        yield f"temperature-{value}", pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(temperature=value))
        yield f"top-p-{value}", pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_p=value, temperature=1))
    for value in FLOATS:  # the logits processing (penalties in [-2, 2], min_p in [0, 1], ...)
        for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
            yield f"{name}-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(max_tokens=2),
                                                        sampling=pb.SamplingParams(**{name: value}))
        yield f"logit-bias-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(max_tokens=2),
                                                        sampling=pb.SamplingParams(logit_bias={0: value}))
    for value in (0, 1, 2, 3, 64, 65, U32):
        yield f"min-tokens-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(max_tokens=2),
                                                        sampling=pb.SamplingParams(min_tokens=value))
        yield f"logit-bias-id-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(max_tokens=2),
                                                           sampling=pb.SamplingParams(logit_bias={value: 1.0}))
    for value in (0, 1, 31999, 32000, 1 << 31, U32):
        yield f"top-k-{value}", pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=value, temperature=1))
        yield f"max-tokens-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(max_tokens=value))
        yield f"num-logprobs-{value}", pb.GenerateRequest(prompt="x", num_logprobs=value)
        yield f"drafts-{value}", pb.GenerateRequest(prompt="x", speculative=pb.SpeculativeOptions(num_draft_tokens=value))
        yield f"stop-id-{value}", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(stop_token_ids=[value]))
        yield f"token-id-{value}", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[value]))
        request = _request(json_schema='{"type": "object"}')
        request.constraint_options.max_whitespace = value
        yield f"max-whitespace-{value}", request
    for value in (0, 1, (1 << 63) - 1, 1 << 63, U64):
        yield f"seed-{value}", pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(seed=value, temperature=1))
    for value in (-1, 3, 99, (1 << 31) - 1, -(1 << 31)):
        backend = _request(json_schema='{"type": "object"}')
        backend.constraint_options.backend = value
        yield f"backend-enum-{value}", backend
        yield f"proposer-enum-{value}", pb.GenerateRequest(prompt="x", speculative=pb.SpeculativeOptions(
            num_draft_tokens=1, proposer=value))


def _other() -> Iterator[tuple[str, pb.GenerateRequest]]:
    yield "empty", pb.GenerateRequest()
    yield "empty-prompt", pb.GenerateRequest(prompt="")
    yield "empty-token-ids", pb.GenerateRequest(token_ids=pb.TokenIds())
    yield "empty-chat", pb.GenerateRequest(chat=pb.ChatMessages())
    yield "chat-no-role", pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(content="hi")]))
    yield "stop-empty-string", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(stop_strings=[""]))
    yield "stop-many", pb.GenerateRequest(prompt="x", stop=pb.StopConditions(stop_strings=["a" * 1000] * 100))
    yield "request-id-long", pb.GenerateRequest(prompt="x", request_id="r" * 100_000)
    yield "json-schema-not-json", _request(json_schema="{not json")
    yield "json-schema-scalar", _request(json_schema="42")
    yield "json-schema-false", _request(json_schema="false")
    yield "json-schema-not", _request(json_schema='{"not": {}}')
    yield "json-schema-min-max", _request(json_schema='{"type": "string", "minLength": 5, "maxLength": 2}')
    yield "json-schema-int-range", _request(json_schema='{"type": "integer", "minimum": 10, "maximum": 1}')
    yield "json-schema-huge-bound", _request(json_schema='{"type": "string", "maxLength": 1e300}')
    yield "json-schema-pattern", _request(json_schema='{"type": "string", "pattern": "(a+)+$"}')
    yield "json-schema-bad-type", _request(json_schema='{"type": "wat"}')
    yield "structural-tag-bad", _request(structural_tag='{"type": "nope"}')
    yield "json-object", _request(json_object=True)
    yield "strict-unenforced", _request(json_schema='{"type": "string", "format": "email"}')
    for name, text in (("nul", "a\x00b"), ("surrogate-escape", '"\\ud800"'), ("bom", "\ufeff{}")):
        yield f"json-schema-{name}", _request(json_schema=text)
        yield f"prompt-{name}", pb.GenerateRequest(prompt=text)


def _turns() -> Iterator[tuple[str, pb.GenerateRequest]]:
    """Tools and reasoning (issue 20): bad schemas, names, choices, markers and budgets."""
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Call a tool.")])

    def tools_request(*tools, **fields) -> pb.GenerateRequest:
        return pb.GenerateRequest(chat=chat, tools=list(tools), stop=pb.StopConditions(max_tokens=4), **fields)

    deep = '{"type": "object", "properties": {"a": ' * 300 + "{}" + "}}" * 300
    for name, parameters in (("not-json", "{"), ("scalar", "7"), ("deep", deep), ("bad-type", '{"type": "wat"}'),
                             ("huge-enum", json.dumps({"enum": list(range(20000))})), ("false", "false")):
        yield f"tool-parameters-{name}", tools_request(pb.Tool(name="f", parameters=parameters),
                                                       tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
    for name in ("", "a b", "x" * 65, "\u00e9", "a\x00", '"; drop'):
        yield f"tool-name-{name[:8]!r}", tools_request(pb.Tool(name=name))
    yield "tools-many", tools_request(*[pb.Tool(name=f"t{i}") for i in range(3000)])
    yield "tools-duplicate", tools_request(pb.Tool(name="f"), pb.Tool(name="f"))
    yield "tools-on-prompt", pb.GenerateRequest(prompt="x", tools=[pb.Tool(name="f")])
    for mode in (-1, 5, (1 << 31) - 1):
        yield f"tool-choice-enum-{mode}", tools_request(pb.Tool(name="f"), tool_choice=pb.ToolChoice(mode=mode))
    yield "tool-choice-named-missing", tools_request(pb.Tool(name="f"), tool_choice=pb.ToolChoice(
        mode=pb.TOOL_CHOICE_MODE_NAMED, name="g"))
    yield "tool-choice-required-none", tools_request(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))
    yield "tools-and-schema", tools_request(pb.Tool(name="f"), json_schema='{"type": "object"}')
    for mode in (-1, 3, 1 << 30):
        yield f"reasoning-enum-{mode}", pb.GenerateRequest(prompt="x", reasoning=pb.ReasoningOptions(mode=mode))
    enabled = pb.REASONING_MODE_ENABLED
    for budget in (0, 1, U32):
        yield f"reasoning-budget-{budget}", pb.GenerateRequest(prompt="x", regex="[a-z]+", reasoning=pb.ReasoningOptions(
            mode=enabled, max_tokens=budget, begin_marker="<r>", end_marker="</r>"))
    for begin, end in (("", "</r>"), ("<r>", ""), ("x" * 100_000, "y"), ("\x00", "\x01"), ("<r>", "<r>")):
        yield f"reasoning-markers-{len(begin)}-{end[:3]!r}", pb.GenerateRequest(prompt="x", regex="a", reasoning=pb.ReasoningOptions(
            mode=enabled, begin_marker=begin, end_marker=end))
    yield "reasoning-no-markers", pb.GenerateRequest(prompt="x", regex="a", reasoning=pb.ReasoningOptions(mode=enabled))
    yield "reasoning-budget-disabled", pb.GenerateRequest(prompt="x", reasoning=pb.ReasoningOptions(
        mode=pb.REASONING_MODE_DISABLED, max_tokens=3))
    call = pb.ToolCall(id="c", name="f", arguments="{" * 5000)
    yield "chat-tool-call-arguments", pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="assistant", tool_calls=[call]), pb.ChatMessage(role="tool", tool_call_id="c")]))


def families(seed: int = 19) -> list[tuple[str, bytes]]:
    cases = [(name, request.SerializeToString()) for source in (
        _ref_chains, _nesting, _huge, _regexes, _lark, _numeric_extremes, _other, _turns)
        for name, request in source()]
    rng = random.Random(seed)
    valid = _request(json_schema='{"type": "object", "properties": {"name": {"type": "string"}}}').SerializeToString()
    for cut in sorted(rng.sample(range(1, len(valid)), 12)):
        cases.append((f"truncated-at-{cut}", valid[:cut]))
    text_field = pb.GenerateRequest(prompt="hello").SerializeToString()
    for i, junk in enumerate((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf")):
        cases.append((f"invalid-utf8-prompt-{i}", text_field[:1] + bytes([len(junk)]) + junk))
        schema = pb.GenerateRequest(json_schema="x").SerializeToString()
        cases.append((f"invalid-utf8-schema-{i}", schema[:-2] + bytes([len(junk)]) + junk))
    for i in range(20):
        cases.append((f"random-bytes-{i}", rng.randbytes(rng.randint(1, 300))))
    cases.append(("wrong-wire-type", b"\x12\x05" + b"\xff" * 3))
    cases.append(("huge-length", b"\x12\xff\xff\xff\xff\x0f"))
    return cases


# ---- hypothesis: any field, any value ------------------------------------------------------
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=30)
_schema_words = st.sampled_from(["type", "properties", "items", "enum", "const", "anyOf", "oneOf", "allOf",
                                 "not", "$ref", "$defs", "required", "minLength", "maxLength", "pattern",
                                 "minimum", "maximum", "additionalProperties", "format", "prefixItems"])
_schemas = st.recursive(
    st.sampled_from([{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object", "array")]),
    lambda children: st.dictionaries(_schema_words, children | _json_values, max_size=4),
    max_leaves=20)
_constraint = st.one_of(
    st.builds(lambda s: {"json_schema": json.dumps(s)}, _schemas),
    st.builds(lambda v: {"json_schema": json.dumps(v)}, _json_values),
    st.builds(lambda t: {"json_schema": t}, st.text(max_size=60)),
    st.builds(lambda t: {"regex": t}, st.text(alphabet="ab()[]{}|*+?.^$\\-0123456789,dws", max_size=40)),
    st.builds(lambda t: {"lark": t}, st.text(alphabet='start:ab|"/*+?()\n %', max_size=60)),
    st.builds(lambda c: {"choice": c}, st.lists(st.text(max_size=8), max_size=6)),
    st.just({"json_object": True}),
    st.builds(lambda t: {"structural_tag": t}, st.text(max_size=40)),
    st.just({}))


@st.composite
def requests(draw) -> bytes:
    constraint = draw(_constraint)
    request = _request(**constraint) if constraint else pb.GenerateRequest()
    source = draw(st.sampled_from(["prompt", "token_ids", "chat", "none"]))
    if source == "prompt":
        request.prompt = draw(st.text(max_size=80))
    elif source == "token_ids":
        request.token_ids.ids.extend(draw(st.lists(st.integers(0, U32), max_size=8)))
    elif source == "chat":
        for role, content in draw(st.lists(st.tuples(st.text(max_size=8), st.text(max_size=30)), max_size=3)):
            request.chat.messages.add(role=role, content=content)
    sampling = request.sampling
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(sampling, name, draw(st.sampled_from(FLOATS) | st.floats(width=32)))
    if draw(st.booleans()):
        sampling.top_k = draw(st.integers(0, U32))
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, U64))
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p"):
        if draw(st.integers(0, 7)) == 0:  # rarely: most values out of range end the call early
            setattr(sampling, name, draw(st.sampled_from(FLOATS) | st.floats(-2, 2, width=32)))
    if draw(st.integers(0, 7)) == 0:
        sampling.logit_bias.update(draw(st.dictionaries(st.integers(0, U32), st.sampled_from(FLOATS), max_size=2)))
    if draw(st.integers(0, 7)) == 0:
        sampling.min_tokens = draw(st.sampled_from([0, 1, 4, 65, U32]))
    request.stop.max_tokens = draw(st.sampled_from([0, 1, 2, 4, 64, 65, U32]))
    request.stop.stop_strings.extend(draw(st.lists(st.text(max_size=4), max_size=2)))
    request.stop.stop_token_ids.extend(draw(st.lists(st.integers(0, U32), max_size=2)))
    request.stop.ignore_eos = draw(st.booleans())
    request.num_logprobs = draw(st.sampled_from([0, 1, 5, 20, 21, U32]))
    request.constraint_options.compact = draw(st.booleans())
    request.constraint_options.strict = draw(st.booleans())
    request.constraint_options.backend = draw(st.sampled_from([0, 1, 2, 3, -1]))
    if draw(st.booleans()):
        request.constraint_options.max_whitespace = draw(st.integers(0, U32))
    request.speculative.num_draft_tokens = draw(st.sampled_from([0, 1, 4, 5, U32]))
    request.speculative.proposer = draw(st.sampled_from([0, 1, 2, 7, -1]))
    data = request.SerializeToString()
    if draw(st.integers(0, 9)) == 0:  # now and then, damage the bytes
        data = data[:draw(st.integers(0, len(data)))] + draw(st.binary(max_size=6))
    return data
