"""The repository's own packages import each other without circles, and the two services
never import each other: what both speak lives in grammar_contract/ and step_channel/.

The graph is read from the source (ast), not from an import: every `import` statement
counts, at module level, inside functions (lazy imports) and under `if TYPE_CHECKING:`
alike. A lazy or type-only import still ties the two modules together (the lazy one just
hides the circle until the call runs); a circle means a missing seam (an interface, a
registry, or a function in the wrong room), so none is exempt.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ("generation_service", "grammar_service", "grammar_contract", "step_channel", "structgen")
SERVICES = ("generation_service", "grammar_service")
BENEATH = ("grammar_contract", "step_channel")  # imported by both services, import neither


def module_files() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The repository module `name` loads (a name inside a module: that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """Repository modules `module` imports -> line of the first such import."""
    found: dict[str, int] = {}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` loads pkg.mod; `from mod import name` loads mod
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        for name in names:
            target = _owner(name, modules)
            if target is not None and target != module:
                found.setdefault(target, node.lineno)
    return found


def import_graph() -> dict[str, dict[str, int]]:
    modules = module_files()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module, as a path
    a -> b -> ... -> a (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(graph[step])))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_circle_in(component, graph) for component in components]


def _circle_in(component: set[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """The shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if target in component and target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle in {component}")


def _describe(circle: list[str], graph: dict[str, dict[str, int]]) -> str:
    hops = [f"{a} (line {graph[a][b]})" for a, b in zip(circle, circle[1:])]
    return " -> ".join(hops + [circle[-1]])


def test_no_import_circle():
    graph = import_graph()
    assert len(graph) > 100, "the walk found too few modules: is ROOT the repository?"
    found = [_describe(circle, graph) for circle in cycles(graph)]
    assert not found, "import circles (give each a seam):\n" + "\n".join(found)


def test_the_services_import_only_what_is_beneath_them():
    graph = import_graph()
    crossings = []
    for module, targets in graph.items():
        top = module.split(".")[0]
        forbidden = {s for s in SERVICES if s != top} if top in SERVICES else set(SERVICES) if top in BENEATH else set()
        crossings += [f"{module} imports {target} (line {line})" for target, line in targets.items()
                      if target.split(".")[0] in forbidden]
    assert not crossings, "a service imports the other, or a shared package imports a service:\n" + "\n".join(crossings)


def test_the_checks_see_a_circle_and_its_lines():
    """The detector itself: a made-up graph with a circle and a line to quote."""
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert _describe(["a", "b", "c", "a"], graph) == "a (line 3) -> b (line 5) -> c (line 7) -> a"
    assert cycles({"a": {"b": 1}, "b": {}}) == []
