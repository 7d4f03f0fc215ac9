"""Real-world schemas through a real server over gRPC (issue 8).

- Every output either validates against the full schema, or the final message reports
  exactly the violations jsonschema finds (re-validated here, independently).
- A request whose grammar is slow to compile does not delay the tokens of other requests:
  whole requests start and finish while it is still compiling (timestamps).
"""
from __future__ import annotations

import json
import threading
import time
import uuid

import jsonschema
import pytest

from benchmarks.corpus import get_schema
from structgen_client.errors import StructgenError

# Real schemas under the test server's 64 KiB grammar limit, with unenforced keywords.
SCHEMAS = ["github-issue-config", "readthedocs", "taskfile", "dependabot"]


def _expected_violations(schema: dict, text: str) -> list[tuple[str, str]]:
    try:
        document = json.loads(text)
    except ValueError:
        return [("", "not JSON")]
    cls = jsonschema.validators.validator_for(schema)
    return sorted(("".join(f"/{p}" for p in e.absolute_path), e.message)
                  for e in cls(schema, format_checker=cls.FORMAT_CHECKER).iter_errors(document))


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("name", SCHEMAS)
def test_output_validates_or_final_message_reports_exactly_jsonschemas_violations(client, name, backend):
    schema = get_schema(name).schema
    for seed in (1, 2):
        chunks = list(client.generate(f"The {name} configuration as JSON:\n", json_schema=schema, compact=True,
                                      backend=backend, temperature=1.0, seed=seed, max_tokens=64))
        assert chunks[0].guarantee is not None and chunks[0].guarantee.backend == backend
        text, final = "".join(c.text for c in chunks), chunks[-1]
        expected = _expected_violations(schema, text)
        assert final.validation is not None, "the final message carries the validation"
        assert final.validation.valid == (not expected), (text, final.validation)
        assert final.validation.status == ("invalid" if expected else "valid")
        if expected == [("", "not JSON")]:  # cut by max_tokens: reported as such
            assert final.finish_reason == "max_tokens" and final.validation.truncated
            assert final.validation.errors[0][0] == "" and "max_tokens cut the document short" in final.validation.errors[0][1]
        else:
            reported = sorted((path, message.split(" (schema ")[0]) for path, message in final.validation.errors)
            assert reported == expected, text


def test_a_slow_compile_does_not_delay_other_requests(client):
    # bamboo-spec takes xgrammar seconds to compile (benchmarks/results/schemas-*.json); a
    # fresh $comment makes it a cache miss whatever ran before.
    slow = {**get_schema("bamboo-spec").schema, "$comment": uuid.uuid4().hex}
    slow_done = {}

    def run_slow():
        started = time.monotonic()
        try:
            stream = client.generate("Bamboo spec:", json_schema=slow, backend="xgrammar", max_tokens=4)
            next(iter(stream))
            slow_done["first_message_s"] = time.monotonic() - started
            list(stream)
        except StructgenError as exc:  # a compile past the service's timeout is refused: still slow
            slow_done["error"] = exc
        slow_done["wait_s"] = time.monotonic() - started

    thread = threading.Thread(target=run_slow)
    thread.start()
    time.sleep(0.2)  # the slow compile is under way
    others = []
    while thread.is_alive() and len(others) < 20:
        started = time.monotonic()
        stamps = [time.monotonic() - started for chunk in client.generate(
            "Count:", choices=["one two three", "four five six"], max_tokens=16) if chunk.token_ids]
        others.append((started, time.monotonic(), stamps))
    thread.join(120)
    if slow_done.get("wait_s", 0) < 1.5:
        pytest.skip(f"the compile was not slow on this machine ({slow_done})")
    finished_meanwhile = [o for o in others if o[1] < others[0][0] + slow_done["wait_s"] - 0.2]
    assert len(finished_meanwhile) >= 2, (slow_done, others)
    # Not queued behind the compile: each got its first token in a fraction of the time the
    # slow request waited (alone here: 0.03-0.4 s against 7 s). A fixed 1 s bound failed once
    # on a loaded 2-core machine, where every first token took 1.1-1.5 s during the compile.
    bound = max(1.0, slow_done["wait_s"] / 4)
    for _, _, stamps in finished_meanwhile:
        assert stamps and stamps[0] < bound, (f"first token took {stamps[0]:.2f} s while another grammar "
                                              f"compiled for {slow_done['wait_s']:.1f} s")
