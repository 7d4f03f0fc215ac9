"""No input path may execute code (issue 7): the shipped packages never unpickle, eval, load
torch files without weights_only, trust remote model code or render unsandboxed templates.
Checked on the syntax tree of every module, so a comment or a string does not count."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[3]
PACKAGES = ("generation_service", "grammar_service", "step_channel", "structgen", "clients/python")
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name and isinstance(keyword.value, ast.Constant):
            return keyword.value.value
    return None


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _local_names(tree: ast.AST) -> set[str]:
    """Names the module binds itself (a parameter called `compile` is not the builtin)."""
    names = {a.arg for node in ast.walk(tree) if isinstance(node, ast.arguments)
             for a in node.posonlyargs + node.args + node.kwonlyargs}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names | {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _findings(path: pathlib.Path) -> list[str]:
    found = []
    tree = ast.parse(path.read_text(), str(path))
    unsafe_builtins = UNSAFE_BUILTINS - _local_names(tree)
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in unsafe_builtins:
                found.append(f"{where} calls {name}()")
            if name.endswith("torch.load") and _keyword(node, "weights_only") is not True:
                found.append(f"{where} torch.load without weights_only=True")
            if _keyword(node, "trust_remote_code") not in (None, False):
                found.append(f"{where} trust_remote_code")
            if _keyword(node, "allow_pickle") not in (None, False):
                found.append(f"{where} allow_pickle")
            if name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load") and "Safe" not in ast.dump(node):
                found.append(f"{where} {name} without SafeLoader")
            if name in ("jinja2.Environment", "jinja2.Template", "Environment", "Template"):
                found.append(f"{where} unsandboxed jinja2 {name}")
    return found


def test_no_module_can_execute_code_from_its_input():
    modules = list(_modules())
    assert len(modules) > 30  # the scan saw the packages
    findings = [f for path in modules for f in _findings(path)]
    assert not findings, "code execution on an input path:\n" + "\n".join(findings)


def test_the_scan_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport torch, jinja2\ntorch.load(f)\neval(x)\n"
                   "m.from_pretrained(p, trust_remote_code=True)\njinja2.Environment()\n"
                   "torch.load(f, weights_only=True)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        findings = _findings(bad)
    finally:
        ROOT = saved
    assert [f.split(" ", 1)[1] for f in findings] == [
        "imports pickle", "torch.load without weights_only=True", "calls eval()", "trust_remote_code",
        "unsandboxed jinja2 jinja2.Environment"]
