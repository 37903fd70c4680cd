"""What a run needs before its first step, in the order that keeps errors cheap: checks of the options and the output
folder, then data, rewards and the tokenizer (every error here comes before a model loads), then DeepSpeed."""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from grpo.checkpoint.resume import check_resume_keeps_policy, saved_config_path
from grpo.checkpoint.store import list_checkpoints
from grpo.config.options import EMBEDDED_MODEL, GRPOConfig
from grpo.data import (dataset_routes, first_rows_per_source, load_dataset_registry, load_prompt_datasets,
                       render_prompts)
from grpo.data.sampler import PromptOrder
from grpo.errors import ConfigError
from grpo.model.base_weights import check_checkpoint_weights
from grpo.model.embedded import resolve_model_path
from grpo.model.loading import load_tokenizer
from grpo.model.vision import load_vision_processor, render_vision_prompts
from grpo.rewards import RewardRouter, load_reward_module
from grpo.rewards.reward_model import register_reward_models
from grpo.rollout.engines import check_tensor_parallel
from grpo.runtime import distributed as dist_utils
from grpo.runtime.deepspeed_config import default_dtype
from grpo.train.tool_setup import check_episode_datasets, prompts_with_tools
from grpo.train.update import lr_schedule

logger = logging.getLogger("grpo")


def check_run_can_start(config: GRPOConfig) -> None:
    """Refusals that need no data and no model: the engine's requirements, the output folder, the resume."""
    if config.num_iterations > 1 and config.uses_lora and config.lora_dropout > 0:
        logger.warning(f"--num_iterations {config.num_iterations} with --lora_dropout {config.lora_dropout}: each "
                       "update draws new dropout masks, so the later updates' ratios to the first one's log-probs "
                       "carry dropout noise and are clipped as if the policy had moved; --lora_dropout 0 avoids it")
    if config.rollout_engine == "vllm":
        if not torch.cuda.is_available():
            raise ConfigError("--rollout_engine vllm needs a GPU; use --rollout_engine hf on CPU")
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--rollout_engine vllm needs vLLM: pip install .[vllm] (tested with vllm 0.26.0)")
    if not config.resume_from_checkpoint and list_checkpoints(config.output_dir) and \
            not config.overwrite_output_dir:
        raise ConfigError(f"--output_dir {config.output_dir} holds checkpoints of an earlier run; continue it with "
                          f"--resume_from_checkpoint latest, or start over with --overwrite_output_dir")
    if config.resume_from_checkpoint:
        check_resume_keeps_policy(saved_config_path(config.resume_from_checkpoint, config.output_dir), config)


@dataclass
class RunData:
    """The run's prompts (rendered to token ids), their order on this rank, and what scores them."""
    model_path: str
    tokenizer: object
    vision: Optional[object]     # grpo.model.vision.VisionProcessor for a vision-language model
    rewards: RewardRouter
    train_set: object            # datasets.Dataset of rendered rows
    eval_set: Optional[object]
    order: PromptOrder
    total_steps: int
    episode_datasets: dict = field(default_factory=dict)  # {name: EpisodeDataset}: rows that run as episodes


def load_run_data(config: GRPOConfig, reward_funcs: Sequence[Callable], rank: int, world: int) -> RunData:
    """Data, rewards and the tokenizer, each checked; also the base checkpoint's readability when qlora's
    re-quantization or loftq will need its 16-bit weights. No model is loaded here."""
    if config.reward_module:
        load_reward_module(config.reward_module)
    # checked and registered now (by folder name), weights loaded on first use
    register_reward_models(config.reward_model, dist_utils.device(), default_dtype(), config.trust_remote_code)
    registry = load_dataset_registry(config.dataset_config_path)
    episode_datasets = check_episode_datasets(config, registry, config.dataset_names + config.eval_dataset_names)
    train_rows, eval_rows = load_prompt_datasets(config.dataset_config_path, config.dataset_names,
                                                 config.effective_train_split_ratio, config.seed,
                                                 eval_names=config.eval_dataset_names,
                                                 max_images_per_prompt=config.max_images_per_prompt)
    routes, reward_kwargs = dataset_routes(registry, config.dataset_names + config.eval_dataset_names)
    rewards = RewardRouter(routes, reward_kwargs, extra_funcs=reward_funcs)
    model_path = resolve_model_path(config.model_name_or_path)
    try:
        tokenizer = load_tokenizer(model_path, config.trust_remote_code)
    except OSError as exc:  # not a folder, and not reachable on the hub
        raise ConfigError(f"--model_name_or_path: cannot load '{config.model_name_or_path}' ({exc}); give a "
                          f"local model folder, a reachable hub id, or '{EMBEDDED_MODEL}'") from exc
    vision = load_vision_processor(model_path, tokenizer, config, train_rows)
    if vision and episode_datasets:
        raise ConfigError(f"dataset(s) {', '.join(sorted(episode_datasets))}: multi-turn episodes (tools, "
                          "environments) are for text models; this model is a vision-language model")

    def render(rows, split):
        if vision:
            return render_vision_prompts(rows, vision, config.max_prompt_length, config.filter_overlong_prompts,
                                         split)
        rows, tools_by_source = prompts_with_tools(rows, tokenizer, episode_datasets)
        return render_prompts(rows, tokenizer, config.max_prompt_length, config.filter_overlong_prompts, split,
                              tools_by_source=tools_by_source)

    train_set = render(train_rows, "train")
    # held-out rows, then eval datasets; the first --eval_max_prompts of each dataset
    eval_set = first_rows_per_source(render(eval_rows, "eval"), config.eval_max_prompts) if len(eval_rows) else None
    if config.rollout_engine == "vllm" and config.vllm_tp > 1:
        check_tensor_parallel(model_path, config)
    check_checkpoint_weights(config, model_path)  # qlora's re-quantization and loftq read its 16-bit weights
    prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
    order = PromptOrder(len(train_set), prompts_per_step, config.seed, rank, world)
    if order.steps_per_epoch == 0:
        raise ConfigError(
            f"--per_device_train_batch_size: the training split has {len(train_set)} prompts, but one step "
            f"needs {prompts_per_step} per rank x {world} ranks; lower the batch size or "
            f"--gradient_accumulation_steps, or raise --train_split_ratio")
    total_steps = config.max_steps if config.max_steps > 0 else config.epochs * order.steps_per_epoch
    return RunData(model_path, tokenizer, vision, rewards, train_set, eval_set, order, total_steps, episode_datasets)


def initialize_deepspeed(policy, ds_config: dict, config: GRPOConfig, total_updates: int):
    """The DeepSpeed engine over the policy's trainable parameters, with AdamW and the learning-rate schedule unless
    the DeepSpeed config names its own optimizer."""
    import deepspeed

    trainable = [p for p in policy.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters; check --tuning_strategy and --lora_target_modules")
    optimizer = scheduler = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        scheduler = lr_schedule(optimizer, config, total_updates)
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=trainable, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config)
    # from_pretrained leaves the model in eval mode, where gradient checkpointing recomputes nothing and LoRA
    # dropout drops nothing; scoring passes that must not drop switch to eval mode themselves
    engine.train()
    return engine
