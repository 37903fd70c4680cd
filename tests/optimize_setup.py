"""One fixed GRPO step (tiny model, 8 completions of uneven length) run through grpo.train.update.update under
DeepSpeed with plain SGD, so that updated weights show the gradient itself; and the same step as one batch in plain
torch, the reference. Used in-process by tests/test_optimize.py and by the 2-rank script tests/optimize_ranks.py."""
import torch

from grpo.algorithm import LossSettings, policy_loss
from grpo.train.step_data import StepData, build_rollout_batch
from grpo.config.options import GRPOConfig
from grpo.train.micro_batches import form_micro_batches
from grpo.rollout.engine import Completion
from grpo.train.logprobs import completion_logprobs

LR = 0.5
PROMPT_LENGTHS = (3, 7, 5, 2)
COMPLETION_LENGTHS = (4, 9, 1, 6, 0, 3, 8, 2)  # two per prompt; one empty


def make_step(vocab: int = 100):
    """(batch [8 rows], advantages [8], old log-probs [8, T], ref log-probs [8, T]) of a made-up step."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    completions = [Completion(prompt_index=i // 2, token_ids=torch.randint(4, vocab, (n,), generator=g).tolist(),
                              logprobs=[-1.0] * n, finish_reason="stop") for i, n in enumerate(COMPLETION_LENGTHS)]
    batch = build_rollout_batch(prompts, completions, pad_id=0)
    advantages = torch.randn(len(completions), generator=g)
    return batch, advantages


def step_config(aggregation: str, **overrides) -> GRPOConfig:
    values = dict(loss_aggregation=aggregation, k_samples=2, rollout_max_new_tokens=16, max_prompt_length=16,
                  max_seq_length=32, kl_beta=0.1, clip_epsilon_low=0.1, temperature=0.9,
                  logprob_chunk_tokens=4)
    values.update(overrides)
    return GRPOConfig(**values)


def old_and_ref(model, batch, cfg):
    """Old log-probs a little off the policy (so that some ratios clip) and reference ones further off."""
    with torch.no_grad():
        current = completion_logprobs(model, batch, cfg.temperature, chunk_tokens=0)[0]
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(current.shape, generator=g)
    return current + 0.2 * noise, current - 0.3 * noise.abs()


def make_engine(model, zero_stage: int = 2):
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=LR)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": zero_stage, "overlap_comm": False}, "zero_allow_untested_optimizer": True,
          "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer, config=ds)
    return engine


def run_split(engine, batch, advantages, old, ref, cfg, groups, count=None, normaliser=None):
    """One update of `engine` over the micro-batches `groups` (row indices); returns the UpdateResult."""
    from grpo.train.update import step_normaliser, update

    micro_batches = form_micro_batches(batch, groups, count=count)
    normaliser = step_normaliser(batch, cfg) if normaliser is None else normaliser
    return update(engine, StepData(batch, micro_batches, advantages, normaliser=normaliser, old_logprobs=old,
                                   ref_logprobs=ref), cfg)


def reference_update(model, batch, advantages, old, ref, cfg) -> dict:
    """Weights after one SGD step on the whole step as one batch, in plain torch."""
    logprobs, _ = completion_logprobs(model, batch, cfg.temperature, chunk_tokens=0)
    settings = LossSettings(eps_low=cfg.clip_epsilon_low, eps_high=cfg.clip_epsilon_high, beta=cfg.kl_beta,
                            aggregation=cfg.loss_aggregation, max_completion_length=cfg.rollout_max_new_tokens)
    loss, _ = policy_loss(logprobs, old, advantages, batch.completion_mask, settings, ref_logprobs=ref)
    loss.backward()
    with torch.no_grad():
        return {name: (p - LR * p.grad).clone() for name, p in model.named_parameters()}
