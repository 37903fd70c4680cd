"""Optimisation: the output folder and resuming, how long a run trains, its batches and micro-batches, sequence
parallelism, AdamW and its schedule, and the checks of those options."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.config.choices import SCHEDULERS, SEQUENCE_PARALLEL_ROLLOUTS
from grpo.config.job import job_world_size
from grpo.config.sections.option import need, option
from grpo.errors import ConfigError


@dataclass
class OptimizationOptions:
    output_dir: str = option("outputs/grpo", "Where checkpoints, logs, plots and the final model go.", "training")
    overwrite_output_dir: bool = option(
        False, "Start afresh in an output_dir an earlier run used: its logs (metrics, completion and eval samples) "
               "start over, its checkpoints are deleted as new ones are saved.",
        "training")
    resume_from_checkpoint: Optional[str] = option(
        None, "Checkpoint folder to continue from, or 'latest' for the newest in output_dir.", "training")
    epochs: int = option(1, "Passes over the training prompts (ignored when --max_steps > 0).", "training")
    max_steps: int = option(-1, "Optimizer steps to run; -1 means run --epochs.", "training")
    per_device_train_batch_size: int = option(
        2, "Prompts per rank per step (times --gradient_accumulation_steps); each yields --k_samples completions. "
           "With --max_tokens_per_micro_batch 0 it is also the micro-batch (this x k_samples rows).", "training")
    gradient_accumulation_steps: int = option(
        1, "Multiplies the prompts per rank per step (this x --per_device_train_batch_size); how they are split "
           "into micro-batches is --max_tokens_per_micro_batch's job.", "training")
    max_tokens_per_micro_batch: str = option(
        "auto", "Token budget (prompt + completion, padding included) of one micro-batch per rank: a step's rows are "
                "packed longest first into as many as needed (the step's loss does not depend on the split). auto: "
                "16384 on CPU; on a GPU the memory plan's: the most that fits beside the model and the sleeping "
                "rollout engine, in steps of 1024 up to 16384 (halving the log-prob chunk where that is what limits "
                "it), checked once they are loaded; a run where one row cannot fit is refused before loading. 0: "
                "--per_device_train_batch_size x --k_samples rows.", "training")
    logprob_chunk_tokens: int = option(
        1024, "Completion tokens whose logits exist at once: log-probs are computed from hidden states through "
              "the output layer in chunks of this size (never a full [N, T, vocab] logits tensor). 0: the "
              "model's full logits (as models with logit soft-capping always do, and every model under ZeRO-3); a "
              "vision-language model takes the hidden states of its multimodal body.",
        "training")
    padding_free: bool = option(
        False, "Pack each micro-batch's sequences into one row with per-sequence position ids (no padding "
               "computed); for decoder models whose attention honours packed position ids (transformers' "
               "Llama/Qwen/Mistral families, SDPA or flash attention; refused for soft-capped attention such as Gemma 2's, "
               "which loads eager in blocks of queries). Needs --logprob_chunk_tokens > 0.",
        "training")
    sequence_parallel_size: int = option(
        1, "Ulysses sequence parallelism (DeepSpeed ALST): N ranks train on the same samples, each holding 1/N of "
           "every sequence (attention heads exchanged all-to-all), for completions too long for one GPU. The "
           "training ranks must be a multiple of N; N must divide the model's attention heads. The group's engines "
           "generate its rollouts together (--sequence_parallel_rollout). Needs --rollout_mode colocate, a text "
           "model, sdpa or flash_attention_2 attention; see docs/sequence_parallel.md.", "training")
    sequence_parallel_rollout: str = option(
        "share", "How a sequence-parallel group (--sequence_parallel_size N > 1) generates the rollouts its ranks "
                 "train on together. share: each rank's engine generates its share of every prompt's --k_samples "
                 "completions (N engines decode at once, with N KV caches); first: the group's first rank generates "
                 "them all, the others' engines idle (the rollouts one process with the same seed draws, for "
                 "comparing layouts). A tensor-parallel engine (--vllm_tp > 1) always generates on every rank "
                 "together and keeps the first rank's.", "training", choices=SEQUENCE_PARALLEL_ROLLOUTS)
    learning_rate: Optional[float] = option(
        None, "AdamW learning rate. Default: 2e-5 for lora / qlora, 1e-6 for full.", "training")
    weight_decay: float = option(0.0, "AdamW weight decay.", "training")
    warmup_ratio: float = option(0.0, "Fraction of steps with linear learning-rate warmup.", "training")
    lr_scheduler_type: str = option("constant", "Schedule after warmup: constant, linear or cosine.", "training",
                                  choices=SCHEDULERS)
    max_grad_norm: float = option(1.0, "Gradient clipping norm (0 disables).", "training")
    seed: int = option(42, "Seed for data order, splits, sampling and initialisation.", "training")

    def check_optimization(self) -> None:
        need(self.lr_scheduler_type in SCHEDULERS, "lr_scheduler_type",
             f"got '{self.lr_scheduler_type}', choose one of {', '.join(SCHEDULERS)}")
        need(self.epochs >= 1, "epochs", "must be >= 1")
        need(self.max_steps == -1 or self.max_steps > 0, "max_steps", "must be -1 (use --epochs) or > 0")
        need(self.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1")
        need(self.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
        token_budget(self.max_tokens_per_micro_batch)  # auto or a number of tokens (made one at construction)
        need(self.logprob_chunk_tokens >= 0, "logprob_chunk_tokens",
             f"must be >= 0 (0: full logits); got {self.logprob_chunk_tokens}")
        need(not self.padding_free or self.logprob_chunk_tokens > 0, "padding_free",
             "needs --logprob_chunk_tokens > 0 (packed rows go through the hidden-state path)")
        need(self.learning_rate > 0, "learning_rate", "must be > 0")
        need(0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", "must be in [0, 1)")
        need(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 disables clipping)")
        self._check_sequence_parallel(job_world_size())

    def _check_sequence_parallel(self, world: int) -> None:
        """--sequence_parallel_size: what DeepSpeed's Ulysses attention (ALST) can shard, and what it cannot."""
        sp = self.sequence_parallel_size
        need(sp >= 1, "sequence_parallel_size", f"must be >= 1; got {sp}")
        need(self.sequence_parallel_rollout in SEQUENCE_PARALLEL_ROLLOUTS, "sequence_parallel_rollout",
             f"got '{self.sequence_parallel_rollout}', choose one of {', '.join(SEQUENCE_PARALLEL_ROLLOUTS)}")
        if sp <= 1:
            return
        need(world % sp == 0, "sequence_parallel_size",
             f"must divide the number of training ranks (WORLD_SIZE={world}); got {sp}: start a multiple of {sp} "
             f"ranks (deepspeed --num_gpus)")
        need(self.rollout_mode == "colocate", "sequence_parallel_size",
             "works with --rollout_mode colocate only (server mode's rollout ranks sit outside the training world the "
             "sequence-parallel groups are cut from); drop --rollout_mode server")
        # both engines work: the HF engine generates with the training model, each rank over whole sequences, with
        # the attention DeepSpeed wrapped put back for the time of generate (sequence_parallel.unsharded_attention)
        need(not self.padding_free, "sequence_parallel_size",
             "cannot be combined with --padding_free (the sharded attention takes one causal sequence per row); drop "
             "--padding_free")


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
