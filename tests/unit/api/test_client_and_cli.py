"""The Python client's request building and ServeConfig's validation (flag/env resolution:
tests/unit/ops/test_settings.py)."""
import json

import pytest

from generation_service.config import ServeConfig
from structgen_client import build_request


def test_build_request_sets_only_what_is_given():
    request = build_request("hi", json_schema={"type": "object"}, compact=True, max_tokens=5)
    assert request.WhichOneof("input") == "prompt" and request.WhichOneof("constraint") == "json_schema"
    assert json.loads(request.json_schema) == {"type": "object"} and request.constraint_options.compact
    assert not request.sampling.HasField("temperature") and request.stop.max_tokens == 5
    assert build_request("hi", temperature=0.0).sampling.HasField("temperature")


def test_build_request_sets_the_logits_processing_it_is_given():
    request = build_request("hi", presence_penalty=0.5, logit_bias={7: -100, "9": 5.0}, min_tokens=3)
    assert request.sampling.presence_penalty == 0.5 and request.sampling.min_tokens == 3
    assert dict(request.sampling.logit_bias) == {7: -100.0, 9: 5.0}
    assert not request.sampling.HasField("frequency_penalty") and not request.sampling.HasField("min_p")


def test_generate_flags_become_the_logits_processing_options():
    from structgen.cli import build_parser
    from structgen.commands.generate import request_options

    args = build_parser().parse_args(["generate", "hi", "--frequency-penalty", "-1.5", "--logit-bias", "42=-100",
                                      "--logit-bias", "7=3", "--min-tokens", "4", "--min-p", "0.1"])
    options = request_options(args)
    assert options["frequency_penalty"] == -1.5 and options["logit_bias"] == {42: -100.0, 7: 3.0}
    assert options["min_tokens"] == 4 and options["min_p"] == 0.1 and options["presence_penalty"] is None
    build_request(**options)  # every option is one build_request takes
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--logit-bias", "42"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "exactly one of prompt"),
    (dict(prompt="a", token_ids=[1]), "exactly one of prompt"),
    (dict(prompt="a", regex="x", choices=["a"]), "at most one constraint"),
])
def test_build_request_refuses_ambiguous_requests(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_request(**kwargs)


def test_serve_config_validates():
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServeConfig(tls_cert="c.pem")
    with pytest.raises(ValueError, match="port"):
        ServeConfig(port=70000)
    assert ServeConfig(host="::", port=1).bind_address == "[::]:1"
