"""What a run writes into --output_dir besides its checkpoints and metrics.jsonl, and what it pushes to the hub:

    grpo_config.json (the options it started with) | completions/rank<N>.jsonl (one sample per prompt and step) |
    training_curves.png | the final model with its card | the end-of-run summary | --push_to_hub's commits

`RunOutputs` holds what these share for the run (its options, model path, tokenizer, dtype, rank, hub repository);
the trainer hands it the step, the rollouts and the DeepSpeed engine when it calls, and keeps no output code itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil

from grpo.checkpoint.final_model import save_final_model
from grpo.checkpoint.hub import hub_files, push
from grpo.checkpoint.layout import CONFIG_FILE
from grpo.checkpoint.resume import log_resumed_options, saved_config_path
from grpo.errors import TrainingError
from grpo.runtime import distributed as dist_utils
from grpo.train.reporting import plot_training_curves, read_metrics
from grpo.train.run_summary import run_summary

logger = logging.getLogger("grpo")


class RunOutputs:
    """The run's outputs (module docstring). Rank 0 writes the run-wide files (`is_main`); every rank its own
    completions, unless another rank of its sequence-parallel group speaks for the same rollouts (`writes_completions`
    False); `hub_repo` None: no --push_to_hub."""

    def __init__(self, config, model_path: str, tokenizer, dtype, rank: int, is_main: bool, hub_repo: str | None,
                 writes_completions: bool = True):
        self.config, self.model_path, self.tokenizer, self.dtype = config, model_path, tokenizer, dtype
        self.rank, self.is_main, self.hub_repo, self.writes_completions = rank, is_main, hub_repo, writes_completions

    # ------------------------------------------------------------------------------------ at the start
    def save_options(self, resume_path: str | None, step: int) -> None:
        """Rank 0: output_dir/grpo_config.json, the options the run started with, as it resolved them (the frozen
        config). A resume never rewrites it: it lists what it changes, and saves its options beside it
        (grpo_config.resumed_at_step<N>.json) when they differ; every checkpoint holds the options it was trained
        with."""
        if not self.is_main:
            return
        config = self.config
        run_file = os.path.join(config.output_dir, CONFIG_FILE)
        changed = []
        if resume_path is not None:
            changed = log_resumed_options(resume_path, step, saved_config_path(resume_path, config.output_dir), config)
        if resume_path is None or not os.path.isfile(run_file):
            config.save(run_file)
        elif changed:
            config.save(os.path.join(config.output_dir, f"grpo_config.resumed_at_step{step}.json"))

    # ------------------------------------------------------------------------------------- every step
    def log_completions(self, step: int, rollout) -> None:
        """One rollout sample per prompt and rank each step (`rollout`: the step's RolloutRound), for reading what the
        model writes (a multi-turn episode: its last message as "completion", the whole episode, tool calls and
        results included, as "episode")."""
        if not self.writes_completions:
            return
        path = os.path.join(self.config.output_dir, "completions", f"rank{self.rank}.jsonl")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        k = self.config.k_samples
        texts, rewards, completions = rollout.texts, rollout.rewards, rollout.completions
        with open(path, "a") as fh:
            for i, p in enumerate(rollout.prompts):
                row = {"step": step, "index": p["index"], "data_source": p["data_source"],
                       "prompt": p["prompt_text"], "completion": texts[i * k], "reward": rewards[i * k].item(),
                       "answer": p["answer"]}
                if completions[i * k].mask is not None:
                    row["episode"] = self.tokenizer.decode(completions[i * k].token_ids)
                fh.write(json.dumps(row) + "\n")

    def plot(self) -> None:
        """Rank 0: training_curves.png from metrics.jsonl (after each evaluation and at the end)."""
        if self.is_main:
            rows = read_metrics(os.path.join(self.config.output_dir, "metrics.jsonl"))
            if rows:
                plot_training_curves(rows, os.path.join(self.config.output_dir, "training_curves.png"))

    def push_checkpoint_model(self, engine, zero3: bool, step: int) -> None:
        """--hub_strategy every_save: the model as it is now, written as the final one is (without a merged copy) to
        a folder of its own, pushed, then removed. Every rank takes part (ZeRO-3 gathers the weights)."""
        state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
        if self.hub_repo is not None:
            folder = os.path.join(self.config.output_dir, "hub_upload")
            options = dataclasses.replace(self.config, save_merged_model=False)
            saved = save_final_model(engine.module, self.tokenizer, folder, options, self.model_path, self.dtype,
                                     state_dict=state_dict, steps=step)
            self.push(saved.get("model") or saved["lora_adapter"], f"step {step}", must=False)
            shutil.rmtree(folder, ignore_errors=True)
        dist_utils.barrier()

    # -------------------------------------------------------------------------------------- at the end
    def final_model(self, engine, zero3: bool, step: int) -> dict:
        """The final model (and its card) in --output_dir, written by rank 0 (every rank takes part under ZeRO-3);
        {kind: path} of what was saved (empty on other ranks)."""
        state_dict = engine._zero3_consolidated_16bit_state_dict() if zero3 else None
        saved = {}
        if self.is_main:
            saved = save_final_model(engine.module, self.tokenizer, self.config.output_dir, self.config,
                                     self.model_path, self.dtype, state_dict=state_dict, steps=step)
            logger.info("final model saved: " + ", ".join(saved.values()))
        dist_utils.barrier()
        return saved

    def summarize(self, seconds: float, steps_run: int, saved: dict) -> None:
        """Rank 0: the end-of-run summary (first -> last eval, time, outputs) in the log."""
        if self.is_main:
            rows = read_metrics(os.path.join(self.config.output_dir, "metrics.jsonl"))
            logger.info(run_summary(rows, self.config.output_dir, seconds, steps_run, saved))

    def push_final_model(self, saved: dict, step: int) -> None:
        """With --push_to_hub (rank 0 holds the repository): the final model, its card, the run's options and curves."""
        if self.hub_repo is not None:
            self.push(saved.get("model") or saved["lora_adapter"], f"final model, step {step}")

    def push(self, model_folder: str, message: str, must: bool = True) -> None:
        """The model in `model_folder`, its card, the run's options and curves, to --push_to_hub's repository in one
        commit. A push that fails stops the run (`must`: the final one; the saved model stays) or warns."""
        config = self.config
        try:
            url = push(self.hub_repo, hub_files(config, model_folder, config.output_dir),
                       True if config.hub_private_repo else None, message)
        except Exception as exc:
            if not must:
                logger.warning(f"--push_to_hub: pushing {message} to {self.hub_repo} failed ({exc}); training goes on")
                return
            raise TrainingError(f"--push_to_hub: pushing {message} to {self.hub_repo} failed: {exc}. The model is "
                                f"saved in {model_folder}; upload it with `hf upload {self.hub_repo} {model_folder}`")
        logger.info(f"pushed {message} to the hub: {url}")
