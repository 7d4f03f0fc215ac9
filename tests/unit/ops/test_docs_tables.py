"""docs/operations.md's generated tables (settings of both processes, metric families) are
what the code has: regenerate with `.venv/bin/python tools/gen_docs_tables.py`."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _tool():
    spec = importlib.util.spec_from_file_location("gen_docs_tables", ROOT / "tools" / "gen_docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_are_current():
    doc = (ROOT / "docs" / "operations.md").read_text()
    assert _tool().render(doc) == doc, "run: .venv/bin/python tools/gen_docs_tables.py"


def test_every_setting_and_family_is_in_the_tables():
    from prometheus_client import CollectorRegistry

    from generation_service.metrics import GenerationMetrics
    from generation_service.settings import SERVE_SETTINGS
    from grammar_service.settings import GRAMMAR_SETTINGS
    doc = (ROOT / "docs" / "operations.md").read_text()
    for bound in (*SERVE_SETTINGS, *GRAMMAR_SETTINGS):
        assert f"| `--{bound.setting.flag}`" in doc and f"`{bound.env}`" in doc
    for family in GenerationMetrics(CollectorRegistry()).families():
        assert f"| `{family.name}` |" in doc
    assert "structgen_kv_pages_total" not in doc and "rpc_errors" not in doc
