"""A JSON Schema whose documents the grammar mostly forces (long keys in a fixed order, enums with
long shared tails, a const, a boolean; every path ends): the grammar proposer's test case
(tests/unit/grammar/test_forced_drafts.py, tests/integration/test_engine_forced_drafts.py)."""

SHIPMENT = {
    "type": "object",
    "properties": {
        "customer_account_identifier": {"enum": ["ACC-0000000001", "ACC-0000000002"]},
        "shipping_status_description": {"enum": ["delivered_to_the_front_door", "returned_to_the_warehouse"]},
        "schema_version": {"const": "structgen.forced-drafts.v1"},
        "is_priority_shipment": {"type": "boolean"},
    },
    "required": ["customer_account_identifier", "shipping_status_description", "schema_version",
                 "is_priority_shipment"],
    "additionalProperties": False,
}
