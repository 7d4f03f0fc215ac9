"""The Python client's request building and `structgen serve`'s flag/env resolution."""
import argparse
import json

import pytest

from generation_service.config import ServeConfig
from structgen.commands.serve import OPTIONS, resolve
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


def _args(**given):
    namespace = argparse.Namespace(**{option.field: None for option in OPTIONS})
    for key, value in given.items():
        setattr(namespace, key, value)
    return namespace


def test_serve_flag_beats_environment_beats_default():
    environ = {"STRUCTGEN_PORT": "6000", "STRUCTGEN_MAX_BATCH_SIZE": "8", "STRUCTGEN_DTYPE": "auto",
               "STRUCTGEN_MAX_NEW_TOKENS": "99"}
    serve = resolve(_args(port=7000), environ, "serve")
    engine = resolve(_args(), environ, "engine")
    assert serve == {"port": 7000}
    assert engine == {"max_batch": 8, "max_new_tokens_limit": 99}  # dtype "auto" = the checkpoint's
    assert ServeConfig(**serve).bind_address == "127.0.0.1:7000"


def test_runner_and_overlap_reach_the_engine_config():
    from generation_service.engine.config import EngineConfig
    engine = resolve(_args(runner="eager"), {"STRUCTGEN_OVERLAP": "off", "STRUCTGEN_VERIFY_GRAPHS": "yes"}, "engine")
    assert engine == {"runner": "eager", "overlap": False, "verify_graphs": True}
    assert EngineConfig(**engine).overlap is False
    with pytest.raises(argparse.ArgumentTypeError, match="true or false"):
        resolve(_args(), {"STRUCTGEN_OVERLAP": "sometimes"}, "engine")


def test_serve_config_validates():
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        ServeConfig(tls_cert="c.pem")
    with pytest.raises(ValueError, match="port"):
        ServeConfig(port=70000)
    assert ServeConfig(host="::", port=1).bind_address == "[::]:1"
