"""Random generations under each backend's mask on real-world schemas: every finished output
either validates, or validate_output reports exactly the violations jsonschema finds; under
either backend every violation is on a keyword the guarantee report listed."""
from __future__ import annotations

import json
import random

import jsonschema
import numpy as np
import pytest

from benchmarks.corpus import get_schema
from channel_driver import allowed_tokens
from grammar_contract.spec import GrammarSpec
from structgen.schema_validation import unexplained_violations, validate_output

EOS = 2  # "</s>" in the Mistral v3 vocabulary

SCHEMAS = ["dependabot", "github-issue-forms", "readthedocs", "taskfile", "woodpecker-ci"]
NUM_WALKS, MAX_TOKENS = 3, 300
STRUCTURAL = set('"{}[],:0123456789.-')


def _random_document(backend, compiled, rng: random.Random, structural: np.ndarray) -> list[int] | None:
    """Sample among allowed tokens (EOS or structure preferred so documents end); None if cut."""
    matcher, masks, ids = backend.new_matcher(compiled), np.zeros((1, backend.tokenizer.mask_words), np.int32), []
    for _ in range(MAX_TOKENS):
        backend.batch_fill([matcher], masks, [0])
        allowed = allowed_tokens(masks[0])
        closing = allowed[structural[allowed]]
        if EOS in allowed and (rng.random() < 0.5 or len(allowed) == 1):
            assert matcher.accept(EOS)
            return ids
        token = int(rng.choice(list(closing)) if len(closing) and rng.random() < 0.6 else rng.choice(list(allowed)))
        assert matcher.accept(token), "a token the mask allowed was refused"
        ids.append(token)
    return None


@pytest.fixture(scope="module")
def structural(tokenizer_data):
    pieces = [p.replace("\u2581", " ").strip() for p in tokenizer_data.encoded_vocab]
    return np.array([bool(p) and (set(p) <= STRUCTURAL or p in ("true", "false", "null")) for p in pieces])


@pytest.mark.parametrize("name", SCHEMAS)
def test_outputs_validate_or_report_exactly_what_jsonschema_finds(backend, mistral_32k, structural, name):
    text = get_schema(name).text
    spec = GrammarSpec("json_schema", text)
    compiled, reported = backend.compile(spec), {u.keyword for u in backend.unenforced_keywords(spec)}
    schema = json.loads(text)
    reference = jsonschema.validators.validator_for(schema)
    reference = reference(schema, format_checker=reference.FORMAT_CHECKER)
    rng, finished = random.Random(f"walk-{name}"), 0
    for _ in range(NUM_WALKS):
        ids = _random_document(backend, compiled, rng, structural)
        if ids is None:
            continue
        finished += 1
        output = mistral_32k.decode(ids)
        result = validate_output(text, output)
        # an honest report: violations only where it said so (both backends)
        assert unexplained_violations(text, output, reported | {"then", "else"}) == [], output
        try:
            document = json.loads(output)
        except ValueError:  # xgrammar's length-limited strings admit raw control characters
            assert not result.valid and result.issues[0].message.startswith("output is not valid JSON")
            continue
        expected = sorted(("".join(f"/{p}" for p in e.absolute_path), e.message)
                          for e in reference.iter_errors(document))
        assert result.valid == (not expected)
        assert sorted((i.path, i.message) for i in result.issues) == expected, output
    assert finished, "no walk finished: raise MAX_TOKENS"
