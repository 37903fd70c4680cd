"""Every option's list of accepted values and the named defaults several modules share, defined once."""

EMBEDDED_MODEL = "smollm2-135m-instruct"
STRATEGIES = ("qlora", "lora", "full")
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
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
REWARD_SCALES = ("group", "batch", "none")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "cispo", "sapo", "gmpo")
ROLLOUT_CORRECTIONS = ("token_truncate", "sequence_truncate", "sequence_mask", "icepop", "geometric_mask")
# the default band [low, high] of each masking correction (grpo.algorithm.rollout_correction)
ROLLOUT_MASK_BANDS = {"sequence_mask": (0.0, 3.0), "icepop": (0.5, 5.0), "geometric_mask": (0.999, 1.001)}
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
