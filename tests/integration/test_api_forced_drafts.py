"""The grammar proposer (DRAFT_PROPOSER_GRAMMAR) over gRPC against the real server and its
default model: tokens the grammar forces are drafted, verified, and the output is the one
decoding without speculation gives."""
import json

import jsonschema

# Mostly fixed structure: long keys in the listed order, enums, a const, a boolean.
SHIPMENT = {
    "type": "object",
    "properties": {
        "shipping_status_description": {"enum": ["delivered_to_the_front_door", "returned_to_the_warehouse"]},
        "schema_version": {"const": "structgen.forced-drafts.v1"},
        "is_priority_shipment": {"type": "boolean"},
    },
    "required": ["shipping_status_description", "schema_version", "is_priority_shipment"],
    "additionalProperties": False,
}


def test_grammar_proposer_drafts_forced_tokens_and_keeps_greedy_output(client):
    prompt = "The shipment record as JSON:"
    plain = client.generate_text(prompt, json_schema=SHIPMENT, compact=True, max_tokens=64)
    drafted = client.generate_text(prompt, json_schema=SHIPMENT, compact=True, max_tokens=64,
                                   num_draft_tokens=4, proposer="grammar")
    assert plain.finish_reason == "grammar_complete", plain.text
    assert drafted.token_ids == plain.token_ids and drafted.text == plain.text
    jsonschema.validate(json.loads(drafted.text), SHIPMENT)
    assert drafted.validation is not None and drafted.validation.valid
    usage = drafted.usage
    # most of the document is forced, and a trained model spells it as the tokenizer does
    assert usage.draft_tokens_accepted >= usage.completion_tokens // 3, usage
    assert 0 < usage.draft_tokens_accepted <= usage.draft_tokens_proposed
    assert 0 < usage.forced_tokens <= usage.draft_tokens_accepted
    assert plain.usage.draft_tokens_proposed == plain.usage.forced_tokens == 0
