"""The optimisation phase of a step: micro-batches through the model, the loss, one DeepSpeed update.

The step's loss is one aggregate over all its completions on all ranks (`algorithm.aggregate`): every micro-batch
contributes  S_mb / D_step  (its numerator over the step's denominator), so the micro-batch losses sum to the step
loss whatever the split. DeepSpeed's own scaling is undone: no division by gradient_accumulation_steps
(`scale_wrt_gas=False`), and a factor world_size against its data-parallel mean of gradients. Hence

    grad = sum over ranks and micro-batches of  d(S_mb / D_step)/dtheta  = d(step loss)/dtheta

and the optimizer steps once, at the boundary this module sets on the last micro-batch (so the number of
micro-batches may change from step to step; all ranks run the same number, see micro_batches.py).
"""
from __future__ import annotations

import contextlib
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo.runtime import distributed as dist_utils
from grpo.algorithm import LossSettings, aggregation_normaliser, masked_mean, policy_loss, rollout_correction
from grpo.algorithm.registry import DEFAULT_ROLLOUT_CORRECTION
from grpo.train.step_data import RolloutBatch, StepData
from grpo.config.options import GRPOConfig
from grpo.model.routing_replay import RouterAgreement, replayed_routing
from grpo.train.micro_batches import MicroBatch, form_micro_batches, micro_batch_groups
from grpo.train.logprobs import completion_logprobs


def step_micro_batches(batch: RolloutBatch, cfg: GRPOConfig, device=None,
                       max_tokens: Optional[int] = None) -> list[MicroBatch]:
    """This rank's micro-batches of the step, as many as the rank with the most has (collective). `max_tokens`: the
    token budget the run resolved (grpo.train.token_budget: auto is the memory plan's); without it,
    --max_tokens_per_micro_batch must be a number. The budget counts the tokens one rank holds."""
    if max_tokens is None:
        max_tokens = cfg.max_tokens_per_micro_batch
        if not isinstance(max_tokens, int):
            raise ValueError(f"step_micro_batches: --max_tokens_per_micro_batch {max_tokens} is the memory plan's "
                             "budget to resolve (grpo.train.token_budget.micro_batch_token_budget); pass it as "
                             "max_tokens")
    # a rank of a sequence-parallel group holds 1/N of each row: N x the budget in whole-row tokens
    groups = micro_batch_groups(batch, max_tokens * cfg.sequence_parallel_size,
                                cfg.per_device_train_batch_size * cfg.k_samples)
    count = int(dist_utils.all_max([float(len(groups))])[0])
    return form_micro_batches(batch, groups, count, device)


def step_normaliser(batch: RolloutBatch, cfg: GRPOConfig, max_completion_length: Optional[int] = None) -> float:
    """The denominator D of the step's loss aggregate: this rank's completions plus every other rank's (collective).
    `max_completion_length`: seq_mean_token_sum_norm's constant, the longest a completion may be (default
    --rollout_max_new_tokens; a run with multi-turn episodes passes its episode budget)."""
    local = aggregation_normaliser(batch.completion_mask, cfg.loss_aggregation,
                                   max_completion_length or cfg.rollout_max_new_tokens)
    # the ranks of a sequence-parallel group hold the same rows: each group counted once
    return dist_utils.all_sum([local])[0] / cfg.sequence_parallel_size


def score(model, mb: MicroBatch, cfg: GRPOConfig, with_entropy: bool = False, entropy_grad: bool = False,
          agreement: Optional[RouterAgreement] = None, replay_routing: bool = True):
    """`_score`, with the engine's routing replayed in every MoE layer where the rows carry it (--routing_replay,
    grpo.model.routing_replay; `replay_routing` False: the trainer's router chooses). `agreement` counts the picks
    the trainer's own router makes alike."""
    routed = mb.batch.routed_experts if replay_routing else None
    with replayed_routing(model, routed, mb.batch.attention_mask, agreement):
        return _score(model, mb, cfg, with_entropy, entropy_grad)


def _score(model, mb: MicroBatch, cfg: GRPOConfig, with_entropy: bool = False, entropy_grad: bool = False):
    """Log-probs (and entropy) of a micro-batch's completions under `model`, the way the config asks for.

    Under ZeRO-3 the model's own forward (full logits) is used: every call of the output layer gathers its
    partitioned weight in a collective, so ranks must call it equally often, which chunking per rank would break.
    """
    zero3 = getattr(model, "zero_optimization_stage", lambda: 0)() == 3
    if cfg.sequence_parallel_size > 1:  # each rank of the group runs 1/N of every row
        from grpo.train.sequence_parallel_scoring import sharded_score

        return sharded_score(model, mb.batch, cfg, 0 if zero3 else cfg.logprob_chunk_tokens, with_entropy,
                             entropy_grad, zero3=zero3)
    return completion_logprobs(model, mb.batch, cfg.temperature, with_entropy=with_entropy,
                               chunk_tokens=0 if zero3 else cfg.logprob_chunk_tokens,
                               packed=cfg.padding_free and not zero3, entropy_grad=entropy_grad)


def has_dropout(model) -> bool:
    """Whether the model in training mode drops anything (e.g. --lora_dropout): its log-probs then differ from those
    of the policy the rollout engine samples from, which never drops."""
    return model.training and any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


def without_dropout(engine, mb: MicroBatch, cfg: GRPOConfig, replay_routing: bool = True) -> torch.Tensor:
    """The micro-batch's log-probs with dropout off (no graph): the sampled policy, for the engine's mismatch."""
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad():
            logprobs, _ = score(engine, mb, cfg, replay_routing=replay_routing)
    finally:
        engine.module.train(was_training)
    return logprobs.float()


@dataclass
class UpdateResult:
    metrics: dict = field(default_factory=dict)   # per-step values (combine_micro_batch_metrics; loss summed)
    bad: bool = False                               # some micro-batch had a non-finite loss: the update was cancelled


def update(engine, step: StepData, cfg: GRPOConfig, first_pass: bool = True) -> UpdateResult:
    """One optimizer step over the step's micro-batches.

    The ratio's old log-probs are `step.old_logprobs` when given, else the pass's own (detached: ratio 1). A first
    pass fills what StepData.keep_for_later_updates made room for, and the later passes read it back: the old
    log-probs, and the old policy as the engine samples it (dropout off; otherwise that is the old log-probs), to
    which the engine's own log-probs are compared (mismatch metric, IS weights). The first pass logs that gap as
    `step.mismatch_key`_mean / _max."""
    device = next(iter(engine.module.parameters())).device
    # DeepSpeed's mean over data-parallel ranks (sequence-parallel groups: dp_world_size is None under their mpu)
    world = getattr(engine, "dp_world_size", None) or dist_utils.world_size() // cfg.sequence_parallel_size
    settings = loss_settings(cfg)
    per_micro_batch: list[tuple[dict, float]] = []  # (policy_loss metrics, completion tokens)
    loss_total = pg_total = 0.0
    rollout_per_micro_batch: list[tuple[dict, float]] = []  # engine mismatch and IS weights, first pass only
    bad = False
    dropout = has_dropout(engine.module)
    filling_old, filling_sampled = first_pass and step.fill_old, first_pass and step.fill_sampled
    read_old = step.old_logprobs is not None and not filling_old
    read_sampled = step.sampled_logprobs is not None and not filling_sampled
    agreement = RouterAgreement()  # --routing_replay: the trainer's own top-k against the engine's, first pass
    gap_by_staleness: dict[int, list[float]] = {}  # versions behind -> [gap sum, tokens] (streamed rollouts)
    for index, mb in enumerate(step.micro_batches):
        last = index == len(step.micro_batches) - 1
        engine.set_gradient_accumulation_boundary(last)
        b = mb.batch
        # the dropout-free pass first: no graph is held while it runs (alike on every rank: ZeRO-3 collectives)
        clean = without_dropout(engine, mb, cfg) \
            if first_pass and dropout and b.rollout_logprobs is not None and not read_sampled else None
        # the engine's gap had the trainer routed each token itself (--routing_replay's effect on it)
        unreplayed = without_dropout(engine, mb, cfg, replay_routing=False) \
            if first_pass and b.routed_experts is not None and b.rollout_logprobs is not None else None
        logprobs, entropy = score(engine, mb, cfg, with_entropy=True, entropy_grad=cfg.entropy_coef != 0,
                                  agreement=agreement if first_pass and not mb.empty else None)
        logprobs = logprobs.float()                                                   # [n, t]
        old = mb.gather(step.old_logprobs).to(device) if read_old else logprobs.detach()
        if filling_old:
            mb.scatter(old, into=step.old_logprobs)
        ref = mb.gather(step.ref_logprobs).to(device) if step.ref_logprobs is not None else None
        if read_sampled:
            sampled_policy = mb.gather(step.sampled_logprobs).to(device)
        else:
            sampled_policy = clean if clean is not None else old
            if filling_sampled:
                mb.scatter(sampled_policy, into=step.sampled_logprobs)
        tokens = b.completion_mask.sum().item()  # one host sync per micro-batch, reused below
        rollout_metrics: dict = {}
        if first_pass and not mb.empty and tokens > 0 and b.rollout_logprobs is not None:
            diff = (sampled_policy - b.rollout_logprobs).abs() * b.completion_mask
            rollout_metrics[f"{step.mismatch_key}_mean"] = diff.sum().item() / tokens
            rollout_metrics[f"{step.mismatch_key}_max"] = diff.max().item()
            if unreplayed is not None:
                own_routing = (unreplayed - b.rollout_logprobs).abs() * b.completion_mask
                rollout_metrics[f"{step.mismatch_key}_unreplayed_mean"] = own_routing.sum().item() / tokens
            if b.staleness is not None:
                add_gap_by_staleness(gap_by_staleness, diff, b.staleness.to(diff.device), b.completion_mask)
        is_weights = None
        if cfg.is_correction:  # (the rollout always asks for log-probs then)
            # the rollout engine sampled from a slightly different policy: weight (truncated IS) or mask its tokens
            is_weights, capped, masked = rollout_correction(  # the registered correction of that name
                sampled_policy, b.rollout_logprobs, b.completion_mask,
                cfg.rollout_correction or DEFAULT_ROLLOUT_CORRECTION, cfg.rollout_is_cap, cfg.rollout_mask_low,
                cfg.rollout_mask_high)
            if first_pass and not mb.empty and tokens > 0:
                rollout_metrics.update(zip(("rollout/is_weight_mean", "rollout/is_capped_frac",
                                            "rollout/is_masked_frac"),
                                           torch.stack([masked_mean(is_weights, b.completion_mask),
                                                        masked_mean(capped.float(), b.completion_mask),
                                                        masked_mean(masked.float(), b.completion_mask)]).tolist()))
        if rollout_metrics:
            rollout_per_micro_batch.append((rollout_metrics, tokens))
        loss, m = policy_loss(logprobs, old, mb.gather(step.advantages).to(device), b.completion_mask, settings,
                              ref_logprobs=ref, is_weights=is_weights, entropy=entropy, normaliser=step.normaliser)
        if dist_utils.any_rank(not torch.isfinite(loss).item()):
            bad = True
        if bad or not loss.requires_grad:
            # keep every rank's backward (and ZeRO's gradient hooks) in step with a zero loss
            loss = sum((p.sum() * 0.0 for p in engine.module.parameters() if p.requires_grad),
                       torch.zeros((), device=device))
        elif not mb.empty:
            loss_total += loss.item()
            pg_total += m.pop("pg_loss")
            # with the trained tokens' mean log-prob before the update (a warm start's negative loss,
            # grpo.train.warm_start), in one host sync
            m["entropy"], m["logprob_mean"] = torch.stack([masked_mean(entropy.detach().float(), b.completion_mask),
                                                           masked_mean(logprobs.detach(), b.completion_mask)]).tolist()
            per_micro_batch.append((m, tokens))
        # the step's gradient is the sum over ranks; DeepSpeed averages over them
        engine.backward(loss * world, scale_wrt_gas=False)
        # a cancelled update still takes the step the boundary needs, leaving weights and moments as they were
        with cancelled_update(engine) if last and bad else contextlib.nullcontext():
            engine.step()
    step.fill_old = step.fill_sampled = False  # filled: the next passes read them
    metrics = combine_micro_batch_metrics(per_micro_batch)
    if not bad:
        metrics["loss"], metrics["pg_loss"] = (value / cfg.sequence_parallel_size  # each group's N ranks alike
                                               for value in dist_utils.all_sum([loss_total, pg_total]))
    metrics.update(combine_micro_batch_metrics(rollout_per_micro_batch))
    metrics.update({f"rollout/logprob_diff_behind_{d}": total / count
                    for d, (total, count) in sorted(gap_by_staleness.items())})
    if agreement.share is not None:
        metrics["rollout/router_agreement"] = agreement.share
    return UpdateResult(metrics, bad)


def loss_settings(cfg: GRPOConfig) -> LossSettings:
    """The loss's scalar settings from the run's options."""
    return LossSettings(eps_low=cfg.clip_epsilon_low, eps_high=cfg.clip_epsilon_high, beta=cfg.kl_loss_coef,
                        kl_estimator=cfg.kl_estimator, aggregation=cfg.loss_aggregation,
                        max_completion_length=cfg.rollout_max_new_tokens,
                        importance_sampling_level=cfg.importance_sampling_level, clip_ratio_c=cfg.clip_ratio_c,
                        entropy_coef=cfg.entropy_coef, loss_type=cfg.loss_type, sapo_tau_pos=cfg.sapo_tau_pos,
                        sapo_tau_neg=cfg.sapo_tau_neg)


def add_gap_by_staleness(into: dict, gap: torch.Tensor, staleness: torch.Tensor, mask: torch.Tensor) -> None:
    """Add a micro-batch's per-token |trainer - engine| log-prob gap [n, t] to `into`, by the versions behind of
    each token [n, t] (-1: unknown, left out; mask [n, t]: the tokens in the loss): into[d] = [sum of gaps, tokens].
    Their means, rollout/logprob_diff_behind_<d>: d = 0 is the engine's own mismatch (the trainer holds the very
    version that sampled those tokens), d > 0 adds d updates of policy change; a d = 0 gap above the on-policy
    steps' says the engine did not sample from the version it reported."""
    kept = (mask > 0) & (staleness >= 0)
    behind = staleness[kept]
    sums = torch.bincount(behind, weights=gap[kept].double()).tolist()  # (one host read each, whatever the d's)
    counts = torch.bincount(behind).tolist()
    for d, (total, count) in enumerate(zip(sums, counts)):
        if count:
            entry = into.setdefault(d, [0.0, 0])
            entry[0] += total
            entry[1] += count


def combine_micro_batch_metrics(per_micro_batch: list[tuple[dict, float]]) -> dict:
    """This rank's step values of policy_loss's per-micro-batch metrics, given each micro-batch's token count n_mb:

        per-token means (clip_frac*, ratio_mean, kl, entropy, ...):  sum_mb n_mb * x_mb / sum_mb n_mb
        maxima (ratio_max, *_max):                                    max_mb x_mb
        entropy_loss (a share of the step's loss, like loss):         sum_mb x_mb
    """
    tokens = sum(n for _, n in per_micro_batch)
    out: dict = {}
    for metrics, n in per_micro_batch:
        weight = n / tokens if tokens else 1.0 / len(per_micro_batch)
        for key, value in metrics.items():
            if key.endswith("_max"):
                out[key] = max(out.get(key, value), value)
            elif key == "entropy_loss":
                out[key] = out.get(key, 0.0) + value
            else:
                out[key] = out.get(key, 0.0) + value * weight
    return out


def lr_schedule(optimizer, config: GRPOConfig, total_updates: int):
    """Linear warmup over warmup_ratio of the updates, then constant / linear decay / cosine decay."""
    warmup = math.ceil(config.warmup_ratio * total_updates)

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / (warmup + 1)
        progress = (update - warmup) / max(1, total_updates - warmup)
        if config.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        if config.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------------------------------- cancelled updates
# Cancelling an update whose loss went non-finite on some micro-batch, without leaving a trace in the optimizer.
#
# By the time a non-finite loss shows, the micro-batches before it have already added their gradients, and the engine
# must still take its step at the accumulation boundary (ZeRO's buffers and hooks expect it). The step is taken with
# learning rate 0, so the weights stay; AdamW's update  p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p)  is then 0.
# But the moments would still move,  m = b1 * m + (1 - b1) * g_partial,  v = b2 * v + (1 - b2) * g_partial^2,  and the
# step count with them (its bias correction), so every later step would feel a partial gradient of a step that
# never happened. The optimizer's state is therefore copied (to host memory: a bad step is rare, a second copy of the
# moments on the GPU may not fit) before that step and put back after it.
def base_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer holding the moments: DeepSpeed's ZeRO / bf16 wrappers keep it as `.optimizer`."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def _host_copy(value):
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


@contextmanager
def cancelled_update(engine):
    """Inside: `engine.step()` changes neither the weights nor the optimizer's state (moments, step counts); the
    learning-rate scheduler still advances, as it would for a step that trained."""
    base = base_optimizer(engine.optimizer)
    saved_state = {param: {key: _host_copy(value) for key, value in state.items()}
                   for param, state in base.state.items()}
    saved_group_steps = [group.get("step") for group in base.param_groups]  # optimizers that count per group
    saved_lrs = [group["lr"] for group in engine.optimizer.param_groups]
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    try:
        yield
    finally:
        for param in list(base.state):
            if param not in saved_state:  # the state was created by this step: back to the optimizer's lazy start
                del base.state[param]
        for param, state in saved_state.items():
            live = base.state[param]
            for key, value in state.items():
                if torch.is_tensor(value) and torch.is_tensor(live.get(key)):
                    live[key].copy_(value)
                else:
                    live[key] = value
        for group, step in zip(base.param_groups, saved_group_steps):
            if step is not None:
                group["step"] = step
        if getattr(engine, "lr_scheduler", None) is None:
            # a scheduler sets the next step's lr itself; without one (a DeepSpeed "optimizer" and no "scheduler")
            # nothing else would undo the 0
            for group, lr in zip(engine.optimizer.param_groups, saved_lrs):
                group["lr"] = lr
