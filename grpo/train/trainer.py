"""GRPOTrainer: one training step reads top to bottom as

    rollout -> rewards -> advantages -> old/ref log-probs -> loss + DeepSpeed step -> weight sync -> log/eval/save

Everything that is not wiring lives elsewhere: math in algorithm.py, data in data/, rewards in rewards/,
models in models.py, engines in rollout/ (which one: rollout/setup.py), the rollout phase in rollout_phase.py,
the optimisation phase in optimize.py, weight sync in sync.py, checkpoints in checkpoint.py, the step's metrics in
step_metrics.py, the stop on a signal in graceful_stop.py.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import time
from typing import Callable, Optional, Sequence

import torch

from grpo.runtime import distributed as dist_utils
from grpo.algorithm import group_advantages, kl_penalized_rewards
from grpo.train.step_data import RolloutBatch
from grpo.checkpoint.store import (TrainerState, check_resume_keeps_policy, list_checkpoints, load_checkpoint,
                         resolve_resume_path, save_checkpoint, saved_config_path, warn_changed_options)
from grpo.model.base_weights import check_checkpoint_weights
from grpo.config.options import EMBEDDED_MODEL, GRPOConfig
from grpo.data import (dataset_routes, first_rows_per_source, load_dataset_registry, load_prompt_datasets,
                   render_prompts)
from grpo.runtime.deepspeed_config import default_dtype, load_deepspeed_config, zero_stage
from grpo.rollout.dynamic_sampling import PendingRollouts, RolloutRound
from grpo.model.embedded import resolve_model_path
from grpo.errors import ConfigError, TrainingError
from grpo.train.metrics import eval_metrics, eval_sample_rows
from grpo.runtime.failures import FailureReporter, phase
from grpo.runtime.signals import GracefulStop
from grpo.model.loading import load_policy, load_reference, load_tokenizer, reference_mode, save_final_model
from grpo.train.reporting import plot_training_curves
from grpo.train.reporting import RunReporter, read_metrics, setup_console_logging
from grpo.rewards import RewardRouter, load_reward_module
from grpo.rewards.reward_model import register_reward_models
from grpo.runtime.roles import enter_training_world, job_rank, rollout_index, rollout_ranks_of
from grpo.rollout.collect import RolloutPhase
from grpo.rollout.engine import SamplingSettings
from grpo.rollout.engines import build_rollout_engine, check_tensor_parallel, engine_dtype, engine_holds_weights
from grpo.train.micro_batches import MicroBatch
from grpo.train.update import has_dropout, lr_schedule, score, step_micro_batches, step_normaliser, update
from grpo.data.sampler import PromptOrder
from grpo.runtime.distributed import seed_everything
from grpo.train.metrics import mean_over_ranks, step_metrics, step_std
from grpo.model.vision import load_vision_processor, render_vision_prompts

logger = logging.getLogger("grpo")
MAX_BAD_STEPS = 3


class GRPOTrainer(RolloutPhase):
    """GRPO on DeepSpeed. `GRPOTrainer(config=GRPOConfig(...), reward_funcs=[...]).train()`.

    `reward_funcs` are extra batched reward callables `fn(completions, answers, **row) -> list[float]` applied to
    every row with weight 1, on top of the rewards the dataset registry names.
    """

    def __init__(self, config: GRPOConfig, reward_funcs: Sequence[Callable] = ()):
        self.config = config
        index = rollout_index(rollout_ranks_of(config))
        if index is not None:  # a script run on every rank of a server-mode job
            raise ConfigError(f"--vllm_mode server: this process is rollout rank {index} (job rank {job_rank()}), "
                              f"which only generates; run grpo.serve_rollouts(config) on it instead of GRPOTrainer, "
                              f"as train_grpo.py does")
        enter_training_world(rollout_ranks_of(config))  # server mode: the rollout ranks are not in this world
        dist_utils.init_distributed(config.ddp_timeout_minutes)
        self.rank, self.world = dist_utils.rank(), dist_utils.world_size()
        self.is_main = dist_utils.is_main()
        os.makedirs(config.output_dir, exist_ok=True)
        setup_console_logging(self.is_main, os.path.join(config.output_dir, "train.log")
                              if config.log_to_file else None)
        self.failures = FailureReporter(config.output_dir, self.rank, self.world)
        seed_everything(config.seed + self.rank)
        if config.num_iterations > 1 and config.uses_lora and config.lora_dropout > 0:
            logger.warning(f"--num_iterations {config.num_iterations} with --lora_dropout {config.lora_dropout}: each "
                           "update draws new dropout masks, so the later updates' ratios to the first one's log-probs "
                           "carry dropout noise and are clipped as if the policy had moved; --lora_dropout 0 avoids it")
        if config.use_vllm_rollout:
            if not torch.cuda.is_available():
                raise ConfigError("--use_vllm_rollout needs a GPU; drop the flag to use the HF engine on CPU")
            if importlib.util.find_spec("vllm") is None:
                raise ConfigError("--use_vllm_rollout needs vLLM: pip install .[vllm] (tested with vllm 0.26.0)")

        if not config.resume_from_checkpoint and list_checkpoints(config.output_dir) and \
                not config.overwrite_output_dir:
            raise ConfigError(f"--output_dir {config.output_dir} holds checkpoints of an earlier run; continue it with "
                              f"--resume_from_checkpoint latest, or start over with --overwrite_output_dir")
        if config.resume_from_checkpoint:
            check_resume_keeps_policy(saved_config_path(config.resume_from_checkpoint, config.output_dir), config)

        # --- data and rewards first: their errors must come before any model loads -------------------
        if config.reward_module:
            load_reward_module(config.reward_module)
        # checked and registered now (by folder name), weights loaded on first use
        register_reward_models(config.reward_model, dist_utils.device(), default_dtype(), config.trust_remote_code)
        registry = load_dataset_registry(config.dataset_config_path)
        train_rows, eval_rows = load_prompt_datasets(config.dataset_config_path, config.dataset_names,
                                                     config.effective_train_split_ratio, config.seed,
                                                     eval_names=config.eval_dataset_names,
                                                     max_images_per_prompt=config.max_images_per_prompt)
        routes, reward_kwargs = dataset_routes(registry, config.dataset_names + config.eval_dataset_names)
        self.rewards = RewardRouter(routes, reward_kwargs, extra_funcs=reward_funcs)
        self.model_path = resolve_model_path(config.model_name_or_path)
        try:
            self.tokenizer = load_tokenizer(self.model_path, config.trust_remote_code)
        except OSError as exc:  # not a folder, and not reachable on the hub
            raise ConfigError(f"--model_name_or_path: cannot load '{config.model_name_or_path}' ({exc}); give a "
                              f"local model folder, a reachable hub id, or '{EMBEDDED_MODEL}'") from exc
        self.vision = load_vision_processor(self.model_path, self.tokenizer, config, train_rows)

        def render(rows, split):
            if self.vision:
                return render_vision_prompts(rows, self.vision, config.max_prompt_length,
                                             config.filter_overlong_prompts, split)
            return render_prompts(rows, self.tokenizer, config.max_prompt_length, config.filter_overlong_prompts,
                                  split)

        self.train_set = render(train_rows, "train")
        # held-out rows, then eval datasets; the first --eval_max_prompts of each dataset
        self.eval_set = first_rows_per_source(render(eval_rows, "eval"), config.eval_max_prompts) \
            if len(eval_rows) else None
        if config.use_vllm_rollout and config.vllm_tp > 1:
            check_tensor_parallel(self.model_path, config)
        check_checkpoint_weights(config, self.model_path)  # qlora's re-quantization and loftq read its 16-bit weights
        self.prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        self.order = PromptOrder(len(self.train_set), self.prompts_per_step, config.seed, self.rank, self.world)
        if self.order.steps_per_epoch == 0:
            raise ConfigError(
                f"--per_device_train_batch_size: the training split has {len(self.train_set)} prompts, but one step "
                f"needs {self.prompts_per_step} per rank x {self.world} ranks; lower the batch size or "
                f"--gradient_accumulation_steps, or raise --train_split_ratio")
        self.total_steps = config.max_steps if config.max_steps > 0 else config.epochs * self.order.steps_per_epoch

        # --- models, DeepSpeed, rollout engine --------------------------------------------------------
        self.device, self.dtype = dist_utils.device(), default_dtype()
        self.ds_config = load_deepspeed_config(config, use_bf16=self.dtype == torch.bfloat16)
        self.zero3 = zero_stage(self.ds_config) == 3
        policy = load_policy(config, self.model_path, self.dtype, self.device)
        self.reference = load_reference(config, self.model_path, self.dtype, self.device)
        self.engine = self._init_deepspeed(policy)
        self.state = TrainerState()
        self.rollout_engine = build_rollout_engine(config, self.model_path, self.engine.module, self.tokenizer,
                                                   self.vision, self.rank, self.dtype)
        try:
            self._restore_and_sync()
        except BaseException:
            self.close()  # server mode: the rollout ranks stop with us
            raise
        if self.is_main:
            if config.resume_from_checkpoint:
                warn_changed_options(saved_config_path(config.resume_from_checkpoint, config.output_dir), config)
            config.save(os.path.join(config.output_dir, "grpo_config.json"))
        self._pending_rollouts: Optional[PendingRollouts] = None  # --async_rollout: the next step's, in flight
        self._position_before_prefetch = (self.state.epoch, self.state.position)

    def _restore_and_sync(self) -> None:
        """Load the checkpoint to resume from, if any, then give the rollout engine the policy."""
        config = self.config
        if config.resume_from_checkpoint:
            path = resolve_resume_path(config.resume_from_checkpoint, config.output_dir)
            self.state = load_checkpoint(self.engine, path, frozen_excluded=config.uses_lora)
            logger.info(f"resumed from {path} at step {self.state.step}")
        # the engine started from the checkpoint on disk: from here on it samples the policy being trained
        # (for qlora the 4-bit weights, for a resumed run the restored ones), in evaluate() before train() too
        self._sync_rollout_weights(first=True)

    # ================================================================================================
    @phase("step", passes=(TrainingError,))  # a stop on signal is deliberate; its message says it all
    def train(self) -> dict:
        """Run until max_steps / epochs; returns the final metrics (and paths of what was saved)."""
        cfg = self.config
        reporter = RunReporter(cfg, self.is_main, self.total_steps, start_step=self.state.step)
        logger.info(f"training {cfg.tuning_strategy} on {', '.join(cfg.dataset_names)}: {len(self.train_set)} "
                    f"prompts, {self.world} rank(s), {self.total_steps} steps of {self.prompts_per_step} prompts "
                    f"x {cfg.k_samples} samples per rank")
        signals = GracefulStop(before=self.failures.raise_if_peer_failed)
        metrics: dict = {}
        try:
            signals.install()
            if self.state.step == 0 and cfg.eval_on_start and self.eval_set is not None:
                self.evaluate(reporter)  # step 0: what training starts from
            while self.state.step < self.total_steps:
                step_start = time.perf_counter()
                rollout, drawn = self._collect_rollouts()  # prompts -> k completions each -> rewards
                batch, rewards, times = self._rollout_batch(rollout), rollout.rewards, dict(rollout.times)
                micro_batches = self._micro_batches(batch)
                policy_logprobs, ref_logprobs, times["logprobs"] = self._policy_and_reference_logprobs(
                    batch, micro_batches)
                if cfg.kl_in_reward:  # r - beta * sum_t (lp - ref), in place of the loss's KL term
                    rewards = kl_penalized_rewards(rewards, policy_logprobs.cpu(), ref_logprobs.cpu(),
                                                   batch.completion_mask, cfg.kl_beta)
                advantages = self._advantages(rewards)  # [N]
                train_metrics, times["train"] = self._optimize(batch, micro_batches, advantages, ref_logprobs,
                                                               stale=rollout.stats.get("rollout/staleness", 0) > 0)
                times["sync"] = self._sync_rollout_weights()
                self.state.step += 1
                times["step"] = time.perf_counter() - step_start

                metrics = self._step_metrics(batch, drawn, rewards, advantages, {**rollout.stats, **train_metrics},
                                             times)
                reporter.log_step(self.state.step, metrics)
                self._log_completions(rollout.prompts, rollout.texts, rollout.rewards)
                if cfg.eval_steps and self.state.step % cfg.eval_steps == 0:
                    self.evaluate(reporter)
                stop = dist_utils.any_rank(signals.requested is not None)
                if stop or (cfg.save_steps and self.state.step % cfg.save_steps == 0):
                    self._save_checkpoint()
                if stop:
                    raise TrainingError(f"stopped by signal at step {self.state.step}; checkpoint saved to "
                                        f"{self.state.last_checkpoint}; continue with "
                                        f"--resume_from_checkpoint latest")
            if self.eval_set is not None and not (cfg.eval_steps and self.state.step % cfg.eval_steps == 0):
                self.evaluate(reporter)
            saved = self._save_final_model()
        finally:
            signals.restore()
            reporter.close()
            self._plot()
        return {**metrics, "saved": saved}

    # ---------------------------------------------------------------------------------------- phases
    @phase("micro-batches")
    def _micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """The step's rows grouped by --max_tokens_per_micro_batch; every rank gets the same number of groups."""
        micro_batches = step_micro_batches(batch, self.config, self.device)
        self._sizes.update({"longest completion": batch.completion_width, "micro-batches": len(micro_batches),
                            "tokens per micro-batch (padded, largest)": max(mb.batch.input_ids.numel()
                                                                            for mb in micro_batches),
                            "--max_tokens_per_micro_batch": self.config.max_tokens_per_micro_batch})
        return micro_batches

    def memory_sizes(self) -> dict:
        """The sizes of the step in progress, for an out-of-memory message."""
        return dict(getattr(self, "_sizes", {}))

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-relative advantages; with --scale_rewards batch the std is the whole step's, over every rank
        (two reductions: the mean, then the squared deviations about it, which keeps the std exact for rewards far
        from 0). Under dynamic sampling the uniform filler groups count in that std like any kept group."""
        batch_std = step_std(rewards) if self.config.scale_rewards == "batch" else None
        return group_advantages(rewards, self.config.k_samples, scale=self.config.scale_rewards, batch_std=batch_std)

    @phase("log-probs")
    @torch.no_grad()
    def _policy_and_reference_logprobs(self, batch: RolloutBatch, micro_batches: list[MicroBatch]):
        """The policy's log-probs before the update (only for --kl_in_reward, whose penalty the advantages need
        first) and the reference's (KL), each step-wide [N, T] on the training device, or None. The loss's ratio
        takes its old log-probs from the first update's own forward instead (see _optimize)."""
        cfg = self.config
        start = time.perf_counter()
        policy = torch.zeros(batch.completion_ids.shape, device=self.device) if cfg.kl_in_reward else None
        ref = torch.zeros(batch.completion_ids.shape, device=self.device) if cfg.kl_coef > 0 else None
        for mb in micro_batches if policy is not None or ref is not None else ():
            if policy is not None:
                mb.scatter(score(self.engine, mb, cfg)[0], into=policy)
            if ref is not None:
                mb.scatter(self._reference_logprobs(mb), into=ref)
        return policy, ref, time.perf_counter() - start

    @phase("optimize")
    def _optimize(self, batch: RolloutBatch, micro_batches: list[MicroBatch], advantages: torch.Tensor,
                  ref_logprobs, stale: bool = False):
        """num_iterations optimizer steps over the micro-batches, each the gradient of the whole step's loss.

        The old log-probs of the ratio are the first update's own (detached: ratio 1 there, dropout or not); later
        updates read them back, and with dropout the importance weights' dropout-free ones too (optimize.update).
        `stale`: the rollouts came from an older policy (--async_rollout), so their log-prob gap to the trainer is
        logged as rollout/offpolicy_logprob_diff, not as the engine's mismatch."""
        start = time.perf_counter()
        normaliser = step_normaliser(batch, self.config)
        metrics: dict = {}
        old_logprobs = None
        keep_old = torch.zeros(batch.completion_ids.shape, device=self.device) \
            if self.config.num_iterations > 1 else None
        # without dropout the dropout-free log-probs are the old ones: nothing more to keep
        keep_sampled = torch.zeros_like(keep_old) if keep_old is not None and self.config.is_correction \
            and has_dropout(self.engine.module) else None
        sampled_logprobs = None
        for iteration in range(self.config.num_iterations):
            first = iteration == 0
            result = update(self.engine, micro_batches, advantages, old_logprobs, ref_logprobs, normaliser,
                            self.config, first_pass=first, keep_old=keep_old if first else None,
                            mismatch_key="rollout/offpolicy_logprob_diff" if stale else "rollout/logprob_diff",
                            sampled_logprobs=sampled_logprobs, keep_sampled=keep_sampled if first else None)
            old_logprobs, sampled_logprobs = keep_old, keep_sampled
            metrics = {**result.metrics, **{k: v for k, v in metrics.items() if k.startswith("rollout/")}}
            grad_norm = self._grad_norm()
            if result.bad or not math.isfinite(grad_norm):
                self._record_bad_step("non-finite loss" if result.bad else f"non-finite gradient norm ({grad_norm})")
            else:
                self.state.consecutive_bad_steps = 0
        metrics["grad_norm"] = self._grad_norm()
        metrics["lr"] = self.engine.get_lr()[0]
        return metrics, time.perf_counter() - start

    @phase("weight sync")
    def _sync_rollout_weights(self, first: bool = False) -> float:
        """Push the updated policy into the rollout engine (vLLM, or the rollout ranks in server mode); the
        colocated HF engine samples the live model."""
        if not engine_holds_weights(self.config):
            return 0.0
        from grpo.model.weight_sync import sync_weights

        stats = sync_weights(self.rollout_engine, self.engine.module, self.config.tuning_strategy,
                             zero3=self.zero3, first_sync=first,
                             dtype=engine_dtype(self.config, self.dtype))
        self._last_sync = stats
        return stats.seconds

    # ------------------------------------------------------------------------------------------- eval
    @torch.no_grad()
    @phase("eval", after_step=True)
    def evaluate(self, reporter: Optional[RunReporter] = None) -> dict:
        """Mean reward, per-function accuracy and length on the eval prompts (sharded over ranks), in total and per
        dataset, plus one sample row per prompt."""
        cfg = self.config
        if self.eval_set is None:
            return {}
        mine = list(range(self.rank, len(self.eval_set), self.world))
        rows = [self.eval_set[i] for i in mine]
        samples = []
        self._restore_engine_weights()  # on every rank, with or without eval rows
        if rows or getattr(self.rollout_engine, "collective_generate", False):  # all ranks generate together
            self.rollout_engine.wake()
            sampling = SamplingSettings(n=1, max_new_tokens=cfg.rollout_max_new_tokens, temperature=cfg.temperature,
                                        top_p=cfg.top_p, greedy=cfg.eval_greedy, logprobs=False)
            images = self._prompt_images(rows)
            completions = self.rollout_engine.generate([r["prompt_ids"] for r in rows], sampling,
                                                       **({"images": images} if images else {}))
            self.rollout_engine.sleep(keep_weights=True)  # no sync follows: the next rollout needs these weights
        if rows:
            texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            result = self.rewards(texts, [r["answer"] for r in rows], [r["data_source"] for r in rows],
                                  prompts=[r["prompt_text"] for r in rows],
                                  completion_ids=[c.token_ids for c in completions],
                                  prompt_messages=[r.get("messages") for r in rows])
            samples = eval_sample_rows(rows, texts, completions, result)
        all_samples = [s for part in dist_utils.gather_objects(samples) for s in part]
        metrics = eval_metrics(all_samples)
        if reporter is not None:
            reporter.log_eval(self.state.step, metrics, all_samples)
            self._plot()
        return metrics

    # -------------------------------------------------------------------------------------- internals
    def _init_deepspeed(self, policy):
        import deepspeed

        trainable = [p for p in policy.parameters() if p.requires_grad]
        if not trainable:
            raise ConfigError("the model has no trainable parameters; check --tuning_strategy and "
                              "--lora_target_modules")
        optimizer = None
        if "optimizer" not in self.ds_config:
            optimizer = torch.optim.AdamW(trainable, lr=self.config.effective_learning_rate,
                                          weight_decay=self.config.weight_decay)
        scheduler = lr_schedule(optimizer, self.config, self.total_steps * self.config.num_iterations) \
            if optimizer is not None else None
        engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=trainable, optimizer=optimizer,
                                               lr_scheduler=scheduler, config=self.ds_config)
        # from_pretrained leaves the model in eval mode, where gradient checkpointing recomputes nothing and LoRA
        # dropout drops nothing; scoring passes that must not drop switch to eval mode themselves
        engine.train()
        return engine

    def close(self) -> None:
        """Stop the rollout ranks of server mode (they wait for this, or for training rank 0 to go away)."""
        close = getattr(self.rollout_engine, "close", None)
        if close is not None:
            close()

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.reference is not None:  # full fine-tuning: a frozen copy of the base model
            return score(self.reference, mb, self.config)[0].float()
        with reference_mode(self.engine.module):  # lora / qlora: the same weights, adapter off
            return score(self.engine, mb, self.config)[0].float()

    def _grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def _record_bad_step(self, why: str) -> None:
        self.state.consecutive_bad_steps += 1
        logger.warning(f"step {self.state.step + 1}: {why}; update skipped "
                       f"({self.state.consecutive_bad_steps}/{MAX_BAD_STEPS} in a row)")
        if self.state.consecutive_bad_steps >= MAX_BAD_STEPS:
            last = self.state.last_good_checkpoint
            lr_flag = "--learning_rate_lora" if self.config.uses_lora else "--learning_rate"
            raise TrainingError(
                f"{MAX_BAD_STEPS} steps in a row had a non-finite loss or gradient ({why}). "
                + (f"The last good checkpoint is {last}; resume from it (--resume_from_checkpoint {last}) with a "
                   f"lower {lr_flag} or --max_grad_norm." if last else
                   f"No checkpoint was saved before; start again with a lower {lr_flag} or --max_grad_norm."))

    @phase("metrics", after_step=True)
    def _step_metrics(self, batch, drawn: RolloutRound, rewards, advantages, train_metrics, times) -> dict:
        local = step_metrics(batch, drawn, rewards, advantages, train_metrics, times, self.config.k_samples,
                             self.config.kl_in_reward)
        if engine_holds_weights(self.config):
            local["sync/bytes"] = float(self._last_sync.bytes)
            freed = getattr(self.rollout_engine, "last_sleep_freed_bytes", None)  # server-mode engines never sleep
            if freed is not None:
                local["memory/vllm_sleep_freed_gib"] = freed / 2**30
        return mean_over_ranks(local)

    def _log_completions(self, prompts, texts, rewards) -> None:
        """One rollout sample per prompt and rank each step, for reading what the model writes."""
        path = os.path.join(self.config.output_dir, "completions", f"rank{self.rank}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        k = self.config.k_samples
        with open(path, "a") as fh:
            for i, p in enumerate(prompts):
                fh.write(json.dumps({"step": self.state.step, "index": p["index"], "data_source": p["data_source"],
                                     "prompt": p["prompt_text"], "completion": texts[i * k],
                                     "reward": rewards[i * k].item(), "answer": p["answer"]}) + "\n")

    @phase("save", after_step=True)
    def _save_checkpoint(self) -> None:
        trained = (self.state.epoch, self.state.position)
        if self._pending_rollouts is not None:  # the prompts in flight are not trained yet: a resume draws them again
            self.state.epoch, self.state.position = self._position_before_prefetch
        try:
            path = save_checkpoint(self.engine, self.state, self.config.output_dir, self.config.save_total_limit,
                                   frozen_excluded=self.config.uses_lora)
        finally:
            self.state.epoch, self.state.position = trained
        logger.info(f"checkpoint saved: {path}")

    @phase("save final model", after_step=True)
    def _save_final_model(self) -> dict:
        state_dict = self.engine._zero3_consolidated_16bit_state_dict() if self.zero3 else None
        saved = {}
        if self.is_main:
            saved = save_final_model(self.engine.module, self.tokenizer, self.config.output_dir, self.config,
                                     self.model_path, self.dtype, state_dict=state_dict)
            logger.info("final model saved: " + ", ".join(saved.values()))
        dist_utils.barrier()
        return saved

    def _plot(self) -> None:
        if self.is_main:
            rows = read_metrics(os.path.join(self.config.output_dir, "metrics.jsonl"))
            if rows:
                plot_training_curves(rows, os.path.join(self.config.output_dir, "training_curves.png"))
