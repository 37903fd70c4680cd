"""GRPOTrainer: one training step reads top to bottom as

    rollout -> rewards -> advantages -> old/ref log-probs -> loss + DeepSpeed step -> weight sync -> log/eval/save

Everything that is not wiring lives elsewhere: the run's setup in setup.py, math in grpo/algorithm/, a step's
rollouts in grpo/rollout/collect.py, the step's tensors in step_data.py, the update in update.py, weight sync in
grpo/sync/weight_sync.py, checkpoints in grpo/checkpoint/, the step's metrics in metrics.py, and what the run writes
besides checkpoints and metrics (its options, sampled completions, curves, the final model, the summary, hub pushes)
in outputs.py.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

import torch

from grpo.algorithm import group_advantages, kl_penalized_rewards
from grpo.checkpoint.base_model import base_model_record
from grpo.checkpoint.layout import folder_bytes, readable_size
from grpo.checkpoint.resume import check_base_model
from grpo.checkpoint.store import TrainerState, load_checkpoint, resolve_resume_path, save_checkpoint
from grpo.config.options import GRPOConfig
from grpo.errors import ConfigError, TrainingError
from grpo.checkpoint.hub import check_hub
from grpo.model.loading import load_policy, load_reference, reference_mode
from grpo.rollout.collect import RolloutCollector
from grpo.rollout.dynamic_sampling import RolloutRound
from grpo.rollout.engines import build_rollout_engine, engine_dtype, engine_holds_weights
from grpo.runtime import distributed as dist_utils
from grpo.runtime.deepspeed_config import default_dtype, zero_stage
from grpo.runtime.distributed import seed_everything
from grpo.runtime.failures import FailureReporter, phase
from grpo.runtime.gpu_budget import cap_gpu_memory, use_expandable_segments
from grpo.runtime.shared_output import check_shared_output_dir
from grpo.runtime.roles import job_rank, rollout_index, rollout_ranks_of
from grpo.runtime.signals import GracefulStop
from grpo.train.agent_setup import agent_rollouts_over
from grpo.train.evaluation import evaluate_prompts
from grpo.train.metrics import ZeroSpreadWatch, mean_over_ranks, step_metrics, step_std
from grpo.train.micro_batches import MicroBatch
from grpo.train.outputs import RunOutputs
from grpo.train.reporting import RunReporter
from grpo.train.run_summary import steps_phrase
from grpo.train.trackers import check_trackers
from grpo.memory.planner import agreed_plan
from grpo.memory.report import save_plan
from grpo.memory.watch import MemoryWatch
from grpo.train.setup import RunData, initialize_deepspeed, log_failed_start, longest_completion, prepare_run
from grpo.train.step_data import RolloutBatch, StepData, build_rollout_batch
from grpo.train.token_budget import checkpointing_on, micro_batch_token_budget
from grpo.train.update import has_dropout, score, step_micro_batches, step_normaliser, update
from grpo.train.warm_start import run_warm_start

logger = logging.getLogger("grpo")
MAX_BAD_STEPS = 3


class GRPOTrainer:
    """GRPO on DeepSpeed. `GRPOTrainer(config=GRPOConfig(...), reward_funcs=[...]).train()`.

    `reward_funcs` are extra batched reward callables `fn(completions, answers, **row) -> list[float]` applied to
    every row with weight 1, on top of the rewards the dataset registry names.
    """

    def __init__(self, config: GRPOConfig, reward_funcs: Sequence[Callable] = (), prepared: RunData | None = None):
        """`prepared`: what grpo.train.setup.prepare_run(config, reward_funcs) returned, where the caller checked
        the run's inputs before importing this module (train_grpo.py does); otherwise prepared here."""
        self.config = config
        index = rollout_index(rollout_ranks_of(config))
        if index is not None:  # a script run on every rank of a server-mode job
            raise ConfigError(f"--rollout_mode server: this process is rollout rank {index} (job rank {job_rank()}), "
                              f"which only generates; run grpo.serve_rollouts(config) on it instead of GRPOTrainer, "
                              f"as train_grpo.py does")
        # --- options, data and rewards first: their errors come before DeepSpeed starts or any model loads ------
        self.hub_repo = None  # --push_to_hub's repository (rank 0 pushes)
        if job_rank() == 0:
            check_trackers(config)  # --report_to's libraries (rank 0 reports)
            self.hub_repo = check_hub(config)  # the token is there and the hub answers, in seconds
        data = prepared or prepare_run(config, reward_funcs)
        # the run's own options, as prepare_run resolved them (the caller's GRPOConfig stays as it was given)
        self.config = data.config if data.config is not None else config.thawed()
        try:
            self._start(data)
        except Exception as exc:
            log_failed_start(config.output_dir, exc)  # the run's log says why it stopped, not only the console
            raise

    def _start(self, data: RunData) -> None:
        """The process group, the checkpoint to resume from, the models, DeepSpeed and the rollout engine."""
        config = self.config
        self._owns_group = dist_utils.init_distributed(config.ddp_timeout_minutes)  # close() ends a group it started
        self._trained = False
        check_shared_output_dir(config.output_dir)  # every node sees it: checkpoints and failure records live there
        self.rank, self.world = dist_utils.rank(), dist_utils.world_size()
        self.is_main = dist_utils.is_main()
        self.failures = FailureReporter(config.output_dir, self.rank, self.world, rollout_ranks_of(config))
        seed_everything(config.seed + self.rank)
        self.model_path, self.tokenizer, self.vision = data.model_path, data.tokenizer, data.vision
        self.rewards, self.train_set, self.eval_set = data.rewards, data.train_set, data.eval_set
        self.total_steps = data.total_steps
        # the longest a training completion may be: seq_mean_token_sum_norm's constant
        self.max_completion_tokens = longest_completion(config, {**data.episode_datasets, **data.agent_datasets})
        # every automatic memory choice, made once before loading; the ranks agree on the least budget
        self.plan = agreed_plan(data.memory_plan, config, data.model_path, self.max_completion_tokens)
        # the options resolved, and frozen from here on: what the run uses and saves. --max_tokens_per_micro_batch
        # auto takes the plan's log-prob chunk (halved where the chunk is what limits the micro-batches)
        if config.max_tokens_per_micro_batch == "auto" and self.plan is not None \
                and self.plan.logprob_chunk_tokens != config.logprob_chunk_tokens:
            config.resolve(logprob_chunk_tokens=self.plan.logprob_chunk_tokens)
        config.freeze()
        self.prompts_per_step = config.per_device_train_batch_size * config.gradient_accumulation_steps
        self.resume_path = self._checkpoint_to_resume()  # verified, and for lora / qlora on its base: before loading

        # --- models, DeepSpeed, rollout engine --------------------------------------------------------
        self.device, self.dtype = dist_utils.device(), default_dtype()
        self.memory = MemoryWatch(self.plan, self.device)  # each phase's measured peak beside the plan's
        if self.device.type == "cuda":
            use_expandable_segments()
        cap_gpu_memory(config.gpu_memory_gib, self.device)
        self.ds_config = data.ds_config
        self.zero3 = zero_stage(self.ds_config) == 3
        policy = load_policy(config, self.model_path, self.dtype, self.device,
                             checkpointing=self.plan.gradient_checkpointing if self.plan else None)
        self.reference = load_reference(config, self.model_path, self.dtype, self.device)
        self.demonstrations = data.demonstrations
        self.demonstration_datasets = data.demonstration_datasets  # tool datasets: demonstrations laid out as episodes
        self.warm_start_losses: list[float] = []  # per warm-start step: negative log-likelihood per model token
        self.engine = initialize_deepspeed(policy, self.ds_config, config,  # a warm start's steps come first
                                           self.total_steps * config.num_iterations + config.warm_start_steps)
        self.state = TrainerState()
        self._sizes: dict = {}  # the step's sizes (micro-batches), for an out-of-memory message
        self._last_sync = None
        engine = build_rollout_engine(config, self.model_path, self.engine.module, self.tokenizer, self.vision,
                                      self.rank, self.dtype, completion_tokens=self.max_completion_tokens,
                                      episode_datasets=sorted(data.episode_datasets), plan=self.plan)
        self.rollouts = RolloutCollector(config, engine, self.tokenizer, self.rewards, self.vision, self.train_set,
                                         data.order, self.total_steps, sync_weights=self._sync_rollout_weights,
                                         episode_datasets=data.episode_datasets,
                                         agents=agent_rollouts_over(config, data.agent_datasets, engine))
        self.outputs = RunOutputs(config, self.model_path, self.tokenizer, self.dtype, self.rank, self.is_main,
                                  self.hub_repo, writes_completions=self.rollouts.first_in_group)
        try:
            self._restore_and_sync()
            # (the log-prob chunk it returns is the resolved option's)
            self.micro_batch_tokens, _ = micro_batch_token_budget(config, self.engine, engine, self.device, self.plan)
        except BaseException:
            self.close()  # server mode: the rollout ranks stop with us
            raise
        self.outputs.save_options(self.resume_path, self.state.step)  # grpo_config.json
        if self.is_main and self.plan is not None:
            save_plan(self.plan, config.output_dir)  # the plan beside the options it came from

    @property
    def rollout_engine(self):
        """The engine the rollouts come from (grpo.rollout.engine.RolloutEngine)."""
        return self.rollouts.engine

    def _checkpoint_to_resume(self):
        """The intact checkpoint to resume from (None for a fresh run). A lora / qlora checkpoint holds only the
        adapter: the base model's files must be those it was trained on. The record of them is taken here for
        this run's own checkpoints."""
        config = self.config
        self._base_record = (base_model_record(config.model_name_or_path, self.model_path)
                             if config.uses_lora and self.is_main else None)
        if not config.resume_from_checkpoint:
            return None
        path = resolve_resume_path(config.resume_from_checkpoint, config.output_dir)
        if config.uses_lora:
            check_base_model(path, self.model_path)
        return path

    def _restore_and_sync(self) -> None:
        """Load the checkpoint to resume from, if any, then give the rollout engine the policy."""
        config = self.config
        if self.resume_path is not None:
            self.state = load_checkpoint(self.engine, self.resume_path, frozen_excluded=config.uses_lora)
        # the engine started from the checkpoint on disk: from here on it samples the policy being trained
        # (for qlora the 4-bit weights, for a resumed run the restored ones), in evaluate() before train() too
        self._sync_rollout_weights(first=True)

    # ================================================================================================
    @phase("step", passes=(TrainingError,))  # a stop on signal is deliberate; its message says it all
    def train(self) -> dict:
        """Run until max_steps / epochs; returns the final metrics (and paths of what was saved)."""
        cfg = self.config
        reporter = RunReporter(cfg, self.is_main, self.total_steps, start_step=self.state.step)
        started, start_step = time.perf_counter(), self.state.step
        each = f"{self.prompts_per_step} prompts x {cfg.k_samples} samples per rank"
        logger.info(f"training {cfg.tuning_strategy} on {', '.join(cfg.dataset_names)}: {len(self.train_set)} "
                    f"prompts, {self.world} rank(s), {steps_phrase(start_step, self.total_steps, each)}")
        signals = GracefulStop(before=self.failures.raise_if_peer_failed)
        spread = ZeroSpreadWatch()
        metrics: dict = {}
        try:
            signals.install()
            if self.state.step == 0 and self.demonstrations is not None:
                self._warm_start()  # supervised steps on demonstrations: what GRPO starts from
            if self.state.step == 0 and cfg.eval_on_start and self.eval_set is not None:
                self.evaluate(reporter)  # step 0: what training starts from
            while self.state.step < self.total_steps:
                step_start = time.perf_counter()
                with self.memory.phase("rollout"):
                    rollout, drawn = self._collect_rollouts()        # prompts -> k completions each -> rewards
                times = dict(rollout.times)
                with self.memory.phase("logprobs"):
                    step, times["logprobs"] = self._step_data(rollout)  # batch, reference log-probs, advantages
                with self.memory.phase("train"):
                    train_metrics, times["train"] = self._optimize(step)  # loss + DeepSpeed step(s)
                with self.memory.phase("sync"):
                    # the new policy into the rollout engine (the policy after this step: its version)
                    times["sync"] = self._sync_rollout_weights(version=self.state.step + 1)
                self.state.step += 1
                times["step"] = time.perf_counter() - step_start

                metrics = self._step_metrics(step, drawn, {**rollout.stats, **train_metrics}, times)
                metrics.update(self.memory.step_metrics())  # measured peaks beside the plan's
                reporter.log_step(self.state.step, metrics)
                if self.is_main:
                    spread.check(self.state.step, metrics)  # a step whose groups all scored alike taught nothing
                self.outputs.log_completions(self.state.step, rollout)  # one sample per prompt
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
            self.outputs.plot()
        self.outputs.summarize(time.perf_counter() - started, self.state.step - start_step, saved)
        self.outputs.push_final_model(saved, self.state.step)
        self._trained = True
        return {**metrics, "saved": saved}

    # ---------------------------------------------------------------------------------------- phases
    @phase("rollout")
    def _collect_rollouts(self) -> tuple[RolloutRound, RolloutRound]:
        """(kept, drawn): the completions the step trains on, and every completion sampled (RolloutCollector)."""
        self._sizes = {}  # the last step's micro-batches say nothing about this rollout's memory
        return self.rollouts.collect(self.state)

    def _step_data(self, rollout: RolloutRound) -> tuple[StepData, float]:
        """The step's tensors: batch, micro-batches, reference log-probs (KL), rewards (KL-penalized with
        --kl_in_reward) and advantages; and the seconds the log-prob passes took."""
        batch = self._rollout_batch(rollout)
        micro_batches = self._micro_batches(batch)
        policy_logprobs, ref_logprobs, seconds = self._policy_and_reference_logprobs(batch, micro_batches)
        rewards = rollout.rewards                                          # [N]
        if self.config.kl_in_reward:  # r - beta * sum_t (lp - ref), in place of the loss's KL term
            rewards = kl_penalized_rewards(rewards, policy_logprobs.cpu(), ref_logprobs.cpu(),
                                           batch.completion_mask, self.config.kl_beta)
        step = StepData(batch, micro_batches, self._advantages(rewards), rewards=rewards,
                        normaliser=step_normaliser(batch, self.config, self.max_completion_tokens),
                        ref_logprobs=ref_logprobs,
                        stale=rollout.stats.get("rollout/staleness", 0) > 0)
        return step, seconds

    def _rollout_batch(self, rollout: RolloutRound) -> RolloutBatch:
        return build_rollout_batch([p["prompt_ids"] for p in rollout.prompts], rollout.completions,
                                   self.tokenizer.pad_token_id, mask_truncated=self.config.mask_truncated_completions,
                                   images=rollout.images, version=self.state.step)

    @phase("micro-batches")
    def _micro_batches(self, batch: RolloutBatch) -> list[MicroBatch]:
        """The step's rows grouped by --max_tokens_per_micro_batch; every rank gets the same number of groups."""
        micro_batches = step_micro_batches(batch, self.config, self.device, self.micro_batch_tokens)
        self._sizes = {"longest completion": batch.completion_width, "micro-batches": len(micro_batches),
                       "tokens per micro-batch (padded, largest)": max(mb.batch.input_ids.numel()
                                                                       for mb in micro_batches),
                       "--max_tokens_per_micro_batch": self.micro_batch_tokens}
        return micro_batches

    def memory_sizes(self) -> dict:
        """The sizes of the step in progress, for an out-of-memory message."""
        return {**self.rollouts.sizes, **self._sizes}

    def memory_settings(self) -> dict:
        """What the run already does against memory, so that an out-of-memory message suggests the rest."""
        engine = self.rollout_engine
        return {"checkpointing": checkpointing_on(self.engine.module),
                "strategy": self.config.strategy,
                "engine_keeps_weights": engine.sleeps_kv_only and not (engine.takes_adapter or engine.merges_in_place)}

    def _advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        """Group-relative advantages; with --scale_rewards batch the std is the whole step's, over every rank
        (two reductions: the mean, then the squared deviations about it, which keeps the std exact for rewards far
        from 0). Under dynamic sampling the uniform filler groups count in that std like any kept group."""
        copies = self.config.sequence_parallel_size  # a sequence-parallel group's ranks hold the same rewards
        batch_std = step_std(rewards, copies) if self.config.scale_rewards == "batch" else None
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
        ref = torch.zeros(batch.completion_ids.shape, device=self.device) if cfg.kl_beta > 0 else None
        for mb in micro_batches if policy is not None or ref is not None else ():
            if policy is not None:
                mb.scatter(score(self.engine, mb, cfg)[0], into=policy)
            if ref is not None:
                mb.scatter(self._reference_logprobs(mb), into=ref)
        return policy, ref, time.perf_counter() - start

    def _reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        if self.reference is not None:  # full fine-tuning: a frozen copy of the base model
            return score(self.reference, mb, self.config)[0].float()
        with reference_mode(self.engine.module):  # lora / qlora: the same weights, adapter off
            return score(self.engine, mb, self.config)[0].float()

    @phase("optimize")
    def _optimize(self, step: StepData) -> tuple[dict, float]:
        """num_iterations optimizer steps over the micro-batches, each the gradient of the whole step's loss.

        The old log-probs of the ratio are the first update's own (detached: ratio 1 there, dropout or not); later
        updates read them back, and with dropout the importance weights' dropout-free ones too (update.update)."""
        start = time.perf_counter()
        if self.config.num_iterations > 1:
            # without dropout the dropout-free log-probs are the old ones: nothing more to keep
            step.keep_for_later_updates(self.device, keep_sampled=self.config.is_correction
                                        and has_dropout(self.engine.module))
        metrics: dict = {}
        for iteration in range(self.config.num_iterations):
            result = update(self.engine, step, self.config, first_pass=iteration == 0)
            metrics = {**result.metrics, **{k: v for k, v in metrics.items() if k.startswith("rollout/")}}
            grad_norm = self._grad_norm()
            if result.bad or not math.isfinite(grad_norm):
                self._record_bad_step("non-finite loss" if result.bad else f"non-finite gradient norm ({grad_norm})")
            else:
                self.state.consecutive_bad_steps = 0
        metrics["grad_norm"] = self._grad_norm()
        metrics["lr"] = self.engine.get_lr()[0]
        return metrics, time.perf_counter() - start

    @phase("warm start")
    def _warm_start(self) -> None:
        """--warm_start_steps supervised steps on the datasets' demonstrations (grpo.train.warm_start), with the
        rollout engine asleep as during an update; then it gets the result."""
        self.rollout_engine.sleep()
        self.warm_start_losses = run_warm_start(self.engine, self.config, self.demonstrations, self.tokenizer,
                                                self.demonstration_datasets, self.max_completion_tokens,
                                                self.micro_batch_tokens, self.device)
        self._sync_rollout_weights()

    @phase("weight sync")
    def _sync_rollout_weights(self, first: bool = False, version: int | None = None) -> float:
        """Push the updated policy into the rollout engine (vLLM, or the rollout ranks in server mode); the
        colocated HF engine samples the live model. `version`: the policy's, in optimizer steps (default: the steps
        done), which streamed rollouts tag their tokens with."""
        if not engine_holds_weights(self.config):
            return 0.0
        from grpo.sync.weight_sync import sync_weights

        self._last_sync = sync_weights(self.rollout_engine, self.engine.module, self.config.strategy,
                                       zero3=self.zero3, first_sync=first,
                                       dtype=engine_dtype(self.config, self.dtype))
        self.rollout_engine.mark_policy_version(self.state.step if version is None else version)
        return self._last_sync.seconds

    # ------------------------------------------------------------------------------------------- eval
    @torch.no_grad()
    @phase("eval", after_step=True)
    def evaluate(self, reporter: RunReporter | None = None) -> dict:
        """Mean reward, per-function accuracy and length on the eval prompts (sharded over ranks), in total and per
        dataset, plus one sample row per prompt."""
        if self.eval_set is None:
            return {}
        metrics, all_samples = evaluate_prompts(self.eval_set, self.rollouts, self.rank, self.world)
        if reporter is not None:
            reporter.log_eval(self.state.step, metrics, all_samples)
            self.outputs.plot()
        return metrics

    # -------------------------------------------------------------------------------------- internals
    def close(self) -> None:
        """Stop the rollout ranks of server mode (they wait for this, or for training rank 0 to go away), and the
        watch over the other ranks; then end the process group this trainer started, so that a notebook can train
        again. Several ranks end it together after a finished run; after a failed one, a group of several ranks is
        left to the failure handling (a peer may never come to end it)."""
        self.failures.close()
        self.rollouts.close()
        self.memory.close()
        if self._owns_group and (self._trained or self.world == 1):
            self._owns_group = False
            dist_utils.shutdown()

    def _grad_norm(self) -> float:
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def _record_bad_step(self, why: str) -> None:
        self.state.consecutive_bad_steps += 1
        logger.warning(f"step {self.state.step + 1}: {why}; update skipped "
                       f"({self.state.consecutive_bad_steps}/{MAX_BAD_STEPS} in a row)")
        if self.state.consecutive_bad_steps >= MAX_BAD_STEPS:
            last = self.state.last_good_checkpoint
            raise TrainingError(
                f"{MAX_BAD_STEPS} steps in a row had a non-finite loss or gradient ({why}). "
                + (f"The last good checkpoint is {last}; resume from it (--resume_from_checkpoint {last}) with a "
                   f"lower --learning_rate or --max_grad_norm." if last else
                   "No checkpoint was saved before; start again with a lower --learning_rate or --max_grad_norm."))

    @phase("metrics", after_step=True)
    def _step_metrics(self, step: StepData, drawn: RolloutRound, train_metrics: dict, times: dict) -> dict:
        local = step_metrics(step.batch, drawn, step.rewards, step.advantages, train_metrics, times,
                             self.config.k_samples, self.config.kl_in_reward, self.config.sequence_parallel_size)
        if engine_holds_weights(self.config):
            local["sync/bytes"] = float(self._last_sync.bytes)
            freed = self.rollout_engine.last_sleep_freed_bytes  # None: it never sleeps (server mode)
            if freed is not None:
                local["memory/vllm_sleep_freed_gib"] = freed / 2**30
        return mean_over_ranks(local)

    @phase("save", after_step=True)
    def _save_checkpoint(self) -> None:
        trained = (self.state.epoch, self.state.position)
        # the prompts of a request in flight are not trained yet: a resume draws them again
        self.state.epoch, self.state.position = self.rollouts.trained_position(self.state)
        self.state.extra.update(self.rollouts.stream_record())  # what was in flight (a resume says what it redoes)
        try:
            path = save_checkpoint(self.engine, self.state, self.config.output_dir, self.config.save_total_limit,
                                   frozen_excluded=self.config.uses_lora, config=self.config,
                                   base_record=self._base_record)
        finally:
            self.state.epoch, self.state.position = trained
        if self.is_main:
            logger.info(f"checkpoint saved: {path} ({readable_size(folder_bytes(path))})")
        if self.config.push_to_hub and self.config.hub_strategy == "every_save":
            self.outputs.push_checkpoint_model(self.engine, self.zero3, self.state.step)

    @phase("save final model", after_step=True)
    def _save_final_model(self) -> dict:
        self.rollout_engine.release_base()  # (in-place mode: a merged model reads the base, which must be its own)
        return self.outputs.final_model(self.engine, self.zero3, self.state.step)
