"""The rollout-engine protocol: every engine implements it, and the loop uses nothing it does not declare."""
import ast
import os

import pytest

from grpo.rollout.engine import DeferredRequest, RolloutEngine, SamplingSettings
from grpo.rollout.hf import HFRolloutEngine
from grpo.rollout.remote import RemoteRolloutEngine
from grpo.rollout.vllm import VLLMRolloutEngine

from .trainer_setup import ROOT

# where the loop talks to an engine, and the names it holds it by there
CALLERS = {"grpo/rollout/collect.py": {"engine"}, "grpo/train/trainer.py": {"rollout_engine"},
           "grpo/sync/weight_sync.py": {"engine"}, "grpo/entry/serve.py": {"engine"}}


def engine_attributes_used(path: str, names: set[str]) -> set[str]:
    """Attributes read on `engine`, `self.engine`, `self.rollout_engine` (whichever `names` lists) in a file."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            holder = node.value
            held_as = holder.id if isinstance(holder, ast.Name) else \
                holder.attr if isinstance(holder, ast.Attribute) and isinstance(holder.value, ast.Name) else None
            if held_as in names:
                used.add(node.attr)
    return used


@pytest.mark.parametrize("path", sorted(CALLERS))
def test_the_loop_uses_only_declared_engine_members(path):
    used = engine_attributes_used(path, CALLERS[path])
    assert used, f"{path}: no engine use found (has the code moved?)"
    undeclared = sorted(name for name in used if not hasattr(RolloutEngine, name))
    assert not undeclared, f"{path} uses {undeclared} on an engine; declare them on grpo.rollout.engine.RolloutEngine"


def test_the_loop_never_probes_engines():
    for path in CALLERS:
        source = open(os.path.join(ROOT, path)).read()
        for probe in ("getattr(engine", "hasattr(engine", "getattr(self.engine", "hasattr(self.engine",
                      "getattr(self.rollout_engine", "hasattr(self.rollout_engine"):
            assert probe not in source, f"{path} probes an engine with {probe}...)"


@pytest.mark.parametrize("engine_class", [HFRolloutEngine, VLLMRolloutEngine, RemoteRolloutEngine])
def test_every_engine_implements_the_protocol(engine_class):
    assert issubclass(engine_class, RolloutEngine)
    assert not getattr(engine_class, "__abstractmethods__", None)


def test_a_colocated_engine_generates_when_collected(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    engine = HFRolloutEngine(model, AutoTokenizer.from_pretrained(tiny_model))
    sampling = SamplingSettings(n=2, max_new_tokens=3, greedy=True)
    ticket = engine.submit([[5, 6, 7]], sampling)
    assert isinstance(ticket, DeferredRequest)  # nothing generated yet: a colocated engine samples on collection
    completions = engine.collect(ticket)
    assert [c.prompt_index for c in completions] == [0, 0]
    assert [c.token_ids for c in completions] == [c.token_ids for c in engine.generate([[5, 6, 7]], sampling)]
    with pytest.raises(NotImplementedError, match="holds no weights"):
        RolloutEngine.load_weights(engine, [])


def test_new_weights_never_sample_on_the_old_weights_cached_prefixes():
    """After a weight update the engine drops vLLM's cached KV blocks; vLLM refusing that (a request still holding
    blocks) is an error, not rollouts whose prompts attend to the old weights' keys and values."""
    from grpo.errors import TrainingError
    from grpo.rollout.vllm import VLLMRolloutEngine

    class PrefixCache:
        def __init__(self, answer):
            self.answer, self.resets = answer, 0

        def reset_prefix_cache(self):
            self.resets += 1
            return self.answer

    engine = object.__new__(VLLMRolloutEngine)
    for answer in (True, None):  # (None: a vLLM whose reset says nothing)
        engine.llm = PrefixCache(answer)
        engine._forget_cached_prefixes()
        assert engine.llm.resets == 1
    engine.llm = PrefixCache(False)
    with pytest.raises(TrainingError, match="vLLM refused to reset its prefix cache"):
        engine._forget_cached_prefixes()
