"""Valid and invalid instances per schema for benchmarks/schema_truth.py, every one checked by
the validator the service's final validation uses (structgen.schema_validation).

Valid instances:
- `example`: the schema's own root `examples` / `default` values that validate;
- `generated`: values jsf (a JSON Schema faker) draws from the schema, seeded, those that
  validate kept, the largest distinct ones first;
- `reordered`: a valid object instance with every object's keys in reverse order (JSON Schema
  never constrains order), and `undeclared_first`: an undeclared property moved before the
  declared ones where the schema allows it. Both probe what grammars fix that the schema
  leaves free.
Invalid instances (`mutated`): one seeded mutation of a valid instance each (a value of
another type, a required property removed, an undeclared property added, an array item
appended or removed), kept when the validator refuses the result.

Generation runs in a worker process per schema, killed past its time budget (a faker can
recurse for long on large schemas); results are cached on disk per schema text and settings.
"""
from __future__ import annotations

import copy
import hashlib
import json
import multiprocessing as mp
import os
import pathlib
import random
from dataclasses import dataclass

CACHE_DIR = pathlib.Path(os.path.expanduser("~")) / ".cache" / "structgen" / "schema-truth-instances"
_CACHE_VERSION = 1
_OTHER_TYPE = {dict: [1, "x"], list: [{"k": 1}, "x"], str: [7, None], bool: ["yes", 0], int: ["12", [1]],
               float: ["1.5", {}], type(None): [0, "null"]}


@dataclass(frozen=True)
class Instance:
    kind: str        # example, generated, reordered, undeclared_first, mutated
    is_valid: bool
    text: str        # the document as it is fed to the grammar

    def to_json(self) -> list:
        return [self.kind, self.is_valid, self.text]


def _is_valid(schema_text: str, value) -> bool | None:
    from structgen.schema_validation import violations

    try:
        return not violations(schema_text, value)
    except Exception:  # noqa: BLE001 -- a schema the validator cannot use: no instances from it
        return None


def _draw(schema: dict, num: int, seed: int) -> list:
    """Values jsf (a JSON Schema faker) draws, seeded; it may draw invalid ones (checked later)."""
    from faker import Faker
    from jsf import JSF

    random.seed(seed)
    Faker.seed(seed)
    faker = JSF(schema)
    return [faker.generate() for _ in range(3 * num)]


def _reversed_keys(value):
    if isinstance(value, dict):
        return {k: _reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [_reversed_keys(v) for v in value]
    return value


def _paths(value, path=()):
    yield path, value
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _paths(sub, (*path, key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            yield from _paths(sub, (*path, index))


def _set(root, path, new):
    if not path:
        return new
    node = root
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = new
    return root


def _mutations(value, rng: random.Random):
    """Candidate invalid documents made from one valid one, one change each."""
    paths = list(_paths(value))
    rng.shuffle(paths)
    for path, sub in paths[:6]:
        for other in _OTHER_TYPE.get(type(sub), []):
            yield _set(copy.deepcopy(value), path, other)
        if isinstance(sub, dict):
            if sub:
                changed = copy.deepcopy(value)
                node = changed
                for step in path:
                    node = node[step]
                del node[rng.choice(list(node))]
                yield changed
            yield _set(copy.deepcopy(value), path, {**sub, "zz_undeclared": 1})
        if isinstance(sub, list):
            yield _set(copy.deepcopy(value), path, [*sub, sub[0] if sub else 1])
            if sub:
                yield _set(copy.deepcopy(value), path, sub[:-1])


def _undeclared_first(schema_text: str, schema: dict, value):
    if not isinstance(value, dict) or not isinstance(schema.get("properties"), dict):
        return None
    declared = [k for k in value if k in schema["properties"]]
    if not declared:
        return None
    moved = {"zz_undeclared": "x", **value}
    return moved if _is_valid(schema_text, moved) else None


def make_instances(schema_text: str, num_generated: int, num_invalid: int, seed: int) -> tuple[list[Instance], str]:
    """(instances, generator error or "") for one schema; slow, runs in a worker."""
    schema = json.loads(schema_text)
    valid: list = []
    if isinstance(schema, dict):
        for key in ("examples", "default"):
            candidates = schema.get(key, []) if key == "examples" else [schema[key]] if key in schema else []
            valid.extend(("example", v) for v in (candidates if isinstance(candidates, list) else [])
                         if _is_valid(schema_text, v))
    error = ""
    try:
        drawn = [v for v in _draw(schema, num_generated, seed) if _is_valid(schema_text, v)]
        by_text = {json.dumps(v, sort_keys=True): v for v in drawn}
        largest = sorted(by_text.values(), key=lambda v: -len(json.dumps(v)))[:num_generated]
        valid.extend(("generated", v) for v in largest)
    except Exception as exc:  # noqa: BLE001 -- jsf refuses or fails on this schema (not, if, ...)
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    out = [Instance(kind, True, json.dumps(v, ensure_ascii=False)) for kind, v in valid]
    objects = [v for _, v in valid if isinstance(v, dict) and len(v) > 1]
    if objects:
        reordered = _reversed_keys(max(objects, key=lambda v: len(json.dumps(v))))
        if _is_valid(schema_text, reordered):
            out.append(Instance("reordered", True, json.dumps(reordered, ensure_ascii=False)))
    for _, v in valid:
        moved = _undeclared_first(schema_text, schema, v)
        if moved is not None:
            out.append(Instance("undeclared_first", True, json.dumps(moved, ensure_ascii=False)))
            break
    rng, invalid, seen = random.Random(seed), [], set()
    for _, v in valid:
        for candidate in _mutations(v, rng):
            text = json.dumps(candidate, ensure_ascii=False)
            if text not in seen and _is_valid(schema_text, candidate) is False:
                seen.add(text)
                invalid.append(Instance("mutated", False, text))
                break
        if len(invalid) >= num_invalid:
            break
    return out + invalid, error


def _worker(conn, schema_text: str, num_generated: int, num_invalid: int, seed: int) -> None:
    instances, error = make_instances(schema_text, num_generated, num_invalid, seed)
    conn.send(([i.to_json() for i in instances], error))


def instances_for(schema_text: str, *, num_generated: int = 6, num_invalid: int = 6, seed: int = 0,
                  budget_s: float = 20.0) -> tuple[list[Instance], str]:
    """Cached make_instances, in a worker process killed past budget_s."""
    key = hashlib.sha256(json.dumps([_CACHE_VERSION, schema_text, num_generated, num_invalid, seed]).encode()).hexdigest()
    path = CACHE_DIR / f"{key[:32]}.json"
    if path.is_file():
        rows, error = json.loads(path.read_text())
        return [Instance(*row) for row in rows], error
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["benchmarks._instances", "jsf", "structgen.schema_validation"])
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=_worker, args=(theirs, schema_text, num_generated, num_invalid, seed), daemon=True)
    process.start()
    theirs.close()
    try:
        if ours.poll(budget_s):
            rows, error = ours.recv()
        else:
            rows, error = [], f"instance generation ran past {budget_s:g} s"
    except EOFError:
        rows, error = [], f"instance generation crashed (exit code {process.exitcode})"
    finally:
        if process.is_alive():
            process.kill()
        process.join()
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([rows, error]))
    tmp.rename(path)
    return [Instance(*row) for row in rows], error
