"""Declarative settings: one table per process, the single source of its command line.

A `SettingsTable` lists, per frozen config dataclass, the fields an operator may set. From
one `Setting` row come the flag (`--max-batch`), the environment variable
(`STRUCTGEN_MAX_BATCH`), the `--help` line (with the dataclass default), the Helm chart's
value (`config.engine.maxBatch` -> the ConfigMap's `STRUCTGEN_MAX_BATCH`) and its JSON schema
(type from the field's annotation, `minimum`, `choices`). Precedence: a flag, then the
variable, then the dataclass default. tools/gen_helm_schema.py and tools/gen_docs_tables.py
write the chart's schema and value block and the docs' reference table from the tables;
tests/unit/ops/test_settings.py checks the rest.

The tables: generation_service/settings.py (`structgen serve`), grammar_service/settings.py
(`structgen grammar`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

ENV_PREFIX = "STRUCTGEN_"
# STRUCTGEN_* variables read outside the two tables (so no process calls them unknown).
OTHER_VARIABLES = {
    "STRUCTGEN_SERVER": "structgen generate: the server address",
    "STRUCTGEN_TOKEN": "structgen generate: the bearer token",
    "STRUCTGEN_CACHE": "where the built-in default model's files are kept",
    "STRUCTGEN_TEKKEN_DIR": "benchmarks and GPU tests: the 131k tokenizer",
    "STRUCTGEN_CODE_COMMIT": "benchmarks: the commit a result records (a device copy has no checkout)",
}


class SettingsError(ValueError):
    """A flag, variable or combination the process cannot start with; says what to fix."""


def on_off(text: str) -> bool:
    """A boolean flag or variable: true/false, on/off, yes/no, 1/0."""
    lowered = text.strip().lower()
    if lowered in ("true", "on", "yes", "1"):
        return True
    if lowered in ("false", "off", "no", "0"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


@dataclass(frozen=True)
class ProcessConfig:
    """What each process's command line needs beside its own config."""
    log_level: str = "INFO"

    def __post_init__(self) -> None:
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class Setting:
    """One operator-facing field of a config dataclass. Everything else is derived."""

    flag: str                       # "max-batch": --max-batch, STRUCTGEN_MAX_BATCH, maxBatch
    help: str
    field: str = ""                 # the dataclass field; default: the flag with "_" for "-"
    chart: bool = True              # a chart value under its group (False: the chart derives it)
    shared: bool = False            # read as STRUCTGEN_<FLAG> even in a table with a longer prefix
    minimum: float | None = None    # checked by the dataclass too; written into the chart schema
    greater_than: float | None = None  # an exclusive minimum (timeouts > 0)
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    none_word: str | None = None    # a word that means None (dtype "auto": the checkpoint's)
    deprecated_env: tuple[str, ...] = ()    # old variable names, still read, with a warning
    deprecated_flags: tuple[str, ...] = ()  # old flag names, still accepted, with a warning
    chart_default: Any = None       # the chart's value when it differs from the process default

    @property
    def dest(self) -> str:
        return self.field or self.flag.replace("-", "_")

    @property
    def chart_key(self) -> str:
        head, *rest = self.flag.split("-")
        return head + "".join(part.capitalize() for part in rest)


@dataclass(frozen=True)
class Group:
    """The settings of one config dataclass; `chart` names its values group (config.<chart>)."""

    config: type
    settings: tuple[Setting, ...]
    chart: str | None = None


@dataclass(frozen=True)
class FieldType:
    kind: type          # int, float, bool or str
    is_optional: bool   # None is a valid value


def field_type(config: type, name: str) -> FieldType:
    hint = typing.get_type_hints(config)[name]
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    kinds = [a for a in args if a is not type(None)] if args else [hint]
    if len(kinds) != 1 or kinds[0] not in (int, float, bool, str):
        raise TypeError(f"{config.__name__}.{name}: settings are int, float, bool or str, got {hint}")
    return FieldType(kinds[0], bool(args) and type(None) in args)


def field_default(config: type, name: str) -> Any:
    for f in dataclasses.fields(config):
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None
    raise KeyError(f"{config.__name__} has no field {name!r}")


@dataclass(frozen=True)
class Bound:
    """A setting with its config class: what the table hands out."""

    setting: Setting
    config: type
    env: str
    chart_group: str | None

    @property
    def type(self) -> FieldType:
        return field_type(self.config, self.setting.dest)

    @property
    def default(self) -> Any:
        return field_default(self.config, self.setting.dest)

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.env, *self.setting.deprecated_env)

    def parse(self, text: str) -> Any:
        """The field value of a flag or variable text; ValueError says what was expected."""
        setting, kind = self.setting, self.type
        if setting.none_word is not None and text == setting.none_word:
            return None
        if setting.choices and text not in setting.choices:
            raise ValueError(f"expected one of {', '.join(setting.choices)}, got {text!r}")
        if kind.kind is bool:
            return on_off(text)
        try:
            return kind.kind(text)
        except ValueError:
            raise ValueError(f"expected {'an integer' if kind.kind is int else 'a number'}, got {text!r}") from None

    def help_text(self) -> str:
        default = self.default
        shown = self.setting.none_word if default is None and self.setting.none_word else default
        parts = [self.setting.help]
        if shown is not None and shown != "":
            parts.append(f"(default {format_value(shown)})")
        return " ".join(parts) + f" [${self.env}]"


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Source:
    """Where a resolved value came from: "flag", "env" (with the variable) or "default"."""
    kind: str
    name: str = ""


@dataclass
class Resolved:
    """The config instances of one process, where each value came from, and warnings."""

    configs: dict[type, Any]
    sources: dict[str, Source]        # by flag
    warnings: list[str] = field(default_factory=list)

    def __getitem__(self, config: type):
        return self.configs[config]

    def as_dict(self) -> dict[str, dict[str, Any]]:
        """{ConfigClassName: {field: value}}: what `--print-config` prints and serve logs."""
        return {cls.__name__: dataclasses.asdict(instance) for cls, instance in self.configs.items()}


class SettingsTable:
    """The settings of one process; `env_prefix` is STRUCTGEN_ or a longer one of its own."""

    def __init__(self, prog: str, groups: tuple[Group, ...], env_prefix: str = ENV_PREFIX):
        self.prog = prog
        self.groups = groups
        self.env_prefix = env_prefix
        self.bound: tuple[Bound, ...] = tuple(
            Bound(s, g.config, (ENV_PREFIX if s.shared else env_prefix) + s.flag.replace("-", "_").upper(),
                  g.chart if s.chart else None)
            for g in groups for s in g.settings)
        flags = [b.setting.flag for b in self.bound]
        if len(flags) != len(set(flags)):
            raise ValueError(f"{prog}: a flag is listed twice")
        for b in self.bound:
            b.type  # noqa: B018 -- fails at import for a field that is missing or of no settable type

    def __iter__(self) -> Iterator[Bound]:
        return iter(self.bound)

    def get(self, flag: str) -> Bound:
        return next(b for b in self.bound if b.setting.flag == flag)

    @property
    def env_names(self) -> frozenset[str]:
        return frozenset(name for b in self.bound for name in b.env_names)

    def chart_settings(self, group: str) -> tuple[Bound, ...]:
        return tuple(b for b in self.bound if b.chart_group == group)

    # ---- the command line ------------------------------------------------------------------
    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """One option per setting (default None: "not given", so the variable can apply)."""
        for b in self.bound:
            names = [f"--{b.setting.flag}", *(f"--{old}" for old in b.setting.deprecated_flags)]
            parser.add_argument(*names, dest=f"setting_{b.setting.flag}", default=None, action=_GivenAs,
                                type=_argparse_type(b), metavar=_metavar(b),
                                help=b.help_text().replace("%", "%%"))
        parser.add_argument("--print-config", action="store_true",
                            help="print the resolved settings as JSON and exit")

    def resolve(self, args: argparse.Namespace, environ: Mapping[str, str]) -> Resolved:
        """The configs from flags, then variables, then defaults. Raises SettingsError."""
        values: dict[type, dict[str, Any]] = {g.config: {} for g in self.groups}
        sources: dict[str, Source] = {}
        warnings: list[str] = []
        for b in self.bound:
            value = getattr(args, f"setting_{b.setting.flag}", None)
            if value is not None:
                sources[b.setting.flag] = Source("flag", f"--{b.setting.flag}")
                given_as = getattr(args, f"setting_{b.setting.flag}_given_as", None)
                if given_as and given_as != f"--{b.setting.flag}":
                    warnings.append(f"{given_as} is deprecated: use --{b.setting.flag}")
                values[b.config][b.setting.dest] = value
                continue
            given = [name for name in b.env_names if name in environ]
            if not given:
                sources[b.setting.flag] = Source("default")
                continue
            name = given[0]
            if name != b.env:
                warnings.append(f"{name} is deprecated: use {b.env}")
            try:
                values[b.config][b.setting.dest] = b.parse(environ[name])
            except ValueError as exc:
                raise SettingsError(f"{name}: {exc}") from None
            sources[b.setting.flag] = Source("env", name)
        configs = {}
        for config, kwargs in values.items():
            try:
                configs[config] = config(**kwargs)
            except (TypeError, ValueError) as exc:
                given = ", ".join(sources[b.setting.flag].name for b in self.bound
                                  if b.config is config and b.setting.dest in str(exc)
                                  and sources[b.setting.flag].kind != "default")
                raise SettingsError(f"{exc}" + (f" (from {given})" if given else "")) from None
        return Resolved(configs, sources, warnings)


class _GivenAs(argparse.Action):
    """Stores the value and the option string it came under (a deprecated name warns)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given_as", option_string)


def _argparse_type(bound: Bound) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return bound.parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    parse.__name__ = bound.type.kind.__name__  # argparse names it in "invalid <type> value"
    return parse


def _metavar(bound: Bound) -> str:
    if bound.setting.choices:
        return "{" + ",".join(bound.setting.choices) + "}"
    return {int: "N", float: "X", bool: "BOOL", str: "TEXT"}[bound.type.kind]


def unknown_variables(environ: Mapping[str, str], *tables: SettingsTable) -> list[str]:
    """STRUCTGEN_* variables that no table and no other reader knows: typos, removed names."""
    known = set(OTHER_VARIABLES).union(*(t.env_names for t in tables))
    return sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)


def print_config(resolved: Resolved) -> None:
    """`--print-config`: the resolved configs as JSON on stdout, warnings on stderr."""
    for warning in resolved.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(json.dumps(resolved.as_dict(), indent=2, sort_keys=True))


def to_json_schema(bound: Bound) -> dict:
    """The chart schema of one setting's value (null always allowed: "the process default")."""
    kind = bound.type.kind
    schema: dict[str, Any] = {"type": {int: "integer", float: "number", bool: "boolean", str: "string"}[kind]}
    if bound.setting.choices:
        schema = {"enum": list(bound.setting.choices)}
    if bound.setting.minimum is not None:
        schema["minimum"] = bound.setting.minimum
    if bound.setting.greater_than is not None:
        schema["exclusiveMinimum"] = bound.setting.greater_than
    if bound.setting.maximum is not None:
        schema["maximum"] = bound.setting.maximum
    schema["description"] = re.sub(r"\s+", " ", bound.setting.help)
    return {"anyOf": [{"type": "null"}, schema]}
