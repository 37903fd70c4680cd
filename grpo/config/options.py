"""GRPOConfig: the one source of every option (its schema). CLI flags of train_grpo.py are generated from it (cli.py).

Each field's ``metadata["help"]`` is its one-line help; ``FLAG_GROUPS`` maps each field to the section it is
listed under (--help, docs/flags.md). Invalid values and combinations raise ConfigError naming the flag, at
construction (validation.py). The guide's spellings of merged options (--learning_rate_lora, --use_kl_penalty,
--use_vllm_rollout, --vllm_mode) are options too, folded into today's at construction (guide_spellings.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Optional

from grpo.config.choices import (  # noqa: F401 (the qlora constants are also read from here)
    AGGREGATIONS, BITSANDBYTES_BLOCK_SCALE, BITSANDBYTES_BLOCK_SIZE, DEFAULT_BLOCK_SCALE, DEFAULT_BLOCK_SIZE,
    DEFAULT_SPLIT_RATIO, EMBEDDED_MODEL, IMPORTANCE_SAMPLING_LEVELS, KL_ESTIMATORS, QLORA_BLOCK_SCALES,
    QLORA_BLOCK_SIZES, QLORA_INITS, QLORA_QUANT_TYPES, REWARD_SCALES, ROLLOUT_ENGINES, ROLLOUT_MODES,
    ROLLOUT_WEIGHTS, SCHEDULERS, STOCK_4BIT_OPTIONS, STRATEGIES)
from grpo.config.derived import DerivedOptions
from grpo.config.validation import validate
from grpo.config.guide_spellings import GUIDE_SPELLINGS, fold_guide_spellings, upgrade_saved_options  # noqa: F401
from grpo.config.shipped import resolve_shipped_file
from grpo.config.strategy import Strategy
from grpo.config.choices import LOSS_TYPES, ROLLOUT_CORRECTIONS, ROLLOUT_MASK_BANDS, SEQUENCE_PARALLEL_ROLLOUTS

DEFAULT_LEARNING_RATE = {Strategy.LORA: 2e-5, Strategy.QLORA: 2e-5, Strategy.FULL: 1e-6}
MIN_DEFAULT_SEQ_LENGTH = 768  # the default --max_seq_length's floor: tool episodes take a few turns past one completion


_groups_in_order: list[str] = []  # one entry per field, in definition order (fields() keeps that order)


def _opt(default, help, group, **kw):
    _groups_in_order.append(group)
    # metadata is passed to argparse.add_argument by HfArgumentParser: keep only its keywords there.
    return field(default=default, metadata={"help": help, **kw})


def _list(default, help, group):
    _groups_in_order.append(group)
    return field(default_factory=lambda: list(default), metadata={"help": help})


@dataclass
class GRPOConfig(DerivedOptions):
    # --- model and tuning strategy ---------------------------------------------------------------
    model_name_or_path: str = _opt(
        EMBEDDED_MODEL, f"HF model folder or hub id; '{EMBEDDED_MODEL}' is the embedded offline model.", "model")
    tuning_strategy: str = _opt(Strategy.LORA.value, "What is trained: qlora (4-bit base + LoRA), lora, or full.",
                                "model", choices=STRATEGIES)
    lora_rank: int = _opt(16, "LoRA rank r (lora/qlora).", "model")
    lora_alpha: int = _opt(32, "LoRA alpha; the update is scaled by alpha / r.", "model")
    lora_dropout: float = _opt(0.05, "Dropout on the LoRA input.", "model")
    lora_target_modules: str = _opt(
        "all-linear", "Comma-separated module names to adapt, or 'all-linear'.", "model")
    lora_exclude_modules: Optional[str] = _opt(
        None, "Modules LoRA must not adapt, on top of --lora_target_modules: comma-separated names (a full name or "
              "its last parts, e.g. 'mlp.down_proj'), or a regex over full names when it has regex characters "
              "(e.g. 'model\\.layers\\.[01]\\..*').", "model")
    qlora_quant_type: str = _opt(
        "nf4", "qlora: the 4-bit data type of the frozen base. nf4: NormalFloat, the least weight error overall. "
               "fp4: bitsandbytes' 4-bit float, with more range for a heavy-tailed layer's large weights; on "
               "SmolLM2-135M it keeps the base's arithmetic (see benchmarks/quantized_arithmetic.py).", "experimental",
        choices=QLORA_QUANT_TYPES)
    qlora_block_size: int = _opt(
        DEFAULT_BLOCK_SIZE,
        "qlora: weights per 4-bit scale in the frozen base. 32 follows the weights more closely than bitsandbytes' "
        "64 for 0.125 more bits per weight; on SmolLM2-135M it keeps more of the 16-bit model's arithmetic (see "
        "benchmarks/quantized_arithmetic.py --rounding). Other than 64 (or with --qlora_block_scale mse), each "
        "weight is quantized again from the checkpoint's 16-bit weights after loading, and the saved adapter "
        f"belongs to a base quantized the same way (grpo.model.loading.load_policy). {STOCK_4BIT_OPTIONS}: "
        "bitsandbytes' stock base, as transformers loads it.", "experimental", choices=QLORA_BLOCK_SIZES)
    qlora_block_scale: str = _opt(
        DEFAULT_BLOCK_SCALE,
        "qlora: how each block's 4-bit scale is chosen. mse: the scale (at most the block's largest magnitude) of "
        "least squared rounding error, a larger weight taking the largest code; on SmolLM2-135M it cuts the weight "
        "error by a tenth, and qlora learns arith to 0.87 of lora's accuracy (benchmarks/RESULTS.md). absmax: the "
        "block's largest magnitude (bitsandbytes' own). Either way the base is a standard bitsandbytes 4-bit model; "
        "mse (with any block size) quantizes each weight again from the checkpoint's 16-bit weights after loading.",
        "experimental", choices=QLORA_BLOCK_SCALES)
    qlora_init: str = _opt(
        "zero", "qlora: zero: the policy starts as the 4-bit model (B = 0). loftq: a frozen rank-r correction of "
                "the 4-bit rounding error (best rank-r approximation of W - dequantize(Q), W read from the "
                "checkpoint) is added, so the policy starts nearer the 16-bit model; the trained "
                "adapter still starts at 0, the KL reference is the corrected start, and the saved adapter is one "
                "rank-2r LoRA (trained + correction) for the 4-bit base.", "experimental",
        choices=QLORA_INITS)
    qlora_skip_modules: Optional[str] = _opt(
        None, "qlora: linear layers kept in 16-bit instead of 4-bit, comma-separated names or suffixes (e.g. "
              "'gate_proj,up_proj,down_proj': on SmolLM2-135M the MLP is where 4-bit rounding costs the most, see "
              "benchmarks/quantized_arithmetic.py); the output layer is always kept.", "experimental")
    lora_adapter_path: Optional[str] = _opt(
        None, "Continue training from a saved LoRA adapter folder (rank/alpha read from its config).", "model")
    freeze_vision_tower: bool = _opt(
        True, "Vision-language models: keep the vision encoder frozen (LoRA 'all-linear' then adapts the language "
        "model only).", "model")
    trust_remote_code: bool = _opt(False, "Allow model code from the model folder / hub repo.", "model")
    gradient_checkpointing: Optional[bool] = _opt(
        None, "Recompute activations in backward to save memory. Default (auto): on for models of "
              "1B parameters or more, whose micro-batch activations outgrow the weights, and always on CPU (RAM is "
              "short there); off below on a GPU, where the recomputation (one more forward) would cost time for "
              "memory the GPU has.", "model")
    save_merged_model: bool = _opt(
        False, "With lora/qlora, also save the base model with the adapter merged. qlora merges into the base at its "
               "original precision, which differs from the trained 4-bit policy by the rounding (with --qlora_init "
               "loftq: into the rounded base); lora_adapter/ on the base quantized as in training is that policy "
               "exactly.", "model")

    # --- data -------------------------------------------------------------------------------------
    dataset_config_path: str = _opt(
        "configs/dataset_config.json", "The dataset registry (JSON) that --dataset_names refer to. A relative path "
        "missing from the current folder is read from the installed package's (configs/, the shipped registry).",
        "data")
    dataset_names: list[str] = _list(["arith"], "Registered dataset names to mix (space or comma separated).",
                                     "data")
    eval_dataset_names: list[str] = _list(
        [], "Registered datasets used only for evaluation, each with its own rewards (space or comma separated).",
        "data")
    train_split_ratio: Optional[float] = _opt(
        None, "Fraction of each training dataset's rows used for training, the rest held out for eval (default: "
              f"{DEFAULT_SPLIT_RATIO}, or 1.0 (no split) with --eval_dataset_names).", "data")
    max_prompt_length: int = _opt(
        256, "Longest prompt in tokens (chat template included); longer is an error unless filtered.", "data")
    filter_overlong_prompts: bool = _opt(
        False, "Drop prompts longer than --max_prompt_length (one line per dataset says how many) instead of "
               "stopping with an error.", "data")
    max_seq_length: Optional[int] = _opt(
        None, "Longest prompt + completion (or tool episode) in tokens. Default: --max_prompt_length + "
              f"--rollout_max_new_tokens, at least {MIN_DEFAULT_SEQ_LENGTH} (room for a few tool turns).", "data")
    max_images_per_prompt: int = _opt(
        1, "Most images one prompt may hold (rows with more are an error; vLLM's limit_mm_per_prompt).", "data")
    reward_module: Optional[str] = _opt(
        None, "Python file whose @register_reward functions become usable in the dataset config.", "data")
    reward_model: list[str] = _list(
        [], "Sequence-classification model folder(s) (space or comma separated) used as rewards: each is registered "
            "under its folder's name for the dataset config's \"rewards\" (score = its single logit).", "data")

    # --- optimisation -----------------------------------------------------------------------------
    output_dir: str = _opt("outputs/grpo", "Where checkpoints, logs, plots and the final model go.", "training")
    overwrite_output_dir: bool = _opt(
        False, "Start afresh in an output_dir an earlier run used: its logs (metrics, completion and eval samples) "
               "start over, its checkpoints are deleted as new ones are saved.",
        "training")
    resume_from_checkpoint: Optional[str] = _opt(
        None, "Checkpoint folder to continue from, or 'latest' for the newest in output_dir.", "training")
    epochs: int = _opt(1, "Passes over the training prompts (ignored when --max_steps > 0).", "training")
    max_steps: int = _opt(-1, "Optimizer steps to run; -1 means run --epochs.", "training")
    per_device_train_batch_size: int = _opt(
        2, "Prompts per rank per step (times --gradient_accumulation_steps); each yields --k_samples completions. "
           "With --max_tokens_per_micro_batch 0 it is also the micro-batch (this x k_samples rows).", "training")
    gradient_accumulation_steps: int = _opt(
        1, "Multiplies the prompts per rank per step (this x --per_device_train_batch_size); how they are split "
           "into micro-batches is --max_tokens_per_micro_batch's job.", "training")
    max_tokens_per_micro_batch: str = _opt(
        "auto", "Token budget (prompt + completion, padding included) of one micro-batch per rank: a step's rows are "
                "packed longest first into as many as needed (the step's loss does not depend on the split). auto: "
                "16384 on CPU; on a GPU the memory plan's: the most that fits beside the model and the sleeping "
                "rollout engine, in steps of 1024 up to 16384 (halving the log-prob chunk where that is what limits "
                "it), checked once they are loaded; a run where one row cannot fit is refused before loading. 0: "
                "--per_device_train_batch_size x --k_samples rows.", "training")
    logprob_chunk_tokens: int = _opt(
        1024, "Completion tokens whose logits exist at once: log-probs are computed from hidden states through "
              "the output layer in chunks of this size (never a full [N, T, vocab] logits tensor). 0: the "
              "model's full logits (as models with logit soft-capping always do, and every model under ZeRO-3); a "
              "vision-language model takes the hidden states of its multimodal body.",
        "training")
    padding_free: bool = _opt(
        False, "Pack each micro-batch's sequences into one row with per-sequence position ids (no padding "
               "computed); for decoder models whose attention honours packed position ids (transformers' "
               "Llama/Qwen/Mistral families, SDPA or flash attention). Needs --logprob_chunk_tokens > 0.",
        "training")
    sequence_parallel_size: int = _opt(
        1, "Ulysses sequence parallelism (DeepSpeed ALST): N ranks train on the same samples, each holding 1/N of "
           "every sequence (attention heads exchanged all-to-all), for completions too long for one GPU. The "
           "training ranks must be a multiple of N; N must divide the model's attention heads. The group's engines "
           "generate its rollouts together (--sequence_parallel_rollout). Needs --rollout_mode colocate, a text "
           "model, sdpa or flash_attention_2 attention; see docs/sequence_parallel.md.", "training")
    sequence_parallel_rollout: str = _opt(
        "share", "How a sequence-parallel group (--sequence_parallel_size N > 1) generates the rollouts its ranks "
                 "train on together. share: each rank's engine generates its share of every prompt's --k_samples "
                 "completions (N engines decode at once, with N KV caches); first: the group's first rank generates "
                 "them all, the others' engines idle (the rollouts one process with the same seed draws, for "
                 "comparing layouts). A tensor-parallel engine (--vllm_tp > 1) always generates on every rank "
                 "together and keeps the first rank's.", "training", choices=SEQUENCE_PARALLEL_ROLLOUTS)
    learning_rate: Optional[float] = _opt(
        None, "AdamW learning rate. Default: 2e-5 for lora / qlora, 1e-6 for full.", "training")
    weight_decay: float = _opt(0.0, "AdamW weight decay.", "training")
    warmup_ratio: float = _opt(0.0, "Fraction of steps with linear learning-rate warmup.", "training")
    lr_scheduler_type: str = _opt("constant", "Schedule after warmup: constant, linear or cosine.", "training",
                                  choices=SCHEDULERS)
    max_grad_norm: float = _opt(1.0, "Gradient clipping norm (0 disables).", "training")
    seed: int = _opt(42, "Seed for data order, splits, sampling and initialisation.", "training")

    # --- GRPO -------------------------------------------------------------------------------------
    k_samples: int = _opt(8, "Completions per prompt (the group size G); at least 2.", "grpo")
    rollout_max_new_tokens: int = _opt(256, "Longest completion in tokens.", "grpo")
    temperature: float = _opt(1.0, "Sampling temperature of rollouts (log-probs use the same temperature).",
                              "grpo")
    top_p: float = _opt(1.0, "Nucleus sampling of rollouts.", "grpo")
    kl_beta: float = _opt(0.0, "KL coefficient beta: adds beta * KL(policy || reference) to the loss (or, with "
                               "--kl_in_reward, subtracts it from the reward). 0: no KL term and no reference pass; "
                               "0.04 was GRPO's original value.", "grpo")
    kl_estimator: str = _opt("k3", "Per-token KL estimator in the loss: k1 (lp - ref), k2 (0.5 (lp - ref)^2) or k3 "
                                   "(low_var_kl).", "grpo", choices=KL_ESTIMATORS)
    kl_in_reward: bool = _opt(
        False, "With --kl_beta > 0: subtract beta * sum_t (lp - ref) (k1 over the completion) from each reward "
               "before advantages, instead of adding KL to the loss.", "grpo")
    entropy_coef: float = _opt(0.0, "Entropy bonus: the loss gets -entropy_coef x the aggregated token entropy "
                                    "(with gradient; 0 = off).", "grpo")
    clip_epsilon_low: float = _opt(0.2, "PPO clip: ratio is kept above 1 - eps_low.", "grpo")
    clip_epsilon_high: Optional[float] = _opt(
        None, "PPO clip: ratio is kept below 1 + eps_high (default: eps_low; DAPO uses 0.28).", "grpo")
    importance_sampling_level: str = _opt(
        "token", "PPO ratio per token, or per sequence (GSPO: exp of the mean token log-ratio, clipped with the same "
                 "eps; GSPO uses tiny ranges such as 3e-4 / 4e-4).", "grpo", choices=IMPORTANCE_SAMPLING_LEVELS)
    clip_ratio_c: Optional[float] = _opt(
        None, "Dual-clip PPO: for A < 0 the token loss is capped at -A x clip_ratio_c (> 1; verl uses 3). "
              "Default off.", "grpo")
    loss_aggregation: str = _opt("token_mean", "How token losses become one number: " + ", ".join(AGGREGATIONS),
                                 "grpo", choices=AGGREGATIONS)
    scale_rewards: str = _opt("batch", "Advantage scaling: (r - group mean) divided by the std of the step's whole "
                              "batch (batch), of the group (group, the original GRPO), or not divided (none, "
                              "Dr. GRPO).", "grpo", choices=REWARD_SCALES)
    num_iterations: int = _opt(1, "Optimizer updates per rollout batch (mu); >1 reuses stored old log-probs.",
                               "grpo")
    mask_truncated_completions: bool = _opt(
        False, "Exclude completions that hit --rollout_max_new_tokens from the loss.", "grpo")
    rollout_is_correction: Optional[bool] = _opt(
        None, "Weight the loss by min(exp(trainer_old - rollout logprob), cap) (truncated IS). Default: on with "
              "--async_rollout or --max_staleness (their rollouts come from policies steps behind), off otherwise.",
        "grpo",
        nargs="?", const=True)  # a bare flag still means true
    rollout_is_cap: float = _opt(2.0, "Cap of the truncated importance-sampling weight.", "grpo")
    rollout_correction: Optional[str] = _opt(
        None, "How --rollout_is_correction corrects: token_truncate (the default: min(ratio, cap) per token), "
              "sequence_truncate (the sequence's ratio, capped), sequence_mask (the sequence's ratio, 0 outside "
              "--rollout_mask_low/high; TRL's default), icepop (the token's ratio, 0 outside the band) or "
              "geometric_mask (weight 1, 0 where the sequence's geometric mean of rollout / trainer probability is "
              "outside the band, as verl's seq_mean_k1). See docs/algorithm.md.", "grpo", choices=ROLLOUT_CORRECTIONS)
    rollout_mask_low: Optional[float] = _opt(
        None, "Lower bound of the masking band of --rollout_correction (default per mode: "
              + ", ".join(f"{m} {lo}" for m, (lo, _) in ROLLOUT_MASK_BANDS.items()) + ").", "grpo")
    rollout_mask_high: Optional[float] = _opt(
        None, "Upper bound of the masking band (default per mode: "
              + ", ".join(f"{m} {hi}" for m, (_, hi) in ROLLOUT_MASK_BANDS.items()) + ").", "grpo")
    loss_type: str = _opt(
        "ppo_clip", "Policy loss: ppo_clip (GRPO / DAPO / GSPO, with the clip options above), cispo (clipped, "
                    "stop-gradient IS weight on every token's log-prob; clip = --clip_epsilon_low/high), sapo "
                    "(soft sigmoid gate instead of the clip; --sapo_tau_pos/neg) or gmpo (geometric mean of the "
                    "token ratios, clipped in log space by --clip_epsilon_low/high; the paper uses 0.4). "
                    "See docs/algorithm.md.", "grpo", choices=LOSS_TYPES)
    sapo_tau_pos: float = _opt(1.0, "SAPO gate temperature for tokens with A > 0.", "grpo")
    sapo_tau_neg: float = _opt(1.05, "SAPO gate temperature for tokens with A <= 0 (larger: damped sooner).", "grpo")
    filter_zero_std_groups: bool = _opt(
        False, "Dynamic sampling (DAPO): drop groups whose rewards are all equal and draw more prompts until the "
               "step has its prompts; each draw consumes data (epochs pass faster).", "grpo")
    max_generation_rounds: int = _opt(
        3, "With --filter_zero_std_groups, most rollout rounds per step; after them the step is topped up with "
           "uniform groups (advantage 0).", "grpo")

    # --- rollout engine ---------------------------------------------------------------------------
    rollout_engine: str = _opt(
        "hf", "What generates the rollouts: hf (Hugging Face generate on the policy itself; CPU or GPU) or vllm "
              "(GPU, pip install .[vllm]; the trained weights are pushed into it after every step).", "rollout",
        choices=ROLLOUT_ENGINES)
    vllm_tp: int = _opt(1, "Tensor-parallel size of each vLLM engine; must divide the number of ranks (in server "
                           "mode: --rollout_gpus).", "rollout")
    rollout_mode: str = _opt(
        "colocate", "Where the engine runs. colocate: every rank trains and generates (the engine sleeps while "
                    "DeepSpeed trains). server: the last --rollout_gpus ranks of the job only generate (with "
                    "--rollout_engine), the others only train; completions and the updated policy travel between "
                    "them after every step.", "rollout", choices=ROLLOUT_MODES)
    rollout_weights: str = _opt(
        "auto", "What the vLLM engine holds of a lora / qlora policy (docs/qlora.md). merged: a 16-bit copy, the "
                "adapter merged in at every sync. adapter: the base once (lora: shared with the trainer; qlora: its "
                "4-bit base) plus the adapter, all a sync sends. in_place (lora): the base once, shared with the "
                "trainer, the adapter merged in for each rollout and taken out after, bit for bit. auto: the memory "
                "plan's (docs/memory.md): by preference in_place for lora once the 16-bit copy would take 8 GiB (4.3B "
                "parameters) or over 25 percent of the budget, adapter over 40 percent for qlora (and lora where "
                "in_place cannot go) and always for a checkpoint saved in 4 bits, merged otherwise (faster there, and "
                "with --vllm_tp > 1 or loftq); the first that fits with the step's sequences in its KV cache at once.",
        "rollout", choices=ROLLOUT_WEIGHTS)
    async_rollout: bool = _opt(
        False, "With --rollout_mode server: the rollout ranks generate the next step's rollouts while this step trains "
               "(one step off policy, corrected by the truncated IS weights; rollout/staleness is logged).",
        "rollout")
    max_staleness: Optional[int] = _opt(
        None, "With --rollout_mode server: rollouts stream "
              "(docs/server_mode.md#streaming-rollouts---max_staleness-k). The rollout ranks generate without "
              "stopping, up to K steps' prompts ahead of training, and take each weight update as it comes; every "
              "token carries the policy version that sampled it, and no step trains on a group more than K versions "
              "behind (such a group is generated again). 1 is --async_rollout. Default: 1 with --async_rollout, else "
              "off.", "rollout")
    rollout_segment_tokens: int = _opt(
        0, "With --max_staleness (or --async_rollout): the rollout ranks generate in pieces of N tokens of every "
           "sequence in flight, taking new weights and new prompts between two pieces, so a weight update lands in the "
           "middle of sequences (partial rollouts: a sequence goes on under the new weights, its earlier tokens keep "
           "their version and log-probs). 0: whole completions per request, updates land between requests.", "rollout")
    partial_rollouts: str = _opt(
        "continue", "With --rollout_segment_tokens: what a sequence in flight does when new weights arrive. continue: "
                    "it goes on under them (each token weighted by the policy that sampled it); restart: it starts "
                    "again from its prompt under the new weights.", "rollout", choices=("continue", "restart"))
    rollout_gpus: int = _opt(0, "With --rollout_mode server: how many of the job's ranks (the last ones) run rollout "
                                "engines; at least 1 and fewer than the job's ranks.", "rollout")
    vllm_gpu_memory_utilization: Optional[float] = _opt(
        None, "Fraction of GPU memory vLLM may take, where its KV cache is not given in bytes: the rollout ranks of "
              "server mode (default 0.85: their GPUs only generate) and models without a plain per-token cache (MLA, "
              "hybrid attention; default 0.3 colocated). A colocated engine otherwise gets the memory plan's bytes.",
        "rollout")
    vllm_kv_cache_gib: Optional[str] = _opt(
        None, "vLLM's KV cache per GPU, in bytes the memory plan gives it (docs/memory.md). auto: one step's "
              "rollouts at once (tp x prompts per rank x k sequences of --max_prompt_length + "
              "--rollout_max_new_tokens tokens, plus a quarter) where the budget holds them, else what it holds (never "
              "less than one --max_seq_length sequence: the rest run in waves); under --gpu_memory_gib it leaves "
              "training micro-batches of 4096 tokens (or one row). A number: that many GiB. share: what "
              "--vllm_gpu_memory_utilization leaves after the weights (as for models without a plain cache: MLA, "
              "hybrid linear attention). Default: auto colocated, share in server mode.", "rollout")
    vllm_sleep: bool = _opt(True, "Put vLLM to sleep while DeepSpeed trains, freeing what --vllm_sleep_level says. "
                                    "false: it stays awake, and a lora / qlora sync sends only the adapted layers. "
                                    "Colocated vLLM only (rollout ranks of server mode never sleep).", "rollout")
    vllm_sleep_level: Optional[int] = _opt(
        None, "With --vllm_sleep: 0 frees the KV cache alone, the weights stay, and a sync writes only what changed "
              "into them; 2 drops the weights, and every sync sends the whole policy (a copy on the GPU); 1 parks "
              "them in pinned CPU memory and copies them back at each wake. Default: 0 for lora / qlora with merged "
              "weights on one GPU where vLLM's 16-bit copy takes at most a quarter of the GPU, else 2; an engine "
              "holding the base once keeps it (parked as at 1, or shared with the trainer: the KV cache alone).",
        "experimental", choices=(0, 1, 2))
    logprob_check_steps: int = _opt(
        10, "Ask the rollout engine for its sampling log-probs every N steps, for the rollout/logprob_diff metric "
            "(always with --rollout_is_correction); vLLM generates faster without them.", "experimental")
    vllm_enforce_eager: bool = _opt(False, "Run vLLM without CUDA graphs / torch.compile (starts faster).",
                                    "rollout")
    routing_replay: Optional[bool] = _opt(
        None, "Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the rollout engine records the experts it "
              "routed each token to, and the trainer's MoE layers use that choice while their gate weights come from "
              "the trainer's own router (docs/moe.md#routing-replay); rollout/router_agreement is logged. Default: on "
              "for those models (it costs 4 bytes per token, layer and routed expert); a dense model has nothing to "
              "replay, and refuses it.",
        "rollout", nargs="?", const=True)  # a bare flag means true

    # --- tools and multi-turn episodes ------------------------------------------------------------
    tool_module: Optional[str] = _opt(
        None, "Python file whose @register_tool / @register_environment functions become usable in the dataset "
              "config's \"tools\" and \"environment\" (docs/tools.md).", "tools")
    max_turns: int = _opt(
        4, "Datasets with tools or an environment: model turns per episode (each at most --rollout_max_new_tokens).",
        "tools")
    max_episode_tokens: Optional[int] = _opt(
        None, "Datasets with tools or an environment: completion tokens per episode, the model's and the "
              "environment's together (the prompt comes on top). Default: --max_seq_length - --max_prompt_length.",
        "tools")
    warm_start_steps: int = _opt(
        0, "Supervised steps on the datasets' \"demonstrations\" (the model's turns written out, e.g. tool calls) "
           "before the first GRPO step of a fresh run: a model that never calls its tools gets calls to prefer.",
        "tools")
    tool_call_reward: Optional[float] = _opt(
        None, "Weight of the tool_call reward (1 for an episode with a tool call that ran) in every named dataset that "
              "offers tools: replaces the registry's weight, or adds the reward where the entry has none; 0 turns it "
              "off. Default: the registry's.", "tools")
    tool_failure_penalty: Optional[float] = _opt(
        None, "What tool_call scores an episode whose tool calls all failed (bad JSON, unknown tool, wrong arguments), "
              "as a penalty >= 0: tool_call's `attempt` becomes -penalty in every named dataset that offers tools. "
              "Default: the registry's attempt.", "tools")
    allow_unsandboxed_code: bool = _opt(
        False, "Where no sandbox can be made (bubblewrap missing or namespaces refused), run the python tool's code "
               "as a plain process anyway: no isolation from the trainer, its files or the network (docs/tools.md).",
        "tools")
    agent_module: Optional[str] = _opt(
        None, "Python file whose @register_agent functions (`async def agent(client, row)` on the OpenAI API) become "
              "usable in the dataset config's \"agent\" (docs/agents.md).", "tools")
    agent_timeout_s: float = _opt(
        300.0, "Datasets with an agent: seconds one episode may run; past them it is cancelled and scores 0 (counted "
               "in agents/timeouts).", "tools")
    agent_max_concurrency: int = _opt(
        64, "Datasets with an agent: episodes running at once on a rank (their calls are generated in batches).",
        "tools")
    agent_on_mismatch: str = _opt(
        "truncate", "Datasets with an agent: an agent's call that does not continue its earlier calls' tokens is "
                    "never trained on; truncate keeps the episode up to it, drop trains on none of the episode.",
        "tools", choices=("truncate", "drop"))

    # --- eval, checkpoints, logging -------------------------------------------------------------
    eval_steps: int = _opt(0, "Evaluate on the held-out split every N steps (0: only at the end).", "logging")
    eval_on_start: bool = _opt(True, "Evaluate before the first step (logged as step 0) when there is an eval set.",
                               "logging")
    eval_max_prompts: int = _opt(64, "Prompts of each eval dataset (and held-out split) per evaluation; -1: all.",
                                 "logging")
    eval_greedy: bool = _opt(True, "Greedy decoding in eval (else sampled with --temperature).", "logging")
    save_steps: int = _opt(50, "Save a checkpoint every N steps (0 disables).", "logging")
    save_total_limit: int = _opt(2, "Checkpoints kept in output_dir (oldest removed first).", "logging")
    logging_steps: int = _opt(1, "Print a metrics line every N steps (metrics.jsonl gets every step).", "logging")
    log_to_file: bool = _opt(True, "Also write the console log to output_dir/train.log.", "logging")
    use_wandb: bool = _opt(False, "Log metrics to Weights & Biases (WANDB_MODE=offline works).", "logging")
    wandb_project: str = _opt("grpo", "W&B project name.", "logging")
    wandb_run_name: Optional[str] = _opt(None, "W&B run name (default: output_dir's name).", "logging")
    report_to: list[str] = _list(
        [], "Trackers the metrics also go to, named as in transformers: wandb, tensorboard, trackio, mlflow "
            "(several, space or comma separated); 'all': each one installed; 'none'. --use_wandb adds wandb; "
            "--wandb_project names each one's project, --wandb_run_name the run (docs/checkpoints.md).", "logging")
    push_to_hub: bool = _opt(
        False, "Upload the final model (the adapter, or the full model) with its model card, the run's options and "
               "curves to the Hugging Face Hub; the token and the hub are checked before any weight loads.", "logging")
    hub_model_id: Optional[str] = _opt(
        None, "--push_to_hub: the repository, 'user/name' or 'name' (the token's user); default: output_dir's name.",
        "logging")
    hub_private_repo: bool = _opt(
        False, "--push_to_hub: make the repository private (else the hub's default for new ones).", "logging")
    hub_strategy: str = _opt("end", "--push_to_hub: 'end' (the final model), or 'every_save' (also the model as it "
                                    "is at each checkpoint).", "logging", choices=("end", "every_save"))

    # --- distributed ------------------------------------------------------------------------------
    deepspeed: str = _opt("zero2", "DeepSpeed config file, or 'zero2' / 'zero3' for the shipped ones (a relative "
                                   "configs/ path missing from the current folder is read from the package's).",
                          "distributed")
    local_rank: int = _opt(-1, "Set by the deepspeed launcher; leave alone.", "distributed")
    gpu_memory_gib: Optional[float] = _opt(
        None, "This run's budget on each GPU, e.g. 24 to try a 24 GB card on a larger GPU (memory other processes "
              "hold lowers what is free, not this budget). The memory plan fits the run within it (docs/memory.md); "
              "with --plan_only on a machine without a GPU it names the card to plan for.", "training")
    plan_only: bool = _opt(
        False, "Print the memory plan of the run these flags describe (each phase's peak, the automatic choices, "
               "what to change where it does not fit) and exit, loading no weights: in seconds, with or without a "
               "GPU (then for the card --gpu_memory_gib names).", "training")
    ddp_timeout_minutes: float = _opt(
        30.0, "How long a collective waits for a rank that never arrives before the run stops with an error "
        "(the process-group timeout).", "distributed")

    # --- the guide's spellings: folded into the options they name at construction, then None ---------
    learning_rate_lora: Optional[float] = _opt(None, f"= {GUIDE_SPELLINGS['learning_rate_lora']}.", "guide")
    use_kl_penalty: Optional[bool] = _opt(None, f"= {GUIDE_SPELLINGS['use_kl_penalty']}.", "guide")
    use_vllm_rollout: Optional[bool] = _opt(None, f"= {GUIDE_SPELLINGS['use_vllm_rollout']}.", "guide")
    vllm_mode: Optional[str] = _opt(None, f"= {GUIDE_SPELLINGS['vllm_mode']}.", "guide")

    # not an option: the saved grpo_config.json a resume took its options from (from_run, train_grpo.py), else None
    resumes_saved_options = None

    @classmethod
    def from_run(cls, output_dir: str, checkpoint: str = "latest", **overrides) -> "GRPOConfig":
        """The options to continue the run in `output_dir` from `checkpoint` ('latest' or a checkpoint folder):
        those saved with that checkpoint, with `overrides` on top (GRPOTrainer lists each one that differs).
        `GRPOConfig.from_run("outputs/run1", max_steps=400)` continues run1 as `train_grpo.py --output_dir
        outputs/run1 --resume_from_checkpoint latest --max_steps 400` does."""
        from grpo.config.saved import config_from_run

        return config_from_run(cls, output_dir, checkpoint, overrides)

    def __post_init__(self):
        self.dataset_names = _names(self.dataset_names)
        self.eval_dataset_names = _names(self.eval_dataset_names)
        self.reward_model = _names(self.reward_model)
        fold_guide_spellings(self)
        if self.max_seq_length is None:
            self.max_seq_length = max(MIN_DEFAULT_SEQ_LENGTH, self.max_prompt_length + self.rollout_max_new_tokens)
        # a file missing here and among the shipped ones stays as given: reading it says so, before any model loads
        self.dataset_config_path = resolve_shipped_file(self.dataset_config_path, "dataset_config_path", strict=False)
        self.deepspeed = resolve_shipped_file(self.deepspeed, "deepspeed", strict=False)
        if self.clip_epsilon_high is None:
            self.clip_epsilon_high = self.clip_epsilon_low
        if self.learning_rate is None:
            self.learning_rate = DEFAULT_LEARNING_RATE.get(self.tuning_strategy, DEFAULT_LEARNING_RATE[Strategy.LORA])
        self.validate()

    def validate(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2)


def _names(value) -> list[str]:
    """Dataset names given space and/or comma separated (a plain string is one argument)."""
    parts = [value] if isinstance(value, str) else list(value)
    return [n.strip() for part in parts for n in part.split(",") if n.strip()]


FLAG_GROUPS: dict[str, str] = {f.name: g for f, g in zip(fields(GRPOConfig), _groups_in_order)}
