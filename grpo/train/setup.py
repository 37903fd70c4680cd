"""What a run needs before its first step, in the order that keeps errors cheap: the options and the output folder,
then rewards, the dataset registry and the data, then the tokenizer (every error so far comes before DeepSpeed is
imported or a model loads), then DeepSpeed.

Heavy libraries load inside the functions that need them, so `train_grpo.py` refuses a bad flag, registry entry,
data file or reward in seconds: torch and transformers only once the inputs are known good, DeepSpeed (and its
CPU communication op) only after `prepare_run` returned.
"""
from __future__ import annotations

import importlib.util
import logging
import logging.handlers
import os
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from grpo.checkpoint.layout import earlier_results, list_checkpoints, resume_source_problem
from grpo.config.options import EMBEDDED_MODEL, GRPOConfig
from grpo.errors import ConfigError, GRPOError
from grpo.runtime.roles import check_node_layout, enter_training_world, launcher_rank_and_world, rollout_ranks_of

logger = logging.getLogger("grpo")


def check_run_can_start(config: GRPOConfig) -> None:
    """Refusals that need no data and no model: the engine's requirements, the output folder, the resume."""
    if config.num_iterations > 1 and config.uses_lora and config.lora_dropout > 0:
        logger.warning(f"--num_iterations {config.num_iterations} with --lora_dropout {config.lora_dropout}: each "
                       "update draws new dropout masks, so the later updates' ratios to the first one's log-probs "
                       "carry dropout noise and are clipped as if the policy had moved; --lora_dropout 0 avoids it")
    if config.use_wandb and importlib.util.find_spec("wandb") is None:
        # the guide's command asks for wandb: run without it rather than refuse, and say so at the start
        logger.warning("--use_wandb: wandb is not installed, so metrics go to metrics.jsonl, train.log and "
                       "training_curves.png only (pip install .[wandb] to log them to Weights & Biases)")
        config.resolve(use_wandb=False)
    check_node_layout(config)  # several nodes: each vLLM tensor-parallel group within one node
    if not config.resume_from_checkpoint and not config.overwrite_output_dir:
        check_no_earlier_run(config.output_dir)
    if config.resume_from_checkpoint:
        from grpo.checkpoint.resume import check_resume_keeps_policy, saved_config_path

        problem = resume_source_problem(config.resume_from_checkpoint, config.output_dir)
        if problem is not None:
            raise ConfigError(problem)
        check_resume_keeps_policy(saved_config_path(config.resume_from_checkpoint, config.output_dir), config)


def check_no_earlier_run(output_dir: str) -> None:
    """A fresh run never replaces what an earlier run left in its folder: checkpoints, a trained model or metrics
    stop it, naming them, unless --overwrite_output_dir (or --resume_from_checkpoint) says what to do with them."""
    found = earlier_results(output_dir)
    if list_checkpoints(output_dir):
        raise ConfigError(f"--output_dir {output_dir} holds checkpoints of an earlier run; continue it "
                          f"with --resume_from_checkpoint latest, or start over with --overwrite_output_dir")
    if found:
        raise ConfigError(f"--output_dir {output_dir} holds the results of an earlier run ({', '.join(found)}), "
                          f"which a new run would replace (it saved no checkpoint to continue from); give another "
                          f"--output_dir, or start over there with --overwrite_output_dir")


def log_failed_start(output_dir: str, exc: BaseException) -> None:
    """Write why the run stopped before its first step into output_dir/train.log, when this run logs there (the
    console shows the error as the caller reports it: written to the file only)."""
    path = os.path.abspath(os.path.join(output_dir, "train.log"))
    handlers = [h for h in logger.handlers if isinstance(h, logging.FileHandler) and h.baseFilename == path]
    if not handlers:
        return
    text = f"the run stopped before its first step: {exc}"
    if not isinstance(exc, GRPOError):
        text = f"the run stopped before its first step: {type(exc).__name__}: {exc}\n" + "".join(
            traceback.format_exception(exc)).rstrip()
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, text, None, None)
    for handler in handlers:
        handler.handle(record)


def check_engine_available(config: GRPOConfig) -> None:
    """vLLM installed and a GPU to run it, for --rollout_engine vllm (checked once the model's source is known good)."""
    if config.rollout_engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--rollout_engine vllm needs vLLM: pip install .[vllm] (tested with vllm 0.26.0)")
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--rollout_engine vllm needs a GPU; use --rollout_engine hf on CPU")


def load_rewards(config: GRPOConfig, reward_funcs: Sequence[Callable] = ()):
    """The reward router for the named datasets: the user's reward module, reward models, the registry's entries
    and every reward they name, checked before any data file is read (torch only for --reward_model)."""
    from grpo.data.registry import check_dataset_names, dataset_routes, load_dataset_registry, tool_datasets
    from grpo.rewards import RewardRouter, load_reward_module
    from grpo.rewards.tool_use import tool_reward_overrides

    if config.reward_module:
        load_reward_module(config.reward_module)
    if config.reward_model:
        from grpo.model.attention import attention_implementation
        from grpo.rewards.reward_model import register_reward_models
        from grpo.runtime import distributed as dist_utils
        from grpo.runtime.deepspeed_config import default_dtype

        # checked and registered now (by folder name), weights loaded on first use; a soft-capped one with the
        # attention that keeps its cap, as the policy
        register_reward_models(config.reward_model, dist_utils.device(), default_dtype(), config.trust_remote_code,
                               attention=attention_implementation)
    registry = load_dataset_registry(config.dataset_config_path)
    check_dataset_names(registry, config.dataset_config_path, config.dataset_names, config.eval_dataset_names,
                        config.effective_train_split_ratio)
    names = config.dataset_names + config.eval_dataset_names
    routes, reward_kwargs = dataset_routes(registry, names)
    routes, reward_kwargs = tool_reward_overrides(routes, reward_kwargs, tool_datasets(registry, names),
                                                  config.tool_call_reward, config.tool_failure_penalty)
    return RewardRouter(routes, reward_kwargs, extra_funcs=reward_funcs)


@dataclass
class RunData:
    """The run's prompts (rendered to token ids), their order on this rank, what scores them, and the DeepSpeed
    config."""
    model_path: str
    tokenizer: object
    vision: Optional[object]     # grpo.model.vision.VisionProcessor for a vision-language model
    rewards: object              # grpo.rewards.RewardRouter
    train_set: object            # datasets.Dataset of rendered rows
    eval_set: Optional[object]
    order: object                # grpo.data.sampler.PromptOrder
    total_steps: int
    ds_config: dict
    episode_datasets: dict = field(default_factory=dict)  # {name: EpisodeDataset}: rows that run as episodes
    demonstrations: Optional[object] = None  # rendered rows with the model's turns (--warm_start_steps)
    memory_plan: Optional[object] = None  # grpo.memory.plan.MemoryPlan: every automatic memory choice of the run
    agent_datasets: dict = field(default_factory=dict)  # {name: AgentDataset}: rows that agents play
    # the run's options as resolved here (the caller's GRPOConfig stays as it was); GRPOTrainer freezes them once the
    # ranks agreed on the memory plan
    config: Optional[GRPOConfig] = None
    # {name: EpisodeDataset} of the datasets whose demonstrations are tool episodes (--warm_start_datasets too)
    demonstration_datasets: dict = field(default_factory=dict)


def prepare_run(config: GRPOConfig, reward_funcs: Sequence[Callable] = ()) -> RunData:
    """Every check and load that needs no process group and no model, cheapest first: the options and the output
    folder, rewards and the registry, the data files, the DeepSpeed config, the tokenizer and the prompts. Once
    they all passed, makes the run's folder and starts console logging (and train.log) for this rank.

    The run resolves its options on its own copy of `config` (RunData.config): what depends on the machine, the data
    and the model (CPU sizing, a tracker that is not installed, the model's positions, routing replay) is set there
    with GRPOConfig.resolve, once."""
    from grpo.runtime.console_log import setup_console_logging

    config = config.thawed()  # the run's own options, resolved below; the caller's stay as given
    enter_training_world(rollout_ranks_of(config))  # server mode: the rollout ranks are not in this world
    rank, world = launcher_rank_and_world()
    setup_console_logging(rank == 0)
    early = logging.handlers.BufferingHandler(capacity=10_000)  # what is said before train.log exists goes in it
    logger.addHandler(early)
    try:
        check_run_can_start(config)
        rewards = load_rewards(config, reward_funcs)
        data = load_run_data(config, rewards, rank, world)
    finally:
        logger.removeHandler(early)
    data.config = config
    # the run's folder, once every check passed: a refused start leaves nothing behind
    os.makedirs(config.output_dir, exist_ok=True)
    if config.log_to_file:
        setup_console_logging(rank == 0, os.path.join(config.output_dir, "train.log"), earlier=early.buffer)
    return data


def load_run_data(config: GRPOConfig, rewards, rank: int, world: int) -> RunData:
    """Data, the DeepSpeed config and the tokenizer, each checked; also the base checkpoint's readability when
    qlora's re-quantization or loftq will need its 16-bit weights. No model is loaded here."""
    from grpo.data import load_dataset_registry, load_prompt_datasets
    from grpo.train.agent_setup import run_agent_datasets
    from grpo.data.episode_datasets import check_episode_datasets, prompts_with_tools, run_episode_datasets

    registry = load_dataset_registry(config.dataset_config_path)
    episode_datasets = run_episode_datasets(config, registry)
    agent_datasets = run_agent_datasets(config, registry)  # --agent_module imported, every agent found
    train_rows, eval_rows = load_prompt_datasets(config.dataset_config_path, config.dataset_names,
                                                 config.effective_train_split_ratio, config.seed,
                                                 eval_names=config.eval_dataset_names,
                                                 max_images_per_prompt=config.max_images_per_prompt)
    import torch

    from grpo.config.cpu_sizing import size_for_cpu
    from grpo.runtime.deepspeed_config import default_dtype, load_deepspeed_config
    from grpo.runtime.quiet_output import name_cpu_accelerator, quiet_progress_bars

    size_for_cpu(config, on_cpu=not torch.cuda.is_available())  # before anything is sized by those options
    name_cpu_accelerator()  # before the model code may import DeepSpeed
    quiet_progress_bars()  # off a terminal: no bars of weight loading in a log file

    ds_config = load_deepspeed_config(config, use_bf16=default_dtype() == torch.bfloat16)
    check_sequence_parallel_zero(config, ds_config)
    from grpo.data import first_rows_per_source, render_prompts
    from grpo.model.base_weights import check_checkpoint_weights
    from grpo.model.embedded import resolve_model_path
    from grpo.model.loading import load_tokenizer
    from grpo.model.vision import load_vision_processor, render_vision_prompts
    from grpo.rollout.engines import check_tensor_parallel

    from grpo.model.model_source import check_model_source, check_positions

    check_model_source(config.model_name_or_path)  # a folder, a cached hub id or one the hub has, in seconds
    check_engine_available(config)
    model_path = resolve_model_path(config.model_name_or_path)
    try:
        tokenizer = load_tokenizer(model_path, config.trust_remote_code)
    except OSError as exc:  # not a folder, and not reachable on the hub
        raise ConfigError(f"--model_name_or_path: cannot load '{config.model_name_or_path}' ({exc}); give a "
                          f"local model folder, a reachable hub id, or '{EMBEDDED_MODEL}'") from exc
    vision = load_vision_processor(model_path, tokenizer, config, train_rows)
    if vision and (episode_datasets or agent_datasets):
        raise ConfigError(f"dataset(s) {', '.join(sorted({**episode_datasets, **agent_datasets}))}: multi-turn "
                          "episodes (tools, environments, agents) are for text models; this model is a "
                          "vision-language model")

    def render(rows, split, with_tools=episode_datasets):
        if vision:
            return render_vision_prompts(rows, vision, config.max_prompt_length, config.filter_overlong_prompts,
                                         split)
        rows, tools_by_source = prompts_with_tools(rows, tokenizer, with_tools)
        return render_prompts(rows, tokenizer, config.max_prompt_length, config.filter_overlong_prompts, split,
                              tools_by_source=tools_by_source)

    train_set = render(train_rows, "train")
    demonstrations, demonstration_datasets = None, dict(episode_datasets)
    if vision and config.sequence_parallel_size > 1:
        raise ConfigError(f"--sequence_parallel_size {config.sequence_parallel_size}: the sharded forward is for text "
                          "models; this model is a vision-language model: use --sequence_parallel_size 1")
    if config.warm_start_steps and vision:
        raise ConfigError("--warm_start_steps: demonstrations are for text models (their turns are laid out as text "
                          "episodes); this model is a vision-language model: drop --warm_start_steps")
    if config.warm_start_steps:  # rendered like the training prompts, tools included
        from grpo.data import load_demonstrations

        warm_names = config.warm_start_datasets or config.dataset_names
        # --warm_start_datasets beyond the run's: their demonstrations are laid out as their own tool episodes
        others = [name for name in warm_names if name not in episode_datasets and registry.get(name) is not None
                  and (registry[name].tools or registry[name].environment)]
        if others:
            demonstration_datasets.update(check_episode_datasets(config, registry, others))
        demonstrations = render(load_demonstrations(config.dataset_config_path, warm_names), "demonstrations",
                                demonstration_datasets)
    # held-out rows, then eval datasets; the first --eval_max_prompts of each dataset
    eval_set = first_rows_per_source(render(eval_rows, "eval"), config.eval_max_prompts) if len(eval_rows) else None
    if config.rollout_engine == "vllm" and config.vllm_tp > 1:
        check_tensor_parallel(model_path, config)
    check_checkpoint_weights(config, model_path)  # qlora's re-quantization and loftq read its 16-bit weights
    check_positions(model_path, config)  # vLLM would refuse a longer --max_seq_length after loading the model
    # --routing_replay: on for a mixture of experts by default
    resolve_model_routing_replay(config, model_path, agent_datasets)
    multi_turn = {**episode_datasets, **agent_datasets}  # rows whose completions hold turns the engine did not sample
    memory_plan = plan_for_run(config, model_path, multi_turn)  # refused here if it does not fit
    prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
    order = prompt_order(len(train_set), prompts_per_step, config, rank, world)
    if order.steps_per_epoch == 0:
        raise ConfigError(
            f"--per_device_train_batch_size: the training split has {len(train_set)} prompts, but one step "
            f"needs {prompts_per_step} per rank x {order.world} data-parallel ranks; lower the batch size or "
            f"--gradient_accumulation_steps, or raise --train_split_ratio")
    total_steps = config.max_steps if config.max_steps > 0 else config.epochs * order.steps_per_epoch
    return RunData(model_path, tokenizer, vision, rewards, train_set, eval_set, order, total_steps, ds_config,
                   episode_datasets, demonstrations, memory_plan, agent_datasets=agent_datasets,
                   demonstration_datasets=demonstration_datasets)


def resolve_model_routing_replay(config: GRPOConfig, model_path: str, agent_datasets: dict) -> bool:
    """--routing_replay for this model (grpo.model.routing_options), from its config.json; datasets that agents
    play do not carry the routing yet."""
    from transformers import AutoConfig

    from grpo.model.routing_options import resolve_routing_replay

    model_config = AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
    return resolve_routing_replay(config, model_config, agent_datasets)


def longest_completion(config: GRPOConfig, episode_datasets: dict) -> int:
    """The longest a training completion may be: a multi-turn episode's token budget where a training dataset runs
    as episodes, else --rollout_max_new_tokens."""
    episodes = any(name in episode_datasets for name in config.dataset_names)
    return config.episode_token_budget if episodes else config.rollout_max_new_tokens


def plan_for_run(config: GRPOConfig, model_path: str, episode_datasets: dict):
    """The run's memory plan, from the model's config.json and this rank's GPU, before any weight loads: a
    ConfigError with what fits where it does not fit (grpo.memory)."""
    from grpo.memory.planner import checked_plan

    return checked_plan(config, model_path, longest_completion(config, episode_datasets))


def prompt_order(num_rows: int, prompts_per_step: int, config: GRPOConfig, rank: int, world: int):
    """Prompts are split by data-parallel rank: the ranks of one sequence-parallel group train on the same prompts."""
    from grpo.data.sampler import PromptOrder
    from grpo.runtime.sequence_parallel import data_parallel_rank, data_parallel_world

    sp = config.sequence_parallel_size
    return PromptOrder(num_rows, prompts_per_step, config.seed, data_parallel_rank(rank, sp),
                       data_parallel_world(world, sp))


def check_sequence_parallel_zero(config: GRPOConfig, ds_config: dict) -> None:
    """--sequence_parallel_size N > 1 under ZeRO-3 needs its reduce_scatter (the default), the one gradient
    reduction whose scale grpo.runtime.sequence_parallel.group_gradient_scale accounts for: without it DeepSpeed
    0.19.8 averages a bucket over world / N or over world depending on the bucket's size."""
    from grpo.runtime.deepspeed_config import zero_stage

    zero = ds_config.get("zero_optimization", {})
    if config.sequence_parallel_size > 1 and zero_stage(ds_config) == 3 and zero.get("reduce_scatter", True) is False:
        raise ConfigError(f"--sequence_parallel_size {config.sequence_parallel_size} under ZeRO-3 needs "
                          "zero_optimization.reduce_scatter true (DeepSpeed's default) in the DeepSpeed config: "
                          "without it the gradient's scale depends on the bucket sizes; remove \"reduce_scatter\": "
                          "false")


def initialize_deepspeed(policy, ds_config: dict, config: GRPOConfig, total_updates: int):
    """The DeepSpeed engine over the policy's trainable parameters, with AdamW and the learning-rate schedule unless
    the DeepSpeed config names its own optimizer; with --sequence_parallel_size N > 1 the model's attention is
    DeepSpeed's Ulysses attention and the engine gets its mpu (groups of N ranks sharing each sequence)."""
    import deepspeed
    import torch

    from grpo.runtime import distributed as dist_utils
    from grpo.runtime.sequence_parallel import layout_line, register_ulysses

    from grpo.train.update import lr_schedule

    trainable = [p for p in policy.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters; check --tuning_strategy and --lora_target_modules")
    optimizer = scheduler = None
    if "optimizer" not in ds_config:
        optimizer = torch.optim.AdamW(trainable, lr=config.learning_rate, weight_decay=config.weight_decay)
        scheduler = lr_schedule(optimizer, config, total_updates)
    mpu = register_ulysses(policy, config.sequence_parallel_size)
    if mpu is not None:
        logger.info(layout_line(dist_utils.world_size(), config.sequence_parallel_size))
    engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=trainable, optimizer=optimizer,
                                           lr_scheduler=scheduler, config=ds_config, mpu=mpu)
    # from_pretrained leaves the model in eval mode, where gradient checkpointing recomputes nothing and LoRA
    # dropout drops nothing; scoring passes that must not drop switch to eval mode themselves
    engine.train()
    return engine
