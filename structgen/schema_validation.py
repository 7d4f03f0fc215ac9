"""Final check of a constrained output against the *full* JSON Schema (jsonschema library).

The grammar enforces only part of some schemas (see grammar_service.guarantees); this is
what tells the client, in the last message of the stream, whether the whole output is valid.
The draft comes from the schema's `$schema` (jsonschema.validators.validator_for; 2020-12
when absent) and formats are checked with that draft's FormatChecker (format checks that
need optional packages are skipped unless `jsonschema[format-nongpl]` is installed).

No torch, no grpc: the server process calls it at the end of a stream.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache

import jsonschema
from jsonschema.exceptions import SchemaError
from referencing.exceptions import Unresolvable

from structgen.schema_draft_uri import draft_of

MAX_ERRORS = 50  # a final message stays small; `num_errors` still counts them all


@dataclass(frozen=True)
class ValidationIssue:
    path: str            # RFC 6901 pointer into the output, "/jobs/0/id" ("" = the whole output)
    message: str         # jsonschema's message
    schema_pointer: str  # RFC 6901 pointer of the failing keyword in the schema

    def __str__(self) -> str:
        """"<pointer>: <message> (schema <pointer>)", the form the server sends and
        generation_service/proto_convert.py splits at the first ": "."""
        where = f" (schema {self.schema_pointer})" if self.schema_pointer.startswith("/") else ""
        return f"{self.path}: {self.message}{where}"


@dataclass(frozen=True)
class ValidationResult:
    valid: bool
    issues: tuple[ValidationIssue, ...] = ()  # at most MAX_ERRORS, in a stable order
    num_errors: int = 0                       # all violations, even beyond the ones listed
    truncated: bool = False                   # max_tokens cut the document short

    @property
    def errors(self) -> tuple[str, ...]:
        """str(issue) per issue, as the final GenerateResponse carries them."""
        return tuple(map(str, self.issues))

    @property
    def is_valid(self) -> bool:
        return self.valid

    @property
    def status(self) -> str:
        """valid, invalid, truncated (max_tokens cut it short) or not_run (jsonschema could not use
        the schema)."""
        if any(issue.schema_pointer == "schema" for issue in self.issues):
            return "not_run"
        return "valid" if self.valid else "truncated" if self.truncated else "invalid"


def _pointer(path) -> str:
    return "".join(f"/{str(p).replace('~', '~0').replace('/', '~1')}" for p in path)


def to_issue(error: jsonschema.ValidationError) -> ValidationIssue:
    """One violation: where in the output, what, and which schema keyword said so."""
    return ValidationIssue(_pointer(error.absolute_path), error.message, _pointer(error.schema_path))


def _search(pattern: str, text: str) -> bool:
    """ECMA-262 patterns as real schemas write them: Python's re first, then the `regex`
    module for what re lacks (\\p{L} classes and the like)."""
    try:
        return re.search(pattern, text) is not None
    except re.error:
        import regex  # raises ImportError -> reported as "schema: cannot validate"

        return regex.search(pattern, text) is not None


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, pattern_properties, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for key, value in instance.items():
            if _search(pattern, key):
                yield from validator.descend(value, subschema, path=key, schema_path=pattern)


_VALIDATORS = {"draft-03": jsonschema.Draft3Validator, "draft-04": jsonschema.Draft4Validator,
               "draft-06": jsonschema.Draft6Validator, "draft-07": jsonschema.Draft7Validator,
               "2019-09": jsonschema.Draft201909Validator, "2020-12": jsonschema.Draft202012Validator}


def validator_class(schema):
    """The draft's validator: its `$schema` however spelled (jsonschema's lookup knows one
    spelling per draft and takes 2020-12 for https://json-schema.org/draft-07/schema#), else
    jsonschema's own lookup, 2020-12 when absent."""
    uri = schema.get("$schema") if isinstance(schema, dict) else None
    draft = draft_of(uri) if isinstance(uri, str) else None
    if draft in _VALIDATORS:
        return _VALIDATORS[draft]
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)


@lru_cache(maxsize=256)
def _validator(schema_text: str):
    schema = json.loads(schema_text)
    cls = validator_class(schema)
    cls = jsonschema.validators.extend(cls, {"pattern": _pattern, "patternProperties": _pattern_properties})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _sorted_errors(validator, instance) -> list[jsonschema.ValidationError]:
    errors = list(validator.iter_errors(instance))
    return sorted(errors, key=lambda e: (list(map(str, e.absolute_path)), list(map(str, e.schema_path))))


def violations(schema_text: str, instance) -> list[ValidationIssue]:
    """Every violation jsonschema finds, in a stable order (tests re-validate with it)."""
    return [to_issue(e) for e in _sorted_errors(_validator(schema_text), instance)]


def validate_output(schema_text: str, output_text: str, cut_by_max_tokens: bool = False) -> ValidationResult:
    """Validate a generated document against the full schema; never raises.

    Output that is not JSON (a stop string...) is invalid with a parse error at path "";
    with `cut_by_max_tokens` (the output ended at max_tokens) such output is `truncated` and
    the issue says so. A schema jsonschema cannot use (bad `pattern` regex, invalid schema) gives
    one issue whose schema_pointer is "schema", so the client sees the output was not checked.
    """
    try:
        instance = json.loads(output_text)
    except ValueError as exc:
        if cut_by_max_tokens:
            message = f"max_tokens cut the document short (raise max_tokens): {exc}"
            return ValidationResult(False, (ValidationIssue("", message, ""),), 1, truncated=True)
        return ValidationResult(False, (ValidationIssue("", f"output is not valid JSON: {exc}", ""),), 1)
    except RecursionError:  # nested past the interpreter's recursion limit
        return ValidationResult(False, (ValidationIssue("", "output nests too deeply to validate", "schema"),), 1)
    try:
        found = violations(schema_text, instance)
    except (SchemaError, ValueError, Unresolvable) as exc:
        message = getattr(exc, "message", None) or str(exc).splitlines()[0]
        return _unusable_schema(message)
    except Exception as exc:  # e.g. a pattern neither re nor regex compiles, a malformed schema
        return _unusable_schema(repr(exc))
    return ValidationResult(not found, tuple(found[:MAX_ERRORS]), len(found))


def _unusable_schema(message: str) -> ValidationResult:
    return ValidationResult(False, (ValidationIssue("", f"cannot validate with jsonschema: {message}", "schema"),), 1)


def unexplained_violations(schema_text: str, output_text: str, unenforced_keywords: set[str]) -> list[str]:
    """Schema pointers of violations that no keyword of the guarantee report explains.

    A violation is explained when the failing keyword, or a keyword failing beneath it (a
    `oneOf` no branch matches because of a nested `propertyNames`), is in
    `unenforced_keywords`. Output that is not JSON is never explained, except raw control
    characters inside strings when minLength/maxLength is reported (xgrammar's length-limited
    strings admit them; its report says so). A non-empty answer
    means the grammar was weaker than its report said: a bug to log, never expected.
    """
    try:
        instance = json.loads(output_text)
    except ValueError:
        try:  # raw control characters inside strings: xgrammar reports its length-limited strings
            instance = json.loads(output_text, strict=False)
        except ValueError:
            return ["(not JSON)"]
        if not {"minLength", "maxLength"} & unenforced_keywords:
            return ["(not JSON)"]

    def explained(error) -> bool:
        return bool(set(map(str, error.absolute_schema_path)) & unenforced_keywords) or any(
            explained(sub) for sub in error.context or ())
    try:
        errors = list(_validator(schema_text).iter_errors(instance))
    except Exception:  # noqa: BLE001 -- a schema jsonschema cannot use: validate_output says so
        return []
    return [_pointer(e.absolute_schema_path) for e in errors if not explained(e)]
