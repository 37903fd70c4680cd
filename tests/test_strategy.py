"""--tuning_strategy resolved once into a type (grpo/config/strategy.py): what each strategy implies, and no strategy
name compared or listed anywhere else in grpo/ (the flag's values are spelled in that module alone)."""
import ast
import os

import pytest

from grpo.config import GRPOConfig
from grpo.config.choices import STRATEGIES
from grpo.config.strategy import Strategy
from grpo.errors import ConfigError

from .trainer_setup import ROOT

NAMES = {strategy.value for strategy in Strategy}
CONTAINERS = (ast.Tuple, ast.List, ast.Set)


def test_each_strategy_answers_what_the_library_asks():
    assert STRATEGIES == ("qlora", "lora", "full")  # --help's order
    assert [s for s in Strategy if s.has_adapter] == [Strategy.QLORA, Strategy.LORA]
    assert [s for s in Strategy if s.four_bit_base] == [Strategy.QLORA]
    assert [s for s in Strategy if s.sixteen_bit_adapter] == [Strategy.LORA]
    assert [s for s in Strategy if s.reference_is_copy] == [Strategy.FULL]
    assert Strategy("qlora") is Strategy.QLORA and Strategy.of(Strategy.LORA) is Strategy.LORA
    assert Strategy.LORA == "lora" and f"{Strategy.QLORA}" == str(Strategy.QLORA) == "qlora"
    assert Strategy.read(None) is None and Strategy.read("4bit") is None
    with pytest.raises(ConfigError, match="--tuning_strategy: got 'half', choose one of qlora, lora, full"):
        Strategy.of("half")


def test_the_config_resolves_its_strategy():
    assert GRPOConfig(tuning_strategy="full").strategy is Strategy.FULL
    assert GRPOConfig().strategy is Strategy.LORA and GRPOConfig().tuning_strategy == "lora"
    with pytest.raises(ConfigError, match="--tuning_strategy: got 'half'"):
        GRPOConfig(tuning_strategy="half")


def strategy_literals(source: str) -> list[int]:
    """Lines where a strategy's name is compared, listed or keyed as a plain string: `x == "lora"`, `x in ("lora",
    "qlora")`, `"qlora" in (a, b)`, `{"full": ...}`, `f(strategy="qlora")`, `("qlora", "lora")`. A name inside a
    longer text (help, messages, f-strings) or a substring test (`"lora" in name`) is not a strategy."""
    found = []

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in NAMES

    def listed(node) -> bool:
        return named(node) or (isinstance(node, CONTAINERS) and any(map(named, node.elts)))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, sides, sides[1:]):
                if isinstance(op, (ast.In, ast.NotIn)):  # in a literal of names, or a name in a literal
                    hit = (listed(right) and not named(right)) or (named(left) and isinstance(right, CONTAINERS))
                else:
                    hit = named(left) or named(right)
                if hit:
                    found.append(node.lineno)
        elif isinstance(node, CONTAINERS) and sum(map(named, node.elts)) >= 2:  # a list of strategies
            found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(named(key) for key in node.keys if key is not None):
            found.append(node.lineno)
        elif isinstance(node, ast.keyword) and "strategy" in (node.arg or "") and listed(node.value):
            found.append(node.value.lineno)
    return found


def test_the_scan_finds_strategy_names_and_only_those():
    source = '''
if config.tuning_strategy == "qlora": pass
if strategy in ("lora", "qlora"): pass
if "full" != strategy: pass
rates = {"lora": 2e-5}
attempt(strategy="lora")
if "qlora" not in (now, saved): pass
CHOICES = ["full", "lora"]
help = "lora: an adapter"; message = f"--tuning_strategy {strategy} (qlora)"
if "lora" in name or name == "lora_A": pass
'''
    assert sorted(set(strategy_literals(source))) == [2, 3, 4, 5, 6, 7, 8]


def test_no_strategy_name_outside_its_module():
    own = os.path.join(ROOT, "grpo", "config", "strategy.py")
    hits = []
    for folder, _, files in os.walk(os.path.join(ROOT, "grpo")):
        for file in sorted(files):
            path = os.path.join(folder, file)
            if file.endswith(".py") and path != own:
                hits += [f"{os.path.relpath(path, ROOT)}:{line}" for line in strategy_literals(open(path).read())]
    assert hits == [], f"compare with grpo.config.strategy.Strategy (or config.strategy): {hits}"
