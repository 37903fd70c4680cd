"""The rollout collector's requests: which prompts go to the engine as one-turn completions and which as episodes,
and which empty requests a collective engine (every rank calls together) still needs."""
import pytest

from grpo.config.options import GRPOConfig
from grpo.rollout.collect import RolloutCollector
from grpo.rollout.engine import RolloutEngine, SamplingSettings
from grpo.tools import get_environment
from grpo.data.episode_datasets import EpisodeDataset


class RecordingEngine(RolloutEngine):
    """A collective engine that runs episodes (as server mode's is): records each request, answers nothing."""
    collective_generate = True
    runs_episodes = True

    def __init__(self):
        self.requests = []

    def generate(self, prompt_token_ids, sampling, images=None):
        raise AssertionError("the collector submits; it does not generate")

    def submit(self, prompt_token_ids, sampling, images=None):
        self.requests.append(("one-turn", len(prompt_token_ids)))
        return "one-turn ticket"

    def submit_episodes(self, prompts, sampling, limits):
        self.requests.append(("episodes", len(prompts)))
        return "episodes ticket"


def collector(dataset_names: list[str], eval_names: list[str] = ()) -> tuple[RolloutCollector, RecordingEngine]:
    config = GRPOConfig(dataset_names=dataset_names, eval_dataset_names=list(eval_names), max_turns=2)
    engine = RecordingEngine()
    calc = EpisodeDataset(tools=["calculator"], environment=get_environment("tools"))
    return RolloutCollector(config, engine, None, None, None, None, None, 1, lambda: 0.0,
                            episode_datasets={"calc": calc}), engine


def row(source: str) -> dict:
    return {"prompt_ids": [1, 2, 3], "messages": [{"role": "user", "content": "1 + 1?"}], "answer": "2",
            "data_source": source}


SAMPLING = SamplingSettings(n=2, max_new_tokens=8)


@pytest.mark.parametrize("names, eval_names, prompts, expected", [
    # only episode datasets: no rank ever has a one-turn prompt, so no empty one-turn request
    (["calc"], [], ["calc", "calc"], [("episodes", 2)]),
    (["calc"], [], [], [("episodes", 0)]),
    # a one-turn dataset in the run: a rank without such prompts still takes part in the one-turn request
    (["calc", "toy"], [], ["calc"], [("one-turn", 0), ("episodes", 1)]),
    (["calc", "toy"], [], ["toy"], [("one-turn", 1), ("episodes", 0)]),
    (["calc"], ["toy"], ["calc"], [("one-turn", 0), ("episodes", 1)]),  # evaluation rows of toy generate in one turn
])
def test_a_collective_engine_gets_the_requests_every_rank_makes(names, eval_names, prompts, expected):
    rollouts, engine = collector(names, eval_names)
    tickets = rollouts._submit([row(source) for source in prompts], SAMPLING, None)
    assert engine.requests == expected
    assert tickets.multi == [i for i, s in enumerate(prompts) if s == "calc"]
    assert tickets.single == [i for i, s in enumerate(prompts) if s != "calc"]


class ReleasingEngine(RolloutEngine):
    """The HF engine behind the interface of an in-place engine: records when it generates, gives the base back and
    sleeps."""
    merges_in_place = True

    def __init__(self, engine, calls: list):
        self.engine, self.calls = engine, calls

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return self.engine.generate(*args, **kwargs)

    def release_base(self):
        self.calls.append("release_base")

    def sleep(self, keep_weights=False):
        self.calls.append("sleep")

    def wake(self):
        self.calls.append("wake")


@pytest.mark.parametrize("rounds", ["one", "dynamic"])
def test_the_base_is_given_back_before_the_rewards_are_scored(tiny_model, registry, tmp_path, rounds):
    """An in-place engine starts taking the adapter out of the shared base (on the GPU's queue) as soon as the
    completions are in, so the CPU's scoring overlaps it; where another round may follow (dynamic sampling) it keeps
    the adapter until its sleep."""
    from grpo.train.trainer import GRPOTrainer
    from .trainer_setup import tiny_config

    dynamic = rounds == "dynamic"
    trainer = GRPOTrainer(tiny_config(tiny_model, registry, str(tmp_path), filter_zero_std_groups=dynamic))
    calls = []
    trainer.rollouts.engine = ReleasingEngine(trainer.rollout_engine, calls)
    score = trainer.rollouts.rewards
    trainer.rollouts.rewards = lambda *args, **kwargs: calls.append("score") or score(*args, **kwargs)
    kept, _ = trainer.rollouts.collect(trainer.state)
    if dynamic:
        assert calls[0] == "wake" and calls[-1] == "sleep" and "release_base" not in calls
        assert calls[1:-1] == ["generate", "score"] * (len(calls[1:-1]) // 2)
    else:
        assert calls == ["wake", "generate", "release_base", "score", "sleep"]
        assert 0 <= kept.times["rollout_release"] < kept.times["rollout"]  # counted with the rollout
    assert len(kept.completions) == trainer.config.per_device_train_batch_size * trainer.config.k_samples
