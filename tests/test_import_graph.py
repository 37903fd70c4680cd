"""The package's import graph: every module of grpo/ imports on its own (a circle of top-level imports fails when
entered from one of its modules), and the engine weight transfer (grpo/sync/) depends on model loading
(grpo/model/), never the other way round, with no circle among them even through imports inside functions."""
import ast
import json
import os
import subprocess
import sys

from .trainer_setup import ROOT, child_env

# one interpreter: third-party libraries load once, every grpo module is dropped before the next is imported alone
IMPORT_EACH_ALONE = """
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "grpo" or m.startswith("grpo.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # an optional library absent here (vLLM, Triton): not this check's concern
        if (exc.name or "").split(".")[0] == "grpo":
            failed[name] = repr(exc)
    except Exception as exc:
        failed[name] = repr(exc)
print(json.dumps(failed))
"""


def grpo_modules() -> dict[str, str]:
    """Dotted name -> file of every module under grpo/."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(ROOT, "grpo")):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(folder, file)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[name.removesuffix(".__init__")] = path
    return modules


def imported_modules(path: str, known: set[str]) -> set[str]:
    """The modules of `known` that a file imports anywhere in it (inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def cycle_from(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as a path that ends where it starts, or None (depth-first search)."""
    done, path = set(), []

    def visit(node):
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return None
        path.append(node)
        for neighbour in sorted(graph[node]):
            found = visit(neighbour)
            if found:
                return found
        path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        found = visit(start)
        if found:
            return found
    return None


def test_cycle_from_finds_a_circle_and_only_a_circle():
    assert cycle_from({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle_from({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_every_module_imports_on_its_own():
    names = sorted(grpo_modules())
    proc = subprocess.run([sys.executable, "-c", IMPORT_EACH_ALONE, *names], capture_output=True, text=True,
                          cwd=ROOT, env=child_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {}


def test_the_weight_transfer_depends_on_model_loading_one_way_without_circles():
    modules = grpo_modules()
    known = set(modules)
    scope = {name: path for name, path in modules.items() if name.startswith(("grpo.model.", "grpo.sync."))}
    graph = {name: {dep for dep in imported_modules(path, known) if dep in scope and dep != name}
             for name, path in scope.items()}
    assert cycle_from(graph) is None, cycle_from(graph)
    back = {name: sorted(deps) for name, deps in graph.items()
            if name.startswith("grpo.model.") and any(dep.startswith("grpo.sync.") for dep in deps)}
    assert back == {}, f"model loading imports the weight transfer: {back}"
    assert graph["grpo.sync.weight_sync"] >= {"grpo.model.layer_weights", "grpo.sync.in_place_merge"}
