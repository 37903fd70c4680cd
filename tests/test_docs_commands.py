"""The commands in README.md and docs/*.md work as written.

Every `python train_grpo.py ...`, `deepspeed ... train_grpo.py ...` and `bash run_grpo.sh ...` line of their fenced
bash blocks parses with grpo.parse_args (so each --flag is a real option and the values pass GRPOConfig's checks),
each VAR=value before a script is a variable that script reads, every script a command runs exists, and the Python
snippets run up to the point where they would start training. Links and repository paths of README.md, docs/*.md
and benchmarks/RESULTS.md must exist too.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "benchmarks" / "RESULTS.md"]

FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.M | re.S)
ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHONS = {"python", "python3"}
PYTEST_VALUE_OPTIONS = {"-k", "-m", "-p", "-o"}


def fenced(path: Path, languages: set[str]) -> list[tuple[int, str]]:
    """(line number, body) of each fenced block of one of `languages`."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in FENCE.finditer(text) if m.group(1) in languages]


def shell_commands(path: Path) -> list[tuple[str, list[str]]]:
    """("file:line", tokens) of each command line in the bash / sh blocks, continuations joined, comments dropped."""
    out = []
    for first, body in fenced(path, {"bash", "sh"}):
        lines = body.split("\n")
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            tokens = shlex.split(line, comments=True)
            if tokens:
                out.append((f"{path.relative_to(ROOT)}:{first + start}", tokens))
    return out


def split_env(tokens: list[str]) -> tuple[list[str], list[str]]:
    """The VAR=value prefixes (their names) and the command after them."""
    names = []
    while tokens and ENV.match(tokens[0]):
        names.append(tokens[0].split("=", 1)[0])
        tokens = tokens[1:]
    return names, tokens


def script_variables(script: Path) -> set[str]:
    """Environment variables a shell script reads (`$VAR` or `${VAR...}`)."""
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", script.read_text()))


def train_arguments(tokens: list[str]):
    """For a command that runs train_grpo.py (directly, through deepspeed, or through run_grpo.sh): (launcher
    tokens, train_grpo.py arguments); None for any other command."""
    if len(tokens) >= 2 and tokens[0] in ("bash", "sh") and tokens[1].endswith("run_grpo.sh"):
        return tokens[:2], tokens[2:]
    if "train_grpo.py" in tokens and (tokens[0] in PYTHONS or tokens[0] == "deepspeed"):
        at = tokens.index("train_grpo.py")
        return tokens[:at], tokens[at + 1:]
    return None


COMMANDS = [(where, tokens) for path in DOCS for where, tokens in shell_commands(path)]
TRAIN_COMMANDS = [(where, tokens) for where, tokens in COMMANDS if train_arguments(split_env(tokens)[1])
                  and "--help" not in tokens]  # --help is run for real in test_help_exits_cleanly


def test_the_docs_hold_commands_to_check():
    assert len(TRAIN_COMMANDS) >= 10, [where for where, _ in TRAIN_COMMANDS]
    assert any("run_grpo.sh" in tokens for _, tokens in TRAIN_COMMANDS)
    assert any("deepspeed" in tokens for _, tokens in TRAIN_COMMANDS)


@pytest.mark.parametrize("where,tokens", TRAIN_COMMANDS, ids=[w for w, _ in TRAIN_COMMANDS])
def test_train_command_flags_are_options(where, tokens, monkeypatch, tmp_path):
    from grpo import parse_args

    names, command = split_env(tokens)
    launcher, args = train_arguments(command)
    if names:
        assert launcher[-1].endswith("run_grpo.sh"), f"{where}: {' '.join(names)} set before {' '.join(launcher)}"
        unknown = sorted(set(names) - script_variables(ROOT / "run_grpo.sh"))
        assert not unknown, f"{where}: run_grpo.sh reads no variable {', '.join(unknown)}: {shlex.join(tokens)}"
    args = [a for a in args if a != "..."]  # "..." stands for the rest of a command line
    if "--config" in args:  # its file is read by parse_args: give it an empty one
        at = args.index("--config") + 1
        if not (ROOT / args[at]).exists():
            (tmp_path / "config.json").write_text("{}")
            args[at] = str(tmp_path / "config.json")
    world = 1
    if "--num_gpus" in launcher:
        world = int(launcher[launcher.index("--num_gpus") + 1])
    elif "--rollout_gpus" in args:
        world = int(args[args.index("--rollout_gpus") + 1]) + 1
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("RANK", raising=False)
    try:
        parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: train_grpo.py rejects the arguments (exit {exc.code}): {shlex.join(tokens)}")
    except Exception as exc:  # a ConfigError from GRPOConfig's checks
        pytest.fail(f"{where}: {type(exc).__name__}: {exc}\n  command: {shlex.join(tokens)}")


def test_env_variables_are_read_by_their_scripts():
    problems = []
    for where, tokens in COMMANDS:
        names, command = split_env(tokens)
        if names and len(command) >= 2 and command[0] in ("bash", "sh"):
            unknown = sorted(set(names) - script_variables(ROOT / command[1]))
            if unknown:
                problems.append(f"{where}: {command[1]} reads no {', '.join(unknown)}")
    assert not problems, "\n".join(problems)


def test_readme_lists_run_grpo_variables():
    listed = re.search(r"^Variables: (.*?)\.$", (ROOT / "README.md").read_text(), re.M | re.S)
    assert listed, "README.md lists run_grpo.sh's variables after 'Variables: '"
    names = re.findall(r"[A-Z][A-Z0-9_]*", listed.group(1))
    unknown = sorted(set(names) - script_variables(ROOT / "run_grpo.sh"))
    assert not unknown, f"README.md lists {', '.join(unknown)}, which run_grpo.sh does not read"


def test_scripts_that_commands_run_exist():
    missing = []
    for where, tokens in COMMANDS:
        _, command = split_env(tokens)
        if len(command) < 2:
            continue
        paths = []
        if command[0] in ("bash", "sh"):
            paths.append(command[1])
        elif command[0] in PYTHONS and command[1].endswith(".py"):
            paths.append(command[1])
        elif command[0] in PYTHONS and command[1:3] == ["-m", "pytest"]:
            arguments = command[3:]
            # the value after -k / -m / -p / -o is an expression or a name, not a path
            values = {i + 1 for i, a in enumerate(arguments) if a in PYTEST_VALUE_OPTIONS}
            paths += [a.split("::")[0] for i, a in enumerate(arguments) if not a.startswith("-") and i not in values]
        missing += [f"{where}: {p}" for p in paths if not (ROOT / p).exists()]
    assert not missing, "\n".join(missing)


def test_help_exits_cleanly():
    assert any(tokens[-2:] == ["train_grpo.py", "--help"] for _, tokens in COMMANDS)
    proc = subprocess.run([sys.executable, "train_grpo.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--tuning_strategy" in proc.stdout


# ---------------------------------------------------------------------------------------------- python snippets
def runnable_part(source: str) -> str:
    """A snippet's imports, function definitions and GRPOConfig(...) assignments: what it does before training."""
    keep = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)):
            keep.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, "id", None) == "GRPOConfig":
            keep.append(node)
    return ast.unparse(ast.Module(body=keep, type_ignores=[]))


SNIPPETS = [(f"{path.relative_to(ROOT)}:{line}", body) for path in DOCS for line, body in fenced(path, {"python"})]


def test_python_snippets_run_up_to_training():
    assert any("from grpo import GRPOTrainer" in body for _, body in SNIPPETS)
    parts = {}
    for where, body in SNIPPETS:
        try:
            parts[where] = runnable_part(body)
        except SyntaxError as exc:
            pytest.fail(f"{where}: not valid Python: {exc}")
    driver = ("import json, sys, traceback\n"
              "failed = []\n"
              "for where, code in json.loads(sys.stdin.read()).items():\n"
              "    try:\n"
              "        exec(compile(code, where, 'exec'), {'__name__': 'docs_snippet'})\n"
              "    except Exception:\n"
              "        failed.append(where + ':\\n' + traceback.format_exc())\n"
              "print('\\n'.join(failed))\n"
              "sys.exit(1 if failed else 0)\n")
    proc = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, input=json.dumps(parts), capture_output=True,
                          text=True, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


# ---------------------------------------------------------------------------------------------- links and paths
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"^(?:benchmarks|scripts|configs|tests|docs|grpo)/[\w./-]*\w$|^(?:run_grpo\.sh|train_grpo\.py)$")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    text = FENCE.sub("", path.read_text())
    heads = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("path", LINKED, ids=[str(p.relative_to(ROOT)) for p in LINKED])
def test_links_and_paths_exist(path):
    text = path.read_text()
    missing = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            missing.append(f"link {target}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            missing.append(f"link {target}: no heading #{anchor}")
    code = re.findall(r"`([^`\n]+)`", FENCE.sub("", text)) + \
        [tok for _, body in fenced(path, {"bash", "sh"}) for tok in body.split()]
    for span in code:
        span = span.split("::")[0].rstrip(",;:")
        if REPO_PATH.match(span) and not (ROOT / span).exists():
            missing.append(f"path {span}")
    assert not missing, f"{path.relative_to(ROOT)}: " + ", ".join(sorted(set(missing)))


def test_the_readme_registry_and_reward_examples_work_when_pasted(tmp_path):
    """The README's registry entry, pasted into a copy of configs/dataset_config.json, finds its file under the
    repository's data/; its reward file registers the reward the entry names; both load before any model."""
    from grpo.data import load_dataset_registry, load_prompt_datasets
    from grpo.rewards import get_reward, load_reward_module

    readme = ROOT / "README.md"
    entry = next(json.loads(body) for _, body in fenced(readme, {"json"}) if '"path"' in body)
    reward_source = next(body for _, body in fenced(readme, {"python"}) if "register_reward" in body)
    name, spec = next(iter(entry.items()))
    tree = tmp_path / "repo"
    (tree / "configs").mkdir(parents=True)
    registry = json.loads((ROOT / "configs" / "dataset_config.json").read_text())
    registry.update(entry)
    (tree / "configs" / "dataset_config.json").write_text(json.dumps(registry))
    data = (tree / "configs" / spec["path"]).resolve()
    assert data.parent == tree / "data", f"the example's path {spec['path']} does not lead to the repository's data/"
    data.parent.mkdir()
    data.write_text("".join(json.dumps({spec["prompt_field"]: f"What is {i} + {i}?",
                                        spec["answer_field"]: f"\\boxed{{{2 * i}}}"}) + "\n" for i in range(8)))
    (tree / "my_rewards.py").write_text(reward_source)
    load_reward_module(str(tree / "my_rewards.py"))
    assert all(get_reward(reward) for reward in spec["rewards"])
    load_dataset_registry(str(tree / "configs" / "dataset_config.json"))
    train, held_out = load_prompt_datasets(str(tree / "configs" / "dataset_config.json"), [name], 0.75, 0)
    assert len(train) + len(held_out) == 8


def test_the_matrix_plans_in_memory_md_are_the_planners():
    """docs/memory.md's table of the matrix's plans is what `python benchmarks/memory_matrix.py --plan_only` prints
    with today's planner (no GPU: each budget as a card of its size), row for row."""
    proc = subprocess.run([sys.executable, "benchmarks/memory_matrix.py", "--plan_only"], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ") and not line.startswith("| shape")]
    shapes = tuple({row.split(" | ")[0] + " | " for row in printed})  # "| qwen2.5-7b | ", ...
    documented = [line for line in (ROOT / "docs" / "memory.md").read_text().splitlines()
                  if line.startswith(shapes) and line.count(" | ") == 4]
    assert len(printed) == 60 and documented == printed, "refresh the table with the command's output"
