"""The rollout phase of a training step: prompts -> k completions each (vLLM, the HF engine, or the rollout ranks of
server mode) -> their rewards, with the engine woken before and put to sleep after.

`GRPOTrainer` inherits it, so the step loop in trainer.py reads `self._collect_rollouts()` where the phase runs. It uses
the trainer's config, state (step and data position), prompt order and set, tokenizer, reward router, rollout engine,
vision processor, failure reporter (every phase names itself in a failure) and weight sync.
"""
from __future__ import annotations

import time
from typing import Optional

from grpo.runtime import distributed as dist_utils
from grpo.train.step_data import RolloutBatch, build_rollout_batch
from grpo.rollout.dynamic_sampling import PendingRollouts, RolloutRound, dynamic_rollouts
from grpo.runtime.failures import phase
from grpo.rollout.engine import SamplingSettings


class RolloutPhase:
    """Mixin of GRPOTrainer: one step's rollouts, scored (see the module docstring for what it reads)."""

    def _collect_rollouts(self) -> tuple[RolloutRound, RolloutRound]:
        """The step's prompts with k scored completions each: one round, or with --filter_zero_std_groups as many
        rounds as it takes to fill the step with groups whose rewards differ (see dynamic_sampling.py).
        Returns (kept, drawn): what the step trains on, and every completion sampled (for reward metrics)."""
        cfg = self.config
        wake = self._switch_engine(awake=True)  # once for all rounds: each sleep drops the KV cache and weights
        if not cfg.filter_zero_std_groups:
            kept = drawn = self._rollout_round()
        else:
            kept, drawn = dynamic_rollouts(self._rollout_round, cfg.k_samples, self.prompts_per_step,
                                           cfg.max_generation_rounds, dist_utils.any_rank)
        sleep = self._switch_engine(awake=False)
        kept.times.update(rollout=kept.times["rollout"] + wake + sleep, rollout_wake=wake, rollout_sleep=sleep)
        return kept, drawn

    @phase("rollout")
    def _switch_engine(self, awake: bool) -> float:
        """Wake the rollout engine (or put it to sleep); returns the seconds it took."""
        start = time.perf_counter()
        if awake:
            self._restore_engine_weights()
            self.rollout_engine.wake()
        else:
            self.rollout_engine.sleep()
        return time.perf_counter() - start

    def _restore_engine_weights(self) -> None:
        """If the engine's last sleep dropped its weights and no whole sync followed (a step stopped between its
        rollout and its sync, e.g. interrupted in a notebook), sync again. Every rank takes part and they agree first:
        under ZeRO-3 the sync gathers parameters collectively. Only engines that drop weights (`needs_every_weight`,
        the same on every rank: one engine kind per job) pay for that agreement."""
        if not getattr(self.rollout_engine, "needs_every_weight", False):
            return
        if dist_utils.any_rank(self.rollout_engine.weights_dropped):
            self._sync_rollout_weights()

    def _rollout_round(self) -> RolloutRound:
        # --async_rollout: this step's request went out during the previous step; the next step's goes out now, so
        # the rollout ranks generate it while this step trains (one step off policy)
        pending = self._pending_rollouts or self._request_rollouts(self._next_prompts())
        self._pending_rollouts = None
        if self.config.async_rollout and self.state.step + 1 < self.total_steps:
            self._position_before_prefetch = (self.state.epoch, self.state.position)
            self._pending_rollouts = self._request_rollouts(self._next_prompts(), steps_ahead=1)
        completions, texts, times = self._receive_rollouts(pending)
        result, times["reward"] = self._score_rewards(pending.prompts, texts, [c.token_ids for c in completions])
        stats = {"rollout/staleness": float(self.state.step - pending.policy_step)} if self.config.async_rollout \
            else {}
        return RolloutRound(pending.prompts, completions, texts, result, pending.images, times, stats)

    @phase("data")
    def _next_prompts(self) -> list[dict]:
        """This rank's prompts for the step (different on every rank), advancing the resumable position."""
        indices, self.state.epoch, self.state.position = self.order.next(self.state.epoch, self.state.position)
        rows = self.train_set.select(indices)
        return [dict(row, index=i) for row, i in zip(rows, indices)]

    @phase("rollout")
    def _request_rollouts(self, prompts: list[dict], steps_ahead: int = 0) -> PendingRollouts:
        """Ask for k completions per prompt: posted at once to server-mode rollout ranks, generated on reception by
        a colocated engine. `steps_ahead`: 1 for the next step's prompts (--async_rollout)."""
        cfg = self.config
        start = time.perf_counter()
        # the engine's log-probs serve the IS correction (every step) and the mismatch metric (every N steps, counted
        # by the step that trains on them)
        logprobs = cfg.is_correction or (self.state.step + steps_ahead) % cfg.logprob_check_steps == 0
        sampling = SamplingSettings(n=cfg.k_samples, max_new_tokens=cfg.rollout_max_new_tokens,
                                    temperature=cfg.temperature, top_p=cfg.top_p, logprobs=logprobs)
        images = self._prompt_images(prompts)  # each prompt's pixels once, shared by its k samples
        pending = PendingRollouts(prompts, images, sampling, policy_step=self.state.step)
        images_done = time.perf_counter()
        if hasattr(self.rollout_engine, "submit"):
            pending.ticket = self.rollout_engine.submit([p["prompt_ids"] for p in prompts], sampling, images)
        pending.seconds = {"rollout_images": images_done - start, "rollout_submit": time.perf_counter() - images_done}
        return pending

    @phase("rollout")
    def _receive_rollouts(self, pending: PendingRollouts):
        """The k completions per prompt (grouped by prompt), their texts, and where the time went."""
        cfg = self.config
        prompts = pending.prompts
        self._sizes = {"prompts per rank": len(prompts), "completions per rank": len(prompts) * cfg.k_samples,
                       "--rollout_max_new_tokens": cfg.rollout_max_new_tokens}
        start = time.perf_counter()
        if pending.ticket is not None:  # server mode: wait for the rollout ranks
            completions = self.rollout_engine.collect(pending.ticket)
        else:
            completions = self.rollout_engine.generate([p["prompt_ids"] for p in prompts], pending.sampling,
                                                       **({"images": pending.images} if pending.images else {}))
        generated = time.perf_counter()
        texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        # time/rollout_images, _submit, _generate (the wait, in server mode), _decode (+ _wake, _sleep)
        parts = {**pending.seconds, "rollout_generate": generated - start,
                 "rollout_decode": time.perf_counter() - generated}
        seconds = sum(parts.values())
        tokens = sum(len(c.token_ids) for c in completions)
        return completions, texts, {"rollout": seconds, **parts, "_rollout_tokens": tokens}

    def _rollout_batch(self, rollout: RolloutRound) -> RolloutBatch:
        return build_rollout_batch([p["prompt_ids"] for p in rollout.prompts], rollout.completions,
                                   self.tokenizer.pad_token_id, mask_truncated=self.config.mask_truncated_completions,
                                   images=rollout.images)

    @phase("rewards")
    def _score_rewards(self, prompts: list[dict], completions: list[str], completion_ids: list[list[int]]):
        start = time.perf_counter()
        k = self.config.k_samples
        per_completion = [p for p in prompts for _ in range(k)]  # completions are grouped by prompt
        result = self.rewards(completions, [p["answer"] for p in per_completion],
                              [p["data_source"] for p in per_completion],
                              prompts=[p["prompt_text"] for p in per_completion], completion_ids=completion_ids,
                              prompt_messages=[p.get("messages") for p in per_completion])
        return result, time.perf_counter() - start

    def _prompt_images(self, prompts: list[dict]) -> Optional[list]:
        """Per prompt, its processed images (vision-language models; None for a text prompt); None without any."""
        if self.vision is None or not any(p.get("images") for p in prompts):
            return None
        return [self.vision.prompt_images(p.get("images") or []) for p in prompts]
