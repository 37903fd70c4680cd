"""The HF rollout engine under ZeRO-3 on 2 gloo CPU ranks: every forward gathers the partitioned weights over all
ranks, so the ranks must generate in step even when their work differs: one rank with more prompts than its batch
holds (more chunks), or none at all, and multi-turn episodes that end after different numbers of turns. Each case
returns on both ranks (a rank that skipped a forward would leave the other waiting in a weight gather)."""
import json
import os
from dataclasses import replace

from tests.spawn_ranks import join_world, spawn_ranks
from tests.tiny_models import make_tiny_model_dir
from tests.trainer_setup import even_tokens, tiny_config, write_prompt_registry


def _talks_for(turns: int):
    """An environment that answers the model `turns` - 1 times, then ends the episode."""
    def environment(messages, **fields):
        model_turns = sum(m["role"] == "assistant" for m in messages)
        return [{"role": "user", "content": "go on"}], model_turns >= turns
    return environment


def _uneven(rank, port, world, model, registry, out):
    join_world(rank, port, world)  # GRPOTrainer starts the process group from it
    os.environ["WANDB_MODE"] = "disabled"
    from grpo.rollout.engine import SamplingSettings
    from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, run_episodes
    from grpo.runtime import distributed as dist_utils
    from grpo.train.trainer import GRPOTrainer

    config = tiny_config(model, registry, out, deepspeed="zero3", eval_on_start=False, ddp_timeout_minutes=1.5)
    trainer = GRPOTrainer(config, reward_funcs=[even_tokens])
    engine, tokenizer = trainer.rollouts.engine, trainer.tokenizer
    assert engine.gathers_weights
    engine.max_batch_size = 1
    prompt = tokenizer("2 + 2 =")["input_ids"]
    sampling = SamplingSettings(n=2, max_new_tokens=6, temperature=1.0, top_p=1.0, logprobs=True)
    seen = {}
    # rank 0: 3 prompts in 3 chunks of 1; rank 1: none
    seen["one_turn"] = len(engine.generate([prompt] * 3 if rank == 0 else [], sampling))
    # rank 0: episodes of 3 model turns; rank 1: one prompt whose episodes end after the first. Each turn is the
    # real generate's, marked as stopped by the model (a random model seldom samples its end-of-turn token)
    generate = engine.generate
    engine.generate = lambda *args: [replace(c, finish_reason="stop") for c in generate(*args)]
    turns = 3 if rank == 0 else 1
    messages = [{"role": "user", "content": "2 + 2 ="}]
    episodes = run_episodes(engine, tokenizer, [EpisodePrompt(prompt, messages, environment=_talks_for(turns))],
                            sampling, EpisodeLimits(max_turns=3, max_episode_tokens=128),
                            any_rank=dist_utils.any_rank)
    seen["episodes"] = len(episodes)
    seen["model_turns"] = [sum(m["role"] == "assistant" for m in e.messages) for e in episodes]
    both = dist_utils.gather_objects(seen)
    if rank == 0:
        with open(os.path.join(out, "seen.json"), "w") as fh:
            json.dump(both, fh)
    trainer.close()


def test_zero3_ranks_generate_in_step_with_uneven_work(tmp_path):
    make_tiny_model_dir(str(tmp_path / "model"))
    registry = write_prompt_registry(str(tmp_path / "data"))
    out = str(tmp_path / "out")
    spawn_ranks(_uneven, 2, str(tmp_path / "model"), registry, out)
    with open(os.path.join(out, "seen.json")) as fh:
        first, second = json.load(fh)
    assert (first["one_turn"], second["one_turn"]) == (6, 0)
    assert (first["episodes"], second["episodes"]) == (2, 2)
    assert first["model_turns"] == [3, 3] and second["model_turns"] == [1, 1]
