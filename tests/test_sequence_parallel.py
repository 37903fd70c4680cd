"""Ulysses sequence parallelism (grpo.runtime.sequence_parallel) on 2 CPU ranks (gloo) with DeepSpeed's own attention:
the sharded log-probs equal the unsharded ones, and the gradient the group's ranks hold together equals the
single-process gradient of the same loss."""

import pytest
import torch

from grpo.runtime.sequence_parallel import (data_parallel_rank, data_parallel_world, layout_line, shard_sequence)
from tests.spawn_ranks import join_world, spawn_ranks


def test_shards_shift_labels_before_cutting():
    ids = torch.tensor([5, 6, 7, 8, 9])  # L = 5, N = 2: padded to 6, slices of 3
    first, second = shard_sequence(ids, 0, 2, pad_id=0), shard_sequence(ids, 1, 2, pad_id=0)
    assert first.input_ids.tolist() == [[5, 6, 7]] and second.input_ids.tolist() == [[8, 9, 0]]
    assert first.position_ids.tolist() == [[0, 1, 2]] and second.position_ids.tolist() == [[3, 4, 5]]
    # the token after the first slice's last token (8) lives on the second rank: shifted before the cut
    assert first.shift_labels.tolist() == [[6, 7, 8]] and second.shift_labels.tolist() == [[9, -100, -100]]


def test_groups_and_layout_line():
    assert [data_parallel_rank(r, 2) for r in range(4)] == [0, 0, 1, 1]
    assert data_parallel_world(4, 2) == 2
    assert layout_line(4, 2) == "sequence parallel: 2 groups of 2 ranks; each rank holds 1/2 of every sequence"
    with pytest.raises(ValueError, match="must divide"):
        data_parallel_world(3, 2)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa", dtype=torch.float32)


def _batch():
    # two rows, prompts left-padded (0 = pad), completions right-padded; odd lengths exercise the padding
    input_ids = torch.tensor([[0, 0, 11, 12, 13, 21, 22, 23, 24, 0],
                              [14, 15, 16, 17, 18, 25, 26, 27, 28, 29]])
    mask = (torch.arange(10) < 0).long().repeat(2, 1)
    mask[0, 2:9] = 1
    mask[1, :] = 1
    return input_ids, mask, 5


def _reference(path):
    """Single-process log-probs [2, 5] and the gradient of their sum w.r.t. every parameter."""
    from grpo.algorithm import hidden_token_logprobs

    model = _load(path)
    ids, mask, width = _batch()
    rows = []
    for row, m in zip(ids, mask):
        real = row[m.bool()].unsqueeze(0)
        hidden = model.model(input_ids=real, use_cache=False).last_hidden_state[0]
        lp, _ = hidden_token_logprobs(hidden[:-1], model.lm_head, real[0, 1:], chunk_tokens=4)
        p = int(m[:-width].sum())
        c = int(m[-width:].sum())
        rows.append(torch.cat([lp[p - 1:p - 1 + c], torch.zeros(width - c)]))
    logprobs = torch.stack(rows)
    (logprobs * torch.arange(1, 11.0).view(2, 5)).sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_main(rank, port, path, out, sp):
    join_world(rank, port, world=sp)
    import deepspeed
    import deepspeed.comm as ds_dist

    from grpo.runtime.sequence_parallel import register_ulysses, sharded_completion_logprobs

    deepspeed.init_distributed(dist_backend="gloo")
    model = _load(path)
    mpu = register_ulysses(model, sp)
    ids, mask, width = _batch()
    logprobs = sharded_completion_logprobs(model.model, model.lm_head, ids, mask, width,
                                           mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), sp,
                                           chunk_tokens=4)
    (logprobs * torch.arange(1, 11.0).view(2, 5)).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():  # what DeepSpeed's reduction over the group's ranks adds up
        ds_dist.all_reduce(g)
    if rank == 0:
        torch.save({"logprobs": logprobs.detach(), "grads": grads}, out)
    ds_dist.barrier()


# 4 ranks: the tiny model's 2 key/value heads are fewer than the group (DeepSpeed replicates them), and its rows of
# 7 and 10 tokens are padded to 8 and 12
@pytest.mark.parametrize("sp", [2, 4])
def test_sharded_ranks_match_one(tmp_path, sp):
    from tests.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "model"))
    out = str(tmp_path / "sp.pt")
    spawn_ranks(_rank_main, path, out, sp, nprocs=sp)
    sharded = torch.load(out)
    logprobs, grads = _reference(path)
    assert torch.allclose(sharded["logprobs"], logprobs, atol=1e-5)
    assert logprobs.abs().sum() > 0
    for name, grad in grads.items():  # fp32 partial sums of N ranks, added in another order: relative to the largest
        assert torch.allclose(sharded["grads"][name], grad, atol=4e-6 * float(grad.abs().max()) + 1e-6), name


@pytest.mark.parametrize("flags, says", [
    (dict(sequence_parallel_size=2), "WORLD_SIZE=3"),
    (dict(sequence_parallel_size=0), "must be >= 1"),
])
def test_ranks_not_divisible_are_refused(monkeypatch, flags, says):
    from grpo.config.options import GRPOConfig
    from grpo.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=says):
        GRPOConfig(**flags)


@pytest.mark.parametrize("flags, says", [
    (dict(rollout_engine="vllm", padding_free=True), "--padding_free"),
    (dict(rollout_engine="vllm", rollout_mode="server", rollout_gpus=1), "--rollout_mode colocate"),
])
def test_unsupported_combinations_say_what_to_use(monkeypatch, flags, says):
    from grpo.config.options import GRPOConfig
    from grpo.errors import ConfigError

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=says):
        GRPOConfig(sequence_parallel_size=2, **flags)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_both_engines_are_accepted(monkeypatch, engine):
    from grpo.config.options import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert GRPOConfig(sequence_parallel_size=2, rollout_engine=engine).sequence_parallel_size == 2


def test_zero3_without_reduce_scatter_is_refused_before_any_model_loads():
    from types import SimpleNamespace

    from grpo.errors import ConfigError
    from grpo.train.setup import check_sequence_parallel_zero

    sp2, sp1 = SimpleNamespace(sequence_parallel_size=2), SimpleNamespace(sequence_parallel_size=1)
    check_sequence_parallel_zero(sp2, {"zero_optimization": {"stage": 2}})
    check_sequence_parallel_zero(sp2, {"zero_optimization": {"stage": 3}})  # reduce_scatter: DeepSpeed's default
    check_sequence_parallel_zero(sp1, {"zero_optimization": {"stage": 3, "reduce_scatter": False}})
    with pytest.raises(ConfigError, match="ZeRO-3 needs zero_optimization.reduce_scatter true"):
        check_sequence_parallel_zero(sp2, {"zero_optimization": {"stage": 3, "reduce_scatter": False}})


def test_the_group_gradient_scale_follows_deepspeeds_reduction():
    from grpo.runtime.sequence_parallel import group_gradient_scale

    # ZeRO-0/1/2 divide the summed gradients by world / N: each rank keeps 1/N of its shard's; ZeRO-3 by world: all
    assert [group_gradient_scale(2, stage) for stage in (0, 1, 2, 3)] == [0.5, 0.5, 0.5, 1.0]
    assert group_gradient_scale(4, 2) == 0.25


def test_size_one_is_the_default(monkeypatch):
    from grpo.config.options import GRPOConfig

    monkeypatch.setenv("WORLD_SIZE", "3")
    assert GRPOConfig().sequence_parallel_size == 1


LR = 0.5


def _lora(path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    # adapters drawn at random (B != 0) so that every LoRA weight has a gradient
    return get_peft_model(_load(path), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                  init_lora_weights=False))


def _lora_reference(path):
    """One process: the loss and the LoRA weights after one SGD step."""
    from grpo.algorithm import hidden_token_logprobs

    model = _lora(path)
    base = model.get_base_model()
    ids, mask, width = _batch()
    loss = 0
    for i, (row, m) in enumerate(zip(ids, mask)):
        real = row[m.bool()].unsqueeze(0)
        hidden = base.model(input_ids=real, use_cache=False).last_hidden_state[0]
        lp, _ = hidden_token_logprobs(hidden[:-1], base.lm_head, real[0, 1:], chunk_tokens=4)
        p, c = int(m[:-width].sum()), int(m[-width:].sum())
        loss = loss - lp[p - 1:p - 1 + c].sum() * (i + 1)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p -= LR * p.grad
    return loss.item(), {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _deepspeed_rank_main(rank, port, path, out, stage):
    join_world(rank, port)
    import deepspeed
    import deepspeed.comm as ds_dist

    from grpo.runtime.sequence_parallel import group_gradient_scale, register_ulysses, sharded_completion_logprobs

    deepspeed.init_distributed(dist_backend="gloo")
    model = _lora(path)
    mpu = register_ulysses(model, 2)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=torch.optim.SGD(trainable, lr=LR), mpu=mpu,
        config={"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0,
                "zero_allow_untested_optimizer": True})  # SGD: its step shows the gradient's scale
    base = engine.module.get_base_model()
    ids, mask, width = _batch()
    logprobs = sharded_completion_logprobs(base.model, base.lm_head, ids, mask, width,
                                           mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), 2,
                                           chunk_tokens=0 if stage == 3 else 4,
                                           grad_scale=group_gradient_scale(2, stage))
    loss = -(logprobs * torch.tensor([[1.0], [2.0]])).sum()
    engine.backward(loss)
    engine.step()
    with deepspeed.zero.GatheredParameters(trainable):  # ZeRO-3: each rank holds a part of every weight
        weights = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    if rank == 0:
        torch.save({"loss": loss.item(), "weights": weights}, out)
    ds_dist.barrier()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_lora_step_under_deepspeed_zero_matches_one_process(tmp_path, stage):
    from tests.tiny_models import make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "model"))
    out = str(tmp_path / "sp.pt")
    spawn_ranks(_deepspeed_rank_main, path, out, stage)
    sharded = torch.load(out)
    loss, weights = _lora_reference(path)
    assert abs(sharded["loss"] - loss) < 1e-4
    before = {n: p for n, p in _lora(path).named_parameters() if p.requires_grad}
    for name, weight in weights.items():
        assert not torch.equal(weight, before[name]), name  # the step moved it
        assert torch.allclose(sharded["weights"][name], weight, atol=1e-5), name


def test_prompts_are_split_by_data_parallel_rank():
    """The ranks of one sequence-parallel group draw the same prompts; the groups split the epoch between them."""
    from types import SimpleNamespace

    from grpo.train.setup import prompt_order

    config = SimpleNamespace(sequence_parallel_size=2, seed=5)
    orders = [prompt_order(12, 3, config, rank, 4) for rank in range(4)]
    first = [order.indices(0, 0) for order in orders]
    assert first[0] == first[1] and first[2] == first[3]
    assert not set(first[0]) & set(first[2])
    assert orders[0].steps_per_epoch == 2  # 12 prompts / 2 groups / 3 per step
    single = prompt_order(12, 3, SimpleNamespace(sequence_parallel_size=1, seed=5), 1, 2)
    assert single.indices(0, 0) == first[2]  # group 1 of 2 draws what rank 1 of 2 draws without SP


def test_step_std_counts_a_group_s_copies_once():
    """Rewards [3, 5] held by both ranks of a group reduce like [3, 5, 3, 5] on one process: with copies 2 their std
    is that of [3, 5], sqrt((1 + 1) / 1), not that of four values, sqrt(4 / 3)."""
    import math

    from grpo.train.metrics import step_std

    assert step_std(torch.tensor([3.0, 5.0, 3.0, 5.0]), copies=2) == pytest.approx(math.sqrt(2.0))
    assert step_std(torch.tensor([3.0, 5.0, 3.0, 5.0])) == pytest.approx(math.sqrt(4.0 / 3.0))


def test_unsharded_attention_puts_the_wrapped_function_back_for_its_time():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from grpo.runtime import sequence_parallel

    original = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def wrapper(*args, **kwargs):
        raise AssertionError("sharded attention called")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sequence_parallel, "_UNSHARDED", {"sdpa": original})
        ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapper
        try:
            with sequence_parallel.unsharded_attention():
                assert ALL_ATTENTION_FUNCTIONS["sdpa"] is original
            assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapper
        finally:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def test_a_group_splits_k_completions_and_merges_them_by_prompt_in_rank_order():
    from grpo.rollout.collect import merge_group_shares
    from grpo.rollout.engine import Completion
    from grpo.runtime.sequence_parallel import split_count

    assert [split_count(8, r, 3) for r in range(3)] == [3, 3, 2]
    assert [split_count(3, r, 2) for r in range(2)] == [2, 1]
    assert [split_count(2, r, 4) for r in range(4)] == [1, 1, 0, 0]
    # 2 prompts, k = 3 over 2 ranks: rank 0 holds 2 of each prompt's, rank 1 one
    rank0 = [Completion(0, [1], [], "stop"), Completion(0, [2], [], "stop"),
             Completion(1, [3], [], "stop"), Completion(1, [4], [], "stop")]
    rank1 = [Completion(0, [5], [], "stop"), Completion(1, [6], [], "stop")]
    completions, episodes = merge_group_shares([(rank0, [None, None, "e1", "e2"]), (rank1, [None, "e3"])], 2)
    assert [c.token_ids for c in completions] == [[1], [2], [5], [3], [4], [6]]
    assert [c.prompt_index for c in completions] == [0, 0, 0, 1, 1, 1]
    assert episodes == [None, None, None, "e1", "e2", "e3"]
