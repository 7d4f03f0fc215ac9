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
