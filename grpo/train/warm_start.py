"""Warm start: supervised steps on demonstrations before GRPO's first step (--warm_start_steps).

GRPO learns only from what the policy already samples: a model that never writes a tool call gets no call to prefer,
however long it trains. A few supervised steps on rows whose model turns are written out (a registry entry's
"demonstrations") give it that start. Each demonstration becomes an episode laid out exactly as a sampled one
(grpo.rollout.episodes.scripted_episode: the real tools answer between the turns), and the step is the GRPO update
itself with every advantage 1 and no KL term: at the ratio's point of expansion (old log-probs = the pass's own,
ratio 1, inside any clip range) the policy-gradient loss

    L = -(1/D) * sum_i sum_t mask_it * A_i * exp(lp_it - stopgrad(lp_it)),  A_i = 1
    grad L = -(1/D) * sum_i sum_t mask_it * grad lp_it

is the gradient of the demonstrations' negative log-likelihood over the model's tokens (environment tokens masked),
under the run's loss aggregation D. So the warm start shares the update's micro-batches, token budget, DeepSpeed
stages and optimizer; its steps come first in the learning-rate schedule, and the optimizer's moments are dropped
after it (GRPO's updates then start as from a fresh optimizer).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import torch

from grpo.rollout.engine import Completion
from grpo.rollout.episodes import EpisodeLimits, EpisodePrompt, scripted_episode
from grpo.runtime import distributed as dist_utils
from grpo.runtime.sequence_parallel import data_parallel_world
from grpo.train.setup import prompt_order
from grpo.train.step_data import RolloutBatch, StepData, build_rollout_batch
from grpo.train.update import base_optimizer, step_micro_batches, step_normaliser, update

logger = logging.getLogger("grpo")


def demonstration_batch(rows: list[dict], tokenizer, episode_datasets: dict, limits: EpisodeLimits) -> RolloutBatch:
    """The rows' demonstrations as one batch: prompt ids, then each episode's tokens, the model's tokens in the mask.
    A row of a dataset without tools or an environment is one completion: its first reply and the EOS token, as a
    sampled one ends (at most the episode budget)."""
    prompt_ids, completions = [], []
    for index, row in enumerate(rows):
        dataset = episode_datasets.get(row["data_source"])
        prompt_ids.append(list(row["prompt_ids"]))
        if dataset is None:
            tokens = tokenizer.encode(row["demonstration"][0], add_special_tokens=False) + [tokenizer.eos_token_id]
            completions.append(Completion(index, tokens[:limits.max_episode_tokens], [], "stop"))
            continue
        fields = {"tools": list(dataset.tools), "answer": row["answer"], "data_source": row["data_source"]}
        prompt = EpisodePrompt(prompt_ids[-1], [dict(m) for m in row["messages"]], fields,
                               environment=dataset.environment)
        episode = scripted_episode(prompt, list(row["demonstration"]), tokenizer, limits)
        completions.append(Completion(index, episode.completion_ids, [], "stop", mask=list(episode.mask)))
    return build_rollout_batch(prompt_ids, completions, tokenizer.pad_token_id)


def supervised_settings(config):
    """The run's options with what the warm start leaves out: the KL term, the entropy bonus, importance weights."""
    return dataclasses.replace(config, kl_beta=0.0, kl_in_reward=False, entropy_coef=0.0, rollout_is_correction=False)


def run_warm_start(engine, config, demonstrations, tokenizer, episode_datasets: dict, max_completion_tokens: int,
                   micro_batch_tokens: int, device) -> list[float]:
    """config.warm_start_steps supervised steps on `demonstrations` (rendered rows with a `demonstration` column);
    each data-parallel rank takes its share of per_device_train_batch_size x k_samples rows a step (the ranks of a
    sequence-parallel group the same rows, each 1/N of every row, as in GRPO's update). Returns each step's loss: the
    negative log-likelihood per model token over every rank, before that step's update."""
    sp = config.sequence_parallel_size
    world = data_parallel_world(dist_utils.world_size(), sp)
    if len(demonstrations) < world:
        raise ValueError(f"--warm_start_steps: {len(demonstrations)} demonstration(s) for {world} data-parallel "
                         "ranks; every rank needs at least one")
    settings = supervised_settings(config)
    per_step = min(config.per_device_train_batch_size * config.k_samples, len(demonstrations) // world)
    order = prompt_order(len(demonstrations), per_step, config, dist_utils.rank(), dist_utils.world_size())
    limits = EpisodeLimits(max_turns=config.max_turns, max_episode_tokens=max_completion_tokens)
    epoch = position = 0
    losses = []
    for step in range(config.warm_start_steps):
        start = time.perf_counter()
        indices, epoch, position = order.next(epoch, position)
        batch = demonstration_batch([demonstrations[i] for i in indices], tokenizer, episode_datasets, limits)
        micro_batches = step_micro_batches(batch, settings, device, micro_batch_tokens)
        data = StepData(batch, micro_batches, torch.ones(len(indices)),
                        normaliser=step_normaliser(batch, settings, max_completion_tokens))
        result = update(engine, data, settings)
        # the pass's log-likelihood: the loss itself reads -1 at ratio 1 whatever the model
        tokens = float(batch.completion_mask.sum())
        # a sequence-parallel group's N ranks hold the same rows (and row-wide log-probs): each counts 1/N
        total, count = dist_utils.all_sum([result.metrics.get("logprob_mean", 0.0) * tokens / sp, tokens / sp])
        loss = -total / max(count, 1.0)
        losses.append(loss)
        logger.info(f"warm start {step + 1}/{config.warm_start_steps}: loss={loss:.4g} (negative log-likelihood per "
                    f"model token, {int(count)} tokens; {time.perf_counter() - start:.2f}s)")
    forget_moments(engine)
    return losses


def forget_moments(engine) -> None:
    """Drop the optimizer's moments and step counts, so GRPO starts as from a fresh optimizer: Adam's second moment
    decays by beta2 = 0.999 a step, so the supervised gradients' (far larger than GRPO's) would shrink GRPO's first
    few hundred updates. The optimizer builds its state again at the next step, as at the first."""
    base_optimizer(engine.optimizer).state.clear()
