"""GRPOConfig's checks, apart from its schema (options.py): invalid values and combinations raise ConfigError naming
the flag, at construction, before any data or model is touched."""
from __future__ import annotations

import math
import os
import re

from grpo.config.choices import (AGGREGATIONS, BITSANDBYTES_BLOCK_SIZE, DEFAULT_BLOCK_SIZE, IMPORTANCE_SAMPLING_LEVELS,
                                 KL_ESTIMATORS, LOSS_TYPES, ROLLOUT_CORRECTIONS, ROLLOUT_MASK_BANDS, QLORA_BLOCK_SCALES, QLORA_BLOCK_SIZES, QLORA_INITS, QLORA_QUANT_TYPES,
                                 REWARD_SCALES, ROLLOUT_ENGINES, ROLLOUT_MODES, ROLLOUT_WEIGHTS, SCHEDULERS,
                                 SEQUENCE_PARALLEL_ROLLOUTS, STRATEGIES, TRACKERS)
from grpo.config.job import job_world_size
from grpo.config.sections.rollout import routing_replay_conflict
from grpo.config.strategy import Strategy
from grpo.algorithm.registry import POLICY_LOSSES, policy_losses_taking
from grpo.errors import ConfigError


def validate(cfg) -> None:
    """Every value and combination checked; a ConfigError names the flag and what to give instead. A number given
    as text (--max_tokens_per_micro_batch from the command line) becomes the number."""
    def need(cond: bool, flag: str, msg: str):
        if not cond:
            raise ConfigError(f"--{flag}: {msg}")

    need(cfg.tuning_strategy in STRATEGIES, "tuning_strategy",
         f"got '{cfg.tuning_strategy}', choose one of {', '.join(STRATEGIES)}")
    need(cfg.loss_aggregation in AGGREGATIONS, "loss_aggregation",
         f"got '{cfg.loss_aggregation}', choose one of {', '.join(AGGREGATIONS)}")
    need(cfg.scale_rewards in REWARD_SCALES, "scale_rewards",
         f"got '{cfg.scale_rewards}', choose one of {', '.join(REWARD_SCALES)}")
    need(cfg.lr_scheduler_type in SCHEDULERS, "lr_scheduler_type",
         f"got '{cfg.lr_scheduler_type}', choose one of {', '.join(SCHEDULERS)}")
    need(cfg.k_samples >= 2, "k_samples",
         f"must be at least 2 (got {cfg.k_samples}): group-relative advantages need a group to compare with")
    if cfg.strategy.has_adapter and not cfg.lora_adapter_path:
        need(cfg.lora_rank > 0, "lora_rank", f"must be > 0 with --tuning_strategy {cfg.tuning_strategy}")
        need(cfg.lora_alpha > 0, "lora_alpha", "must be > 0")
    need(0.0 <= cfg.lora_dropout < 1.0, "lora_dropout", "must be in [0, 1)")
    need(cfg.lora_adapter_path is None or cfg.strategy.has_adapter, "lora_adapter_path",
         "needs --tuning_strategy lora or qlora (an adapter cannot be continued with full fine-tuning)")
    need(bool(cfg.dataset_names), "dataset_names", "give at least one registered dataset name")
    need(cfg.train_split_ratio is None or 0.0 < cfg.train_split_ratio <= 1.0, "train_split_ratio",
         "must be in (0, 1]")
    twice = sorted({n for n in cfg.eval_dataset_names if cfg.eval_dataset_names.count(n) > 1})
    need(not twice, "eval_dataset_names", f"{', '.join(twice)} listed more than once; name each dataset once")
    both = [n for n in cfg.eval_dataset_names if n in cfg.dataset_names]
    need(not both, "eval_dataset_names",
         f"{', '.join(both)} is also in --dataset_names, so the model would be evaluated on rows it trains on; "
         f"register the held-out file as its own entry (as gsm8k_test is for gsm8k), or drop it here and hold "
         f"out part of it with --train_split_ratio")
    need(cfg.max_prompt_length > 0, "max_prompt_length", "must be > 0")
    need(cfg.max_images_per_prompt >= 1, "max_images_per_prompt", "must be >= 1")
    need(cfg.rollout_max_new_tokens > 0, "rollout_max_new_tokens", "must be > 0")
    need(cfg.max_seq_length >= cfg.max_prompt_length + cfg.rollout_max_new_tokens, "max_seq_length",
         f"must be >= --max_prompt_length + --rollout_max_new_tokens "
         f"({cfg.max_prompt_length} + {cfg.rollout_max_new_tokens}); got {cfg.max_seq_length}")
    need(cfg.epochs >= 1, "epochs", "must be >= 1")
    need(cfg.max_steps == -1 or cfg.max_steps > 0, "max_steps", "must be -1 (use --epochs) or > 0")
    need(cfg.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
    cfg.max_tokens_per_micro_batch = token_budget(cfg.max_tokens_per_micro_batch)
    need(cfg.logprob_chunk_tokens >= 0, "logprob_chunk_tokens",
         f"must be >= 0 (0: full logits); got {cfg.logprob_chunk_tokens}")
    need(not cfg.padding_free or cfg.logprob_chunk_tokens > 0, "padding_free",
         "needs --logprob_chunk_tokens > 0 (packed rows go through the hidden-state path)")
    need(cfg.learning_rate > 0, "learning_rate", "must be > 0")
    need(0.0 <= cfg.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
    need(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")
    need(cfg.temperature > 0, "temperature", "must be > 0 (use --eval_greedy for greedy eval)")
    need(0.0 < cfg.top_p <= 1.0, "top_p", "must be in (0, 1]")
    need(cfg.kl_beta >= 0, "kl_beta", "must be >= 0")
    need(0.0 < cfg.clip_epsilon_low < 1.0, "clip_epsilon_low", "must be in (0, 1)")
    need(cfg.clip_epsilon_high > 0, "clip_epsilon_high", "must be > 0")
    need(cfg.num_iterations >= 1, "num_iterations", "must be >= 1")
    need(cfg.kl_estimator in KL_ESTIMATORS, "kl_estimator",
         f"got '{cfg.kl_estimator}', choose one of {', '.join(KL_ESTIMATORS)}")
    need(not cfg.kl_in_reward or cfg.kl_beta > 0, "kl_in_reward",
         "needs --kl_beta > 0: it moves that penalty from the loss into the reward")
    need(cfg.entropy_coef >= 0, "entropy_coef", f"must be >= 0 (a bonus on entropy), got {cfg.entropy_coef}")
    need(cfg.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
         f"got '{cfg.importance_sampling_level}', choose one of {', '.join(IMPORTANCE_SAMPLING_LEVELS)}")
    need(cfg.clip_ratio_c is None or cfg.clip_ratio_c > 1.0, "clip_ratio_c",
         f"must be > 1 (the cap -A x c must lie above the clipped loss), got {cfg.clip_ratio_c}")
    need(cfg.max_generation_rounds >= 1, "max_generation_rounds", "must be >= 1")
    names = [reward_model_name(p) for p in cfg.reward_model]
    twice = sorted({n for n in names if names.count(n) > 1})
    need(not twice, "reward_model", f"two folders are named {', '.join(twice)}; reward models are registered "
                                    f"by folder name, so give each a distinct name")
    need(cfg.rollout_is_cap >= 1.0, "rollout_is_cap", "must be >= 1")
    _validate_loss_and_correction(cfg, need)
    need(cfg.vllm_tp >= 1, "vllm_tp", "must be >= 1")
    need(cfg.logprob_check_steps >= 1, "logprob_check_steps", "must be >= 1")
    world = job_world_size()
    need(cfg.rollout_engine in ROLLOUT_ENGINES, "rollout_engine",
         f"got '{cfg.rollout_engine}', choose one of {', '.join(ROLLOUT_ENGINES)}")
    need(cfg.rollout_mode in ROLLOUT_MODES, "rollout_mode",
         f"got '{cfg.rollout_mode}', choose one of {', '.join(ROLLOUT_MODES)}")
    if cfg.rollout_mode == "server":
        need(1 <= cfg.rollout_gpus < world, "rollout_gpus",
             f"server mode needs at least 1 rollout rank and at least 1 training rank: got {cfg.rollout_gpus} of "
             f"the job's {world} ranks (start more with `deepspeed --num_gpus N`, or use --rollout_mode colocate)")
        need(cfg.rollout_gpus % cfg.vllm_tp == 0, "vllm_tp",
             f"must divide --rollout_gpus {cfg.rollout_gpus}; got {cfg.vllm_tp}")
    else:
        need(cfg.rollout_gpus == 0, "rollout_gpus", "is for --rollout_mode server (colocate: every rank generates)")
        need(not cfg.async_rollout, "async_rollout",
             "needs --rollout_mode server (colocated engines share the GPU with training, so nothing overlaps)")
        need(cfg.max_staleness is None, "max_staleness",
             "needs --rollout_mode server (colocated engines share the GPU with training, so nothing overlaps)")
        need(world % cfg.vllm_tp == 0, "vllm_tp",
             f"must divide the number of ranks (WORLD_SIZE={world}); got {cfg.vllm_tp}")
    _validate_sequence_parallel(cfg, need, world)
    need(cfg.gpu_memory_gib is None or cfg.gpu_memory_gib > 0, "gpu_memory_gib", "must be > 0 (GiB)")
    need(cfg.rollout_weights in ROLLOUT_WEIGHTS, "rollout_weights",
         f"got '{cfg.rollout_weights}', choose one of {', '.join(ROLLOUT_WEIGHTS)}")
    if cfg.rollout_weights == "adapter":
        need(cfg.strategy.has_adapter, "rollout_weights",
             "adapter is for --tuning_strategy lora / qlora (a full run has no adapter): use merged")
        need(cfg.rollout_engine == "vllm", "rollout_weights",
             "adapter needs --rollout_engine vllm (the HF engine samples the live policy, or on a rollout rank "
             "takes merged weights): use merged")
        need(not (cfg.strategy.four_bit_base and cfg.vllm_tp > 1), "rollout_weights",
             f"adapter with qlora runs the 4-bit base on one GPU per engine (vLLM 0.26 cannot split a pre-quantized "
             f"model): use --vllm_tp 1 or --rollout_weights merged (got --vllm_tp {cfg.vllm_tp})")
        need(cfg.qlora_init != "loftq" or not cfg.strategy.four_bit_base, "rollout_weights",
             "adapter cannot carry --qlora_init loftq's rounding correction: use merged")
    if cfg.rollout_weights == "in_place":
        need(cfg.strategy.sixteen_bit_adapter, "rollout_weights",
             "in_place merges a LoRA adapter into a 16-bit base the trainer shares with vLLM: it is for --tuning_strategy "
             "lora (qlora: adapter or merged)")
        need(cfg.rollout_engine == "vllm" and cfg.rollout_mode == "colocate" and cfg.vllm_tp == 1, "rollout_weights",
             "in_place shares the base between the trainer and a colocated vLLM engine on the same GPU: it needs "
             "--rollout_engine vllm, --rollout_mode colocate and --vllm_tp 1 (else use adapter or merged)")
    need(cfg.max_staleness is None or cfg.max_staleness >= 1, "max_staleness",
         f"must be at least 1 (1 is --async_rollout; leave it unset to generate every step's rollouts on the step's "
         f"policy); got {cfg.max_staleness}")
    need(cfg.rollout_segment_tokens >= 0, "rollout_segment_tokens", "must be >= 0 (0: whole completions)")
    need(cfg.partial_rollouts in ("continue", "restart"), "partial_rollouts",
         f"got '{cfg.partial_rollouts}', choose continue or restart")
    need(cfg.rollout_segment_tokens == 0 or cfg.rollout_staleness >= 1, "rollout_segment_tokens",
         "streams rollouts: it needs --max_staleness (or --async_rollout)")
    need(cfg.rollout_segment_tokens == 0 or cfg.vllm_tp == 1, "rollout_segment_tokens",
         "needs --vllm_tp 1 (the ranks of a tensor-parallel engine must generate the same pieces in step, and each "
         "rank takes new prompts as they come)")
    if cfg.routing_replay:
        conflict = routing_replay_conflict(cfg)
        need(conflict is None, "routing_replay", f"{conflict}; drop --routing_replay (or that option)")
    need(cfg.vllm_gpu_memory_utilization is None or 0.0 < cfg.vllm_gpu_memory_utilization < 1.0,
         "vllm_gpu_memory_utilization", "must be in (0, 1)")
    kv_cache = cfg.vllm_kv_cache  # raises on a value that is neither auto, share nor a number of GiB
    need(not (kv_cache == "auto" and cfg.rollout_mode == "server"), "vllm_kv_cache_gib",
         "auto is for colocated engines (they give the memory back to training); rollout ranks of server mode "
         "only generate: leave it unset (share) or give a number of GiB")
    need(cfg.save_steps >= 0, "save_steps", "must be >= 0")
    need(cfg.save_total_limit >= 1, "save_total_limit", "must be >= 1")
    need(cfg.eval_steps >= 0, "eval_steps", "must be >= 0")
    need(cfg.logging_steps >= 1, "logging_steps", "must be >= 1")
    _check_report_to(cfg, need)
    need(cfg.hub_strategy in ("end", "every_save"), "hub_strategy",
         f"got '{cfg.hub_strategy}', choose one of end, every_save")
    need(cfg.ddp_timeout_minutes > 0, "ddp_timeout_minutes",
         f"must be > 0 (minutes; got {cfg.ddp_timeout_minutes}); raise it when one step (a long rollout, "
         f"a large checkpoint save) can keep some ranks waiting longer than that")
    need(cfg.eval_max_prompts == -1 or cfg.eval_max_prompts >= 1, "eval_max_prompts",
         f"must be >= 1, or -1 for all prompts; got {cfg.eval_max_prompts}")
    need(cfg.qlora_skip_modules is None or cfg.strategy is Strategy.QLORA, "qlora_skip_modules",
         "needs --tuning_strategy qlora")
    need(cfg.qlora_skip_modules is None or bool(cfg.qlora_skip_list), "qlora_skip_modules",
         "give comma-separated module names, e.g. v_proj,down_proj")
    if cfg.lora_exclude_modules is not None:
        _validate_lora_exclude(cfg, need)
    _validate_episodes(cfg, need)
    need(cfg.vllm_sleep_level in (None, 0, 1, 2), "vllm_sleep_level", f"got {cfg.vllm_sleep_level}, choose 0, 1 or 2")
    need(cfg.qlora_quant_type in QLORA_QUANT_TYPES, "qlora_quant_type",
         f"got '{cfg.qlora_quant_type}', choose one of {', '.join(QLORA_QUANT_TYPES)}")
    need(cfg.qlora_quant_type == "nf4" or cfg.strategy is Strategy.QLORA, "qlora_quant_type",
         "needs --tuning_strategy qlora")
    need(cfg.qlora_block_size in QLORA_BLOCK_SIZES, "qlora_block_size",
         f"got {cfg.qlora_block_size}, choose one of {', '.join(map(str, QLORA_BLOCK_SIZES))}")
    # the stock values pass too: a lora or full run's config saved before the defaults changed holds them
    need(cfg.qlora_block_size in (DEFAULT_BLOCK_SIZE, BITSANDBYTES_BLOCK_SIZE) or cfg.strategy is Strategy.QLORA,
         "qlora_block_size", "needs --tuning_strategy qlora")
    need(cfg.qlora_block_scale in QLORA_BLOCK_SCALES, "qlora_block_scale",
         f"got '{cfg.qlora_block_scale}', choose one of {', '.join(QLORA_BLOCK_SCALES)}")
    need(cfg.qlora_init in QLORA_INITS, "qlora_init",
         f"got '{cfg.qlora_init}', choose one of {', '.join(QLORA_INITS)}")
    if cfg.qlora_init == "loftq":
        need(cfg.strategy is Strategy.QLORA, "qlora_init", "loftq needs --tuning_strategy qlora")
        need(not cfg.lora_adapter_path, "qlora_init",
             "loftq sets a new adapter; a continued one (--lora_adapter_path) keeps its own weights: drop one")


def _validate_sequence_parallel(cfg, need, world: int) -> None:
    """--sequence_parallel_size: what DeepSpeed's Ulysses attention (ALST) can shard, and what it cannot."""
    sp = cfg.sequence_parallel_size
    need(sp >= 1, "sequence_parallel_size", f"must be >= 1; got {sp}")
    need(cfg.sequence_parallel_rollout in SEQUENCE_PARALLEL_ROLLOUTS, "sequence_parallel_rollout",
         f"got '{cfg.sequence_parallel_rollout}', choose one of {', '.join(SEQUENCE_PARALLEL_ROLLOUTS)}")
    if sp <= 1:
        return
    need(world % sp == 0, "sequence_parallel_size",
         f"must divide the number of training ranks (WORLD_SIZE={world}); got {sp}: start a multiple of {sp} ranks "
         f"(deepspeed --num_gpus)")
    need(cfg.rollout_mode == "colocate", "sequence_parallel_size",
         "works with --rollout_mode colocate only (server mode's rollout ranks sit outside the training world the "
         "sequence-parallel groups are cut from); drop --rollout_mode server")
    # both engines work: the HF engine generates with the training model, each rank over whole sequences, with the
    # attention DeepSpeed wrapped put back for the time of generate (sequence_parallel.unsharded_attention)
    need(not cfg.padding_free, "sequence_parallel_size",
         "cannot be combined with --padding_free (the sharded attention takes one causal sequence per row); drop "
         "--padding_free")


def _validate_loss_and_correction(cfg, need) -> None:
    """--loss_type and its settings, and --rollout_correction's band."""
    need(cfg.loss_type in LOSS_TYPES, "loss_type", f"got '{cfg.loss_type}', choose one of {', '.join(LOSS_TYPES)}")
    need(cfg.sapo_tau_pos > 0 and cfg.sapo_tau_neg > 0, "sapo_tau_pos",
         f"SAPO's temperatures must be > 0, got --sapo_tau_pos {cfg.sapo_tau_pos} --sapo_tau_neg {cfg.sapo_tau_neg}")
    loss = POLICY_LOSSES[cfg.loss_type]
    need(cfg.importance_sampling_level == "token" or loss.sequence_ratio, "importance_sampling_level",
         f"'sequence' goes with --loss_type {' or '.join(policy_losses_taking('sequence_ratio'))}; {cfg.loss_type} "
         f"takes token ratios (gmpo forms its own geometric mean): drop --importance_sampling_level or choose "
         f"another loss")
    need(cfg.clip_ratio_c is None or loss.dual_clip, "clip_ratio_c",
         f"the dual clip applies to --loss_type {' / '.join(policy_losses_taking('dual_clip'))} only; drop it with "
         f"--loss_type {cfg.loss_type}")
    mode = cfg.rollout_correction
    need(mode is None or mode in ROLLOUT_CORRECTIONS, "rollout_correction",
         f"got '{mode}', choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    need(mode is None or cfg.rollout_is_correction is not None or cfg.is_correction, "rollout_correction",
         f"'{mode}' corrects only with --rollout_is_correction (on by default with --async_rollout / --max_staleness "
         f"only): add --rollout_is_correction true")
    given = [name for name in ("rollout_mask_low", "rollout_mask_high") if getattr(cfg, name) is not None]
    for name in given:
        need(mode in ROLLOUT_MASK_BANDS, name,
             f"sets the band of --rollout_correction {' / '.join(ROLLOUT_MASK_BANDS)}; the truncating ones "
             f"(--rollout_correction {mode or 'token_truncate'}) use --rollout_is_cap")
    if mode in ROLLOUT_MASK_BANDS:
        low = ROLLOUT_MASK_BANDS[mode][0] if cfg.rollout_mask_low is None else cfg.rollout_mask_low
        high = ROLLOUT_MASK_BANDS[mode][1] if cfg.rollout_mask_high is None else cfg.rollout_mask_high
        need(0.0 <= low < high, "rollout_mask_low" if cfg.rollout_mask_low is not None else "rollout_mask_high",
             f"the band needs 0 <= low < high (ratios), got {low} .. {high}")


def _validate_episodes(cfg, need) -> None:
    need(cfg.max_turns >= 1, "max_turns", f"must be >= 1, got {cfg.max_turns}")
    for name in ("tool_call_reward", "tool_failure_penalty"):
        value = getattr(cfg, name)
        need(value is None or (math.isfinite(value) and value >= 0), name,
             f"must be a number >= 0, got {value}" + (" (a penalty is given as its size: 0.5 scores a failed call "
                                                       "-0.5)" if name == "tool_failure_penalty" else ""))
    need(cfg.warm_start_steps >= 0, "warm_start_steps", f"must be >= 0, got {cfg.warm_start_steps}")
    need(cfg.max_episode_tokens is None or cfg.max_episode_tokens >= 1, "max_episode_tokens",
         f"must be >= 1, got {cfg.max_episode_tokens}")
    need(cfg.max_prompt_length + cfg.episode_token_budget <= cfg.max_seq_length, "max_episode_tokens",
         f"the prompt and an episode must fit --max_seq_length: --max_prompt_length {cfg.max_prompt_length} + "
         f"--max_episode_tokens {cfg.episode_token_budget} > {cfg.max_seq_length}; lower it or raise "
         "--max_seq_length")
    need(cfg.tool_module is None or bool(cfg.tool_module.strip()), "tool_module", "give a Python file's path")
    need(cfg.agent_module is None or bool(cfg.agent_module.strip()), "agent_module", "give a Python file's path")
    need(math.isfinite(cfg.agent_timeout_s) and cfg.agent_timeout_s > 0, "agent_timeout_s",
         f"must be a number of seconds > 0, got {cfg.agent_timeout_s}")
    need(cfg.agent_max_concurrency >= 1, "agent_max_concurrency", f"must be >= 1, got {cfg.agent_max_concurrency}")
    need(cfg.agent_on_mismatch in ("truncate", "drop"), "agent_on_mismatch",
         f"got '{cfg.agent_on_mismatch}', choose truncate or drop")


def _validate_lora_exclude(cfg, need) -> None:
    need(cfg.strategy.has_adapter, "lora_exclude_modules",
         "needs --tuning_strategy lora or qlora")
    need(not cfg.lora_adapter_path, "lora_exclude_modules",
         "does not apply with --lora_adapter_path (the continued adapter's own config decides what it adapts)")
    need(bool(cfg.lora_exclude_modules.strip().strip(",")), "lora_exclude_modules",
         "give module names (comma-separated) or a regex")
    if isinstance(cfg.lora_exclude, str):
        try:
            re.compile(cfg.lora_exclude)
        except re.error as exc:
            need(False, "lora_exclude_modules", f"'{cfg.lora_exclude}' is read as a regex (it has regex "
                                                f"characters) but does not compile: {exc}")


def reward_model_name(path: str) -> str:
    """The reward name a --reward_model folder registers under: its folder name."""
    return os.path.basename(os.path.normpath(path))


def token_budget(value) -> "str | int":
    """--max_tokens_per_micro_batch as "auto" or a whole number of tokens >= 0 (text from the command line or a
    JSON file becomes the number)."""
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        tokens = int(text)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ConfigError(f"--max_tokens_per_micro_batch: got {value!r}; give auto (the most that fits the GPU, "
                          f"16384 on CPU), a number of tokens (e.g. 8192), or 0 (micro-batches of "
                          f"--per_device_train_batch_size prompts)")
    return tokens


def _check_report_to(cfg, need) -> None:
    """--report_to: tracker names (a list, or one string, space or comma separated; lower-cased here), or 'none' /
    'all' alone ('none' becomes the empty list). Whether each is installed is checked when the run starts."""
    parts = [cfg.report_to] if isinstance(cfg.report_to, str) else list(cfg.report_to or [])
    names = [n.strip().lower() for part in parts for n in str(part).split(",") if n.strip()]
    unknown = [n for n in names if n not in TRACKERS and n not in ("none", "all")]
    need(not unknown, "report_to", f"unknown tracker {', '.join(repr(n) for n in unknown)}; choose from "
                                   f"{', '.join(TRACKERS)}, or 'none', or 'all' (each one installed)")
    need(len(names) <= 1 or not {"none", "all"} & set(names), "report_to",
         f"'none' and 'all' stand alone (got {' '.join(names)})")
    cfg.report_to = [] if names == ["none"] else names
