"""The package's import graph: every module of grpo/ imports on its own (a circle of top-level imports fails when
entered from one of its modules), no two modules of grpo/ import each other even through a circle of several or
through imports inside functions (which only wait for a call to fail, or hide which module depends on which), and
the engine weight transfer (grpo/sync/) depends on model loading (grpo/model/), never the other way round. The
packages stand in layers (LAYERS): each imports only those below it."""
import ast
import json
import os
import re
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


def imported_modules(path: str, known: set[str], name: str = "") -> set[str]:
    """The modules of `known` that a file (module `name`, for its relative imports) imports anywhere in it (inside
    functions too)."""
    found = set()
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".") if node.level else []
            module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            names = [module] + [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of grpo/ its import statements run: those it names, and the packages above them (their
    __init__ runs first) but its own."""
    modules = grpo_modules()
    graph = {}
    for name, path in modules.items():
        named = imported_modules(path, set(modules), name)
        graph[name] = {package for dep in named for package in _packages_of(dep) if package in modules} \
            - set(_packages_of(name))
    return graph


def _packages_of(module: str) -> list[str]:
    """The module and every package above it: grpo.a.b -> grpo.a.b, grpo.a, grpo."""
    return [module.rsplit(".", depth)[0] for depth in range(module.count(".") + 1)]


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


def test_imports_are_read_with_the_packages_they_run():
    graph = import_graph()
    assert {"grpo.config.options", "grpo.errors"} <= graph["grpo.config.cli"]
    assert "grpo.config" in graph["grpo.checkpoint.layout"]  # grpo.config.run_layout's package __init__ runs first
    assert "grpo.config" not in graph["grpo.config.cli"]  # its own package: already being imported


# the packages of grpo/ (and its top-level modules), bottom to top: each imports only those before it
LAYERS = [
    ("grpo.errors", "the exceptions every layer raises; imports nothing of grpo"),
    ("grpo.user_code", "imports the user's files (--reward_module, --tool_module, --agent_module); nothing of grpo"),
    ("grpo.algorithm", "pure tensor math: no model, no engine, no config object"),
    ("grpo.config", "every option, its checks, a run folder's names; reads only the algorithm's registered names"),
    ("grpo.runtime", "the process around training (ranks, roles, failures, signals, DeepSpeed's config)"),
    ("grpo.tools", "tools and environments and their sandbox, usable alone"),
    ("grpo.rewards", "reward functions and their routing per dataset, usable alone"),
    ("grpo.data", "the dataset registry and prompts: an entry names its rewards and tools"),
    ("grpo.model", "loading the policy and the reference (vision prompts render through data)"),
    ("grpo.sync", "the policy's weights into an engine: reads the model's layers"),
    ("grpo.checkpoint", "saving, resuming and the final model: model and adapters as files"),
    ("grpo.rollout", "engines and a step's rollouts: generate from the model, take synced weights, score rewards"),
    ("grpo.agents", "agents over an OpenAI-compatible endpoint in front of a rollout engine"),
    ("grpo.memory", "the memory plan: every phase's peak from the model, the engine and the options"),
    ("grpo.train", "the loop (and setup, reporting) wiring all of the above; only the entry points import it"),
    ("grpo.entry", "the processes' mains: training and server mode's rollout ranks; nothing imports it"),
]


def layer_of(module: str) -> str:
    """grpo.a.b -> grpo.a (a package of grpo/, or a top-level module such as grpo.errors)."""
    return ".".join(module.split(".")[:2])


def test_every_package_has_a_layer():
    placed = {name for name, _ in LAYERS}
    assert len(placed) == len(LAYERS)
    unplaced = sorted({layer_of(name) for name in grpo_modules() if name != "grpo"} - placed)
    assert unplaced == [], f"place these in LAYERS (tests/test_import_graph.py) and docs/architecture.md: {unplaced}"


def test_every_package_imports_only_the_layers_below_it():
    """Every import of grpo/ (at the top of a module or inside a function) goes down the layers; within a package
    imports are free (the circle test above keeps them apart). The package's own __init__ (`import grpo`: the public
    names) stands above them all. A name two layers share lives in the lower one; a higher layer that needs to be
    called from a lower one passes a callable or an object down (the trainer hands the rollout collector its
    agents)."""
    rank = {name: index for index, (name, _) in enumerate(LAYERS)}
    upward = []
    for name, deps in sorted(import_graph().items()):
        if name == "grpo":
            continue
        named = {dep for dep in deps if dep != "grpo"}
        for dep in sorted(named - {package for dep in named for package in _packages_of(dep)[1:]}):
            if rank[layer_of(dep)] > rank[layer_of(name)]:
                upward.append(f"{name} -> {dep}")
    assert upward == [], f"imports up the layers ({' < '.join(rank)}):\n" + "\n".join(upward)


def test_the_architecture_doc_gives_the_layers_in_order():
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    order = text.split("## Layers\n\n", 1)[1].split("\n\n")[1]  # the paragraph after the one saying what a layer is
    assert re.findall(r"`(\w+)`", order) == [name.removeprefix("grpo.") for name, _ in LAYERS]


def test_relative_imports_are_resolved(tmp_path):
    (tmp_path / "__init__.py").write_text("from . import b\nfrom .sub.c import f\n")
    (tmp_path / "m.py").write_text("from .b import g\nfrom ..other import h\n")
    known = {"p", "p.b", "p.sub.c", "other"}
    assert imported_modules(str(tmp_path / "__init__.py"), known, "p") == {"p", "p.b", "p.sub.c"}
    assert imported_modules(str(tmp_path / "m.py"), known, "p.m") == {"p.b", "other"}


def test_no_import_circle_among_grpo_modules():
    """A circle (a imports b, b imports a, directly or through others, at the top or inside a function) means two
    modules each need the other: the shared name belongs in one of them, or in a module both import."""
    circle = cycle_from(import_graph())
    assert circle is None, "import circle: " + " -> ".join(circle)


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


def test_the_math_never_imports_the_config():
    """grpo/config/ reads the algorithm's names (grpo/algorithm/registry.py: --loss_type's choices are the registered
    losses); the math reads nothing of the config."""
    graph = import_graph()
    back = {name: sorted(dep for dep in deps if dep.startswith("grpo.config"))
            for name, deps in graph.items() if name.startswith("grpo.algorithm")}
    assert {name: deps for name, deps in back.items() if deps} == {}
    assert "grpo.algorithm.registry" in graph["grpo.config.choices"]


def test_user_files_are_imported_by_a_module_of_their_own():
    """--reward_module, --tool_module and --agent_module files are imported by grpo/user_code.py: the tools and the
    agents do not reach into the rewards for it (grpo.rewards.registry keeps the names, for code that imports them
    from there)."""
    graph = import_graph()
    for name in ("grpo.rewards.registry", "grpo.tools.registry", "grpo.agents.registry"):
        assert "grpo.user_code" in graph[name], name
    assert not {dep for dep in graph["grpo.tools.registry"] if dep.startswith("grpo.rewards")}
    from grpo import user_code
    from grpo.rewards import registry

    assert (registry.import_user_file, registry.qualified_name) == (user_code.import_user_file,
                                                                    user_code.qualified_name)


def test_the_training_loop_is_the_top_floor_of_the_library():
    """grpo/train/ (the trainer, its setup and reporting) sits above the library: nothing below it imports it, only
    the processes' mains (grpo/entry/). The rollout ranks' process (grpo/entry/serve.py) logs through
    grpo/runtime/console_log.py and sets up its episode datasets through grpo/data/episode_datasets.py, as training
    does."""
    graph = import_graph()
    upward = {name: sorted(dep for dep in deps if dep.startswith("grpo.train"))
              for name, deps in graph.items() if not name.startswith(("grpo.train", "grpo.entry")) and name != "grpo"}
    assert {name: deps for name, deps in upward.items() if deps} == {}
    assert not [dep for dep in graph["grpo.entry.serve"] if dep.startswith("grpo.train")]  # a rollout rank: no loop
    assert "grpo.train.trainer" in graph["grpo.entry.train"]


def test_nothing_imports_the_entry_points():
    """grpo/entry/ holds the processes' mains (train_grpo.py runs grpo.entry.train): no module of the library imports
    them (the package's __init__ names serve_rollouts lazily, for scripts of their own)."""
    graph = import_graph()
    importers = {name: sorted(dep for dep in deps if dep.startswith("grpo.entry"))
                 for name, deps in graph.items() if not name.startswith("grpo.entry") and name != "grpo"}
    assert {name: deps for name, deps in importers.items() if deps} == {}
    assert "grpo.entry.serve" in graph["grpo.entry.train"]
