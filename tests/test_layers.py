"""The house's layer contract: every import of a project module runs down the wings, and no modules import in a loop.

Wings, top to bottom (a wing imports only wings below it; wings on one line stand side by side and import none of
each other)::

    face         ntpflow/__init__.py, __main__.py, cli.py
    experiments  reproductions and reports
    replay       attribution and balance of a finished run
    runs         the run folder, its data, the training loop, groups, probing, sweeps
    engine | tasks | probes | llm
    model        GPT, hooks, sites, loss, conversions
    files | stats | progress   the ground: files and devices; statistics; progress lines

Function-level imports count like module-level ones (they are the project's graph all the same).
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ntpflow"
RANKS = {"face": 6, "experiments": 5, "replay": 4, "runs": 3, "engine": 2, "tasks": 2, "probes": 2, "llm": 2,
         "model": 1, "files": 0, "stats": 0, "progress": 0}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing(module: str) -> str:
    """The wing of ``ntpflow.x.y``: its first component below ``ntpflow`` (the root, __main__ and cli: the face)."""
    parts = module.split(".")
    return "face" if len(parts) == 1 or parts[1] in ("__main__", "cli") else parts[1]


def project_imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules that the file at ``path`` imports (``from a import b`` counts ``a.b`` if that is a module)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("ntpflow")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.startswith("ntpflow"):
                subs = {f"{base}.{a.name}" for a in node.names} & modules
                found |= subs or {base}
    return found - {name}


def import_graph() -> dict[str, set[str]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in files}
    return {module_name(p): project_imports(p, modules) & modules for p in files}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a wing at or above the importer's rank (other than its own wing)."""
    bad = []
    for mod, targets in graph.items():
        for t in sorted(targets):
            a, b = wing(mod), wing(t)
            if a != b and RANKS[b] >= RANKS[a]:
                bad.append(f"{mod} ({a}) imports {t} ({b})")
    return bad


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The loops of the module graph (one per strongly connected component of more than one module)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_module_belongs_to_a_known_wing():
    assert sorted({wing(m) for m in import_graph()} - set(RANKS)) == []


def test_imports_run_down_the_wings():
    assert upward_imports(import_graph()) == []


def test_no_module_imports_in_a_loop():
    # a package's __init__ that re-exports its submodules is not a loop with them: drop the edges into __init__s
    graph = import_graph()
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    assert import_cycles({m: t - packages for m, t in graph.items()}) == []


def test_the_contract_catches_an_upward_import_and_a_loop():
    graph = {"ntpflow.model.gpt": {"ntpflow.runs.run"}, "ntpflow.runs.run": {"ntpflow.model.gpt"},
             "ntpflow.engine.influence": {"ntpflow.tasks.base"}, "ntpflow.files": set()}
    assert sorted(upward_imports(graph)) == ["ntpflow.engine.influence (engine) imports ntpflow.tasks.base (tasks)",
                                             "ntpflow.model.gpt (model) imports ntpflow.runs.run (runs)"]
    assert import_cycles(graph) == [["ntpflow.model.gpt", "ntpflow.runs.run"]]
