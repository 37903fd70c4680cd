"""Every option's list of accepted values and the named defaults several modules share, defined once. The
algorithm's variants (losses, corrections, KL estimators, aggregations, ratio levels) are named in
grpo/algorithm/registry.py, where the math finds them too: --loss_type's choices are the registered policy losses,
--rollout_correction's the registered rollout corrections."""
import grpo.algorithm.loss_types  # noqa: F401 (registers the built-in policy losses)
import grpo.algorithm.rollout_correction  # noqa: F401 (registers the built-in rollout corrections; loads no torch)
from grpo.algorithm.registry import (ADVANTAGE_SCALES, AGGREGATIONS, DEFAULT_ROLLOUT_CORRECTION,  # noqa: F401
                                     IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, POLICY_LOSSES, ROLLOUT_CORRECTIONS)
from grpo.config.strategy import STRATEGIES  # noqa: F401 (--tuning_strategy's names, with their type)

EMBEDDED_MODEL = "smollm2-135m-instruct"
QLORA_INITS = ("zero", "loftq")
QLORA_QUANT_TYPES = ("nf4", "fp4")
QLORA_BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # the ones bitsandbytes' 4-bit kernels take
QLORA_BLOCK_SCALES = ("absmax", "mse")
# bitsandbytes' stock 4-bit base, as transformers loads it: blocks of 64, each scaled by its largest magnitude
BITSANDBYTES_BLOCK_SIZE, BITSANDBYTES_BLOCK_SCALE = 64, "absmax"
STOCK_4BIT_OPTIONS = f"--qlora_block_size {BITSANDBYTES_BLOCK_SIZE} --qlora_block_scale {BITSANDBYTES_BLOCK_SCALE}"
# grpo's: the base quantized again from the checkpoint in blocks of 32 with searched scales, which keeps more of the
# 16-bit model (docs/qlora.md, benchmarks/RESULTS.md)
DEFAULT_BLOCK_SIZE, DEFAULT_BLOCK_SCALE = 32, "mse"
REWARD_SCALES = ADVANTAGE_SCALES  # --scale_rewards: group_advantages' scales
LOSS_TYPES = POLICY_LOSSES.keys()  # the registered policy losses, in order; one registered later is a choice too
ROLLOUT_CORRECTION_NAMES = ROLLOUT_CORRECTIONS.keys()  # the registered rollout corrections, the same way
ROLLOUT_ENGINES = ("hf", "vllm")
ROLLOUT_MODES = ("colocate", "server")
ROLLOUT_WEIGHTS = ("auto", "merged", "adapter", "in_place")
SCHEDULERS = ("constant", "linear", "cosine")
SEQUENCE_PARALLEL_ROLLOUTS = ("share", "first")  # who of a sequence-parallel group generates
TRACKERS = ("wandb", "tensorboard", "trackio", "mlflow")  # --report_to's names (transformers'), beside 'none' / 'all'
# --max_tokens_per_micro_batch auto: this on CPU; on a GPU the most that fits, never more than this
MICRO_BATCH_TOKENS = 16384
DEFAULT_SPLIT_RATIO = 0.95
# a --lora_exclude_modules value with any of these is a regex; '.' is not one: module names are dotted paths
REGEX_CHARS = set("*+?[]()|^$\\{}")
