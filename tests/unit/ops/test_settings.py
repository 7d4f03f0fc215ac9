"""The settings tables: flags, STRUCTGEN_* variables, --help and the configs they build.

What the chart renders is checked against the same tables in test_helm.py (in-process) and
tests/integration/test_ops_chart.py (the processes started with the rendered environment).
"""
from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from generation_service.config import ServeConfig
from generation_service.engine.config import EngineConfig
from generation_service.settings import NOT_SETTINGS, SERVE_SETTINGS
from grammar_service.config import GrammarServiceConfig
from grammar_service.settings import GRAMMAR_SETTINGS
from structgen.cli import build_parser
from structgen.commands.serve import resolve
from structgen.settings import OTHER_VARIABLES, ProcessConfig, SettingsError, unknown_variables

ROOT = pathlib.Path(__file__).resolve().parents[3]
TABLES = {"serve": SERVE_SETTINGS, "grammar": GRAMMAR_SETTINGS}


def serve(argv=(), environ=None):
    return resolve(build_parser().parse_args(["serve", *argv]), environ or {})


def grammar(argv=(), environ=None):
    from grammar_service.server import build_parser as grammar_parser
    return GRAMMAR_SETTINGS.resolve(grammar_parser().parse_args(list(argv)), environ or {})


def test_flag_beats_variable_beats_default():
    environ = {"STRUCTGEN_PORT": "6000", "STRUCTGEN_MAX_BATCH": "8", "STRUCTGEN_DTYPE": "auto",
               "STRUCTGEN_MAX_NEW_TOKENS_LIMIT": "99", "STRUCTGEN_OVERLAP": "off"}
    resolved = serve(["--port", "7000", "--runner", "eager"], environ)
    assert resolved[ServeConfig] == ServeConfig(port=7000)
    assert resolved[EngineConfig] == EngineConfig(max_batch=8, max_new_tokens_limit=99, dtype=None,
                                                  runner="eager", overlap=False)
    assert resolved.sources["port"].kind == "flag" and resolved.sources["max-batch"].name == "STRUCTGEN_MAX_BATCH"
    assert resolved.sources["host"].kind == "default" and not resolved.warnings


def test_the_variables_the_chart_used_to_set_reach_the_config():
    """STRUCTGEN_MAX_CONCURRENT_RPCS was set by the chart but read by nothing."""
    resolved = serve(environ={"STRUCTGEN_MAX_CONCURRENT_RPCS": "1024", "STRUCTGEN_NUM_WORKERS": "128"})
    assert (resolved[ServeConfig].max_concurrent_rpcs, resolved[ServeConfig].num_workers) == (1024, 128)


@pytest.mark.parametrize("old, new, field, value", [
    ("STRUCTGEN_MAX_BATCH_SIZE", "STRUCTGEN_MAX_BATCH", "max_batch", 8),
    ("STRUCTGEN_MAX_QUEUE_LENGTH", "STRUCTGEN_MAX_WAITING", "max_waiting", 9),
    ("STRUCTGEN_MAX_NEW_TOKENS", "STRUCTGEN_MAX_NEW_TOKENS_LIMIT", "max_new_tokens_limit", 10),
])
def test_renamed_variables_still_work_with_a_warning(old, new, field, value):
    resolved = serve(environ={old: str(value)})
    assert getattr(resolved[EngineConfig], field) == value
    assert resolved.warnings == [f"{old} is deprecated: use {new}"]
    both = serve(environ={old: "1", new: str(value)})  # the new name wins
    assert getattr(both[EngineConfig], field) == value


def test_the_old_drain_flag_still_works_with_a_warning():
    resolved = serve(["--grace-s", "7"])
    assert resolved[ServeConfig].grace_s == 7
    assert resolved.warnings == ["--grace-s is deprecated: use --drain-seconds"]
    assert not serve(["--drain-seconds=7"]).warnings


@pytest.mark.parametrize("environ, message", [
    ({"STRUCTGEN_MAX_BATCH": "eight"}, "STRUCTGEN_MAX_BATCH: expected an integer, got 'eight'"),
    ({"STRUCTGEN_OVERLAP": "sometimes"}, "STRUCTGEN_OVERLAP: expected true or false"),
    ({"STRUCTGEN_RUNNER": "fast"}, "STRUCTGEN_RUNNER: expected one of auto, cuda_graph, eager"),
    ({"STRUCTGEN_MAX_BATCH": "0"}, "max_batch must be >= 1, got 0 (from STRUCTGEN_MAX_BATCH)"),
    ({"STRUCTGEN_TLS_CERT": "c.pem"}, "tls_cert and tls_key go together"),
    ({"STRUCTGEN_LOG_LEVEL": "loud"}, "log_level must be one of DEBUG, INFO, WARNING, ERROR"),
])
def test_bad_values_say_what_to_fix(environ, message):
    with pytest.raises(SettingsError) as error:
        serve(environ=environ)
    assert message in str(error.value)


@pytest.mark.parametrize("argv, expected", [
    (["--device", "cuda"], True), (["--device", "cuda:1"], True), ([], False),  # default: on a GPU
    (["--device", "cuda", "--tensor-parallel", "2"], False),
    (["--device", "cuda", "--engine-process", "false"], False), (["--engine-process", "true"], True),
])
def test_the_engine_runs_in_its_own_process_by_default_on_a_gpu(argv, expected):
    from structgen.commands.serve import uses_engine_process
    resolved = serve(argv)
    assert uses_engine_process(resolved[ServeConfig], resolved[EngineConfig]) is expected


def test_engine_process_with_tensor_parallel_says_it_does_not_go():
    with pytest.raises(SettingsError, match="--engine-process does not go with --tensor-parallel > 1"):
        serve(["--engine-process", "true", "--tensor-parallel", "2"])


def test_serve_exits_2_with_the_message_before_loading_anything(capsys, monkeypatch):
    from structgen.cli import main
    monkeypatch.setenv("STRUCTGEN_MAX_WAITING", "-1")
    assert main(["serve"]) == 2
    assert "max_waiting must be >= 1, got -1 (from STRUCTGEN_MAX_WAITING)" in capsys.readouterr().err


def test_unknown_structgen_variables_are_reported():
    environ = {"STRUCTGEN_MAX_BATCH_SZE": "8", "STRUCTGEN_SERVER": "x:1", "STRUCTGEN_GRAMMAR_NUM_FILL_THREADS": "2"}
    assert serve(environ=environ).warnings == ["STRUCTGEN_MAX_BATCH_SZE is set but no structgen setting reads it"]
    assert unknown_variables(environ, SERVE_SETTINGS, GRAMMAR_SETTINGS) == ["STRUCTGEN_MAX_BATCH_SZE"]


def test_print_config_prints_the_resolved_configs(capsys, monkeypatch):
    import json

    from structgen.cli import main
    monkeypatch.setenv("STRUCTGEN_MAX_BATCH", "3")
    assert main(["serve", "--port=0", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["EngineConfig"]["max_batch"] == 3 and printed["ServeConfig"]["port"] == 0


def test_every_config_field_is_a_setting_or_says_why_not():
    """A new EngineConfig / ServeConfig / GrammarServiceConfig field needs a row or a reason."""
    for table in TABLES.values():
        for group in table.groups:
            listed = {s.dest for s in group.settings}
            fields = {f.name for f in dataclasses.fields(group.config)}
            not_settings = set(NOT_SETTINGS) if group.config is EngineConfig else set()
            assert listed <= fields, f"{group.config.__name__}: no field {listed - fields}"
            assert fields - listed == not_settings, f"{group.config.__name__}: {fields - listed - not_settings} have no row"


def _below(bound, value):
    return value - 1 if bound.type.kind is int else value - 0.5


@pytest.mark.parametrize("table", TABLES.values(), ids=TABLES)
def test_the_limits_the_schema_states_are_the_ones_the_config_enforces(table):
    """minimum / greater_than / maximum / choices go into values.schema.json: each must be the
    dataclass's own rule, so that the chart refuses what the process would refuse."""
    for bound in table:
        s, make = bound.setting, (lambda value, b=bound: b.config(**{b.setting.dest: value}))
        if s.minimum is not None:
            make(bound.type.kind(s.minimum))
            with pytest.raises(ValueError):
                make(_below(bound, s.minimum))
        if s.greater_than is not None:
            with pytest.raises(ValueError):
                make(bound.type.kind(s.greater_than))
        if s.maximum is not None:
            make(bound.type.kind(s.maximum))
            with pytest.raises(ValueError):
                make(bound.type.kind(s.maximum) + 1)
        for choice in s.choices:
            make(bound.parse(choice))


def test_variable_names_follow_the_flags_and_never_collide():
    for table in TABLES.values():
        for bound in table:
            assert bound.env.endswith(bound.setting.flag.replace("-", "_").upper())
    serve_env = {b.env for b in SERVE_SETTINGS}
    grammar_env = {b.env for b in GRAMMAR_SETTINGS}
    shared = {b.env for b in GRAMMAR_SETTINGS if b.setting.shared}
    assert serve_env & grammar_env == shared == {"STRUCTGEN_MAX_GRAMMAR_BYTES", "STRUCTGEN_LOG_LEVEL"}
    assert all(name.startswith("STRUCTGEN_GRAMMAR_") for name in grammar_env - shared)


def test_a_shared_variable_sets_both_processes():
    environ = {"STRUCTGEN_MAX_GRAMMAR_BYTES": "4096", "STRUCTGEN_LOG_LEVEL": "debug",
               "STRUCTGEN_GRAMMAR_NUM_FILL_THREADS": "3", "STRUCTGEN_MAX_BATCH": "4"}
    g, s = grammar(environ=environ), serve(environ=environ)
    assert g[GrammarServiceConfig].max_grammar_bytes == s[ServeConfig].max_grammar_bytes == 4096
    assert g[ProcessConfig].log_level == s[ProcessConfig].log_level == "debug"
    assert g[GrammarServiceConfig].num_fill_threads == 3
    assert g[GrammarServiceConfig] == GrammarServiceConfig(max_grammar_bytes=4096, num_fill_threads=3)


@pytest.mark.parametrize("command", ["serve", "grammar"])
def test_help_lists_every_flag_with_its_variable_and_default(command, capsys):
    from structgen.cli import main
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for bound in TABLES[command]:
        entry = re.search(rf"--{bound.setting.flag}\b.*?\[\${bound.env}\]", text)
        assert entry, f"--{bound.setting.flag} [${bound.env}] missing from `structgen {command} --help`"
        default = bound.default
        if default not in (None, "") and bound.setting.none_word is None:
            assert "(default" in entry.group(0), bound.setting.flag


def test_docs_name_only_variables_that_exist():
    """README, docs and chart: every STRUCTGEN_* they mention is read by something (an old
    name only on a line that calls it deprecated)."""
    current = set(OTHER_VARIABLES) | {b.env for t in TABLES.values() for b in t}
    deprecated = {name for t in TABLES.values() for b in t for name in b.setting.deprecated_env}
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "helm").rglob("*.yaml"),
             *(ROOT / "helm").rglob("*.tpl")]
    for path in files:
        for line in path.read_text().splitlines():
            for name in re.findall(r"STRUCTGEN_[A-Z0-9_]*[A-Z0-9]", line):
                if name.endswith(("_TLS", "_GRAMMAR")):  # a prefix: STRUCTGEN_TLS_*, STRUCTGEN_GRAMMAR_<FLAG>
                    continue
                assert name in current or (name in deprecated and "deprecated" in line.lower()), \
                    f"{path.relative_to(ROOT)} names {name}, which nothing reads: {line.strip()}"
